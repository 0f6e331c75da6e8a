"""tools/serve_benchmark.py and tools/bench_serve.py on the CPU backend with the tiny random model: the offline
LLM.generate and the server get the same requests and generate exactly the requested tokens, the runs' numbers
and the goal lines reach the table, a missing `transformers serve` is reported as skipped with its reason, and
the transformers dialect of the client sends what that server accepts. (tests/test_server_cuda.py and
tools/gpu_serve_check.sh measure on the GPU; transformers serve itself is not run here.)"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tools import bench_serve, serve_benchmark

REPO = Path(__file__).resolve().parents[1]
LENS = ["--prompt-lens", "8", "24", "--output-lens", "4", "12"]


def test_tinyvllm_offline_and_served_on_the_same_requests(tiny_model_dir, tmp_path):
    run = [sys.executable, str(REPO / "tools" / "serve_benchmark.py")]
    done = subprocess.run(run + ["tinyvllm", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--backend",
                                 "cpu", "--runs", "inf:6,4:3", *LENS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "tinyvllm.json").read_text())
    assert r["errors"] == [] and r["backend"] == "cpu"
    args = argparse.Namespace(seed=0, prompt_lens=[8, 24], output_lens=[4, 12], model=tiny_model_dir)
    requested = [sum(o for _, o in serve_benchmark.workload(args, n)) for n in (6, 3)]
    [offline] = r["offline"]
    assert offline["num_prompts"] == 6 and offline["output_tokens"] == requested[0]
    saturated, paced = r["runs"]
    assert (saturated["request_rate"], paced["request_rate"]) == (float("inf"), 4.0)
    for run_result, n, tokens in zip((saturated, paced), (6, 3), requested):
        assert run_result["completed"] == n and run_result["failed"] == 0
        assert run_result["output_tokens"] == tokens          # the same requests, every token generated
        for name in ("ttft_ms", "tpot_ms", "itl_ms"):
            p = run_result[name]
            if name == "itl_ms" and p["p50"] is None:
                continue  # every answer came in one chunk: the CPU engine may outrun this client on the tiny model
            assert 0 <= p["p50"] <= p["p90"] <= p["p99"]
        assert 0 <= run_result["client_cpu_s"] and 0 <= run_result["server_cpu_s"]
    assert saturated["prompt_tokens"] == offline["prompt_tokens"]  # token-id prompts: no re-tokenization

    done = subprocess.run(run + ["transformers", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--python",
                                 str(tmp_path / "no-python")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cannot run" in json.loads((tmp_path / "transformers.json").read_text())["skipped"]

    assert serve_benchmark.main(["table", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "serve_bench.md").read_text()
    assert "| tinyvllm LLM.generate (offline) | 6 | all at once |" in table
    assert "| tinyvllm serve | 3 | Poisson 4/s | 3 |" in table
    assert "of LLM.generate's" in table and "at 4 requests/s (3 requests): p99 TTFT" in table
    assert "| transformers serve | - |" in table and "cannot run" in table


def test_the_transformers_dialect(tiny_model_dir):
    tiny = bench_serve.request_body("m", [1, 2, 3], 7, "tinyvllm")
    assert tiny["ignore_eos"] and tiny["stream_options"] == {"include_usage": True} and tiny["max_tokens"] == 7
    hf = bench_serve.request_body("m", "Hi", 7, "transformers")
    assert "ignore_eos" not in hf and "stream_options" not in hf and hf["max_tokens"] == 7
    assert json.loads(hf["generation_config"]) == {"eos_token_id": -1, "do_sample": False, "max_new_tokens": 7}

    from tinyvllm.tokenizer import Tokenizer

    ids = np.random.default_rng(0).integers(0, 256, 20).tolist()
    [(text, n)] = bench_serve.text_prompts([(ids, 5)], str(tiny_model_dir))
    assert n == 5 and text == Tokenizer.from_dir(tiny_model_dir).decode(ids)


def test_the_sim_runner_generates_every_requested_token_at_its_modelled_pace(tiny_model_dir):
    """tools/sim_runner.py: the real engine over a timer; a step of T new tokens takes base + T * per_token."""
    import time

    from tinyvllm import SamplingParams
    from tools.sim_runner import sim_llm

    llm = sim_llm(tiny_model_dir, base_ms=5.0, per_token_ms=0.5)
    start = time.perf_counter()
    outs = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 6)],
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 6]
    assert all(0 <= t < llm.engine.config.vocab_size for o in outs for t in o.outputs[0].token_ids)
    # 6 steps at least: a prefill of 5 tokens (7.5 ms), then decodes of 2 tokens (6 ms) and 1 token (5.5 ms)
    assert seconds >= 0.0075 + 3 * 0.006 + 2 * 0.0055 - 1e-3
