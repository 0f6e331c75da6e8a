"""tools/torch_peer.py, the PyTorch Llama that tools/bench.py measures tinyvllm against, where torch is installed
(it never is a tinyvllm dependency: without it these tests skip). In float32 on the CPU its greedy tokens equal
tinyvllm's CPU reference on the tiny random models (GQA 2:1 with an untied LM head; llama3 RoPE scaling with
GQA 4:1 and tied embeddings), for a static batch and a prompt long enough for the scaling to matter; a peer
with the scaling dropped does not match (so the comparison can fail). Its decode attention over the filled
part of the cache, in buckets, gives the tokens of a textbook forward that recomputes every position with
full attention (float32). The decode step traces whole under torch.compile (fullgraph; the aot_eager backend,
which skips Inductor's slow code generation) and gives the eager step's tokens; its compiles do not grow with
the buckets or the batch sizes. The bench runs the peer on the tiny model beside the cpu engine."""

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tools/ (`python -m pytest` from the root has it already; plain pytest does not)
    sys.path.insert(0, str(REPO))

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tools import torch_peer  # noqa: E402
NEW_TOKENS = 16


def prompts_for(seed: int) -> tuple[list[list[int]], list[int]]:
    """A static batch of three 7-token prompts, and one 300-token prompt (past tiny-llama3's original context
    of 64, where llama3 scaling changes the rotation)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (3, 7)).tolist(), rng.integers(0, 256, 300).tolist()


def reference_tokens(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model_dir, backend="cpu")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(params=["tiny_model_dir", "tiny_llama3_model_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def test_greedy_tokens_equal_the_cpu_reference(model_dir):
    batch, long = prompts_for(0)
    peer = torch_peer.TorchPeer(model_dir, device="cpu", dtype=torch.float32)
    assert peer.generate(batch, NEW_TOKENS) == reference_tokens(model_dir, batch)
    assert peer.generate([long], NEW_TOKENS) == reference_tokens(model_dir, [long])


def test_llama3_scaling_is_what_makes_the_long_prompt_match(tiny_llama3_model_dir, monkeypatch):
    _, long = prompts_for(0)
    tables = torch_peer.rope_tables
    monkeypatch.setattr(torch_peer, "rope_tables",
                        lambda config, n: tables(dataclasses.replace(config, rope_scaling=None), n))
    peer = torch_peer.TorchPeer(tiny_llama3_model_dir, device="cpu", dtype=torch.float32)
    assert peer.generate([long], NEW_TOKENS) != reference_tokens(tiny_llama3_model_dir, [long])


def plain_logits(model, ids, dtype):
    """The logits [B, T, vocab] of the token sequences ids [B, T] by the textbook forward: no cache, every
    position attends to every earlier one by an explicit masked softmax, K and V repeated per query head
    (rounded to bf16 on the way, as the peer's and tinyvllm's caches store them)."""
    c = model.config
    b, t = ids.shape
    cos, sin = (table[:t] for table in torch_peer.rope_tables(c, t))
    w = {name: p.to(dtype) for name, p in model.named_parameters()}
    x = w["embed"][ids]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(c.num_layers):
        h = torch_peer.rms_norm(x, w[f"layers.{i}.attn_norm"], c.rms_norm_eps)
        q, k, v = (h @ w[f"layers.{i}.wqkv"].T).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = torch_peer.rope(q.reshape(b, t, c.num_heads, c.head_dim), cos, sin).transpose(1, 2)
        k = torch_peer.rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin).transpose(1, 2)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        group = c.num_heads // c.num_kv_heads
        k, v = (y.to(torch.bfloat16).to(dtype).repeat_interleave(group, dim=1) for y in (k, v))
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(c.head_dim)
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = (p.to(dtype) @ v).transpose(1, 2).reshape(b, t, c.q_size)
        x = x + attn @ w[f"layers.{i}.wo"].T
        gate, up = (torch_peer.rms_norm(x, w[f"layers.{i}.mlp_norm"], c.rms_norm_eps)
                    @ w[f"layers.{i}.w_gate_up"].T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w[f"layers.{i}.w_down"].T
    head = w["lm_head"] if "lm_head" in w else w["embed"]
    return torch_peer.rms_norm(x, w["norm"], c.rms_norm_eps) @ head.T


def plain_tokens(model, prompts: list[list[int]], new_tokens: int, dtype) -> list[list[int]]:
    """Greedy tokens by plain_logits, the whole sequence recomputed at every step."""
    ids = torch.tensor(prompts)
    for _ in range(new_tokens):
        ids = torch.cat([ids, plain_logits(model, ids, dtype)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, len(prompts[0]):].tolist()


@pytest.mark.parametrize("bucket", [4, 16])
def test_bucketed_decode_equals_plain_full_attention_in_float32(model_dir, monkeypatch, bucket):
    """Decode attention over the filled part of the cache, rounded up to a bucket, masked past the length,
    gives the greedy tokens of a forward that recomputes everything with full attention (float32; one bucket
    when 16, several when 4)."""
    monkeypatch.setattr(torch_peer, "BUCKET", bucket)
    batch, _ = prompts_for(4)
    peer = torch_peer.TorchPeer(model_dir, device="cpu", dtype=torch.float32)
    assert peer.generate(batch, NEW_TOKENS) == plain_tokens(peer.model, batch, NEW_TOKENS, torch.float32)


def test_compiles_do_not_grow_with_the_buckets_or_the_batches(tiny_model_dir, monkeypatch):
    """The bucket, the batch, the prompt length and the cache are dynamic sizes: one compiled decode graph
    serves all five buckets of a generation and every batch above 1, one prefill graph their prompts (batch 1
    has a graph of each of its own), all compiled in the warm-up; nothing compiles while timed."""
    monkeypatch.setattr(torch_peer, "_compile", aot_eager)
    monkeypatch.setattr(torch_peer, "CPU_MODES", ("torch.compile", "eager"))
    monkeypatch.setattr(torch_peer, "BUCKET", 8)
    torch._dynamo.reset()
    peer = torch_peer.TorchPeer(tiny_model_dir, device="cpu")
    r = peer.decode_throughput(prompts_for(5)[0], 30, runs=2)   # three 7-token prompts: 8 to 36 positions
    assert (r["mode"], r["buckets"], r["compiles_warmup"], r["compiles_timed"]) == ("torch.compile", 5, 2, 0)
    assert r["eager_agreement"] == f"{3 * torch_peer.CHECK_STEPS} of {3 * torch_peer.CHECK_STEPS} decode tokens " \
                                   "equal to the eager step's"
    prompts = np.random.default_rng(6).integers(0, 256, (5, 12)).tolist()
    r = peer.decode_throughput(prompts, 40, runs=1)   # another batch, prompt length, cache and buckets
    assert (r["buckets"], r["compiles_warmup"], r["compiles_timed"]) == (6, 0, 0)
    r = peer.decode_throughput(prompts[:1], 30, runs=1)
    assert (r["compiles_warmup"], r["compiles_timed"]) == (2, 0)


def aot_eager(fn, mode=None):
    """torch.compile as the peer calls it, with Inductor replaced by aot_eager (fast on the CPU)."""
    return torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)


def test_compiled_step_traces_whole_and_gives_the_eager_tokens(tiny_llama3_model_dir, monkeypatch):
    monkeypatch.setattr(torch_peer, "_compile", aot_eager)
    batch, _ = prompts_for(1)
    peer = torch_peer.TorchPeer(tiny_llama3_model_dir, device="cpu", dtype=torch.float32)
    assert peer.generate(batch, NEW_TOKENS, mode="torch.compile") == peer.generate(batch, NEW_TOKENS)
    # the check the bench records beside each timed mode: all equal here, fewer for a step that is wrong
    n = 3 * torch_peer.CHECK_STEPS
    ids = torch.tensor(batch)
    assert peer.eager_agreement(ids, "torch.compile") == f"{n} of {n} decode tokens equal to the eager step's"
    peer.functions["at zero"] = (torch_peer.prefill, lambda model, cache, x, pos, keys: torch_peer.forward(
        model, cache, x, pos * 0, keys))
    assert not peer.eager_agreement(ids, "at zero").startswith(f"{n} of")
    # where a mode parts from eager, a float32 reference's logit gap between the two choices
    reference = torch_peer.TorchPeer(tiny_llama3_model_dir, device="cpu", dtype=torch.float32)
    assert peer.near_ties(batch, "torch.compile", reference)["parted"] == 0
    wrong = peer.near_ties(batch, "at zero", reference)
    assert wrong["parted"] > 0 and len(wrong["gaps"]) == wrong["parted"] and all(g >= 0 for g in wrong["gaps"])


def test_decode_throughput_and_prefill_ttft_on_the_cpu(tiny_model_dir):
    peer = torch_peer.TorchPeer(tiny_model_dir, device="cpu")
    batch, long = prompts_for(2)
    r = peer.decode_throughput(batch, NEW_TOKENS, runs=2)
    assert (r["mode"], r["batch"], r["prompt_tokens"], r["new_tokens"], r["dtype"]) == ("eager", 3, 7, NEW_TOKENS,
                                                                                        "float32")
    assert r["output_tok_s"] == pytest.approx(3 * NEW_TOKENS / r["elapsed_s"]) and len(r["runs_elapsed_s"]) == 2
    assert r["decode_tok_s"] == pytest.approx(3 / r["step_s"]) and r["eager_agreement"] is None
    p = peer.prefill_ttft(long, runs=2)
    assert p["mode"] == "eager" and p["prompt_tokens"] == 300 and p["ttft_ms"] == p["eager_ttft_ms"] > 0
    with pytest.raises(ValueError, match="prompts of one length"):
        peer.decode_throughput([[1, 2], [3]], 4)
    peer.close()


def test_bench_runs_the_torch_peer_beside_tinyvllm(tmp_path, capsys):
    """Latency, static batches, step times and prefill of the peer, on tinyvllm's prompts, in the bench's JSON,
    goal table and main table; HF is left out (--peers torch)."""
    spec = importlib.util.spec_from_file_location("tinyvllm_tools_bench_torch", REPO / "tools" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
        out = tmp_path / "bench.json"
        argv = ["latency", "static", "prefill", "step", "--quick", "--preset", "tiny", "--backend", "cpu",
                "--max-num-seqs", "4", "--static-batches", "2,3", "--scheduler", "static", "--peers", "torch",
                "--model-dir", str(tmp_path / "model"), "--json", str(out)]
        bench.main(argv)
    finally:
        del sys.modules[spec.name]
    r = json.loads(out.read_text())
    q, theirs = bench.QUICK, r["torch_peer"]
    assert [e["job"] for e in r["errors"]] == [] and r["peer"]["skipped"].endswith("--peers torch")
    assert theirs["device"] == "cpu" and theirs["dtype"] == "float32" and theirs["torch"] == torch.__version__
    assert theirs["latency"]["batch"] == 1 and theirs["latency"]["new_tokens"] == q.latency_new
    assert {b: v["batch"] for b, v in theirs["static"].items()} == {"2": 2, "3": 3}
    assert list(theirs["step"]["batches"]) == ["1", "16", "64"]  # run for the step times, from the static sizes
    assert theirs["prefill"]["prompt_tokens"] == q.prefill_prompt and theirs["prefill"]["ttft_ms"] > 0
    latency_row = next(g for g in r["goals"] if g["workload"].startswith("latency"))
    assert latency_row["torch"] == bench._rate(theirs["latency"]["decode_tok_s"])
    md = capsys.readouterr().out
    assert f"| PyTorch compiled (ours) (torch {torch.__version__}, float32, cpu) |" in md
    assert "PyTorch peer static batch 3: decode step eager." in md


@pytest.mark.parametrize("graphs_skipped", [False, True])
def test_decode_modes_fall_back_in_order(tiny_model_dir, monkeypatch, graphs_skipped):
    """The first mode that completes a warm-up is kept; one that raises, or (reduce-overhead) whose CUDA graphs
    Inductor skipped, is recorded with its error and the next is tried. (Inductor is replaced by aot_eager and
    its skip counter faked: the modes' plumbing, not their speed.)"""
    monkeypatch.setattr(torch_peer, "_compile", aot_eager)
    monkeypatch.setattr(torch_peer, "CPU_MODES", ("no such mode", "torch.compile reduce-overhead", "eager"))
    skips = iter(range(100))
    monkeypatch.setattr(torch_peer, "cudagraph_skips", lambda: next(skips) if graphs_skipped else 0)
    batch, _ = prompts_for(3)
    peer = torch_peer.TorchPeer(tiny_model_dir, device="cpu")
    r = peer.decode_throughput(batch, NEW_TOKENS, runs=1)
    failed = ["no such mode at batch 3: ValueError: unknown mode 'no such mode'"]
    if graphs_skipped:
        failed.append("torch.compile reduce-overhead at batch 3: RuntimeError: Inductor skipped CUDA graphs (its "
                      "warning above says why)")
        assert (r["mode"], r["eager_agreement"]) == ("eager", None)
    else:
        n = 3 * torch_peer.CHECK_STEPS
        assert r["mode"] == "torch.compile reduce-overhead"
        assert r["eager_agreement"] == f"{n} of {n} decode tokens equal to the eager step's"
    assert peer.failed == failed
    assert peer.decode_throughput(batch, NEW_TOKENS, runs=1)["mode"] == r["mode"] and peer.failed == failed  # kept
