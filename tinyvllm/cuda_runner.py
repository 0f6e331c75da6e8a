"""The CUDA backend: owns every byte of GPU memory (weights, KV cache, activations) and runs the kernels.

At start: the bf16 weights are uploaded once (Q/K/V and gate/up fused into one matrix each), fixed-size
activation buffers are allocated for `max_num_batched_tokens` tokens and `max_num_seqs` sequences, and the
KV cache takes what is left of `gpu_memory_utilization` of the card (reported on stderr), in the format
`kv_cache_dtype` (cuda_kernels/kv_format.py: bf16, 2 bytes an element; fp32, 4; fp8 e4m3, 1, with per-tensor
scales k_scale = v_scale = 1.0). A step then:

1. packs the scheduled batch on the host (tinyvllm/batch.py) into one pinned buffer and copies it to the
   device in one transfer (tinyvllm/step_inputs.py);
2. runs the layer loop: embedding -> per layer [RMSNorm (fused with the residual add after the first layer)
   -> QKV matmul + RoPE + KV-cache write (one gemv at decode sizes) -> attention (paged decode when every
   sequence has one new token, flash-style prefill otherwise, on tensor cores when the head size allows)
   -> O matmul -> residual + RMSNorm -> gate/up matmul + SiLU*mul (one gemv at decode sizes; at prefill
   sizes written as the down GEMM's bf16 planes, matmul.mlp) -> down matmul] -> final residual + RMSNorm
   -> gather of the sampled rows -> LM head on those rows only; most of these kernels are launched with
   programmatic dependent launch (cuda_kernels/pdl.py), so each starts while the one before it finishes;
3. samples on the GPU (argmax when every row is greedy) and copies back only the token ids; rows with
   penalties, logit_bias or min_tokens masks are processed first (cuda_kernels/penalties.py), logprobs come
   from the raw logits after the draw (cuda_kernels/logprobs.py: ids, values and ranks come back), and
   prompt logprobs from the LM head run on the prompt rows that ask, max_num_seqs rows at a time.

`launch` starts a step and returns; `collect` waits for its tokens. Between the two the engine may launch
the next decode step, whose input ids are the samples still on the device (`chain_src`, see
tinyvllm/engine.py): the step's first kernel copies them in, in stream order.

No step allocates device memory: every kernel writes into a prefix of a preallocated buffer, and every
launch goes to the runner's stream. That makes a step capturable: a pure decode step (one new token per
sequence) is padded to a batch-size bucket (1, 2, 4, 8, 16, 32, 48, ...) and a block-table width bucket
(16, 32, 64, ... blocks), captured as a CUDA graph the first time that bucket occurs, and replayed after
that (tinyvllm/cuda_graph.py): about 150 kernels for one driver call instead of 150 Python launches.
Prefill steps launch eagerly; `enforce_eager` turns graphs off (and the simulator cannot capture).
"""

from __future__ import annotations

import sys
import threading
from functools import partial
from typing import NamedTuple

import numpy as np

from cuda_kernels import compat  # noqa: F401  (the numpy shim precedes numba.cuda)
from cuda_kernels import attention_policy, embedding, gemm_pipelined, matmul, matmul_policy, rmsnorm, sampling_policy
from cuda_kernels import kv_cache, kv_format, logprobs, penalties
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import preparing
from numba import cuda

from reference.rope import rope_tables
from tinyvllm.batch import block_copies, pack
from tinyvllm.cuda_driver import PinnedCopy
from tinyvllm.cuda_graph import CUDAGraph
from tinyvllm.sampler import LOGPROB_WIDTH, StepLogprobs
from tinyvllm.scheduler import ScheduledSequence
from tinyvllm.step_inputs import StepInputs, StepShape

# Without a real device to measure (the simulator), a small cache.
SIMULATOR_KV_BLOCKS = 256
PREFIX_CACHE_SIZES = 256   # (tokens, sampled rows) sizes whose buffer prefixes are kept


def _no_trace(layer, name, array):
    pass


class SamplingMode(NamedTuple):
    """What a step's sampling runs: argmax (every row greedy) or the sampler; the penalties kernel first;
    the logprobs kernel after. Part of a CUDA graph's key."""

    greedy: bool
    penalties: bool = False
    logprobs: bool = False


class CUDARunner:
    name = "cuda"
    # launch() returns once the step is queued on the GPU; collect() waits for it (Numba's simulator instead
    # computes the step in launch)
    launches_async = not SIMULATOR

    def __init__(self, config, weights: dict[str, np.ndarray], block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, gpu_memory_utilization: float = 0.9, num_blocks: int | None = None,
                 enforce_eager: bool = False, matmul_precision: str = "fp32", kv_cache_dtype: str = "bf16"):
        c = self.config = config
        if kv_cache_dtype not in kv_format.FORMATS:
            raise ValueError(f"kv_cache_dtype must be one of {kv_format.FORMATS}, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        # fp8's per-tensor scales (kv_format): 1.0, vLLM's when a checkpoint carries none
        self.k_scale = self.v_scale = 1.0
        self.matmul_precision = matmul_precision
        self.bf16_inputs = matmul_precision == "bf16"   # matmul inputs rounded to bf16 (reference/matmul.py)
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
        # x's bf16 planes for gemm_pipelined (prefill and large batches), for the widest matmul input
        self.planes = empty(gemm_pipelined.workspace_size(t, max(c.hidden_size, c.q_size, c.intermediate_size),
                                                          self.bf16_inputs), np.uint16)
        # split-K partial sums and tile counters of the skinny GEMMs (decode batches; gemm_pipelined), the
        # counters zero (each launch leaves them so); the simulator's engine takes the tiled SIMT GEMM instead
        weight_shapes = [(c.q_size + 2 * c.kv_size, c.hidden_size, False), (c.hidden_size, c.q_size, False),
                         (2 * c.intermediate_size, c.hidden_size, True), (c.hidden_size, c.intermediate_size, False),
                         (c.vocab_size, c.hidden_size, False)]
        partials, counters = matmul_policy.split_workspace_sizes(weight_shapes, self.bf16_inputs)
        self.split_workspace = None if SIMULATOR else (empty(partials, f32),
                                                       cuda.to_device(np.zeros(counters, np.int32)))
        # the MLP's act as the down projection's planes, written by the gate/up GEMM (matmul.mlp)
        self.act_planes = empty((gemm_pipelined.pieces(self.bf16_inputs) * t, c.intermediate_size), np.uint16)
        self.last = empty((s, c.hidden_size), f32)
        self.logits = empty((s, c.vocab_size), f32)
        self.tokens = empty(s, np.int32)                  # the last launched step's samples
        # the prefixes of these buffers a step of (tokens, sampled rows) uses, made once per size: a slice
        # of a Numba device array costs tens of us, and a new array object is typed afresh at each launch.
        # NOTE: a plain dict, not an lru_cache of a bound method, which would keep the runner (and its GPU
        # memory) alive in a reference cycle until the garbage collector runs
        self._prefix_cache: dict[tuple[int, int], dict] = {}
        # two host copies of them, so a step's tokens can be read while the next step's are on their way
        self.tokens_host = [cuda.pinned_array(s, np.int32) for _ in range(2)]
        # the split argmax's per-chunk winners (sampling_policy.argmax_workspace_size)
        self.argmax_workspace = empty(sampling_policy.argmax_workspace_size(s, c.vocab_size), np.int32)
        # the split sample's histograms, row state and partials (sampling_policy.sample_workspace_size)
        self.sample_workspace = empty(sampling_policy.sample_workspace_size(s, c.vocab_size), np.uint64)
        self._features: dict | None = None   # the penalties', logprobs' and block copies' buffers (_feature)

        itemsize = kv_format.DTYPES[kv_cache_dtype].itemsize
        per_block = 2 * c.num_layers * block_size * c.kv_size * itemsize
        self.num_blocks = num_blocks or self._blocks_that_fit(per_block, gpu_memory_utilization)
        max_width = min(-(-c.max_position_embeddings // block_size), self.num_blocks)
        self.inputs = StepInputs(t, s, max_width)
        # split-K decode attention's partials, for every batch up to s sequences and tables up to max_width
        self.attn_workspace = empty(max(1, attention_policy.decode_workspace_size(
            s, c.num_heads, c.num_kv_heads, c.head_dim, max_width)), f32)
        self.stream = cuda.stream()
        self.tokens_out = [PinnedCopy(host, self.tokens, self.stream) for host in self.tokens_host]
        self.token_events = [cuda.event(), cuda.event()]
        self._slot = 0
        self._thread = threading.get_ident()   # a thread in which the device's context is current
        # NOTE: the simulator cannot capture graphs; there every step launches eagerly.
        self.use_graphs = not enforce_eager and not SIMULATOR
        self.batch_buckets, self.width_buckets = batch_buckets(s), width_buckets(max_width)
        self.graphs: dict[tuple[int, int, bool], CUDAGraph] = {}
        # trace(layer, name, device array), when set, sees the step's intermediate results as they are written
        # (reference.llama.TRACE_POINTS; eager steps only: tools/compare_layers.py)
        self.trace = None
        shape = (self.num_blocks, block_size, c.num_kv_heads, c.head_dim)
        dtype = kv_format.DTYPES[kv_cache_dtype]
        self.k_cache = [empty(shape, dtype) for _ in range(c.num_layers)]
        self.v_cache = [empty(shape, dtype) for _ in range(c.num_layers)]
        print(f"tinyvllm: KV cache ({kv_cache_dtype}): {self.num_blocks} blocks of {block_size} tokens = "
              f"{self.num_blocks * block_size} tokens ({self.num_blocks * per_block / 2**30:.2f} GiB)", file=sys.stderr)

    def _blocks_that_fit(self, per_block: int, utilization: float) -> int:
        if SIMULATOR:
            return SIMULATOR_KV_BLOCKS
        free, total = cuda.current_context().get_memory_info()
        budget = total * utilization - (total - free)
        blocks = int(budget // per_block)
        if blocks < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                               f"{total / 2**30:.1f} GiB, gpu_memory_utilization {utilization}")
        return blocks

    def launch(self, scheduled: list[ScheduledSequence], chain_src=None):
        """Start one step on the GPU and return at once (a handle for collect()). chain_src: per new token,
        the row of the previous launched step's samples that is its id, -1 for the packed id."""
        if self._thread != threading.get_ident():
            self._enter_thread()
        batch, sampling = pack(scheduled, self.block_size)
        t, s, n = len(batch.token_ids), len(scheduled), len(batch.logits_indices)
        if t > self.max_tokens or s > self.max_seqs:
            raise RuntimeError(f"batch of {t} tokens / {s} sequences exceeds the runner's buffers "
                               f"({self.max_tokens} / {self.max_seqs})")
        mode = SamplingMode(bool(np.all(sampling.temperature == 0)), sampling.processes_logits,
                            sampling.wants_logprobs)
        m = sampling.num_prompt_rows
        features = self._feature() if mode.penalties or mode.logprobs or m else None
        copies = block_copies(scheduled)
        if len(copies):
            self._copy_blocks(copies)
        if sampling.entries is not None and len(sampling.entries) > self.inputs.entry_capacity:
            self._grow_entries(len(sampling.entries))
        width = batch.block_tables.shape[1]
        # A pure decode step (one new token per sequence, each sampled) runs as a CUDA graph, padded to
        # its bucket; anything else (prefill chunks, eager mode) launches kernel by kernel.
        key = None
        if self.use_graphs and t == s == n and not m:
            b, w = _bucket(s, self.batch_buckets), _bucket(width, self.width_buckets)
            key, shape = (b, w, mode), StepShape(b, b, b, w)
        else:
            shape = StepShape(t, s, n, width, m)
        self.inputs.write(shape, batch, sampling, chain_src)
        self.inputs.upload(shape, self.stream)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            max_q_len = int(np.diff(batch.cu_seqlens_q).max())
            record = partial(self._forward, self.inputs.views(shape), shape, max_q_len, mode)
            # compiles what the capture below needs, and runs this step
            record(self.stream, chained=chain_src is not None)
            if key is not None:
                self.stream.synchronize()
                self.graphs[key] = CUDAGraph(partial(record, chained=True), self.stream)
        self._slot ^= 1
        if n:
            self.tokens_out[self._slot].to_host(4 * n)  # the samples, behind the step in the stream
        logprob_rows = n if mode.logprobs else 0
        if features is not None:
            hosts, copiers = features["hosts"][self._slot], features["out"][self._slot]
            for host, copier, rows in zip(hosts, copiers, (logprob_rows,) * 3 + (m,) * 3):
                if rows:  # ids, values, ranks: rows of each, behind the step in the stream
                    copier.to_host(rows * host.nbytes // len(host))
        self.token_events[self._slot].record(self.stream)
        return n, self._slot, logprob_rows, m

    def _enter_thread(self) -> None:
        """Make the device's context current in the calling thread (the server steps the engine in a thread of
        its own). NOTE: a step's copies and launches are direct driver calls (cuda_kernels/driver.py), which
        fail in a thread with no current context (CUDA_ERROR_INVALID_CONTEXT); a Numba call makes Numba push
        the primary context there, where it stays."""
        if not SIMULATOR:
            cuda.current_context()
        self._thread = threading.get_ident()

    def collect(self, handle) -> list[int]:
        """Wait for a launched step; its sampled tokens, one per sampled row (tinyvllm/batch.py)."""
        n, slot = handle[:2]
        self.token_events[slot].synchronize()
        return self.tokens_host[slot][:n].tolist()

    def execute(self, scheduled: list[ScheduledSequence]) -> list[int]:
        return self.collect(self.launch(scheduled))

    def _forward(self, v: dict, shape: StepShape, max_q_len: int, mode: SamplingMode, stream, chained: bool) -> None:
        """Launch one step's kernels on `stream`: the model on shape.tokens tokens, then sampling. chained:
        first copy the previous step's samples into the input ids where chain_src says (always in a graph,
        which serves chained and unchained steps alike)."""
        c = self.config
        t, _, n, _, m = shape
        mode = mode if isinstance(mode, SamplingMode) else SamplingMode(bool(mode))
        ids, pos, slots, tables, ctx = (v[k] for k in ("token_ids", "positions", "slot_mapping", "block_tables",
                                                        "context_lens"))
        p = self._prefixes(t, n)
        x, h, sub, q, attn, act = p["x"], p["h"], p["sub"], p["q"], p["attn"], p["act"]
        decode = max_q_len == 1
        mm = partial(matmul.matmul, bf16_inputs=self.bf16_inputs, workspace=self.planes,
                     split_workspace=self.split_workspace)
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        trace = self.trace or _no_trace
        if chained:
            embedding.chain_tokens(ids, self.tokens, v["chain_src"], stream)
        embedding.embedding(ids, self.embed, x, stream)
        trace(-1, "embedding", x)
        # where the QKV, O and gate/up GEMMs read their input's bf16 planes, the kernels before them write the
        # planes too (the norms; for O the decode attention): no conversion kernel between them
        planes_qkv = self._planes_for(t, c.q_size + 2 * c.kv_size, c.hidden_size, False)
        planes_o = self._planes_for(t, c.hidden_size, c.q_size, False) if decode else None
        planes_mlp = self._planes_for(t, 2 * c.intermediate_size, c.hidden_size, True)
        for i, layer in enumerate(self.layers):
            if i == 0:
                rmsnorm.rmsnorm(x, layer["input_norm"], c.rms_norm_eps, h, stream, planes_qkv, self.bf16_inputs)
            else:
                rmsnorm.fused_add_rmsnorm(sub, x, layer["input_norm"], c.rms_norm_eps, h, stream, planes_qkv,
                                          self.bf16_inputs)
            trace(i, "input_norm", h)
            matmul.matmul_rope_kv_write(h, layer["qkv"], pos, self.cos, self.sin, self.k_cache[i], self.v_cache[i],
                                        slots, q, p["qkv"], stream, bf16_inputs=self.bf16_inputs,
                                        workspace=self.planes, split_workspace=self.split_workspace,
                                        planes_ready=planes_qkv is not None, **scales)
            trace(i, "q", q)
            trace(i, "k", self.k_cache[i])
            trace(i, "v", self.v_cache[i])
            if decode:
                attention_policy.decode_attention(q, self.k_cache[i], self.v_cache[i], tables, ctx, self.scale,
                                                  attn, stream, workspace=self.attn_workspace, planes=planes_o,
                                                  bf16_inputs=self.bf16_inputs, **scales)
            else:
                attention_policy.prefill_attention(q, self.k_cache[i], self.v_cache[i], tables, v["cu_seqlens_q"],
                                                   ctx, self.scale, attn, max_q_len, stream, **scales)
            trace(i, "attention", attn)
            mm(p["attn_rows"], layer["o"], sub, stream, planes_ready=planes_o is not None)
            trace(i, "o_proj", sub)
            rmsnorm.fused_add_rmsnorm(sub, x, layer["post_norm"], c.rms_norm_eps, h, stream, planes_mlp,
                                      self.bf16_inputs)
            trace(i, "post_norm", h)
            matmul.mlp(h, layer["gate_up"], layer["down"], sub, act, p["gate_up"], stream, bf16_inputs=self.bf16_inputs,
                       workspace=self.planes, act_planes=p["act_planes"], split_workspace=self.split_workspace,
                       planes_ready=planes_mlp is not None)
            trace(i, "mlp", sub)
        if n == 0 and m == 0:
            return
        # A decode step samples every row in order (logits_indices = 0 .. t - 1): the LM head multiplies h itself,
        # with no gather, and its bf16 planes where it reads them, written by the final norm.
        direct = decode and n == t
        planes_lm = self._planes_for(t, c.vocab_size, c.hidden_size, False) if direct else None
        rmsnorm.fused_add_rmsnorm(sub, x, self.final_norm, c.rms_norm_eps, h, stream, planes_lm, self.bf16_inputs)
        if n:
            self._sample(v, p, h, mm, mode, stream, direct, planes_lm is not None)
        if m:
            self._prompt_logprobs(v, m, h, mm, stream)

    def _sample(self, v: dict, p: dict, h, mm, mode: SamplingMode, stream, direct: bool, planes_ready: bool) -> None:
        """The sampled rows: LM head, then (penalties ->) argmax or sample (-> raw logits back, logprobs). direct:
        the sampled rows are h's rows in order (no gather); planes_ready: h's bf16 planes are in the workspace."""
        last, logits, tokens = p["last"], p["logits"], p["tokens"]
        if direct:
            last = h
        else:
            embedding.gather_rows(h, v["logits_indices"], last, stream)
        if self.trace is not None:
            self.trace(-1, "final_norm", last)
        mm(last, self.lm_head, logits, stream, planes_ready=planes_ready)
        if self.trace is not None:
            self.trace(-1, "logits", logits)
        n = logits.shape[0]
        f = self._feature_rows(n) if mode.penalties or mode.logprobs else None
        undo = (v["entry_offsets"], v["entries"], self._features["saved"], f["extra_token"], f["extra_saved"]) \
            if mode.penalties else None
        if mode.penalties:
            penalties.apply_penalties(logits, v["token_ids"], v["logits_indices"], v["pending"],
                                      v["repetition_penalty"], v["presence_penalty"], v["frequency_penalty"], *undo,
                                      stream)
        if mode.greedy:
            sampling_policy.greedy(logits, tokens, stream, workspace=self.argmax_workspace)
        else:
            sampling_policy.sample(logits, v["temperature"], v["top_k"], v["top_p"], v["min_p"], v["uniform"],
                                   tokens, stream, workspace=self.sample_workspace)
        if mode.logprobs:
            if mode.penalties:  # the logprobs are the model's own: the raw logits back first
                penalties.restore_logits(logits, *undo, stream)
            logprobs.top_logprobs(logits, tokens, v["num_logprobs"], *f["sampled"], stream)

    def _prompt_logprobs(self, v: dict, m: int, h, mm, stream) -> None:
        """LM head and logprobs of the m prompt rows that ask (prompt_logprobs), max_num_seqs rows at a time
        through the sampled rows' buffers (this runs after their sampling, in stream order)."""
        out = self._features["prompt"]
        for start in range(0, m, self.max_seqs):
            end = min(m, start + self.max_seqs)
            last, logits = self.last[: end - start], self.logits[: end - start]
            embedding.gather_rows(h, v["prompt_rows"][start:end], last, stream)
            mm(last, self.lm_head, logits, stream)
            logprobs.top_logprobs(logits, v["prompt_targets"][start:end], v["prompt_num_logprobs"][start:end],
                                  *(a[start:end] for a in out), stream)

    def prepare(self, shape: StepShape, max_q_len: int, mode: SamplingMode) -> None:
        """Compile (or load from the kernel cache) every kernel a step of this shape and mode launches,
        running none of them (tinyvllm/warmup.py)."""
        if mode.penalties or mode.logprobs or shape.prompt_rows:
            self._feature()
        with preparing():
            self._forward(self.inputs.views(shape), shape, max_q_len, mode, self.stream, chained=True)

    def prepare_block_copy(self) -> None:
        """Compile (or load) the copy-on-write kernel of parallel sampling (n > 1), running nothing (warm-up):
        it launches outside the step, before the first step that writes into a shared block."""
        with preparing():
            for cache in (self.k_cache[0], self.v_cache[0]):
                kv_cache.copy_blocks(cache, self._feature()["pairs"][:1], self.stream)

    def capture(self, batch: int, width: int, mode: SamplingMode) -> None:
        """Capture the decode graph of a (batch, width) bucket and mode now, if it is not yet: the graph is
        recorded from the launches alone (its kernels ready, see prepare); it reads its inputs when replayed."""
        key = (batch, width, mode)
        if self.use_graphs and key not in self.graphs:
            shape = StepShape(batch, batch, batch, width)
            self.prepare(shape, 1, mode)
            self.graphs[key] = CUDAGraph(partial(self._forward, self.inputs.views(shape), shape, 1, mode,
                                                 chained=True), self.stream)

    def _planes_for(self, t: int, n: int, k: int, gated: bool):
        """The planes workspace, if the GEMM of t rows by a weight (n, k) reads x's bf16 planes (gemv_tc,
        gemm_pipelined, gemm_wgmma or gemm_tma: matmul_policy.reads_planes), which the kernel before it then
        writes, else None."""
        reads = matmul_policy.reads_planes(t, n, k, self.bf16_inputs, gated, self.split_workspace)
        return self.planes if reads else None

    def _prefixes(self, t: int, n: int) -> dict:
        """The first t rows of the token buffers and the first n of the sampled-row ones, as device arrays."""
        p = self._prefix_cache.get((t, n))
        if p is not None:
            return p
        if len(self._prefix_cache) >= PREFIX_CACHE_SIZES:
            self._prefix_cache.clear()
        p = self._prefix_cache[t, n] = {name: getattr(self, name)[:t]
                                         for name in ("x", "h", "sub", "q", "attn", "act", "qkv", "gate_up")}
        p["attn_rows"] = p["attn"].reshape(t, self.config.q_size)
        p["act_planes"] = self.act_planes[:gemm_pipelined.pieces(self.bf16_inputs) * t]
        p.update({name: getattr(self, name)[:n] for name in ("last", "logits", "tokens")})
        return p


    # -- penalties, logprobs and block copies -----------------------------------------------------------------

    def _feature(self) -> dict:
        """The buffers of penalties, logprobs and copy-on-write, made by the first step that needs them:
        the penalties' undo (saved: one logit per entry of the step inputs' capacity; extra_*: one per row),
        the logprobs outputs of the sampled rows and of up to max_num_batched_tokens prompt rows, two pinned
        host copies of those (a step's are read while the next step's are on their way), and the copy pairs."""
        if self._features is None:
            s, t, w, empty = self.max_seqs, self.max_tokens, LOGPROB_WIDTH, cuda.device_array
            shapes = (((s, w), np.int32), ((s, w), np.float32), ((s,), np.int32),
                      ((t, w), np.int32), ((t, w), np.float32), ((t,), np.int32))
            device = [empty(shape, dtype) for shape, dtype in shapes]
            hosts = [[cuda.pinned_array(shape, dtype) for shape, dtype in shapes] for _ in range(2)]
            self._features = {
                "saved": empty(self.inputs.entry_capacity, np.float32),
                "extra_token": empty(s, np.int32), "extra_saved": empty(s, np.float32),
                "sampled": tuple(device[:3]), "prompt": tuple(device[3:]), "hosts": hosts,
                "out": [[PinnedCopy(hst, dev, self.stream) for hst, dev in zip(slot, device)] for slot in hosts],
                "pairs": empty((s, 2), np.int32), "rows": {},
            }
        return self._features

    def _feature_rows(self, n: int) -> dict:
        """The first n rows of the per-row feature buffers, made once per n (see _prefixes)."""
        rows = self._features["rows"]
        if n not in rows:
            f = self._features
            rows[n] = {"extra_token": f["extra_token"][:n], "extra_saved": f["extra_saved"][:n],
                       "sampled": tuple(a[:n] for a in f["sampled"])}
        return rows[n]

    def collect_logprobs(self, handle) -> StepLogprobs | None:
        """The logprobs of a launched step (after collect): ids, values and ranks of its sampled rows and of
        its prompt rows, copied out of the pinned buffers (the step after next reuses them)."""
        _, slot, rows, m = handle
        if not rows and not m:
            return None
        self.token_events[slot].synchronize()
        host = self._features["hosts"][slot]
        return StepLogprobs(sampled=tuple(a[:rows].copy() for a in host[:3]) if rows else None,
                            prompt=tuple(a[:m].copy() for a in host[3:]) if m else None)

    def _copy_blocks(self, pairs: np.ndarray) -> None:
        """Copy-on-write before the step: blocks pairs[:, 1] <- pairs[:, 0] in every layer's K and V cache."""
        d_pairs = self._feature()["pairs"][: len(pairs)]
        d_pairs.copy_to_device(pairs, stream=self.stream)
        for cache in (*self.k_cache, *self.v_cache):
            kv_cache.copy_blocks(cache, d_pairs, self.stream)

    def _grow_entries(self, entries: int) -> None:
        """A step with more penalty entries than the step inputs hold: bigger buffers (after every queued step
        is done with the old ones), and graphs captured again, since they hold the old buffers' addresses."""
        self.stream.synchronize()
        self.inputs.grow_entries(entries)
        self._feature()["saved"] = cuda.device_array(self.inputs.entry_capacity, np.float32)
        self.graphs.clear()


def _bucket(size: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `size` (buckets ascending, the last one the capacity)."""
    return next(b for b in buckets if b >= size)


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """CUDA-graph batch sizes: powers of two up to 128, then steps of 64, up to max_num_seqs.
    NOTE: few buckets, because the warm-up captures every one of them before the engine reports ready. The
    padding they cost is small: the decode GEMMs' tiles already round M up to 16, 32, 64 or 128 rows
    (matmul_policy.PIPELINED_SKINNY_TILES), and a padding row's attention is empty (context length 0)."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_num_seqs] + list(range(192, max_num_seqs, 64))
    return tuple(sizes) + (max_num_seqs,)


def width_buckets(max_width: int) -> tuple[int, ...]:
    """Block-table widths graphs are captured for: 16, 32 and 64 blocks, then x4 (256, 1024, ...), up to
    max_width. Coarse for the same reason as batch_buckets.
    NOTE: the width is the shape decode attention's policy sees (attention_policy.decode_partitions): a
    table padded from 17 to 64 blocks would split a 272-token context into 4 partitions (three of them near
    empty) and add the reduce kernel, where 32 blocks take one pass. Hence the x2 steps while contexts are
    short."""
    sizes = [w for w in (16, 32) if w < max_width]
    w = 64
    while w < max_width:
        sizes.append(w)
        w *= 4
    return tuple(sizes) + (max_width,)
