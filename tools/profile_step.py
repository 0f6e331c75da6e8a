"""Where the GPU time of one decode step goes, kernel by kernel, on the CUDA engine (needs a GPU).

    python3 tools/profile_step.py [--batch 1,16,64] [--context 256] [--matmul-precision auto] [--json out.json]
                                  [--ablate] [--gemv N,K=WARPS,ROWS,UNROLL,SPLIT[,PIPELINED] ...]
                                  [--gemv N,K=staged,ROWS,WARPS ...] [--set MODULE.NAME=VALUE ...]

For each batch size: a Llama-3.2-1B-shaped random model (or --model) serves `batch` requests with a
`context`-token prompt until they decode; then the decode step the engine replays is captured again with a
CUDA event recorded after every kernel (Numba's launch is wrapped to do that), and that graph is replayed.
The time between consecutive events is one kernel's GPU time inside the real step (its real buffers, its
place in the stream, weights not left in L2 by a repeat of the same launch). The table sums the kernels by
name and launch shape over the layers, and compares the sum with the plain graph's time: the difference is
what the events themselves and the gaps between kernels cost.

The events break programmatic dependent launch (cuda_kernels/pdl.py): a kernel cannot overlap one that an
event sits behind. --ablate measures the other way: for each kernel function, the plain graph is captured
again with every launch of that function left out, and the time it saves is that function's marginal cost in
the real, overlapped step (the skipped kernels' outputs are stale, so only the timing means anything).
--gemv captures the plain graph again with gemv's configuration for an (N, K) weight overridden, and times
it against the default choice: the way to tune gemv_config under PDL, where a kernel's prologue overlaps its
producer. One --gemv option is one variant and may name several shapes
(`--gemv 3072,2048=8,4,4,4 2048,2048=8,4,4,4`); repeat the option for more variants. `N,K=staged,ROWS,WARPS`
names a gemv.GemvStaged configuration (whole rows staged in shared memory).
--set does the same for any policy constant of cuda_kernels, set while the variant's graph is captured: one
option is one variant (`--set attention_policy.LARGE_GRID_WARPS=4 attention_policy.FOUR_LANES_MAX_BLOCKS=512`);
repeat it for more. A setting that needs a larger workspace than the engine allocated for its default policies
fails with the launcher's error.
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import json
import sys
import tempfile
from collections import defaultdict
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from cuda_kernels import compat  # noqa: E402,F401  (the numpy shim before numba.cuda)
from numba import cuda  # noqa: E402
from numba.cuda import dispatcher  # noqa: E402

from cuda_kernels import launch as kernel_launch  # noqa: E402
from cuda_kernels.driver import driver, ok, stream_handle  # noqa: E402

REPLAYS = 50


def record_external(event, stream) -> None:
    """Record `event` on a capturing `stream` as a node of the graph. NOTE: a plain cuEventRecord during capture
    only orders streams and is never recorded when the graph runs (cuEventElapsedTime then fails with
    CUDA_ERROR_INVALID_VALUE); CU_EVENT_RECORD_EXTERNAL makes it an event-record node that fires on replay."""
    drv = driver()
    ok(drv.cuEventRecordWithFlags(drv.CUevent(int(event.handle.value if hasattr(event.handle, "value")
                                                  else event.handle)),
                                  stream_handle(stream), drv.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL))


class Launches:
    """While the `with` block runs, every kernel launch, through Numba's syntax or cuda_kernels.launch, goes
    to around(label, name, go) instead: label is "name grid (x, y, z)", go() makes the launch."""

    def __init__(self, around):
        self.around = around

    def __enter__(self):
        self.numba, self.submit = dispatcher._LaunchConfiguration.__call__, kernel_launch.submit
        numba, submit, around = self.numba, self.submit, self.around

        def through_numba(config, *args):
            name = config.dispatcher.py_func.__name__
            around(f"{name} grid {tuple(config.griddim)}", name, lambda: numba(config, *args))

        def through_launch(kernel, grid, *rest):
            name = kernel.py_func.__name__
            around(f"{name} grid {tuple(grid) if isinstance(grid, tuple) else (grid,)}", name,
                   lambda: submit(kernel, grid, *rest))

        dispatcher._LaunchConfiguration.__call__ = through_numba
        kernel_launch.submit = through_launch
        return self

    def __exit__(self, *exc):
        dispatcher._LaunchConfiguration.__call__ = self.numba
        kernel_launch.submit = self.submit


def timed_launches(record, stream, events):
    """Run record() with one of `events` recorded on `stream` after each kernel launch (every launch of the
    step goes to that stream); returns [(label, event)]. The events are made beforehand, outside the capture."""
    marks = []

    def launch_and_mark(label, name, go):
        go()
        event = events[len(marks)]
        record_external(event, stream)
        marks.append((label, event))

    with Launches(launch_and_mark):
        record()
    return marks


def skipped_launches(record, names):
    """Run record() with every launch of a kernel function named in `names` left out."""
    def launch_unless_named(label, name, go):
        if name not in names:
            go()

    with Launches(launch_unless_named):
        record()


def with_settings(record, settings):
    """Run record() with each cuda_kernels.<module>.<name> of settings ((module, name, value), as `setting`
    parses them) set to its value, and the old values back afterwards."""
    saved = []
    try:
        for module, name, value in settings:
            mod = importlib.import_module(f"cuda_kernels.{module}")
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)
        record()
    finally:
        for mod, name, old in reversed(saved):
            setattr(mod, name, old)


def with_gemv_configs(record, overrides: dict):
    """Run record() with matmul_policy.gemv_config returning overrides[(n, k)] for those weight shapes (set and
    restored as with_settings does)."""
    from cuda_kernels import matmul_policy

    default = matmul_policy.gemv_config

    def config(m, n, k):
        return overrides.get((n, k)) or default(m, n, k)

    with_settings(record, (("matmul_policy", "gemv_config", config),))


def graph_time(graph, stream) -> float:
    """Mean GPU seconds of one replay."""
    start, stop = cuda.event(), cuda.event()
    graph.replay()
    start.record(stream)
    for _ in range(REPLAYS):
        graph.replay()
    stop.record(stream)
    stop.synchronize()
    return cuda.event_elapsed_time(start, stop) / 1e3 / REPLAYS


def decoding_engine(model_dir: Path, max_batch: int, context: int, precision: str):
    """A CUDA engine for up to max_batch sequences of `context`-token prompts (plus a few decode steps)."""
    from tinyvllm.engine import LLMEngine

    return LLMEngine.from_options(model_dir, backend="cuda", max_num_seqs=max_batch,
                                  num_kv_blocks=max(256, max_batch * (-(-(context + 64) // 16))),
                                  matmul_precision=precision, enable_prefix_caching=False)


def replayed_graph(engine, batch: int, context: int):
    """Serve `batch` requests with `context`-token prompts until they decode; returns the CUDA graph their last
    decode step replayed. (Found by watching replays, not by guessing its key: a warmed-up engine holds a graph
    for every batch and table-width bucket.) The requests are left running."""
    from tinyvllm.cuda_graph import CUDAGraph
    from tinyvllm.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(0, 10000, context).tolist(),
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), final_only=True)
    replayed, replay = [], CUDAGraph.replay

    def watched(graph):
        replayed.append(graph)
        replay(graph)

    CUDAGraph.replay = watched
    try:
        for _ in range(10):  # prefill (a step or a few), then decode steps (a first one may capture the graph)
            engine.step()
    finally:
        CUDAGraph.replay = replay
    if not replayed:
        raise RuntimeError(f"batch {batch}: no decode step replayed a CUDA graph (enforce_eager, or no GPU?)")
    return replayed[-1]


def graph_key(runner, graph) -> tuple | None:
    """The runner's key of `graph`: (batch bucket, table-width bucket, sampling mode); None if it holds no such
    graph."""
    return next((key for key, g in runner.graphs.items() if g is graph), None)


def step_times(model_dir: Path, batches: list[int], context: int, precision: str) -> dict:
    """{batch: {"graph_s": the plain decode graph's mean replay time, "graph_batch": its batch bucket}}, all
    batches on one engine sized for the largest (a graph's time depends on its bucket, not on the engine)."""
    engine = decoding_engine(model_dir, max(batches), context, precision)
    times = {}
    for batch in batches:
        graph = replayed_graph(engine, batch, context)
        key = graph_key(engine.runner, graph)
        times[batch] = {"graph_s": graph_time(graph, engine.runner.stream), "graph_batch": key and key[0]}
        while engine.has_unfinished_requests():
            engine.step()
    return times


def profile(model_dir: Path, batch: int, context: int, precision: str, ablate: bool = False,
            variants: tuple = ()) -> dict:
    """The step's kernels timed between events; with ablate each kernel function's marginal cost; variants:
    (label, wrap) pairs, each timed as the plain graph captured again with wrap(record) (gemv_variant,
    settings_variant) next to the default's time."""
    from tinyvllm.cuda_graph import CUDAGraph

    engine = decoding_engine(model_dir, batch, context, precision)
    runner = engine.runner
    plain = replayed_graph(engine, batch, context)
    key = graph_key(runner, plain)
    if key is None:
        raise RuntimeError("the replayed decode graph is not among runner.graphs: profile cannot capture it again")
    b, w, greedy = key
    from tinyvllm.step_inputs import StepShape

    shape = StepShape(b, b, b, w)
    # the device inputs still hold the last decode step: replaying it again recomputes the same step
    forward = partial(runner._forward, runner.inputs.views(shape), shape, 1, greedy)
    marks = []
    stream = runner.stream
    start, events = cuda.event(), [cuda.event() for _ in range(64 * runner.config.num_layers)]

    def record(s):
        record_external(start, s)
        marks[:] = timed_launches(partial(forward, s, chained=True), s, events)

    marked = CUDAGraph(record, stream)
    marked.replay()
    stream.synchronize()
    times, previous = defaultdict(lambda: [0.0, 0]), start
    for label, event in marks:
        entry = times[label]
        entry[0] += cuda.event_elapsed_time(previous, event) / 1e3
        entry[1] += 1
        previous = event
    total = sum(t for t, _ in times.values())
    plain_s = graph_time(plain, stream)
    result = {"batch": batch, "graph_batch": b, "context": context, "matmul_precision": runner.matmul_precision,
              "graph_s": plain_s, "marked_graph_s": total,
              "kernels": [{"kernel": k, "launches": n, "seconds": t} for k, (t, n) in
                          sorted(times.items(), key=lambda item: -item[1][0])]}

    def variant_time(wrap) -> float:
        wrap(partial(forward, stream, chained=True))  # compiles what the capture needs (capture cannot load modules)
        stream.synchronize()
        graph = CUDAGraph(lambda s: wrap(partial(forward, s, chained=True)), stream)
        return graph_time(graph, stream)

    if ablate:
        names = sorted({label.split(" grid ")[0] for label, _ in marks})
        result["ablation"] = [{"kernel": name, "launches": sum(label.startswith(name + " ") for label, _ in marks),
                               "saved_s": plain_s - variant_time(partial(skipped_launches, names={name}))}
                              for name in names]
        result["ablation"].sort(key=lambda row: -row["saved_s"])
    if variants:
        result["variants"] = []
        for label, wrap in variants:
            # the default's time again next to each variant: replays drift by a few tenths of a percent
            base, varied = graph_time(plain, stream), variant_time(wrap)
            result["variants"].append({"variant": label, "default_s": base, "variant_s": varied})
    return result


def table(result: dict) -> str:
    lines = [f"batch {result['batch']} (graph {result['graph_batch']}), context {result['context']}, matmul "
             f"{result['matmul_precision']}: step {result['graph_s'] * 1e6:,.0f} us in the plain graph, "
             f"{result['marked_graph_s'] * 1e6:,.0f} us summed between events", "",
             "| kernel and grid | launches | us per step | share |", "| --- | ---: | ---: | ---: |"]
    for k in result["kernels"]:
        lines.append(f"| {k['kernel']} | {k['launches']} | {k['seconds'] * 1e6:,.1f} | "
                     f"{k['seconds'] / result['marked_graph_s']:.0%} |")
    if "ablation" in result:
        lines += ["", "| kernel left out | launches | us the step saves | per launch |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {r['kernel']} | {r['launches']} | {r['saved_s'] * 1e6:,.1f} | "
                  f"{r['saved_s'] * 1e6 / max(1, r['launches']):.2f} |" for r in result["ablation"]]
    if "variants" in result:
        lines += ["", "| variant | default us | variant us | ratio |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {v['variant']} | {v['default_s'] * 1e6:,.1f} | {v['variant_s'] * 1e6:,.1f} | "
                  f"{v['variant_s'] / v['default_s']:.3f} |" for v in result["variants"]]
    return "\n".join(lines)


def gemv_variant(overrides: dict) -> tuple:
    """(label, wrap) of a --gemv variant: gemv's configuration for each (N, K) of overrides (warps, rows, unroll,
    split[, pipelined], or a GemvStaged)."""
    label = "gemv " + "; ".join(f"{n},{k}: {tuple(c)}" for (n, k), c in overrides.items())
    return label, partial(with_gemv_configs, overrides=overrides)


def setting(text: str) -> tuple:
    """'MODULE.NAME=VALUE' -> (MODULE, NAME, value): a constant of cuda_kernels.MODULE (it must exist) and a
    Python literal for it, e.g. attention_policy.LARGE_GRID_WARPS=2."""
    target, _, value = text.partition("=")
    module, _, name = target.rpartition(".")
    try:
        mod = importlib.import_module(f"cuda_kernels.{module}")
    except ImportError:
        raise argparse.ArgumentTypeError(f"{text!r}: no module cuda_kernels.{module}") from None
    if not name or not hasattr(mod, name):
        raise argparse.ArgumentTypeError(f"{text!r}: cuda_kernels.{module} has no {name!r}")
    try:
        return module, name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a Python literal") from None


def settings_variant(settings) -> tuple:
    """(label, wrap) of a --set variant: the step with every setting of `settings` (as `setting` parses them)."""
    label = "; ".join(f"{module}.{name}={value!r}" for module, name, value in settings)
    return label, partial(with_settings, settings=tuple(settings))


def gemv_override(text: str) -> tuple:
    """'N,K=W,R,U,S[,P]' -> ((N, K), GemvConfig(W, R, U, S, P)), P 1 for a pipelined configuration;
    'N,K=staged,ROWS,W' -> ((N, K), GemvStaged(ROWS, W))."""
    from cuda_kernels.gemv import GemvConfig, GemvStaged

    shape, config = text.split("=")
    n, k = (int(v) for v in shape.split(","))
    if config.startswith("staged,"):
        return (n, k), GemvStaged(*(int(v) for v in config.split(",")[1:]))
    values = [int(v) for v in config.split(",")]
    return (n, k), GemvConfig(*values[:4], *(bool(v) for v in values[4:]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a model directory (default: a random Llama-3.2-1B-shaped one)")
    p.add_argument("--batch", type=lambda t: [int(b) for b in t.split(",")], default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256, help="prompt tokens of every request (default 256)")
    p.add_argument("--matmul-precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="the engine's matmul inputs (default auto: the engine's default, bf16 on the GPU)")
    p.add_argument("--json", type=Path)
    p.add_argument("--ablate", action="store_true", help="time the step without each kernel function in turn")
    p.add_argument("--gemv", type=gemv_override, action="append", nargs="+", default=[], metavar="N,K=W,R,U,S[,P]|N,K=staged,R,W",
                   help="one variant of gemv configurations per option (repeatable)")
    p.add_argument("--set", type=setting, action="append", nargs="+", default=[], metavar="MODULE.NAME=VALUE",
                   help="one variant per option: the step with these cuda_kernels constants set, e.g. "
                        "attention_policy.LARGE_GRID_WARPS=2 (repeatable)")
    args = p.parse_args()
    variants = tuple(gemv_variant(dict(v)) for v in args.gemv) + tuple(settings_variant(v) for v in args.set)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tinyvllm.random_model import make_random_model

            model = make_random_model(Path(tmp) / "m", "llama-3.2-1b", seed=0)
        results = []
        for batch in args.batch:
            results.append(profile(model, batch, args.context, args.matmul_precision, args.ablate, variants))
            print(table(results[-1]) + "\n", flush=True)
            gc.collect()  # the engine's device memory goes back before the next one is made
            cuda.current_context().deallocations.clear()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
