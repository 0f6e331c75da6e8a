"""The CUDA backend: owns every byte of GPU memory (weights, KV cache, activations) and runs the kernels.

At start: the bf16 weights are uploaded once (Q/K/V and gate/up fused into one matrix each), fixed-size
activation buffers are allocated for `max_num_batched_tokens` tokens and `max_num_seqs` sequences, and the
KV cache takes what is left of `gpu_memory_utilization` of the card (reported on stderr). A step then:

1. packs the scheduled batch on the host (tinyvllm/batch.py) and copies it into the fixed device buffers;
2. runs the layer loop: embedding -> per layer [RMSNorm (fused with the residual add after the first layer)
   -> QKV matmul -> RoPE + KV-cache write -> attention (paged decode when every sequence has one new token,
   flash-style prefill otherwise) -> O matmul -> residual + RMSNorm -> gate/up matmul -> SiLU*mul -> down
   matmul] -> final residual + RMSNorm -> gather of the sampled rows -> LM head on those rows only;
3. samples on the GPU (argmax when every row is greedy) and copies back only the token ids.

No step allocates device memory: every kernel writes into a prefix of a preallocated buffer.
"""

from __future__ import annotations

import sys

import numpy as np

from cuda_kernels import compat  # noqa: F401  (the numpy shim precedes numba.cuda)
from cuda_kernels import activation, attention, embedding, matmul, paged_attention, rmsnorm, rope, sampling
from numba import cuda

from reference.rope import rope_tables
from tinyvllm.batch import pack
from tinyvllm.scheduler import ScheduledSequence

# Without a real device to measure (the simulator), a small cache.
SIMULATOR_KV_BLOCKS = 256


class CUDARunner:
    name = "cuda"

    def __init__(self, config, weights: dict[str, np.ndarray], block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, gpu_memory_utilization: float = 0.9, num_blocks: int | None = None):
        c = self.config = config
        self.block_size = block_size
        self.max_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        up = cuda.to_device
        self.embed = up(weights["model.embed_tokens.weight"])
        self.lm_head = self.embed if c.tie_word_embeddings else up(weights["lm_head.weight"])
        self.final_norm = up(weights["model.norm.weight"])
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "input_norm": up(weights[p + "input_layernorm.weight"]),
                "qkv": up(np.concatenate([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])),
                "o": up(weights[p + "self_attn.o_proj.weight"]),
                "post_norm": up(weights[p + "post_attention_layernorm.weight"]),
                "gate_up": up(np.concatenate([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])),
                "down": up(weights[p + "mlp.down_proj.weight"]),
            })
        cos, sin = rope_tables(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
        self.cos, self.sin = up(cos), up(sin)
        self.scale = np.float32(c.head_dim ** -0.5)

        t, s, f32 = max_num_batched_tokens, max_num_seqs, np.float32
        empty = cuda.device_array
        # activations, for up to t tokens and s sampled rows
        self.x = empty((t, c.hidden_size), f32)           # the residual stream
        self.h = empty((t, c.hidden_size), f32)           # normed input of a sublayer
        self.sub = empty((t, c.hidden_size), f32)         # a sublayer's output, added to x by the next norm
        self.qkv = empty((t, c.q_size + 2 * c.kv_size), f32)
        self.q = empty((t, c.num_heads, c.head_dim), f32)
        self.attn = empty((t, c.num_heads, c.head_dim), f32)
        self.gate_up = empty((t, 2 * c.intermediate_size), f32)
        self.act = empty((t, c.intermediate_size), f32)
        self.last = empty((s, c.hidden_size), f32)
        self.logits = empty((s, c.vocab_size), f32)
        self.tokens = empty(s, np.int32)
        # per-step metadata
        i32 = np.int32
        self.d_token_ids, self.d_positions, self.d_slots = empty(t, i32), empty(t, i32), empty(t, i32)
        self.d_cu = empty(s + 1, i32)
        self.d_context = empty(s, i32)
        self.d_logit_rows = empty(s, i32)
        self.d_temperature, self.d_top_p, self.d_min_p, self.d_uniform = (empty(s, f32) for _ in range(4))
        self.d_top_k = empty(s, i32)

        per_block = 2 * c.num_layers * block_size * c.kv_size * 2
        self.num_blocks = num_blocks or self._blocks_that_fit(per_block, gpu_memory_utilization)
        max_blocks_per_seq = -(-c.max_position_embeddings // block_size)
        # flat, so that the (S, width) table of any step is a contiguous prefix
        self.d_block_tables = empty(s * min(max_blocks_per_seq, self.num_blocks), i32)
        shape = (self.num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.k_cache = [empty(shape, np.uint16) for _ in range(c.num_layers)]
        self.v_cache = [empty(shape, np.uint16) for _ in range(c.num_layers)]
        print(f"tinyvllm: KV cache: {self.num_blocks} blocks of {block_size} tokens = "
              f"{self.num_blocks * block_size} tokens ({self.num_blocks * per_block / 2**30:.2f} GiB)", file=sys.stderr)

    def _blocks_that_fit(self, per_block: int, utilization: float) -> int:
        from cuda_kernels.compat import SIMULATOR

        if SIMULATOR:
            return SIMULATOR_KV_BLOCKS
        free, total = cuda.current_context().get_memory_info()
        budget = total * utilization - (total - free)
        blocks = int(budget // per_block)
        if blocks < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                               f"{total / 2**30:.1f} GiB, gpu_memory_utilization {utilization}")
        return blocks

    def execute(self, scheduled: list[ScheduledSequence]) -> list[int]:
        c = self.config
        batch, sp = pack(scheduled, self.block_size)
        t, s, n = len(batch.token_ids), len(scheduled), len(batch.logits_indices)
        if t > self.max_tokens or s > self.max_seqs:
            raise RuntimeError(f"batch of {t} tokens / {s} sequences exceeds the runner's buffers "
                               f"({self.max_tokens} / {self.max_seqs})")
        ids, pos, slots = self.d_token_ids[:t], self.d_positions[:t], self.d_slots[:t]
        ids.copy_to_device(batch.token_ids)
        pos.copy_to_device(batch.positions)
        slots.copy_to_device(batch.slot_mapping)
        cu, ctx = self.d_cu[: s + 1], self.d_context[:s]
        cu.copy_to_device(batch.cu_seqlens_q)
        ctx.copy_to_device(batch.context_lens)
        width = batch.block_tables.shape[1]
        tables = self.d_block_tables[: s * width].reshape(s, width)
        tables.copy_to_device(np.ascontiguousarray(batch.block_tables))
        q_lens = np.diff(batch.cu_seqlens_q)
        decode = bool(np.all(q_lens == 1))

        x, h, sub, qkv, q, attn = (a[:t] for a in (self.x, self.h, self.sub, self.qkv, self.q, self.attn))
        gate_up, act = self.gate_up[:t], self.act[:t]
        embedding.embedding(ids, self.embed, x)
        for i, layer in enumerate(self.layers):
            if i == 0:
                rmsnorm.rmsnorm(x, layer["input_norm"], c.rms_norm_eps, h)
            else:
                rmsnorm.fused_add_rmsnorm(sub, x, layer["input_norm"], c.rms_norm_eps, h)
            matmul.matmul(h, layer["qkv"], qkv)
            rope.rope_kv_write(qkv, pos, self.cos, self.sin, self.k_cache[i], self.v_cache[i], slots, q)
            if decode:
                paged_attention.paged_attention(q, self.k_cache[i], self.v_cache[i], tables, ctx, self.scale, attn)
            else:
                attention.prefill_attention(q, self.k_cache[i], self.v_cache[i], tables, cu, ctx, self.scale, attn,
                                            int(q_lens.max()))
            matmul.matmul(attn.reshape(t, c.q_size), layer["o"], sub)
            rmsnorm.fused_add_rmsnorm(sub, x, layer["post_norm"], c.rms_norm_eps, h)
            matmul.matmul(h, layer["gate_up"], gate_up)
            activation.silu_and_mul(gate_up, act)
            matmul.matmul(act, layer["down"], sub)
        if n == 0:
            return []
        rmsnorm.fused_add_rmsnorm(sub, x, self.final_norm, c.rms_norm_eps, h)
        rows = self.d_logit_rows[:n]
        rows.copy_to_device(batch.logits_indices)
        last, logits, tokens = self.last[:n], self.logits[:n], self.tokens[:n]
        embedding.gather_rows(h, rows, last)
        matmul.matmul(last, self.lm_head, logits)
        if np.all(sp.temperature == 0):
            sampling.argmax(logits, tokens)
        else:
            params = (self.d_temperature[:n], self.d_top_k[:n], self.d_top_p[:n], self.d_min_p[:n], self.d_uniform[:n])
            for dev, host in zip(params, (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.uniform)):
                dev.copy_to_device(host)
            sampling.sample(logits, *params, tokens)
        return tokens.copy_to_host().tolist()
