"""A plain Llama in PyTorch with a static KV cache and a compiled decode step: the strong peer of tools/bench.py.

    python3 tools/torch_peer.py --model DIR [--batch 1,64,256] [--prompt 128] [--new 256] [--prefill 1024]

It is what a user could write instead of running tinyvllm, in the way gpt-fast writes one: the model as a few
tensor functions, a KV cache allocated once, the decode step compiled with torch.compile(mode="reduce-overhead")
(Inductor's kernels, replayed as a CUDA graph per batch size). It loads the same checkpoint as tinyvllm
(tinyvllm.weights.load_weights: bf16, checked against config.json; the RoPE settings come from tinyvllm's
ModelConfig, llama3 scaling included), so both run the same random weights in the benchmark.

- Weights: Q, K and V fused into one matrix, gate and up into another (one GEMM each, as vLLM does); a tied
  LM head is the embedding itself.
- KV cache: k and v, each [layers, batch, kv_heads, max_len, head_dim] in bf16 (rounded to nearest even, as
  tinyvllm's cache is), written at the step's positions with index_copy_ (no host sync: graph-capturable).
- Prefill: the whole prompt at once; every sequence of a batch has the same prompt length (a static batch of
  equal prompts), so positions are shared. Causal SDPA over the prompt's own keys, read back through the
  cache's bf16 (what tinyvllm's attention reads); the LM head on the last token only.
- Decode: one token per sequence at a position held in a device tensor; SDPA over the whole cache with a
  mask of the positions written so far (static shapes, which CUDA graphs need), each KV head's group of
  query heads as the query rows (GQA without copying K and V).
- Numerics: compute in `dtype` (bf16 on the GPU, as HF transformers runs a bf16 checkpoint; float32 in the
  correctness test, which then equals tinyvllm's CPU reference up to summation order); RMSNorm in fp32.
- The compiled step, tried in order until one runs (the first that works is recorded as `mode`):
  torch.compile reduce-overhead; torch.compile with the step captured in a torch.cuda.CUDAGraph by hand;
  the eager step in a CUDAGraph; eager. Prefill of a static batch runs eagerly (its time is GEMMs, not
  launches); the 1,024-token TTFT is measured compiled (reduce-overhead) and eagerly.

Greedy decoding only. torch is imported when a peer is made, never at import time: tinyvllm does not depend
on it, and tools/bench.py skips this peer where torch is absent. tests/test_torch_peer.py checks its greedy
tokens against tinyvllm's CPU reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tinyvllm from a source checkout
    sys.path.insert(0, str(REPO))

torch = None  # the module, bound by _require_torch() (so that importing this file needs no torch)

# how a decode step runs, best first; each is tried until one completes a warm-up
GPU_MODES = ("torch.compile reduce-overhead", "torch.compile + CUDAGraph", "eager + CUDAGraph", "eager")
CPU_MODES = ("eager",)
WARMUP_STEPS = 3      # compiled calls before timing (reduce-overhead records its graph on the second or third)
CHECK_STEPS = 8       # decode steps compared with the eager step after a warm-up


def _require_torch():
    """Import torch (ImportError if absent) and allow one compiled graph per batch size and prompt shape."""
    global torch
    if torch is None:
        import torch as module

        for limit in ("cache_size_limit", "recompile_limit"):  # renamed across 2.x; set whichever exists
            if hasattr(module._dynamo.config, limit):
                setattr(module._dynamo.config, limit, max(64, getattr(module._dynamo.config, limit)))
        torch = module
    return torch


# -- the model ---------------------------------------------------------------------------------------------

def rope_tables(config, positions: int):
    """cos, sin [positions, head_dim/2] float32, computed in float64; llama3 scaling as HF transformers defines
    it (long wavelengths divided by `factor`, short ones kept, the band between blended)."""
    d = config.head_dim
    inv = config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    s = config.rope_scaling
    if s is not None:
        wavelength = 2 * math.pi / inv
        context = s.original_max_position_embeddings
        blend = (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        scaled = torch.where(wavelength > context / s.low_freq_factor, inv / s.factor, inv)
        medium = (wavelength >= context / s.high_freq_factor) & (wavelength <= context / s.low_freq_factor)
        inv = torch.where(medium, (1 - blend) * inv / s.factor + blend * inv, scaled)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float(), angles.sin().float()


def _bf16(array: np.ndarray):
    """A tensor of the bf16 bit patterns tinyvllm.weights loads (uint16), sharing their memory."""
    with warnings.catch_warnings():  # the arrays are read-only maps of the file; the tensor is only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)


def build_model(model_dir: Path, device: str, dtype):
    """The checkpoint as an nn.Module of frozen parameters (nn.Module so that torch.compile treats the weights
    as static inputs: CUDA graphs then read them in place instead of copying them every call)."""
    from tinyvllm.config import ModelConfig
    from tinyvllm.weights import load_weights

    config = ModelConfig.from_dir(model_dir)
    raw = load_weights(model_dir, config)

    def weight(*names):
        pieces = [_bf16(raw[n]).to(device) for n in names]   # joined on the device: no host copy of the whole
        return torch.nn.Parameter(torch.cat(pieces).to(dtype), requires_grad=False)

    model = torch.nn.Module()
    model.config = config
    model.embed = weight("model.embed_tokens.weight")
    model.lm_head = model.embed if config.tie_word_embeddings else weight("lm_head.weight")
    model.norm = weight("model.norm.weight")
    model.layers = torch.nn.ModuleList()
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = torch.nn.Module()
        layer.attn_norm = weight(p + "input_layernorm.weight")
        layer.wqkv = weight(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"))
        layer.wo = weight(p + "self_attn.o_proj.weight")
        layer.mlp_norm = weight(p + "post_attention_layernorm.weight")
        layer.w_gate_up = weight(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        layer.w_down = weight(p + "mlp.down_proj.weight")
        model.layers.append(layer)
    return model


def new_cache(config, batch: int, max_len: int, device) -> dict:
    """A zeroed KV cache for `batch` sequences of up to max_len tokens, and RoPE tables that reach max_len.
    Zeros, not garbage: masked positions still enter softmax(.) @ V with weight 0, and 0 * NaN is NaN."""
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    cos, sin = rope_tables(config, max_len)
    tensors = {"k_cache": torch.zeros(shape, dtype=torch.bfloat16, device=device),
               "v_cache": torch.zeros(shape, dtype=torch.bfloat16, device=device),
               "cos": cos.to(device), "sin": sin.to(device)}
    if device.type == "cuda":  # read and written in place by every graph replay: never copied
        for t in tensors.values():
            torch._dynamo.mark_static_address(t)
    return tensors


def rms_norm(x, weight, eps: float):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x, cos, sin):
    """x [B, T, heads, d] rotated by the "rotate half" pairs (i, i + d/2); cos, sin [T, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def attention(model, i: int, q, k, v, pos):
    """q [B, T, H, d], k and v [B, T, Hkv, d] at positions pos [T]: K and V into the cache, then attention
    -> [B, T, H * d]. T > 1 is a prefill from position 0 (causal over the prompt); T == 1 a decode step."""
    c = model.config
    b, t = q.shape[:2]
    k, v = k.transpose(1, 2).to(torch.bfloat16), v.transpose(1, 2).to(torch.bfloat16)   # [B, Hkv, T, d]
    model.k_cache[i].index_copy_(2, pos, k)
    model.v_cache[i].index_copy_(2, pos, v)
    if t > 1:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, c.q_size)
    # one query per sequence: the query heads of each KV head are the rows that attend to its keys
    group = q.reshape(b, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
    written = (torch.arange(model.k_cache.shape[3], device=pos.device) <= pos)[None, None, None, :]  # [1,1,1,L]
    out = torch.nn.functional.scaled_dot_product_attention(
        group, model.k_cache[i].to(q.dtype), model.v_cache[i].to(q.dtype), attn_mask=written)
    return out.reshape(b, 1, c.q_size)


def forward(model, ids, pos):
    """ids [B, T] at positions pos [T] -> the greedy next token of each sequence [B] (LM head on the last
    position only)."""
    c = model.config
    b, t = ids.shape
    x = model.embed[ids]
    cos, sin = model.cos[pos], model.sin[pos]
    for i, layer in enumerate(model.layers):
        h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
        q, k, v = torch.nn.functional.linear(h, layer.wqkv).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = rope(q.reshape(b, t, c.num_heads, c.head_dim), cos, sin)
        k = rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        attn = attention(model, i, q, k, v.reshape(b, t, c.num_kv_heads, c.head_dim), pos)
        x = x + torch.nn.functional.linear(attn, layer.wo)
        gate, up = torch.nn.functional.linear(rms_norm(x, layer.mlp_norm, c.rms_norm_eps),
                                              layer.w_gate_up).chunk(2, dim=-1)
        x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, layer.w_down)
    logits = torch.nn.functional.linear(rms_norm(x[:, -1], model.norm, c.rms_norm_eps), model.lm_head)
    return logits.argmax(dim=-1)


def prefill(model, ids):
    """The prompts ids [B, P] from position 0 -> first tokens [B]."""
    return forward(model, ids, torch.arange(ids.shape[1], device=ids.device))


# -- running it ----------------------------------------------------------------------------------------------

def cache_len(prompt_len: int, new_tokens: int) -> int:
    """Cache positions for a run: the prompt and its new tokens, and room for the warm-up and agreement runs."""
    return prompt_len + max(new_tokens, WARMUP_STEPS + 1, CHECK_STEPS + 1)


def _graphed(fn, model, batch: int):
    """fn(model, ids [batch, 1], pos [1]) captured once in a torch.cuda.CUDAGraph; returns a step function that
    copies its inputs into the graph's and replays it (its output is the graph's, overwritten by the next)."""
    ids = torch.zeros(batch, 1, dtype=torch.long, device=model.embed.device)
    pos = torch.zeros(1, dtype=torch.long, device=model.embed.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and run once outside the capture (writes position 0: rewritten later)
        for _ in range(WARMUP_STEPS):
            fn(model, ids, pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(model, ids, pos)

    def step(model_, new_ids, new_pos):
        ids.copy_(new_ids)
        pos.copy_(new_pos)
        graph.replay()
        return out

    return step


def cudagraph_skips() -> int:
    """How many times Inductor has compiled a graph for CUDA graphs and then decided against them (it logs a
    warning and counts; reduce-overhead then runs the kernels without graphs)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def _compile(fn, mode: str | None = None):
    return torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)


class TorchPeer:
    """The model on one device; decode runs per batch size with the best step mode that works there."""

    def __init__(self, model_dir: str | Path, device: str | None = None, dtype=None):
        _require_torch()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model = build_model(Path(model_dir), self.device, self.dtype)
        # per (batch, max_len): the cache and RoPE tables, kept so that their addresses (which compiled code
        # guards on and CUDA graphs hold) never change, and the decode step chosen there (mode, step)
        self.caches: dict[tuple[int, int], dict] = {}
        self.steps: dict[tuple[int, int], tuple[str, object]] = {}
        self.failed: list[str] = []   # modes that raised, with their errors

    def use_cache(self, batch: int, max_len: int) -> None:
        """Point the model's buffers at the cache of this shape (made on first use)."""
        key = (batch, max_len)
        if key not in self.caches:
            self.caches[key] = new_cache(self.model.config, batch, max_len, self.device)
        for name, tensor in self.caches[key].items():
            self.model.register_buffer(name, tensor, persistent=False)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _tensor(self, rows: list[list[int]]):
        if len({len(r) for r in rows}) != 1:
            raise ValueError("a static batch needs prompts of one length, got " + str(sorted({len(r) for r in rows})))
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _decode(self, ids, new_tokens: int, step) -> tuple[list, float, float]:
        """Prefill ids [B, P] (eager), then new_tokens - 1 decode steps -> (token tensors, seconds to the first
        token, seconds of the decode steps). The cache must hold P + new_tokens positions."""
        self.sync()
        start = time.perf_counter()
        with torch.inference_mode():
            tokens = [prefill(self.model, ids)]
            self.sync()
            first = time.perf_counter()
            pos = torch.full((1,), ids.shape[1], dtype=torch.long, device=self.device)
            for _ in range(new_tokens - 1):
                tokens.append(step(self.model, tokens[-1][:, None], pos).clone())  # the next call overwrites it
                pos += 1
            self.sync()
        return tokens, first - start, time.perf_counter() - first

    def generate(self, prompts: list[list[int]], new_tokens: int, mode: str = "eager") -> list[list[int]]:
        """Greedy tokens of a static batch (prompts of one length); mode: the decode step's, or "best"."""
        ids = self._tensor(prompts)
        max_len = cache_len(ids.shape[1], new_tokens)
        self.use_cache(len(prompts), max_len)
        step = self._step(len(prompts), max_len, ids) if mode == "best" else self._make_step(mode, len(prompts))
        tokens, _, _ = self._decode(ids, new_tokens, step)
        return torch.stack(tokens, dim=1).tolist()

    def _make_step(self, mode: str, batch: int):
        if mode == "eager":
            return forward
        if mode == "torch.compile":
            return _compile(forward)
        if mode == "torch.compile reduce-overhead":
            compiled = _compile(forward, "reduce-overhead")

            def step(model, ids, pos):
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were cloned: reuse its memory
                return compiled(model, ids, pos)
            return step
        if mode == "torch.compile + CUDAGraph":
            return _graphed(_compile(forward), self.model, batch)
        if mode == "eager + CUDAGraph":
            return _graphed(forward, self.model, batch)
        raise ValueError(f"unknown decode mode {mode!r}")

    def _step(self, batch: int, max_len: int, ids):
        """The best decode mode that completes a warm-up (prefill + WARMUP_STEPS steps) at this shape (whose
        cache is in use)."""
        if (batch, max_len) in self.steps:
            return self.steps[batch, max_len][1]
        modes = GPU_MODES if self.device.type == "cuda" else CPU_MODES
        for mode in modes:
            try:
                skips = cudagraph_skips()
                step = self._make_step(mode, batch)
                self._decode(ids, WARMUP_STEPS + 1, step)
                if mode.endswith("reduce-overhead") and cudagraph_skips() > skips:
                    raise RuntimeError("Inductor skipped CUDA graphs (its warning above says why)")
            except Exception as exc:  # a mode that fails here falls back to the next one
                self.failed.append(f"{mode} at batch {batch}: {type(exc).__name__}: {exc}")
                print(f"torch_peer: {self.failed[-1]}", file=sys.stderr, flush=True)
                continue
            self.steps[batch, max_len] = (mode, step)
            return step
        raise RuntimeError(f"no decode mode ran at batch {batch}: " + "; ".join(self.failed[-len(modes):]))

    def decode_throughput(self, prompts: list[list[int]], new_tokens: int, runs: int = 2) -> dict:
        """A static batch (prompts of one length), greedy, new_tokens each, best of `runs` after a warm-up.

        output_tok_s counts batch * new_tokens over prefill + decode (from the call to the last token, as
        tinyvllm's static workload times LLM.generate); decode_tok_s counts batch * (new_tokens - 1) over the
        decode steps alone (from the first token to the last, as the latency workload times tinyvllm)."""
        ids = self._tensor(prompts)
        batch, max_len = len(prompts), cache_len(ids.shape[1], new_tokens)
        self.use_cache(batch, max_len)
        step = self._step(batch, max_len, ids)
        mode = self.steps[batch, max_len][0]
        agreement = self.eager_agreement(ids, step)
        totals, decodes = [], []
        for _ in range(runs):
            tokens, ttft, decode = self._decode(ids, new_tokens, step)
            totals.append(ttft + decode)
            decodes.append(decode)
        best = int(np.argmin(totals))
        return {"mode": mode, "batch": batch, "prompt_tokens": ids.shape[1], "new_tokens": len(tokens),
                "dtype": str(self.dtype).removeprefix("torch."),
                "output_tok_s": batch * new_tokens / totals[best], "elapsed_s": totals[best],
                "decode_tok_s": batch * (new_tokens - 1) / min(decodes), "step_s": min(decodes) / (new_tokens - 1),
                "runs_elapsed_s": totals, "eager_agreement": agreement}

    def eager_agreement(self, ids, step) -> str | None:
        """How many of CHECK_STEPS greedy tokens per sequence `step` gives as the eager step does, from the
        prompts ids (None: it is the eager step); a step that lost its cache writes (a wrong graph) fails this,
        bf16 near-ties may cost a few. The cache in use must hold CHECK_STEPS + 1 tokens past the prompts."""
        if step is forward:
            return None
        mine = torch.stack(self._decode(ids, CHECK_STEPS + 1, step)[0], dim=1)
        eager = torch.stack(self._decode(ids, CHECK_STEPS + 1, forward)[0], dim=1)
        same = int((mine[:, 1:] == eager[:, 1:]).sum())
        return f"{same} of {eager[:, 1:].numel()} decode tokens equal to the eager step's"

    def prefill_ttft(self, prompt: list[int], runs: int = 3) -> dict:
        """Time to the first token of one prompt (prefill + LM head on its last token + argmax), best of
        `runs`: compiled (reduce-overhead, on the GPU) and eager."""
        ids = self._tensor([prompt])
        self.use_cache(1, ids.shape[1] + 1)
        result = {"prompt_tokens": ids.shape[1], "dtype": str(self.dtype).removeprefix("torch."),
                  "eager_ttft_ms": self._best_ms(lambda: prefill(self.model, ids), runs)}
        result.update(mode="eager", ttft_ms=result["eager_ttft_ms"])
        if self.device.type == "cuda":
            compiled = _compile(prefill, "reduce-overhead")

            def run():
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(self.model, ids)
            try:
                skips = cudagraph_skips()
                result["compiled_ttft_ms"] = self._best_ms(run, runs)
                graphs = "CUDA graphs skipped" if cudagraph_skips() > skips else "CUDA graphs"
                result.update(mode=f"torch.compile reduce-overhead ({graphs})", ttft_ms=result["compiled_ttft_ms"])
            except Exception as exc:  # the eager figure stands
                result["compile_error"] = f"{type(exc).__name__}: {exc}"
        return result

    def _best_ms(self, fn, runs: int) -> float:
        times = []
        with torch.inference_mode():
            for i in range(WARMUP_STEPS + runs):
                self.sync()
                start = time.perf_counter()
                fn().cpu()   # the token on the host, as a TTFT
                if i >= WARMUP_STEPS:
                    times.append((time.perf_counter() - start) * 1e3)
        return min(times)

    def close(self) -> None:
        """Give the device memory back (weights, cache, compiled graphs' pools) before another user of the GPU."""
        self.model = None
        self.steps.clear()
        self.caches.clear()
        torch._dynamo.reset()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def describe(run: dict) -> str:
    """A decode run's step mode, and its agreement with the eager step where it is another."""
    return run["mode"] + (f"; {run['eager_agreement']}" if run["eager_agreement"] else "")


# -- the entry points the issue names ------------------------------------------------------------------------

def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    return np.random.default_rng([seed, batch, length]).integers(0, min(vocab, 10000), (batch, length)).tolist()


def decode_throughput(model_dir, batch: int, prompt_len: int, new_tokens: int, runs: int = 2) -> float:
    """Output tokens/s of a static batch of random prompts, prefill included (TorchPeer.decode_throughput)."""
    peer = TorchPeer(model_dir)
    try:
        prompts = random_prompts(batch, prompt_len, peer.model.config.vocab_size)
        return peer.decode_throughput(prompts, new_tokens, runs)["output_tok_s"]
    finally:
        peer.close()


def prefill_ttft(model_dir, tokens: int = 1024, runs: int = 3) -> float:
    """Milliseconds of prefill + first token for a random prompt of `tokens` (compiled on the GPU)."""
    peer = TorchPeer(model_dir)
    try:
        return peer.prefill_ttft(random_prompts(1, tokens, peer.model.config.vocab_size)[0], runs)["ttft_ms"]
    finally:
        peer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a model directory (Hugging Face layout)")
    p.add_argument("--batch", type=lambda t: [int(b) for b in t.split(",")], default=[1, 64, 256])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--prefill", type=int, default=1024, help="prompt tokens of the TTFT measurement (0: none)")
    a = p.parse_args(argv)
    peer = TorchPeer(a.model)
    vocab = peer.model.config.vocab_size
    results = {"device": str(peer.device), "torch": torch.__version__, "decode": {}}
    for batch in a.batch:
        r = results["decode"][batch] = peer.decode_throughput(random_prompts(batch, a.prompt, vocab), a.new)
        print(f"batch {batch}: {r['output_tok_s']:,.0f} output tok/s, {r['decode_tok_s']:,.0f} decode tok/s "
              f"({describe(r)})", file=sys.stderr, flush=True)
    if a.prefill:
        results["prefill"] = peer.prefill_ttft(random_prompts(1, a.prefill, vocab)[0])
    results["failed_modes"] = peer.failed
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
