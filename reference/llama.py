"""A whole Llama forward pass in NumPy over a paged KV cache: the engine's CPU backend and the GPU's oracle.

One call runs any mix of sequences: each contributes a chunk of new tokens (a whole prompt, a piece of a
long prompt, or the single token of a decode step) whose K and V are written into the cache before
attention reads the sequence's full context back through its block table. So prefill, chunked prefill,
prefix caching and batched decode are all the same code path.

Per layer, for the T new tokens of the batch (x: the fp32 residual stream, (T, H)):

    h = rmsnorm(x);  q, k, v = h @ Wqkv^T;  q, k = rope(q, k);  cache[slots] = store(k), store(v)
    x = x + attention(q, cache) @ Wo^T
    h = rmsnorm(x);  x = x + (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T

and logits = rmsnorm(x) @ Wlm^T for the rows in `logits_indices` only (the last token of each sequence).
Weights are widened from bf16 to fp32 once, at construction, and fused (QKV, gate/up) so each projection is
a single NumPy matmul per block of rows (a long prompt's blocks run on every core: reference/parallel.py;
a decode step's rows are one block). With matmul_precision "bf16" the input of every projection (the
five matmuls above, the LM head included) is rounded to bf16 first, as the GPU's bf16-input kernels do
(reference/matmul.py); everything else stays fp32. store() is the KV cache's format (kv_cache_dtype,
reference/kv_format.py): bf16 rounding by default, fp32 unrounded, or fp8 e4m3 with per-tensor scales.

`trace`, when set, is called as trace(layer, name, array) with the intermediate results of the forward (the
names of TRACE_POINTS; layer -1 outside the layers): tools/compare_layers.py compares them with the CUDA
runner's. While it is set, each layer's row-wise steps run as one block, in the calling thread, so that
every traced array holds all T rows (attention keeps its tiles and threads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference.activation import silu_and_mul
from reference.bf16 import bf16_to_f32, round_to_bf16
from reference.embedding import embedding
from reference.kv_cache import allocate_kv_cache
from reference.kv_format import check_format, kv_decode
from reference.paged_attention import prefill_attention
from reference.parallel import for_row_blocks
from reference.rmsnorm import rmsnorm
from reference.rope import rope_kv_write, rope_tables


# "fp32": matmul inputs as they are; "bf16": rounded to bf16 first (reference/matmul.py)
MATMUL_PRECISIONS = ("fp32", "bf16")
# What `trace` sees, in order: per layer the first eight, then "final_norm" and "logits" (layer -1), after
# "embedding" (layer -1). k and v are the new tokens' rows of the cache, read back as float32.
TRACE_POINTS = ("input_norm", "q", "k", "v", "attention", "o_proj", "post_norm", "mlp")


@dataclass
class ForwardBatch:
    """What one forward step needs; S sequences with T new tokens in all.

    token_ids, positions, slot_mapping: (T,) for the new tokens, sequence by sequence.
    cu_seqlens_q: (S+1,) offsets of each sequence's new tokens in those arrays.
    context_lens: (S,) tokens in each sequence's cache after this step (cached prefix + new tokens).
    block_tables: (S, max_blocks) block ids, -1 past the end.
    logits_indices: rows of the T new tokens whose logits are wanted (usually each sequence's last).
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_seqlens_q: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    logits_indices: np.ndarray


class PagedKVCache:
    """Per-layer K and V block pools, (num_blocks, block_size, Hkv, d) each in format fmt (bf16 bits by
    default), NaN where unwritten; k_scale and v_scale are fp8's per-tensor scales (1.0, as the engine's)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 fmt: str = "bf16", k_scale: float = 1.0, v_scale: float = 1.0):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.format = check_format(fmt)
        self.k_scale, self.v_scale = k_scale, v_scale
        self.k = [allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, fmt) for _ in range(num_layers)]
        self.v = [allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, fmt) for _ in range(num_layers)]


class ReferenceLlama:
    """The Llama forward in NumPy, from a ModelConfig and the bf16 weights of tinyvllm.weights.load_weights."""

    def __init__(self, config, weights: dict[str, np.ndarray], matmul_precision: str = "fp32"):
        if matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {matmul_precision!r}")
        self.config = config
        self.bf16_inputs = matmul_precision == "bf16"
        f32 = bf16_to_f32
        self.embed_tokens = weights["model.embed_tokens.weight"]  # stays bf16: only T rows are looked up
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "input_norm": weights[p + "input_layernorm.weight"],
                "qkv": f32(np.concatenate([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])),
                "o": f32(weights[p + "self_attn.o_proj.weight"]),
                "post_norm": weights[p + "post_attention_layernorm.weight"],
                "gate_up": f32(np.concatenate([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])),
                "down": f32(weights[p + "mlp.down_proj.weight"]),
            })
        self.norm = weights["model.norm.weight"]
        self.lm_head = f32(weights["lm_head.weight"])
        self.cos, self.sin = rope_tables(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                         config.rope_scaling)
        self.scale = config.head_dim ** -0.5
        self.trace = None   # trace(layer, name, array): see the module docstring

    def new_kv_cache(self, num_blocks: int, block_size: int, fmt: str = "bf16") -> PagedKVCache:
        c = self.config
        return PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, fmt)

    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> np.ndarray:
        """Logits (len(logits_indices), vocab) float32; writes the new tokens' K and V into `kv`."""
        c = self.config
        t = len(batch.token_ids)
        tracing = self.trace is not None
        trace = self.trace or (lambda *_: None)
        x = embedding(batch.token_ids, self.embed_tokens)
        # A copy: x is updated in place below.
        trace(-1, "embedding", x.copy() if tracing else x)
        q = np.empty((t, c.num_heads, c.head_dim), np.float32)
        for i, layer in enumerate(self.layers):
            # Everything but attention works on each token's row alone: it runs in blocks of rows, on every
            # core for a long prompt (reference/parallel.py). When tracing, a layer is one block, in this
            # thread, so that trace sees each result whole.
            def attention_input(rows):
                h = rmsnorm(x[rows], layer["input_norm"], c.rms_norm_eps)
                trace(i, "input_norm", h)
                q[rows] = rope_kv_write(self._linear(h, layer["qkv"]), batch.positions[rows], self.cos, self.sin,
                                        kv.k[i], kv.v[i], batch.slot_mapping[rows], c.num_heads, kv.k_scale,
                                        kv.v_scale)

            def attention_output_and_mlp(rows):
                o = self._linear(attn[rows], layer["o"])
                trace(i, "o_proj", o)
                x[rows] += o
                h = rmsnorm(x[rows], layer["post_norm"], c.rms_norm_eps)
                trace(i, "post_norm", h)
                mlp = self._linear(silu_and_mul(self._linear(h, layer["gate_up"])), layer["down"])
                trace(i, "mlp", mlp)
                x[rows] += mlp

            if tracing:
                attention_input(slice(0, t))
                # A copy: q is the next layer's buffer too.
                trace(i, "q", q.copy())
                trace(i, "k", kv_decode(slot_rows(kv.k[i], batch.slot_mapping), kv.k_scale))
                trace(i, "v", kv_decode(slot_rows(kv.v[i], batch.slot_mapping), kv.v_scale))
            else:
                for_row_blocks(attention_input, t)
            attn = prefill_attention(q, kv.k[i], kv.v[i], batch.block_tables, batch.cu_seqlens_q,
                                     batch.context_lens, self.scale, kv.k_scale, kv.v_scale)
            trace(i, "attention", attn)
            attn = attn.reshape(t, c.q_size)
            if tracing:
                attention_output_and_mlp(slice(0, t))
            else:
                for_row_blocks(attention_output_and_mlp, t)
        last = rmsnorm(x[batch.logits_indices], self.norm, c.rms_norm_eps)
        trace(-1, "final_norm", last)
        logits = self._linear(last, self.lm_head)
        trace(-1, "logits", logits)
        return logits

    def _linear(self, x: np.ndarray, weight_f32: np.ndarray) -> np.ndarray:
        """x @ W^T with W already widened; x rounded to bf16 first in the bf16 matmul precision."""
        return (round_to_bf16(x) if self.bf16_inputs else x) @ weight_f32.T


def slot_rows(cache: np.ndarray, slot_mapping: np.ndarray) -> np.ndarray:
    """The cache rows (T', Hkv, d) at the batch's slots (padding slots -1 left out), in the cache's format."""
    slots = np.asarray(slot_mapping)
    slots = slots[slots >= 0]
    return cache[slots // cache.shape[1], slots % cache.shape[1]]


def single_sequence_batch(token_ids, start: int, block_table: np.ndarray, block_size: int) -> ForwardBatch:
    """A batch of one sequence whose new tokens `token_ids` sit at positions start, start+1, ...; logits of the last."""
    n = len(token_ids)
    positions = np.arange(start, start + n, dtype=np.int64)
    slots = block_table[positions // block_size].astype(np.int64) * block_size + positions % block_size
    return ForwardBatch(
        token_ids=np.asarray(token_ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=np.array([0, n]),
        context_lens=np.array([start + n]),
        block_tables=block_table[None, :],
        logits_indices=np.array([n - 1]),
    )
