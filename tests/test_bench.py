"""tools/bench.py on the CPU backend with the tiny random model: real measured numbers, exactly the requested
token counts, the markdown rows, and the peer skipped (with its reason) where torch cannot be imported. The
kernels workload runs where the CUDA engine's kernels do (the simulator under the default test profile)."""

import dataclasses
import importlib.util
import json
import os
import sys
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
            "--model-dir", str(tmp_path / "model"), "--json", str(out_json), "--markdown", str(out_md),
            "--plot", str(out_png)]
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

    assert "torch" in r["peer"]["skipped"] and "not importable" in r["peer"]["skipped"]
    assert r["tinyvllm"]["kernels"] == {
        "skipped": "kernels not measured: the cpu backend (--backend cpu) has no GPU kernels to time"}

    md = out_md.read_text()
    assert md in capsys.readouterr().out
    assert f"Command: `{r['command']}`" in md
    for line in (f"| latency: batch 1, prompt {q.latency_prompt}, {q.latency_new} new | decode tok/s |",
                 "| output tok/s, continuous |", "| output tok/s, static |",
                 f"| prefill: {q.prefill_prompt}-token prompt | time to first token (ms) |",
                 f"{r['peer']['skipped']}.", f"{r['tinyvllm']['kernels']['skipped']}.",
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


def test_failed_kernel_check_is_reported(bench):
    """A case whose reference check failed (checked_time's text instead of seconds) is not timed or rated."""
    case = SimpleNamespace(name="GEMV: O", shape="1x8 @ 8x8^T", config="matmul: gemv (4, 2, 1, 1)",
                           bytes_moved=6_000_000)
    failed = bench.kernel_row(case, 3500.0, "FAILED: AssertionError: 3 outputs off")
    assert failed == {"name": "GEMV: O", "shape": "1x8 @ 8x8^T", "config": "matmul: gemv (4, 2, 1, 1)",
                      "bytes": 6_000_000, "target_gb_s": 3500.0, "check": "FAILED: AssertionError: 3 outputs off"}
    timed = bench.kernel_row(case, 3500.0, 2e-6)
    assert timed["gb_s"] == pytest.approx(3000.0) and timed["met"] is False and timed["check"] == "passed"
    results = {"config": {"matmul_precision": "fp32"},
               "tinyvllm": {"kernels": {"device": "GPU", "cold_bytes": 1 << 20, "cases": [failed, timed]}}}
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
