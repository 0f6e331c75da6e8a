"""Where the CUDA engine and the NumPy reference part: one prefill step on both, compared layer by layer and
operation by operation.

    python3 tools/compare_layers.py [--model DIR | --preset tiny | --preset llama-3.2-1b]
                                    [--prompt-tokens 300 37 9] [--matmul-precision fp32] [--kv-cache-dtype fp32]
                                    [--perturb LAYER.WEIGHT] [--threshold 1e-4]

Both backends run the same step (random prompts of the given lengths, batched, as the engine packs them):
the CUDA runner eagerly, with its trace hook copying each intermediate result to the host as it is written,
and reference.llama.ReferenceLlama with the same hook. For each (layer, operation) of
reference.llama.TRACE_POINTS, in the order the forward computes them, the table gives the largest absolute
difference, that difference relative to the largest reference value of the tensor ("rel"; element-wise
ratios explode where values cross zero), and that largest value. The first row whose rel exceeds
--threshold is marked: with --matmul-precision fp32 and --kv-cache-dtype fp32 both sides differ by
summation order alone (rel about 1e-7 to 1e-6), so a row far above that is where a kernel computes something
else. k and v are the new tokens' rows of the cache, read back in its format.

--perturb LAYER.WEIGHT (qkv, o, gate_up or down) scales the first row of that weight by 1 + 2^-3 on the GPU
only: a fault whose place the table must show (tests/test_compare_layers.py checks it does); a course
exercise too. Under NUMBA_ENABLE_CUDASIM=1 it runs in Numba's simulator (use the tiny preset).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from cuda_kernels import compat  # noqa: E402,F401  (the numpy shim before numba.cuda)

WEIGHTS = ("qkv", "o", "gate_up", "down")


@dataclass
class Row:
    layer: int          # -1 outside the layers
    op: str
    max_abs: float
    rel: float          # max_abs / largest |reference value|
    scale: float        # largest |reference value|


def _host(array):
    return array.copy_to_host() if hasattr(array, "copy_to_host") else np.asarray(array)


def perturb_weight(runner, spec: str) -> None:
    """Scale row 0 of the GPU copy of weight `spec` = "LAYER.WEIGHT" by 1 + 2^-3 (bf16-exact for most values)."""
    from reference.bf16 import bf16_to_f32, f32_to_bf16

    layer, _, name = spec.partition(".")
    if name not in WEIGHTS or not layer.isdigit() or int(layer) >= len(runner.layers):
        raise ValueError(f"--perturb: expected LAYER.WEIGHT with LAYER < {len(runner.layers)} and WEIGHT one of "
                         f"{', '.join(WEIGHTS)}, got {spec!r}")
    device = runner.layers[int(layer)][name]
    host = device.copy_to_host()
    host[0] = f32_to_bf16(bf16_to_f32(host[0]) * np.float32(1.125))
    device.copy_to_device(host)


def compare(model_dir, prompt_lengths, matmul_precision="fp32", kv_cache_dtype="fp32", block_size=16,
            perturb: str | None = None, seed: int = 0, keep: dict | None = None) -> list[Row]:
    """One prefill step of random prompts on the CUDA runner and on the reference; a Row per traced result.
    keep: if given, receives the traced arrays, keep["cuda"] and keep["reference"][(layer, op)]."""
    from reference.kv_format import kv_decode
    from reference.llama import ReferenceLlama, slot_rows
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.batch import pack
    from tinyvllm.scheduler import ScheduledSequence
    from tinyvllm.sequence import Sequence
    from tinyvllm.weights import load_weights

    total = sum(prompt_lengths)
    blocks = sum(-(-n // block_size) for n in prompt_lengths) + 1
    llm = LLM(model_dir, backend="cuda", enforce_eager=True, block_size=block_size, num_kv_blocks=blocks,
              max_num_seqs=max(len(prompt_lengths), 1), max_num_batched_tokens=max(total, 16),
              enable_prefix_caching=False, matmul_precision=matmul_precision, kv_cache_dtype=kv_cache_dtype)
    engine, runner = llm.engine, llm.engine.runner
    if perturb:
        perturb_weight(runner, perturb)
    rng = np.random.default_rng(seed)
    vocab = min(engine.config.vocab_size, 10000)
    seqs = [Sequence(str(i), rng.integers(0, vocab, n).tolist(), SamplingParams(temperature=0), 0)
            for i, n in enumerate(prompt_lengths)]
    scheduled = []
    for seq in seqs:
        engine.block_manager.allocate(seq, seq.num_tokens)
        scheduled.append(ScheduledSequence(seq, seq.num_tokens))
    batch, _ = pack(scheduled, block_size)
    scales = {"k": runner.k_scale, "v": runner.v_scale}

    def collector(into, whole_cache):
        def trace(layer, name, array):
            if hasattr(array, "copy_to_host"):
                runner.stream.synchronize()
            value = _host(array)
            if whole_cache and name in scales:   # the runner's cache: its rows at this step's slots, as float32
                value = kv_decode(slot_rows(value, batch.slot_mapping), scales[name])
            into[layer, name] = np.array(value, np.float32)
        return trace

    got, want = {}, {}
    runner.trace = collector(got, True)
    try:
        runner.execute(scheduled)
    finally:
        runner.trace = None
    ref = ReferenceLlama(engine.config, load_weights(model_dir, engine.config), matmul_precision=matmul_precision)
    ref.trace = collector(want, False)   # (it traces the rows, read back)
    ref.forward(batch, ref.new_kv_cache(blocks, block_size, kv_cache_dtype))
    if keep is not None:
        keep.update(cuda=got, reference=want)
    rows = []
    for key, w in want.items():
        g = got[key]
        if g.shape != w.shape:
            raise AssertionError(f"{key}: {g.shape} vs {w.shape}")
        diff = float(np.nanmax(np.abs(g.astype(np.float64) - w))) if w.size else 0.0
        if np.isnan(g).any() != np.isnan(w).any():
            diff = float("nan")
        scale = float(np.nanmax(np.abs(w))) if w.size else 0.0
        rows.append(Row(key[0], key[1], diff, diff / scale if scale else diff, scale))
    return rows


def first_parting(rows: list[Row], threshold: float) -> int | None:
    """The index of the first row whose rel exceeds threshold (NaN counts), or None."""
    return next((i for i, r in enumerate(rows) if not r.rel <= threshold), None)


def format_table(rows: list[Row], threshold: float) -> str:
    first = first_parting(rows, threshold)
    lines = ["| layer | op | max abs diff | rel | max abs ref |", "| ---: | --- | ---: | ---: | ---: |"]
    for i, r in enumerate(rows):
        mark = "  <- first above the threshold" if i == first else ""
        layer = "-" if r.layer < 0 else str(r.layer)
        lines.append(f"| {layer} | {r.op} | {r.max_abs:.3e} | {r.rel:.3e} | {r.scale:.3e} |{mark}")
    if first is None:
        lines.append(f"every row within rel {threshold:g}")
    else:
        r = rows[first]
        lines.append(f"first above rel {threshold:g}: layer {r.layer}, {r.op} (rel {r.rel:.3e})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="a model directory (Hugging Face layout)")
    source.add_argument("--preset", default="tiny", help="a random model of tinyvllm.random_model's presets "
                                                         "(default tiny)")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[30, 7, 1], metavar="N",
                        help="the lengths of the random prompts, prefilled as one batch (default 30 7 1)")
    parser.add_argument("--matmul-precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--kv-cache-dtype", choices=("fp32", "bf16", "fp8"), default="fp32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--perturb", metavar="LAYER.WEIGHT", help="scale row 0 of one GPU weight by 1.125 "
                        f"(WEIGHT: {', '.join(WEIGHTS)})")
    parser.add_argument("--threshold", type=float, default=1e-4, help="rel above which a row parts (default 1e-4)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tinyvllm.random_model import llama32_tokenizer_path, make_random_model

            extra = {"tokenizer_json": llama32_tokenizer_path(download=False)} if args.preset == "llama-3.2-1b" else {}
            model = make_random_model(Path(tmp) / "model", args.preset, seed=0, **extra)
        rows = compare(model, args.prompt_tokens, args.matmul_precision, args.kv_cache_dtype, args.block_size,
                       args.perturb, args.seed)
    print(f"prefill of {args.prompt_tokens} tokens; matmul {args.matmul_precision}, KV cache {args.kv_cache_dtype}"
          + (f"; perturbed {args.perturb} on the GPU" if args.perturb else ""))
    print(format_table(rows, args.threshold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
