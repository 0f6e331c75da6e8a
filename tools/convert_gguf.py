"""Convert a Llama-architecture GGUF file into a Hugging Face-layout model directory.

    python tools/convert_gguf.py MODEL.gguf OUT_DIR [--overwrite] [--no-progress]

OUT_DIR receives config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json and
generation_config.json; see tinyvllm/gguf_convert.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import tinyvllm.gguf_convert  # noqa: F401
except ImportError:  # run from a checkout without installing: the repository root is one level up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.gguf_convert import GGUFError, convert_gguf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert a Llama GGUF file into a Hugging Face-layout directory.")
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the directory to create")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        out = convert_gguf(args.gguf, args.out_dir, progress=not args.no_progress, overwrite=args.overwrite)
    except (GGUFError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
