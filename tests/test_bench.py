"""tools/bench.py on the CPU backend with the tiny random model: real measured numbers, exactly the requested
token counts, the markdown rows, and the peer skipped (with its reason) where torch cannot be imported."""

import importlib.util
import json
import sys
from pathlib import Path

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


def test_all_workloads_and_sweep_on_cpu(bench, tmp_path, no_torch, capsys):
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

    md = out_md.read_text()
    assert md in capsys.readouterr().out
    assert f"Command: `{r['command']}`" in md
    for line in (f"| latency: batch 1, prompt {q.latency_prompt}, {q.latency_new} new | decode tok/s |",
                 "| output tok/s, continuous |", "| output tok/s, static |",
                 f"| prefill: {q.prefill_prompt}-token prompt | time to first token (ms) |",
                 f"{r['peer']['skipped']}.",
                 "| batch size | tinyvllm continuous | tinyvllm static | HF static batch |"):
        assert line in md
    sweep_rows = [row for row in md.splitlines() if row.startswith(("| 1 |", "| 2 |"))]
    assert len(sweep_rows) == 2 and all(row.endswith("| - |") for row in sweep_rows)  # no peer column values
    if r["versions"]["matplotlib"]:
        assert out_png.stat().st_size > 0 and r["plot"] == f"wrote {out_png}"
    else:
        assert not out_png.exists() and "matplotlib" in r["plot"]


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
