"""A plain Llama in PyTorch with a static KV cache, prefill and decode compiled: the strong peer of tools/bench.py.

    python3 tools/torch_peer.py --model DIR [--batch 1,64,256] [--prompt 128] [--new 256] [--prefill 1024]

It is what a user could write instead of running tinyvllm, in the way gpt-fast writes one: the model as a few
tensor functions, a KV cache allocated once, prefill and decode compiled with torch.compile(mode=
"reduce-overhead") (Inductor's kernels, replayed as CUDA graphs). It loads the same checkpoint as tinyvllm
(tinyvllm.weights.load_weights: bf16, checked against config.json; the RoPE settings come from tinyvllm's
ModelConfig, llama3 scaling included), so both run the same random weights in the benchmark.

- Weights: Q, K and V fused into one matrix, gate and up into another (one GEMM each, as vLLM does); a tied
  LM head is the embedding itself.
- KV cache: per layer k and v [batch, kv_heads, max_len, head_dim] in bf16 (rounded to nearest even, as
  tinyvllm's cache is), an argument of the compiled functions, written in place at the step's positions
  (`cache[:, :, pos] = k`, which Inductor keeps in place; a slice of one tensor stacking all layers was
  copied whole at every write).
- Prefill: the whole prompt at once from position 0; every sequence of a batch has the same prompt length (a
  static batch of equal prompts), so positions are shared. Causal SDPA over the prompt's own keys, read back
  through the cache's bf16 (what tinyvllm's attention reads), GQA by SDPA itself (enable_gqa: the flash
  kernel); the LM head on the last token only.
- Decode: one token per sequence at a position held in a device tensor. Attention reads only the filled part
  of the cache, rounded up to a bucket of BUCKET positions (the bucket is the length of a `key_positions`
  input, arange(bucket)); the positions past the sequence's length (at most BUCKET - 1) are masked. Each KV
  head's group of query heads are the query rows (GQA without copying K and V, which a masked SDPA, the
  memory-efficient kernel, needs: it has no GQA of its own).
- Compiles: the bucket, the batch, the prompt length and the cache's sizes are dynamic to torch.compile
  (dynamic=False otherwise), so one graph serves all decode steps and one all prefills (batch 1 gets its
  own of each); reduce-overhead records a CUDA graph per shape (batch, bucket; batch, prompt length). The
  warm-up is one whole generation, so every graph is compiled and recorded before timing (each run reports
  compiles_warmup and compiles_timed).
- Numerics: compute in `dtype`, bf16 on the GPU as HF transformers runs a bf16 checkpoint (residual stream,
  RoPE and logits in bf16; RMSNorm in fp32, cast back); float32 in the correctness tests, which then equal
  tinyvllm's CPU reference up to summation order (a difference that can flip a K or V value's bf16 rounding
  in the cache, and so a near-tie: compiled and eager float32 logits differ by 1e-6 without that rounding,
  by up to 1e-2 with it on the tiny model).
- Modes, tried in order until one completes a warm-up (the first that works is recorded as `mode`):
  torch.compile reduce-overhead; torch.compile (no CUDA graphs); eager. Prefill and decode share the mode.
  The 1,024-token TTFT is measured compiled (reduce-overhead) and eagerly.

Greedy decoding only. torch is imported when a peer is made, never at import time: tinyvllm does not depend
on it, and tools/bench.py skips this peer where torch is absent. tests/test_torch_peer.py checks its greedy
tokens against tinyvllm's CPU reference and against a plain full-attention forward.
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

# how the prefill and decode steps run, best first; each is tried until one completes a warm-up
GPU_MODES = ("torch.compile reduce-overhead", "torch.compile", "eager")
CPU_MODES = ("eager",)
BUCKET = 64           # decode attention reads the cache up to the context length rounded up to this
WARMUP_CALLS = 3      # compiled prefills before timing a TTFT (reduce-overhead records its graph on the second)
CHECK_STEPS = 8       # decode steps compared with the eager step after a warm-up


def _require_torch():
    """Import torch (ImportError if absent) and allow one compiled graph per batch size and cache shape."""
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
    set_rope(model, config.max_position_embeddings)
    return model


def set_rope(model, positions: int) -> None:
    """The model's RoPE tables (cos, sin buffers) for `positions` positions."""
    cos, sin = rope_tables(model.config, positions)
    model.register_buffer("cos", cos.to(model.embed.device), persistent=False)
    model.register_buffer("sin", sin.to(model.embed.device), persistent=False)


def new_cache(config, batch: int, max_len: int, device) -> list[tuple]:
    """A zeroed KV cache for `batch` sequences of up to max_len tokens: per layer (k, v), each [batch, kv_heads,
    max_len, head_dim] bf16. Zeros, not garbage: masked positions still enter softmax(.) @ V with weight 0, and
    0 * NaN is NaN. Its batch and length are dynamic sizes to torch.compile (one graph for every cache; batch 1
    gets its own), and on the GPU its addresses static to CUDA graphs (read and written in place, never copied;
    another cache is recorded anew, not compiled anew)."""
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    cache = [tuple(torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in "kv")
             for _ in range(config.num_layers)]
    for t in (t for kv in cache for t in kv):
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 2)
        if device.type == "cuda":
            torch._dynamo.mark_static_address(t)
    return cache


def rms_norm(x, weight, eps: float):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x, cos, sin):
    """x [B, T, heads, d] rotated by the "rotate half" pairs (i, i + d/2); cos, sin [T, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def attention(model, kv_cache, q, k, v, pos, key_positions):
    """q [B, T, H, d], k and v [B, T, Hkv, d] at positions pos [T]: K and V into the layer's cache (k_cache,
    v_cache), then attention -> [B, T, H * d]. key_positions None: a prefill from position 0 (causal over the
    prompt); else a decode step (T == 1) over the cache positions key_positions (arange(bucket)) <= pos."""
    c, sdpa = model.config, torch.nn.functional.scaled_dot_product_attention
    b, t = q.shape[:2]
    k, v = k.transpose(1, 2).to(torch.bfloat16), v.transpose(1, 2).to(torch.bfloat16)   # [B, Hkv, T, d]
    k_cache, v_cache = kv_cache
    k_cache[:, :, pos] = k
    v_cache[:, :, pos] = v
    if key_positions is None:
        out = sdpa(q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, c.q_size)
    n = key_positions.shape[0]   # the bucket: the filled part of the cache and at most BUCKET - 1 more
    keys, values = k_cache[:, :, :n].to(q.dtype), v_cache[:, :, :n].to(q.dtype)
    group = q.reshape(b, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)  # [B, Hkv, H/Hkv, d]
    written = (key_positions <= pos)[None, None, None, :]   # one length for the whole static batch
    out = sdpa(group, keys, values, attn_mask=written)
    return out.reshape(b, 1, c.q_size)


def logits(model, cache, ids, pos, key_positions=None):
    """ids [B, T] at positions pos [T] -> the logits of each sequence's last position [B, vocab] (in the
    model's dtype); cache: new_cache's. key_positions: see attention."""
    c = model.config
    b, t = ids.shape
    x = model.embed[ids]
    cos, sin = model.cos[pos], model.sin[pos]
    for layer, kv_cache in zip(model.layers, cache):
        h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
        q, k, v = torch.nn.functional.linear(h, layer.wqkv).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = rope(q.reshape(b, t, c.num_heads, c.head_dim), cos, sin)
        k = rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        attn = attention(model, kv_cache, q, k, v.reshape(b, t, c.num_kv_heads, c.head_dim), pos, key_positions)
        x = x + torch.nn.functional.linear(attn, layer.wo)
        gate, up = torch.nn.functional.linear(rms_norm(x, layer.mlp_norm, c.rms_norm_eps),
                                              layer.w_gate_up).chunk(2, dim=-1)
        x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, layer.w_down)
    return torch.nn.functional.linear(rms_norm(x[:, -1], model.norm, c.rms_norm_eps), model.lm_head)


def forward(model, cache, ids, pos, key_positions):
    """A decode step: ids [B, 1] at position pos [1] -> the greedy next token of each sequence [B]."""
    return logits(model, cache, ids, pos, key_positions).argmax(dim=-1)


def prefill(model, cache, ids):
    """The prompts ids [B, P] from position 0 -> first tokens [B]."""
    return logits(model, cache, ids, torch.arange(ids.shape[1], device=ids.device)).argmax(dim=-1)


# -- running it ----------------------------------------------------------------------------------------------

def bucket(length: int) -> int:
    """Cache positions a decode step attends to when `length` are filled: length rounded up to BUCKET."""
    return -(-length // BUCKET) * BUCKET


def cache_len(prompt_len: int, new_tokens: int) -> int:
    """Cache positions for a run (the prompt, its new tokens and room for the agreement check): whole buckets
    and one position more, so that no bucket is the whole cache (a slice that is the whole tensor is
    contiguous, which torch.compile cannot tell from a dynamic size: it compiled a second graph for it)."""
    return bucket(prompt_len + max(new_tokens, CHECK_STEPS + 1)) + 1


def cudagraph_skips() -> int:
    """How many times Inductor has compiled a graph for CUDA graphs and then decided against them (it logs a
    warning and counts; reduce-overhead then runs the kernels without graphs)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def compiles() -> int:
    """Graphs compiled by torch.compile in this process so far (Dynamo's count)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _compile(fn, mode: str | None = None):
    return torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)


class TorchPeer:
    """The model on one device; decode runs per batch size with the best mode that works there."""

    def __init__(self, model_dir: str | Path, device: str | None = None, dtype=None):
        _require_torch()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model = build_model(Path(model_dir), self.device, self.dtype)
        # per (batch, max_len): the cache, kept so that its addresses (which CUDA graphs hold) never change;
        # self.cache: the one in use; per (batch, prompt length, new tokens): the mode warmed up there
        self.caches: dict[tuple[int, int], list] = {}
        self.cache: list | None = None
        self.modes: dict[tuple[int, int, int], str] = {}
        self.functions: dict[str, tuple] = {}            # mode -> (prefill, step), compiled once
        self.key_positions: dict[int, object] = {}       # bucket -> arange(bucket), its size marked dynamic
        self.failed: list[str] = []   # modes that raised, with their errors

    def use_cache(self, batch: int, max_len: int) -> None:
        """Use the cache of this shape (made on first use); RoPE tables that reach max_len."""
        key = (batch, max_len)
        if key not in self.caches:
            self.caches[key] = new_cache(self.model.config, batch, max_len, self.device)
        self.cache = self.caches[key]
        if self.model.cos.shape[0] < max_len:  # past max_position_embeddings: longer tables (compiled anew)
            set_rope(self.model, max_len)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _tensor(self, rows: list[list[int]]):
        if len({len(r) for r in rows}) != 1:
            raise ValueError("a static batch needs prompts of one length, got " + str(sorted({len(r) for r in rows})))
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _keys(self, length: int):
        """arange(bucket(length)) on the device, one tensor per bucket, its size dynamic to torch.compile."""
        n = bucket(length)
        if n not in self.key_positions:
            self.key_positions[n] = torch.arange(n, device=self.device)
            torch._dynamo.maybe_mark_dynamic(self.key_positions[n], 0)   # if a kernel needs it static: a graph each
        return self.key_positions[n]

    def _decode(self, ids, new_tokens: int, mode: str) -> tuple[list, float, float]:
        """Prefill ids [B, P], then new_tokens - 1 decode steps -> (token tensors, seconds to the first token,
        seconds of the decode steps). The cache in use must hold P + new_tokens - 1 positions."""
        prefill_fn, step = self._functions(mode)
        length = ids.shape[1]
        self.sync()
        start = time.perf_counter()
        with torch.inference_mode():
            tokens = [prefill_fn(self.model, self.cache, ids).clone()]   # the next call may overwrite a graph's output
            self.sync()
            first = time.perf_counter()
            pos = torch.full((1,), length, dtype=torch.long, device=self.device)
            for n in range(length + 1, length + new_tokens):   # n: cache positions filled after the step
                tokens.append(step(self.model, self.cache, tokens[-1][:, None], pos, self._keys(n)).clone())
                pos += 1
            self.sync()
        return tokens, first - start, time.perf_counter() - first

    def generate(self, prompts: list[list[int]], new_tokens: int, mode: str = "eager") -> list[list[int]]:
        """Greedy tokens of a static batch (prompts of one length); mode: one of the modes, or "best"."""
        ids = self._tensor(prompts)
        max_len = cache_len(ids.shape[1], new_tokens)
        self.use_cache(len(prompts), max_len)
        if mode == "best":
            mode = self._mode(ids, new_tokens)
        tokens, _, _ = self._decode(ids, new_tokens, mode)
        return torch.stack(tokens, dim=1).tolist()

    def _functions(self, mode: str):
        """(prefill, step) of a mode, made once (a compiled function keeps its graphs across batch sizes)."""
        if mode not in self.functions:
            if mode == "eager":
                self.functions[mode] = (prefill, forward)
            elif mode in ("torch.compile", "torch.compile reduce-overhead"):
                graphs = mode.endswith("reduce-overhead")
                self.functions[mode] = tuple(_dynamic(_compile(fn, "reduce-overhead" if graphs else None), graphs)
                                             for fn in (prefill, forward))
            else:
                raise ValueError(f"unknown mode {mode!r}")
        return self.functions[mode]

    def _mode(self, ids, new_tokens: int) -> str:
        """The best mode that completes a warm-up at this shape (whose cache is in use): one whole generation,
        so that every bucket's graph is compiled and recorded before anything is timed."""
        batch = ids.shape[0]
        key = (batch, ids.shape[1], new_tokens)
        if key in self.modes:
            return self.modes[key]
        modes = GPU_MODES if self.device.type == "cuda" else CPU_MODES
        for mode in modes:
            try:
                skips = cudagraph_skips()
                self._decode(ids, new_tokens, mode)
                if mode.endswith("reduce-overhead") and cudagraph_skips() > skips:
                    raise RuntimeError("Inductor skipped CUDA graphs (its warning above says why)")
            except Exception as exc:  # a mode that fails here falls back to the next one
                self.failed.append(f"{mode} at batch {batch}: {type(exc).__name__}: {exc}")
                print(f"torch_peer: {self.failed[-1]}", file=sys.stderr, flush=True)
                continue
            self.modes[key] = mode
            return mode
        raise RuntimeError(f"no mode ran at batch {batch}: " + "; ".join(self.failed[-len(modes):]))

    def decode_throughput(self, prompts: list[list[int]], new_tokens: int, runs: int = 2) -> dict:
        """A static batch (prompts of one length), greedy, new_tokens each, best of `runs` after a warm-up.

        output_tok_s counts batch * new_tokens over prefill + decode (from the call to the last token, as
        tinyvllm's static workload times LLM.generate); decode_tok_s counts batch * (new_tokens - 1) over the
        decode steps alone (from the first token to the last, as the latency workload times tinyvllm).
        compiles_timed: graphs torch.compile made during the timed runs (0: all in the warm-up)."""
        ids = self._tensor(prompts)
        batch, max_len = len(prompts), cache_len(ids.shape[1], new_tokens)
        self.use_cache(batch, max_len)
        before = compiles()
        mode = self._mode(ids, new_tokens)
        warmup_compiles = compiles() - before
        agreement = self.eager_agreement(ids, mode)
        before = compiles()
        totals, decodes = [], []
        for _ in range(runs):
            tokens, ttft, decode = self._decode(ids, new_tokens, mode)
            totals.append(ttft + decode)
            decodes.append(decode)
        best = int(np.argmin(totals))
        return {"mode": mode, "batch": batch, "prompt_tokens": ids.shape[1], "new_tokens": len(tokens),
                "dtype": str(self.dtype).removeprefix("torch."),
                "output_tok_s": batch * new_tokens / totals[best], "elapsed_s": totals[best],
                "decode_tok_s": batch * (new_tokens - 1) / min(decodes), "step_s": min(decodes) / (new_tokens - 1),
                "runs_elapsed_s": totals, "eager_agreement": agreement,
                "buckets": len({bucket(n) for n in range(ids.shape[1] + 1, ids.shape[1] + new_tokens)}),
                "compiles_warmup": warmup_compiles, "compiles_timed": compiles() - before}

    def eager_agreement(self, ids, mode: str) -> str | None:
        """How many of CHECK_STEPS greedy tokens per sequence `mode` gives as the eager mode does, from the
        prompts ids (None: it is the eager mode); a step that lost its cache writes (a wrong graph) fails this,
        bf16 near-ties may cost a few. The cache in use must hold CHECK_STEPS + 1 tokens past the prompts."""
        if mode == "eager":
            return None
        mine = torch.stack(self._decode(ids, CHECK_STEPS + 1, mode)[0], dim=1)
        eager = torch.stack(self._decode(ids, CHECK_STEPS + 1, "eager")[0], dim=1)
        same = int((mine[:, 1:] == eager[:, 1:]).sum())
        return f"{same} of {eager[:, 1:].numel()} decode tokens equal to the eager step's"

    def near_ties(self, prompts: list[list[int]], mode: str, reference: "TorchPeer") -> dict:
        """Where `mode` and the eager mode first choose different tokens (per sequence, within CHECK_STEPS decode
        steps), the logit gap between the two choices by `reference` (the same weights in float32, eager), and
        its top-1 minus top-2 gap at the prompts' ends for scale: bf16 near-ties part where that gap is among
        the smallest ones; a wrong step parts anywhere."""
        ids = self._tensor(prompts)
        self.use_cache(len(prompts), cache_len(ids.shape[1], CHECK_STEPS + 1))
        mine, eager = (torch.stack(self._decode(ids, CHECK_STEPS + 1, m)[0], dim=1).tolist() for m in (mode, "eager"))

        def reference_logits(rows):
            reference.use_cache(len(rows), cache_len(len(rows[0]), 1))
            with torch.inference_mode():
                return logits(reference.model, reference.cache, reference._tensor(rows),
                              torch.arange(len(rows[0]), device=self.device))

        top2 = reference_logits(prompts).topk(2, dim=-1).values
        typical = (top2[:, 0] - top2[:, 1]).sort().values
        gaps = []
        for prompt, a, b in zip(prompts, mine, eager):
            t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if t is not None:
                row = reference_logits([prompt + a[:t]])[0]
                gaps.append(float((row[a[t]] - row[b[t]]).abs()))
        below = [float((typical < g).float().mean()) for g in gaps]
        return {"sequences": len(prompts), "parted": len(gaps), "gaps": gaps, "typical_median": float(typical.median()),
                "fraction_of_typical_below": below}

    def prefill_ttft(self, prompt: list[int], runs: int = 3) -> dict:
        """Time to the first token of one prompt (prefill + LM head on its last token + argmax), best of
        `runs`: compiled (reduce-overhead, on the GPU) and eager."""
        ids = self._tensor([prompt])
        self.use_cache(1, cache_len(ids.shape[1], 1))
        result = {"prompt_tokens": ids.shape[1], "dtype": str(self.dtype).removeprefix("torch."),
                  "eager_ttft_ms": self._best_ms(lambda: prefill(self.model, self.cache, ids), runs)}
        result.update(mode="eager", ttft_ms=result["eager_ttft_ms"])
        if self.device.type == "cuda":
            compiled = self._functions("torch.compile reduce-overhead")[0]
            try:
                skips = cudagraph_skips()
                result["compiled_ttft_ms"] = self._best_ms(lambda: compiled(self.model, self.cache, ids), runs)
                graphs = "CUDA graphs skipped" if cudagraph_skips() > skips else "CUDA graphs"
                result.update(mode=f"torch.compile reduce-overhead ({graphs})", ttft_ms=result["compiled_ttft_ms"])
            except Exception as exc:  # the eager figure stands
                result["compile_error"] = f"{type(exc).__name__}: {exc}"
        return result

    def _best_ms(self, fn, runs: int) -> float:
        times = []
        with torch.inference_mode():
            for i in range(WARMUP_CALLS + runs):
                self.sync()
                start = time.perf_counter()
                fn().cpu()   # the token on the host, as a TTFT
                if i >= WARMUP_CALLS:
                    times.append((time.perf_counter() - start) * 1e3)
        return min(times)

    def close(self) -> None:
        """Give the device memory back (weights, cache, compiled graphs' pools) before another user of the GPU."""
        self.model = None
        self.functions.clear()
        self.caches.clear()
        self.cache = None
        self.key_positions.clear()
        torch._dynamo.reset()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _dynamic(compiled, graphs: bool):
    """compiled(model, cache, ids, ...) with the sizes of ids dynamic (so that one graph serves every batch and
    prompt length, as the cache's sizes are); with CUDA graphs (graphs), each call starts a new graph step
    (the outputs of the last one were cloned, so its memory may be reused)."""
    def call(model, cache, ids, *args):
        for dim in range(ids.dim()):
            torch._dynamo.maybe_mark_dynamic(ids, dim)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(model, cache, ids, *args)
    return call


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
    p.add_argument("--ties", action="store_true", help="where the best mode and eager part, the float32 logit gap "
                   "(a float32 copy of the model on the same device)")
    a = p.parse_args(argv)
    started = time.perf_counter()
    peer = TorchPeer(a.model)
    vocab = peer.model.config.vocab_size
    reference = TorchPeer(a.model, peer.device, torch.float32) if a.ties else None
    results = {"device": torch.cuda.get_device_name() if peer.device.type == "cuda" else str(peer.device),
               "torch": torch.__version__, "decode": {}}
    for batch in a.batch:
        start, prompts = time.perf_counter(), random_prompts(batch, a.prompt, vocab)
        r = results["decode"][batch] = peer.decode_throughput(prompts, a.new)
        r["wall_s"] = time.perf_counter() - start
        print(f"batch {batch}: {r['output_tok_s']:,.0f} output tok/s, {r['decode_tok_s']:,.0f} decode tok/s, step "
              f"{r['step_s'] * 1e3:.2f} ms ({describe(r)}; {r['buckets']} buckets, {r['compiles_warmup']} compiles "
              f"in the warm-up, {r['compiles_timed']} timed; {r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        if reference is not None and r["mode"] != "eager":
            t = r["near_ties"] = peer.near_ties(prompts, r["mode"], reference)
            print(f"  parted from eager: {t['parted']} of {t['sequences']} sequences; float32 gaps between the two "
                  f"choices {', '.join(f'{g:.4f}' for g in t['gaps'])} (median top-2 gap {t['typical_median']:.4f})",
                  file=sys.stderr, flush=True)
    if a.prefill:
        r = results["prefill"] = peer.prefill_ttft(random_prompts(1, a.prefill, vocab)[0])
        print(f"prefill {a.prefill}: {r['ttft_ms']:.2f} ms ({r['mode']}; eager {r['eager_ttft_ms']:.2f} ms)",
              file=sys.stderr, flush=True)
    results.update(failed_modes=peer.failed, compiles=compiles(), wall_s=time.perf_counter() - started)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
