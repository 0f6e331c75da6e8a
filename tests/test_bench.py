"""tools/bench.py on the CPU backend with the tiny random model: real measured numbers, exactly the requested
token counts, the markdown rows, and the peers skipped (with their reasons) where torch cannot be imported. The
kernels workload runs where the CUDA engine's kernels do (the simulator under the default test profile); step
needs a GPU (its graph lookup is tested with a fake engine); startup runs the real CLI on the cpu backend and
a fake command; the goal table is checked on made-up results at its thresholds. tests/test_torch_peer.py runs
the PyTorch peer where torch is installed."""

import dataclasses
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tinyvllm_tools_bench", REPO / "tools" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture
def no_torch(monkeypatch):
    """Make `import torch` fail, as on a machine without it (the GPU image has torch)."""
    monkeypatch.setitem(sys.modules, "torch", None)


@pytest.fixture
def no_simulator(monkeypatch):
    """Run as without NUMBA_ENABLE_CUDASIM (which the default test profile sets): the cpu backend then has no
    kernels to time. Only code that reads compat.SIMULATOR when called sees it; the cpu backend runs no kernel."""
    from cuda_kernels import compat

    monkeypatch.setattr(compat, "SIMULATOR", False)


def test_all_workloads_and_sweep_on_cpu(bench, tmp_path, no_torch, no_simulator, capsys):
    out_json, out_md, out_png = tmp_path / "bench.json", tmp_path / "bench.md", tmp_path / "sweep.png"
    argv = ["all", "--quick", "--preset", "tiny", "--backend", "cpu", "--max-num-seqs", "4", "--sweep", "1,2",
            "--static-batches", "2,3", "--model-dir", str(tmp_path / "model"), "--json", str(out_json),
            "--markdown", str(out_md), "--plot", str(out_png)]
    assert bench.main(argv) == 0
    r = json.loads(out_json.read_text())
    q = bench.QUICK
    assert r["errors"] == []
    assert r["command"] == "python3 tools/bench.py " + " ".join(argv)
    assert r["tinyvllm"]["backend"] == "cpu" and r["config"]["sizes"]["latency_new"] == q.latency_new

    lat = r["tinyvllm"]["latency"]
    assert lat["prompt_tokens"] == q.latency_prompt and lat["new_tokens"] == q.latency_new
    assert len(lat["runs_decode_tok_s"]) == q.runs and min(lat["runs_decode_tok_s"]) > 0
    assert lat["decode_tok_s"] == max(lat["runs_decode_tok_s"])
    assert lat["roofline_fraction"] == pytest.approx(lat["decode_tok_s"] / r["tinyvllm"]["roofline_tok_s"])
    # no GPU to measure the copy on: the H200's rate, said so
    assert r["tinyvllm"]["bandwidth_gbs"] == bench.H200_COPY_GBS == 4250
    assert r["tinyvllm"]["bandwidth_source"] == "not measured (no GPU here): the H200's device copy in GPU.md"
    weight = r["model"]["weight_bytes_per_token"]
    assert r["tinyvllm"]["roofline_tok_s"] == pytest.approx(4250e9 / weight)

    pre = r["tinyvllm"]["prefill"]
    assert pre["prompt_tokens"] == q.prefill_prompt and pre["new_tokens"] == 1
    assert len(pre["runs_ttft_ms"]) == q.runs and pre["ttft_ms"] == min(pre["runs_ttft_ms"]) > 0

    for scheduler in ("continuous", "static"):
        tp = r["tinyvllm"]["throughput"][scheduler]
        assert tp["requests"] == q.num_requests
        assert tp["output_tokens"] == tp["requested_output_tokens"]
        assert q.num_requests * q.output_lens[0] <= tp["output_tokens"] <= q.num_requests * q.output_lens[1]
        assert q.num_requests * q.prompt_lens[0] <= tp["prompt_tokens"] <= q.num_requests * q.prompt_lens[1]
        assert tp["elapsed_s"] > 0
        assert tp["output_tok_s"] == pytest.approx(tp["output_tokens"] / tp["elapsed_s"])
        for batch in (1, 2):
            point = r["tinyvllm"]["sweep"][scheduler][str(batch)]
            assert point["requests"] == bench.SWEEP_WAVES * batch
            assert point["prompt_tokens"] == point["requests"] * q.sweep_prompt
            assert point["output_tokens"] == point["requested_output_tokens"] and point["output_tok_s"] > 0
    # the same seeded workload for both schedulers
    assert (r["tinyvllm"]["throughput"]["continuous"]["requested_output_tokens"]
            == r["tinyvllm"]["throughput"]["static"]["requested_output_tokens"])

    for batch in (2, 3):  # one static batch each, every request its static_new tokens, best of the runs
        st = r["tinyvllm"]["static"][str(batch)]
        assert st["batch"] == st["requests"] == batch and st["prompt_tokens"] == batch * q.static_prompt
        assert st["output_tokens"] == st["requested_output_tokens"] == batch * q.static_new
        assert len(st["runs_output_tok_s"]) == q.runs and st["output_tok_s"] == max(st["runs_output_tok_s"])
    assert r["tinyvllm"]["step"] == {"skipped": "step not measured: it needs a GPU (backend cpu)"}
    startup = r["tinyvllm"]["startup"]
    assert startup["backend"] == "cpu" and "-m tinyvllm generate --backend cpu --model" in startup["command"]
    assert [run["run"] for run in startup["runs"]] == ["first (cold kernel cache)",
                                                       "second (kernels cached by the first)"]
    assert all(0 < run["first_byte_s"] <= run["exit_s"] for run in startup["runs"])
    stalls = r["tinyvllm"]["stalls"]
    assert [p["requests"] for p in stalls["phases"]] == [*q.stall_batches, q.stall_singles]
    assert all(p["steps"] > 0 and p["compiles"] == p["captures"] == 0 for p in stalls["phases"])  # cpu: none
    assert stalls["worst_step_s"] == max(p["worst_step_s"] for p in stalls["phases"]) > 0
    assert [g["workload"] for g in r["goals"]] == [
        f"static batch 64, prompt {q.static_prompt} -> {q.static_new}",
        f"static batch 256, prompt {q.static_prompt} -> {q.static_new}",
        f"throughput: {q.num_requests} requests, prompts and outputs U[16, 128] / U[16, 64], continuous",
        f"prefill {q.prefill_prompt} tokens (TTFT)", f"latency: batch 1, prompt {q.latency_prompt} -> {q.latency_new}",
        "decode step at batch 16 vs batch 1", "decode step at batch 64 vs batch 1",
        "`tinyvllm generate`, second process on the machine: process start to first token",
        "compiles or graph captures after the engine reports ready, over a varied workload"]
    measured = [g["value"] is not None for g in r["goals"]]
    assert measured == [False, False, True, True, True, False, False, True, True]  # batches 64, 256 not run here
    assert r["goals"][8]["met"] is True and r["goals"][8]["measured"].startswith("0 compiles, 0 captures")

    assert "torch" in r["peer"]["skipped"] and "not importable" in r["peer"]["skipped"]
    assert r["torch_peer"]["skipped"].startswith("PyTorch peer not measured: torch is not importable here")
    assert r["tinyvllm"]["kernels"] == {
        "skipped": "kernels not measured: the cpu backend (--backend cpu) has no GPU kernels to time"}

    md = out_md.read_text()
    assert md in capsys.readouterr().out
    assert f"Command: `{r['command']}`" in md
    for line in (f"| latency: batch 1, prompt {q.latency_prompt}, {q.latency_new} new | decode tok/s |",
                 "| output tok/s, continuous |", "| output tok/s, static |",
                 f"| prefill: {q.prefill_prompt}-token prompt | time to first token (ms) |",
                 f"{r['peer']['skipped']}.", f"{r['torch_peer']['skipped']}.",
                 f"{r['tinyvllm']['kernels']['skipped']}.", f"{r['tinyvllm']['step']['skipped']}.",
                 "| goal workload | goal | tinyvllm | met | PyTorch compiled (ours) | HF transformers |",
                 f"| static batch 3, prompt {q.static_prompt}, {q.static_new} new |  | "
                 f"{bench._rate(r['tinyvllm']['static']['3']['output_tok_s'])} | - | - |  |  |",
                 "| phase | requests | steps | compiles | captures | longest step (ms) |",
                 "| batch size | tinyvllm continuous | tinyvllm static | HF static batch |",
                 f"at 4,250 GB/s (not measured (no GPU here): the H200's device copy in GPU.md) = "
                 f"{r['tinyvllm']['roofline_tok_s']:,.0f} tok/s at batch 1."):
        assert line in md
    sweep_rows = [row for row in md.splitlines() if row.startswith(("| 1 |", "| 2 |"))]
    assert len(sweep_rows) == 2 and all(row.endswith("| - |") for row in sweep_rows)  # no peer column values
    if r["versions"]["matplotlib"]:
        assert out_png.stat().st_size > 0 and r["plot"] == f"wrote {out_png}"
    else:
        assert not out_png.exists() and "matplotlib" in r["plot"]


def test_kernels_workload_checks_and_times_every_case(bench, tmp_path, capsys):
    """The kernels workload alone on the tiny model (in the simulator under the default profile, on the GPU
    under the gpu one): every case passed its reference check and was timed; bytes follow the shapes, GB/s =
    bytes / time, met = GB/s >= target; one markdown row per case."""
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["kernels", "--quick", "--preset", "tiny", "--backend", "cuda", "--matmul-precision", "bf16", "--no-peer",
            "--model-dir", str(tmp_path / "model"), "--json", str(out_json), "--markdown", str(out_md)]
    assert bench.main(argv) == 0
    r = json.loads(out_json.read_text())
    assert r["errors"] == [] and r["tinyvllm"]["backend"] == "cuda" and r["config"]["workloads"] == ["kernels"]
    assert r["peer"] == {"skipped": "HF transformers peer not measured: --no-peer"}
    cases = r["tinyvllm"]["kernels"]["cases"]
    # the tiny preset: hidden 64, 4 query and 2 KV heads of 16, FFN 96, vocab 260; fp32 x and out
    q, kv, f = 4 * 16, 2 * 16, 96
    expected = [  # name, shape, call, bytes (weight + x + out; QKV also writes K and V as bf16), target
        ("GEMV: QKV + RoPE + KV write", "1x64 @ 128x64^T", "matmul_rope_kv_write",
         128 * 64 * 2 + 4 * (64 + q) + 2 * kv * 2, 3500),
        ("GEMV: O", "1x64 @ 64x64^T", "matmul", 64 * 64 * 2 + 4 * (q + 64), 3500),
        ("GEMV: gate/up + SiLU*mul", "1x64 @ 192x64^T -> 1x96", "gated_matmul", 2 * f * 64 * 2 + 4 * (64 + f), 3500),
        ("GEMV: down", "1x96 @ 64x96^T", "matmul", 64 * f * 2 + 4 * (f + 64), 3500),
        ("GEMV: LM head", "1x64 @ 260x64^T", "matmul", 260 * 64 * 2 + 4 * (64 + 260), 3500),
        # K and V read: 2 sequences of 256 tokens (QUICK), 2 KV heads of 16, bf16
        ("PagedAttention decode", "batch 2 x context 256, 4/2 heads, d 16, block 16", "paged_attention",
         2 * 2 * 256 * kv * 2, 3000)]
    assert [(c["name"], c["shape"], c["config"].split(":")[0], c["bytes"], c["target_gb_s"]) for c in cases] == expected
    md = out_md.read_text()
    assert md in capsys.readouterr().out
    assert "| kernel | shape | call: kernel (config) | time (us) | GB/s | target GB/s | status |" in md
    for c in cases:
        assert c["check"] == "passed" and c["time_us"] > 0
        assert c["gb_s"] == pytest.approx(c["bytes"] / (c["time_us"] * 1e-6) / 1e9)
        assert c["met"] == (c["gb_s"] >= c["target_gb_s"])
        status = f"{'met' if c['met'] else 'not met'} ({c['gb_s'] / c['target_gb_s']:.0%})"
        assert (f"| {c['name']} | {c['shape']} | {c['config']} | {c['time_us']:,.1f} | {c['gb_s']:,.0f} | "
                f"{c['target_gb_s']:,.0f} | {status} |") in md


def test_kvcache_workload_reports_capacity_attention_throughput_and_logit_differences(bench, tmp_path):
    """issue 31's report on the tiny model: the engines on the cpu backend (their capacity is the cpu
    default's, the same for each format there), decode attention per format where the kernels run (the
    simulator under the default profile, the GPU under the gpu one), bytes by the format's element size; the
    logits compared with bf16's and fp32's; throughput for the formats asked."""
    from cuda_kernels import compat

    backend = "cpu" if compat.SIMULATOR else "cuda"
    sizes = dataclasses.replace(bench.QUICK, attention_context=48, num_requests=4, kv_prompts=(9, 3), kv_new=3)
    cfg = bench.BenchConfig(workloads=["kvcache"], sizes=sizes, preset="tiny", model_dir=tmp_path / "m",
                            backend=backend, max_num_seqs=4, peer=False, kv_throughput=["fp8"],
                            command="python3 tools/bench.py kvcache")
    r = bench.run_bench(cfg)
    assert r["errors"] == []
    kv = r["tinyvllm"]["kvcache"]
    assert set(kv["capacity"]) == {"bf16", "fp8", "fp32"} and all(c["blocks"] > 0 for c in kv["capacity"].values())
    if not compat.SIMULATOR:   # on the GPU: half the bytes, about twice the blocks
        assert kv["capacity"]["fp8"]["blocks"] > 1.8 * kv["capacity"]["bf16"]["blocks"]
    itemsize = {"bf16": 2, "fp8": 1, "fp32": 4}
    for fmt, row in kv["attention"].items():
        assert row["check"] == "passed" and row["bytes"] == 2 * 2 * 48 * 2 * 16 * itemsize[fmt]
    assert set(kv["attention"]) == {"bf16", "fp8", "fp32"}
    assert list(kv["throughput"]) == ["fp8"] and kv["throughput"]["fp8"]["output_tokens"] > 0
    logits = kv["logits"]
    assert set(logits) == {"fp8 vs bf16", "fp32 vs bf16", "bf16 vs fp32", "fp8 vs fp32"}
    assert 0 < logits["fp32 vs bf16"]["max_abs_logit_diff"] < logits["fp8 vs fp32"]["max_abs_logit_diff"]
    md = bench.markdown(r)
    assert "| fp8 vs bf16 |" in md and "| format | KV blocks at 0.9 |" in md


def test_failed_kernel_check_is_reported(bench):
    """A case whose reference check failed (checked_time's text instead of seconds) is not timed or rated."""
    case = SimpleNamespace(name="GEMV: O", shape="1x8 @ 8x8^T", config="matmul: gemv (4, 2, 1, 1)",
                           bytes_moved=6_000_000)
    failed = bench.kernel_row(case, 3500.0, "FAILED: AssertionError: 3 outputs off")
    assert failed == {"name": "GEMV: O", "shape": "1x8 @ 8x8^T", "config": "matmul: gemv (4, 2, 1, 1)",
                      "bytes": 6_000_000, "target_gb_s": 3500.0, "check": "FAILED: AssertionError: 3 outputs off"}
    timed = bench.kernel_row(case, 3500.0, 2e-6)
    assert timed["gb_s"] == pytest.approx(3000.0) and timed["met"] is False and timed["check"] == "passed"
    results = {"config": {"matmul_precision": "auto"},
               "tinyvllm": {"kernels": {"device": "GPU", "cold_bytes": 1 << 20, "matmul_precision": "fp32",
                                        "cases": [failed, timed]}}}
    rows = [line for line in bench.kernels_markdown(results) if line.startswith("| GEMV: O |")]
    assert rows == ["| GEMV: O | 1x8 @ 8x8^T | matmul: gemv (4, 2, 1, 1) | FAILED: AssertionError: 3 outputs off |  "
                    "| 3,500 | not measured |",
                    "| GEMV: O | 1x8 @ 8x8^T | matmul: gemv (4, 2, 1, 1) | 2.0 | 3,000 | 3,500 | not met (86%) |"]


def test_no_peer_says_so(bench, tmp_path):
    sizes = bench.Sizes(latency_prompt=8, latency_new=4, runs=1, prefill_prompt=16, prompt_lens=(4, 8),
                        sweep_prompt=8)
    cfg = bench.BenchConfig(workloads=["latency"], sizes=sizes, preset="tiny", model_dir=tmp_path / "m",
                            backend="cpu", max_num_seqs=2, peer=False, matmul_precision="bf16",
                            command="python3 tools/bench.py latency")
    r = bench.run_bench(cfg)
    assert r["config"]["matmul_precision"] == "bf16" and "(matmul precision bf16)" in bench.markdown(r)
    assert r["peer"] == {"skipped": "HF transformers peer not measured: --no-peer"}
    assert r["tinyvllm"]["latency"]["new_tokens"] == 4 and "throughput" not in r["tinyvllm"]
    assert "peer not measured: --no-peer." in bench.markdown(r)


def test_roofline_bandwidth_given_and_none_without_latency(bench, tmp_path):
    sizes = bench.Sizes(latency_prompt=8, latency_new=4, runs=1, prefill_prompt=16)
    given = bench.BenchConfig(workloads=["latency"], sizes=sizes, preset="tiny", model_dir=tmp_path / "m",
                              backend="cpu", max_num_seqs=2, peer=False, bandwidth_gbs=1000.0)
    r = bench.run_bench(given)
    assert (r["tinyvllm"]["bandwidth_gbs"], r["tinyvllm"]["bandwidth_source"]) == (1000.0, "given with --bandwidth-gbs")
    assert r["tinyvllm"]["roofline_tok_s"] == pytest.approx(1000e9 / r["model"]["weight_bytes_per_token"])
    assert "at 1,000 GB/s (given with --bandwidth-gbs) = " in bench.markdown(r)
    # without latency there is no roofline to set, so no copy is measured
    r = bench.run_bench(dataclasses.replace(given, workloads=["prefill"], bandwidth_gbs=None))
    assert r["errors"] == [] and r["tinyvllm"]["prefill"]["ttft_ms"] > 0
    assert "bandwidth_gbs" not in r["tinyvllm"] and "Roofline" not in bench.markdown(r)
    with pytest.raises(SystemExit):
        bench.parse_args(["latency", "--bandwidth-gbs", "0"])


@pytest.mark.skipif(os.environ.get("TINYVLLM_TEST_PROFILE", "sim") != "gpu", reason="times a copy on a real GPU")
def test_copy_bandwidth_is_measured_on_the_gpu():
    from tools.kernel_benchmarks.common import copy_bandwidth_gbs

    gbs = copy_bandwidth_gbs(1 << 28, repeats=5)
    assert 100 < gbs < 20_000  # any GPU this runs on: a broken timing gives 0, a negative or an absurd rate


def test_peer_unavailable_without_torch(bench, no_torch):
    assert bench.peer_unavailable().startswith("HF transformers peer not measured: torch and transformers")


def test_engine_plan_builds_each_engine_once(bench):
    cfg = bench.BenchConfig(workloads=["latency", "throughput", "prefill"], max_num_seqs=64, sweep=[1, 64])
    plan = dict(bench.engine_plan(cfg))
    assert plan == {
        ("continuous", 64): [("latency", None), ("prefill", None), ("throughput", None), ("sweep", 64)],
        ("static", 64): [("throughput", None), ("sweep", 64)],
        ("continuous", 1): [("sweep", 1)],
        ("static", 1): [("sweep", 1)],
    }
    only_latency = bench.BenchConfig(workloads=["latency"], schedulers=["static"])
    assert bench.engine_plan(only_latency) == [(("static", 256), [("latency", None)])]


def test_random_requests_are_seeded_and_in_range(bench):
    a = bench.random_requests(np.random.default_rng(0), 256, (100, 1024), (100, 1024), 10000)
    b = bench.random_requests(np.random.default_rng(0), 256, (100, 1024), (100, 1024), 10000)
    assert a == b and len(a) == 256
    assert all(100 <= len(p) <= 1024 and 100 <= n <= 1024 and 0 <= min(p) and max(p) < 10000 for p, n in a)


def test_weight_bytes_of_llama_3_2_1b(bench):
    from tinyvllm.config import ModelConfig
    from tinyvllm.random_model import LLAMA_3_2_1B

    config = ModelConfig.from_dict({"model_type": "llama", **LLAMA_3_2_1B})
    # 1,235,814,400 parameters (the tied embedding read once, as the LM head), 2 bytes each
    assert bench.weight_bytes_per_token(config) == 2_471_628_800
    untied = ModelConfig.from_dict({"model_type": "llama", **LLAMA_3_2_1B, "tie_word_embeddings": False})
    assert bench.weight_bytes_per_token(untied) == 2_471_628_800  # an LM head read, an embedding row gathered


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_warm_up_reaches_every_decode_batch_size(bench, tiny_model_dir, num_seqs):
    from tinyvllm import LLM

    llm = LLM(tiny_model_dir, backend="cpu", max_num_seqs=num_seqs, enable_prefix_caching=False)
    sizes = []
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda scheduled, chain_src=None: sizes.append(
        len(scheduled) if all(item.num_new_tokens == 1 for item in scheduled) else 0) or launch(scheduled,
                                                                                             chain_src)
    bench.warm_up(llm, np.random.default_rng(0), num_seqs, 40, 200)
    assert set(range(1, num_seqs + 1)) <= set(sizes)  # 0 marks a step with a prefill in it


def test_parse_args_presets_peers_and_static_batches(bench):
    cfg, _ = bench.parse_args(["goals"])
    assert cfg.workloads == list(bench.GOAL_WORKLOADS) == [
        "latency", "throughput", "prefill", "static", "step", "startup", "stalls"]
    assert cfg.peers == ["torch", "hf"] and cfg.static_batches == [16, 64, 256] and cfg.matmul_precision == "auto"
    assert bench.parse_args(["all"])[0].workloads == list(bench.ALL_WORKLOADS) == list(bench.WORKLOADS[:-1])
    assert bench.parse_args(["goals", "kernels"])[0].workloads == list(bench.ALL_WORKLOADS)
    cfg, _ = bench.parse_args(["kvcache", "--kv-formats", "bf16,fp8", "--kv-throughput", "fp8"])
    assert cfg.workloads == ["kvcache"] and cfg.kv_formats == ["bf16", "fp8"] and cfg.kv_throughput == ["fp8"]
    assert cfg.kv_cache_dtype == "bf16" and bench.parse_args(["latency", "--kv-cache-dtype", "fp8"])[0].kv_cache_dtype == "fp8"
    cfg, _ = bench.parse_args(["static", "--static-batches", "64,256", "--peers", "torch"])
    assert cfg.workloads == ["static"] and cfg.static_batches == [64, 256] and cfg.peers == ["torch"]
    assert bench.parse_args(["latency", "--peers", "none"])[0].peers == []
    for bad in (["latency", "--peers", "vllm"], ["static", "--static-batches", "0"], ["goal"],
                ["kvcache", "--kv-formats", "fp16"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_peer_skipped_says_why(bench):
    cfg = bench.BenchConfig(workloads=["latency"], peers=["torch"])
    assert bench.peer_skipped(cfg, "torch", bench.TORCH_PEER_WORKLOADS, "PyTorch peer") is None
    assert bench.peer_skipped(cfg, "hf", bench.PEER_WORKLOADS, "HF peer") == "HF peer not measured: --peers torch"
    only_stalls = bench.BenchConfig(workloads=["stalls"])
    assert bench.peer_skipped(only_stalls, "torch", bench.TORCH_PEER_WORKLOADS, "PyTorch peer") == (
        "PyTorch peer not measured: none of latency, prefill, static, step was asked for")
    sweep = bench.BenchConfig(workloads=[], sweep=[4])  # the HF peer runs the sweep; the torch peer does not
    assert bench.peer_skipped(sweep, "hf", bench.PEER_WORKLOADS, "HF peer") is None
    assert bench.peer_skipped(sweep, "torch", bench.TORCH_PEER_WORKLOADS, "PyTorch peer") is not None


def test_engine_plan_puts_static_batches_on_a_static_engine_that_holds_them(bench):
    cfg = bench.BenchConfig(workloads=["throughput", "static"], max_num_seqs=256, static_batches=[16, 64, 256])
    assert bench.engine_plan(cfg) == [
        (("continuous", 256), [("throughput", None)]),
        (("static", 256), [("throughput", None), ("static", 16), ("static", 64), ("static", 256)])]
    bigger = bench.BenchConfig(workloads=["static"], max_num_seqs=64, static_batches=[16, 300])
    assert bench.engine_plan(bigger) == [(("static", 300), [("static", 16), ("static", 300)])]


def test_static_requests_are_seeded_per_batch(bench):
    cfg = bench.BenchConfig(workloads=["static"])
    a, b = bench.static_requests(cfg, 4, 1000), bench.static_requests(cfg, 4, 1000)
    assert a == b and len(a) == 4 and len({tuple(p) for p, _ in a}) == 4
    assert all(len(p) == 128 and n == 256 and max(p) < 1000 for p, n in a)
    assert bench.static_requests(cfg, 5, 1000)[0] != a[0]


def test_step_summary_ratios_against_the_smallest_batch(bench):
    r = bench.step_summary({16: 3.0e-3, 1: 1.5e-3, 64: 4.5e-3}, 256)
    assert list(r["batches"]) == ["1", "16", "64"] and r["context"] == 256
    assert [v["ratio"] for v in r["batches"].values()] == pytest.approx([1.0, 2.0, 3.0])
    assert r["summary"] == "batch 1 1.50 ms (1.00x), batch 16 3.00 ms (2.00x), batch 64 4.50 ms (3.00x)"


def test_replayed_graph_is_the_last_decode_steps(bench, monkeypatch):
    """profile_step.replayed_graph (what the step workload times) returns the graph the engine's last step
    replayed, whatever graphs the runner holds, restores CUDAGraph.replay, and says so when none was replayed.
    (The bench fixture puts tools/ on the path, as bench.py does.)"""
    from tinyvllm.cuda_graph import CUDAGraph
    from tools import profile_step

    monkeypatch.setattr(CUDAGraph, "replay", lambda graph: None)  # no driver here: the original does nothing
    graphs = {(b, 16, True): object.__new__(CUDAGraph) for b in (1, 2, 4)}

    class Engine:
        def __init__(self, decode_batch):
            self.steps, self.requests, self.decode_batch = 0, [], decode_batch
            self.runner = type("Runner", (), {"graphs": graphs})()

        def add_request(self, prompt, params, final_only):
            self.requests.append((len(prompt), params.max_tokens))

        def step(self):
            self.steps += 1
            if self.decode_batch and self.steps > 2:  # two prefill steps, then decode steps replay a graph
                graphs[(self.decode_batch, 16, True)].replay()

    replay = CUDAGraph.replay
    engine = Engine(decode_batch=2)
    graph = profile_step.replayed_graph(engine, 2, 40)
    assert graph is graphs[(2, 16, True)] and profile_step.graph_key(engine.runner, graph) == (2, 16, True)
    assert engine.requests == [(40, 32), (40, 32)] and engine.steps == 10 and CUDAGraph.replay is replay
    assert profile_step.graph_key(engine.runner, object.__new__(CUDAGraph)) is None
    with pytest.raises(RuntimeError, match="batch 3: no decode step replayed a CUDA graph"):
        profile_step.replayed_graph(Engine(decode_batch=None), 3, 40)
    assert CUDAGraph.replay is replay


def test_profile_step_settings_hold_while_the_variant_records(bench):
    """--set: each MODULE.NAME=VALUE of cuda_kernels is set while the variant's step is recorded (here the decode
    attention's policy for batch 128 x a 32-block table as it was before 2 warps for large grids: 4 warps, and 8
    lanes per key with 4 lanes allowed up to 512 blocks only), then restored, also when the recording fails; a
    name or value that cannot be set is refused before anything runs. (The bench fixture puts tools/ on the path.)"""
    import argparse

    from cuda_kernels import attention_policy as ap
    from tools import profile_step

    settings = [profile_step.setting("attention_policy.LARGE_GRID_WARPS=4"),
                profile_step.setting("attention_policy.FOUR_LANES_MAX_BLOCKS=512")]
    assert settings == [("attention_policy", "LARGE_GRID_WARPS", 4), ("attention_policy", "FOUR_LANES_MAX_BLOCKS", 512)]
    label, wrap = profile_step.settings_variant(settings)
    assert label == "attention_policy.LARGE_GRID_WARPS=4; attention_policy.FOUR_LANES_MAX_BLOCKS=512"
    before = ap.LARGE_GRID_WARPS, ap.FOUR_LANES_MAX_BLOCKS, ap.decode_config(128, 32, 8, 64, 32)
    assert before[2] == (4, 2, 32)   # the default: 4 lanes and 2 warps for a grid of 1,024 blocks
    seen = []
    wrap(lambda: seen.append(ap.decode_config(128, 32, 8, 64, 32)))
    assert seen == [(8, 4, 32)]
    assert (ap.LARGE_GRID_WARPS, ap.FOUR_LANES_MAX_BLOCKS, ap.decode_config(128, 32, 8, 64, 32)) == before
    with pytest.raises(ZeroDivisionError):
        wrap(lambda: 1 / 0)
    assert (ap.LARGE_GRID_WARPS, ap.FOUR_LANES_MAX_BLOCKS) == before[:2]
    for text, message in [("attention_policy.NOPE=2", "has no 'NOPE'"), ("nomodule.X=1", "no module cuda_kernels.nomodule"),
                          ("attention_policy.LARGE_GRID_WARPS=two", "'two' is not a Python literal")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            profile_step.setting(text)


def test_stall_phases_cover_the_sizes_ends_and_both_samplings(bench):
    s = bench.Sizes()
    phases = bench.stall_phases(s, 0, 10000)
    names = [name for name, _ in phases]
    assert names == ["batch 1, greedy", "batch 3, greedy and sampled", "batch 17, greedy",
                     "batch 64, greedy and sampled", "batch 200, greedy",
                     "4 single requests in a row, prompts 3000 down to 5"]
    for (name, waves), batch in zip(phases[:5], s.stall_batches):
        (wave,) = waves
        lengths = [len(p) for p, _ in wave]
        assert len(wave) == batch and lengths[0] == 3000 and (batch == 1 or lengths[1] == 5)
        assert all(5 <= n <= 3000 for n in lengths)
        sampled = [params.temperature > 0 for _, params in wave]
        assert any(sampled) == ("sampled" in name) and not all(sampled)
        assert all(16 <= params.max_tokens <= 64 and params.ignore_eos for _, params in wave)
    singles = phases[5][1]
    assert [len(wave) for wave in singles] == [1] * 4
    assert [len(wave[0][0]) for wave in singles] == [3000, 356, 42, 5]
    assert [wave[0][1].temperature > 0 for wave in singles] == [False, True, False, True]
    again = bench.stall_phases(s, 0, 10000)  # seeded: the same prompts and lengths
    assert [[(p, sp.max_tokens) for p, sp in w] for _, ws in again for w in ws] == \
        [[(p, sp.max_tokens) for p, sp in w] for _, ws in phases for w in ws]


def test_stalls_count_compiles_and_captures_after_ready(bench, tiny_model_dir, monkeypatch):
    """The counters' deltas per phase and in total (faked: the cpu backend has neither), and the goal row."""
    counts = iter([(5, 1), (5, 1), (7, 1), (7, 1), (7, 3), (7, 3), (7, 3), (7, 3), (8, 3)])
    monkeypatch.setattr(bench, "setup_counts", lambda backend: next(counts))
    sizes = bench.Sizes(stall_batches=(1, 2, 3), stall_prompt_lens=(3, 40), stall_new=2, stall_singles=1)
    cfg = bench.BenchConfig(workloads=["stalls"], sizes=sizes, model=tiny_model_dir, backend="cpu", max_num_seqs=4,
                            peer=False)
    r = bench.run_bench(cfg)
    st = r["tinyvllm"]["stalls"]
    assert r["errors"] == [] and (st["prepared_at_ready"], st["captures_at_ready"]) == (5, 1)
    assert [(p["compiles"], p["captures"]) for p in st["phases"]] == [(2, 0), (0, 2), (0, 0), (1, 0)]
    assert (st["compiles_after_ready"], st["captures_after_ready"]) == (3, 2)
    goal = r["goals"][-1]
    assert goal["value"] == 5 and goal["met"] is False and goal["measured"].startswith("3 compiles, 2 captures")
    assert next(counts, None) is None


def test_time_to_first_byte_of_a_command(bench):
    """Timed from before Popen to the first stdout byte (the child sleeps 0.3 s first) and to the exit (0.3 s
    later); a failing, silent or hanging command raises, naming the problem and the end of its stderr."""
    env = dict(os.environ)
    script = "import sys, time; time.sleep(0.3); sys.stdout.write('x'); sys.stdout.flush(); time.sleep(0.3)"
    r = bench.time_to_first_byte([sys.executable, "-c", script], env, 30)
    assert 0.3 <= r["first_byte_s"] < r["exit_s"] and r["exit_s"] - r["first_byte_s"] >= 0.25
    with pytest.raises(RuntimeError, match=r"exited with 3; stderr ends:\nboom"):
        failing = "import sys; print('a'); sys.stderr.write('boom'); sys.exit(3)"
        bench.time_to_first_byte([sys.executable, "-c", failing], env, 30)
    with pytest.raises(RuntimeError, match="printed nothing"):
        bench.time_to_first_byte([sys.executable, "-c", "pass"], env, 30)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="did not finish within 1 s"):
        bench.time_to_first_byte([sys.executable, "-c", "import time; print('a', flush=True); time.sleep(60)"],
                                 env, 1)
    assert time.perf_counter() - start < 10


def made_up_results(bench, **ours) -> dict:
    """Results with every goal's measurement (defaults), as run_bench records them, for goal_rows."""
    sizes = dataclasses.asdict(bench.Sizes())
    tinyvllm = {
        "static": {"64": {"output_tok_s": 40_000.0}, "256": {"output_tok_s": 69_999.0}},
        "throughput": {"continuous": {"output_tok_s": 35_000.0}},
        "prefill": {"ttft_ms": 5.0},
        "latency": {"decode_tok_s": 1_299.0, "roofline_fraction": 0.76},
        "step": bench.step_summary({1: 1.0e-3, 16: 1.2e-3, 64: 1.51e-3}, 256),
        "startup": {"runs": [{"first_byte_s": 35.0}, {"first_byte_s": 9.9}]},
        "stalls": {"compiles_after_ready": 0, "captures_after_ready": 0, "worst_step_s": 0.25},
    }
    tinyvllm.update(ours)
    torch_peer = {"torch": "2.11", "dtype": "bfloat16", "device": "cuda",
                  "static": {"64": {"output_tok_s": 26_400.0}, "256": {"output_tok_s": 43_700.0}},
                  "latency": {"decode_tok_s": 720.0},
                  "prefill": {"ttft_ms": 5.7, "eager_ttft_ms": 12.1, "mode": "torch.compile reduce-overhead"},
                  "step": bench.step_summary({1: 1.0e-3, 16: 1.1e-3, 64: 1.3e-3}, 128)}
    hf = {"version": "5.17", "throughput": {"output_tok_s": 1_062.0, "subsample_short": "64 of 256 requests"},
          "prefill": {"ttft_ms": 9.4}, "latency": {"static": {"decode_tok_s": 373.0}}}
    return {"config": {"sizes": sizes}, "tinyvllm": tinyvllm, "torch_peer": torch_peer, "peer": hf}


def test_goal_rows_at_their_thresholds(bench):
    rows = bench.goal_rows(made_up_results(bench))
    assert [(r["measured"], r["met"]) for r in rows] == [
        ("40,000", True), ("69,999", False), ("35,000", True), ("5.00 ms", True), ("1,299 (76% of roofline)", False),
        ("1.20x (1.20 ms)", True), ("1.51x (1.51 ms)", False), ("9.9 s (first, cold cache: 35.0 s)", True),
        ("0 compiles, 0 captures (longest step 250 ms)", True)]
    assert [r["torch"] for r in rows] == [
        "26,400", "43,700", "-", "5.70 ms (torch.compile reduce-overhead; eager 12.10)", "720", "1.10x (1.10 ms)",
        "1.30x (1.30 ms)", "-", "-"]
    assert [r["hf"] for r in rows] == ["-", "-", "1,062 (generate_batch, 64 of 256 requests)", "9.40 ms (eager)",
                                       "373 (static cache + compile)", "-", "-", "-", "-"]
    assert [r["goal"] for r in rows] == [">= 40,000 output tok/s", ">= 70,000 output tok/s", ">= 35,000 output tok/s",
                                         "<= 5 ms", ">= 1,300 tok/s", "<= 1.2x", "<= 1.5x", "<= 10 s", "0"]
    lines = bench.goals_markdown(made_up_results(bench))
    assert lines[1] == ("| goal workload | goal | tinyvllm | met | PyTorch compiled (ours) (torch 2.11, bfloat16, "
                        "cuda) | HF transformers 5.17 |")
    assert lines[3] == "| static batch 64, prompt 128 -> 256 | >= 40,000 output tok/s | 40,000 | yes | 26,400 | - |"
    assert lines[4] == "| static batch 256, prompt 128 -> 256 | >= 70,000 output tok/s | 69,999 | **no** | 43,700 | - |"


def test_startup_from_cache_times_one_process_on_a_copy_of_the_kernel_cache(bench, monkeypatch, tmp_path):
    """--startup-from-cache: one process (the goal's second), its TINYVLLM_KERNEL_CACHE a fresh directory holding a
    copy of this process's kernel cache, the source left as it was; the goal row reads that run. Without a filled
    kernel cache to copy it refuses, naming the directory."""
    source = tmp_path / "kernels"
    source.mkdir()
    (source / "entry").write_bytes(b"kernel")
    monkeypatch.setenv("TINYVLLM_KERNEL_CACHE", str(source))
    seen = []

    def timed(argv, env, timeout_s):
        cache = Path(env["TINYVLLM_KERNEL_CACHE"])
        seen.append((cache != source, (cache / "entry").read_bytes(), sorted(p.name for p in cache.iterdir())))
        return {"first_byte_s": 7.5, "exit_s": 7.9}

    monkeypatch.setattr(bench, "time_to_first_byte", timed)
    cfg = bench.BenchConfig(workloads=["startup"], backend="cpu", startup_from_cache=True)
    results = {"tinyvllm": {}}
    assert bench.run_startup(cfg, tmp_path / "model", results) == "7.5 s to the first token"
    assert seen == [(True, b"kernel", ["entry"])] and sorted(p.name for p in source.iterdir()) == ["entry"]
    startup = results["tinyvllm"]["startup"]
    assert startup["from_cache"] and [r["run"] for r in startup["runs"]] == [bench.STARTUP_FROM_CACHE_RUN]
    row = bench.goal_rows(made_up_results(bench, startup=startup))[7]
    assert (row["value"], row["met"], row["measured"]) == (7.5, True, "7.5 s (on a copy of this run's cache)")
    (source / "entry").unlink()
    with pytest.raises(RuntimeError, match=f"needs a kernel cache to copy, and {source} is not a directory holding"):
        bench.run_startup(cfg, tmp_path / "model", results)
    assert bench.parse_args(["startup", "--startup-from-cache"])[0].startup_from_cache
    assert not bench.parse_args(["startup"])[0].startup_from_cache


def test_goal_rows_not_measured(bench):
    """A workload that did not run (or was skipped) is 'not measured', neither met nor missed."""
    results = made_up_results(bench, step={"skipped": "step not measured: it needs a GPU"}, startup={},
                              stalls={}, static={})
    del results["tinyvllm"]["prefill"], results["torch_peer"], results["peer"]
    rows = bench.goal_rows(results)
    assert [r["met"] for r in rows] == [None, None, True, None, False, None, None, None, None]
    assert all(r["measured"] == "not measured" for r in rows if r["met"] is None)
    assert all(r["torch"] == r["hf"] == "-" for r in rows)


@pytest.mark.parametrize("m, n, k", [(16, 3072, 2048), (64, 2048, 2048), (128, 2048, 8192), (32, 16384, 2048),
                                     (1024, 3072, 2048)])
def test_tma_split_plans_fill_the_gpu_once_with_valid_splits(m, n, k):
    """The --tma benchmark's gemm_tma plans: at decode sizes each candidate tile whose rows are at most twice
    max(M, 64) at about one block per SM and at half that, every split non-empty and at least the minimum slabs
    long; at prefill sizes every tile unsplit."""
    from cuda_kernels import gemm_tma as gtma
    from cuda_kernels import matmul_policy as mp
    from cuda_kernels.split_k import valid_splits
    from tools.kernel_benchmarks.matmul import TMA_CANDIDATES, TMA_DECODE_CANDIDATES, tma_split_plans

    plans = tma_split_plans(m, n, k)
    slabs = -(-k // gtma.TILE_K)
    if m >= mp.WGMMA_MIN_M:
        assert plans == [(t, 1) for t in TMA_CANDIDATES]
        return
    timed = {t for t in TMA_DECODE_CANDIDATES if t.bm <= 2 * max(m, 64)}
    assert {t for t, _ in plans} == timed
    for tile, splits in plans:
        assert splits in valid_splits(slabs)
        assert splits == 1 or slabs // splits >= mp.WGMMA_MIN_SPLIT_SLABS
        assert gtma.tiles(tile, m, n) * splits <= 1.5 * mp.SM_COUNT
    fullest = max(gtma.tiles(t, m, n) * s for t, s in plans)
    assert fullest >= min(mp.SM_COUNT // 2, max(gtma.tiles(t, m, n) * (slabs // mp.WGMMA_MIN_SPLIT_SLABS)
                                                   for t in timed))
