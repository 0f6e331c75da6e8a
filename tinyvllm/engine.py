"""LLMEngine: requests in, tokens out, one scheduled step at a time (the layer servers build on).

    engine = LLMEngine.from_options(model="path/to/model")
    rid = engine.add_request("Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.request_id, out.new_text, out.finished)

A step asks the scheduler for a batch, has the runner (CPU reference or CUDA) compute it and sample, then
appends the sampled tokens, checks stop conditions, registers newly full KV blocks with the prefix cache,
and frees the blocks of finished sequences.

Async scheduling (`async_scheduling`, on by default; vLLM has the same option): while the GPU computes a
decode step, the host would idle until its tokens come back, and the GPU would idle while the host then
prepares the next step. When the next step can only be the decode of the same sequences (nothing waits
that could be admitted, no sequence ends by length, blocks suffice without preemption), it is scheduled and
launched before this step's tokens are read: its input ids are this step's samples, which stay on the
device (the runner's `chain_src`). The host then reads and processes this step's tokens while the next one
runs. A sequence that stops on a stop token or string meanwhile has one token computed in vain, which is
dropped. Until a step's tokens are read, the sequence holds a PENDING placeholder where each goes.

Text is optional: a request added with `detokenize=False` gets only token ids (`step_tokens()`), and whoever
reads them turns them into text and looks for its stop strings (the server's front end, in another process:
tinyvllm/server/engine_core.py, as vLLM's engine core leaves detokenization to its API server). It tells the
engine where a stop string ended a completion (`stop_completion`).

A request with n > 1 is n sequences: the first computes the prompt, and in the step that draws its first
token the other n - 1 draw theirs from the same logits and take shares of its KV blocks (tinyvllm/sequence.py,
block_manager.py). Its RequestOutput holds the n completions. logprobs / prompt_logprobs come back from the
runner beside the tokens (`collect_logprobs`) as token ids, log-probabilities and ranks; here they become
vLLM's {token id: Logprob} dicts.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Sequence as SequenceABC
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from reference.kv_format import FORMATS as KV_CACHE_DTYPES
from reference.llama import MATMUL_PRECISIONS
from tinyvllm.batch import prompt_logprob_range
from tinyvllm.block_manager import BlockManager
from tinyvllm.config import ModelConfig
from tinyvllm.scheduler import ScheduledSequence, Scheduler
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import PENDING, Sequence, SequenceStatus
from tinyvllm.text_stream import TextStream
from tinyvllm.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request the engine cannot serve: empty, too long for the context, malformed."""


@dataclass
class Logprob:
    """One token's log-probability (the model's log-softmax, before penalties and temperature), its rank
    among the vocabulary (1 = most likely) and its text (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class TokenIdsSoFar(SequenceABC):
    """The first `count` ids of a running sequence's output list, without copying them.

    A streamed request gets an output every step; a copy of its ids each time costs O(length) per token, which
    at 256 sequences of ~500 tokens was the largest host cost of a step in streaming mode. The list is only ever
    appended to, and an id is not changed once read back (a PENDING slot is filled once; a finished sequence's
    list is cut after its last id), so its first `count` entries stay what they were: a view is a snapshot.
    Reads like a list (len, indexing, slicing, iteration, ==); a finished request's output holds a real list."""

    __slots__ = ("_ids", "_count")

    def __init__(self, ids: list[int], count: int):
        self._ids, self._count = ids, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._ids[:self._count][index] if index.step not in (None, 1) else \
                self._ids[slice(*index.indices(self._count))]
        if not -self._count <= index < self._count:
            raise IndexError("token index out of range")
        return self._ids[index % self._count]

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, TokenIdsSoFar)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(self._ids[:self._count])


# step_tokens()'s record of one token read back: (request id, completion index, token id, finish reason or None,
# extra: None, or a dict of what else the reader needs then: see LLMEngine._row_extra). A plain tuple: a step
# has hundreds, which the engine core sends to another process.
TokenRow = tuple[str, int, int, "str | None", "dict | None"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int] | TokenIdsSoFar    # a list once finished; while streaming, a view (no copy)
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None   # per token: itself and the N most likely (logprobs=N)
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_text: str = ""                       # text released by the step that produced this output
    num_cached_tokens: int = 0               # prompt tokens served by the prefix cache
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token (the first: None)

    @property
    def text(self) -> str:
        return self.outputs[0].text


@dataclass
class EngineOptions:
    """Engine settings (vLLM's names where they exist)."""

    backend: str = "auto"                     # auto | cpu | cuda
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None          # overrides the size computed from memory
    enable_prefix_caching: bool = True
    scheduler: str = "continuous"             # continuous | static
    seed: int = 0                             # draws the seeds of requests that do not set one
    enforce_eager: bool = False               # CUDA backend: no CUDA graphs, every kernel launched from Python
    # auto | fp32 | bf16: bf16 rounds the matmuls' inputs to bf16 (vLLM's numerics); auto is bf16 on the CUDA
    # engine (its fast path, what the benchmarks measure) and fp32 on the CPU reference (exact inputs)
    matmul_precision: str = "auto"
    # bf16 | fp32 | fp8: the KV cache's format (vLLM's kv_cache_dtype; reference/kv_format.py). bf16 rounds K
    # and V to bf16; fp32 stores them unrounded (GPU and reference then differ by summation order only);
    # fp8 stores e4m3 with per-tensor scales (1.0), half the bytes of bf16: twice the tokens in the same memory
    kv_cache_dtype: str = "bf16"
    async_scheduling: bool = True             # launch the next decode step before reading this one's tokens
    # CUDA backend: make every kernel ready and capture the decode graphs before the engine is returned
    # (tinyvllm/warmup.py), so no request waits on either; None: on a GPU yes, in Numba's simulator no
    warmup: bool | None = None

    def __post_init__(self):
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {self.backend!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.matmul_precision not in ("auto", *MATMUL_PRECISIONS):
            raise ValueError(f"matmul_precision must be 'auto' or one of {MATMUL_PRECISIONS}, "
                             f"got {self.matmul_precision!r}")
        # vLLM's spellings of the same formats: "auto" (the model's dtype, bf16 here) and "fp8_e4m3"
        self.kv_cache_dtype = {"auto": "bf16", "fp8_e4m3": "fp8"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (or 'auto', 'fp8_e4m3'), "
                             f"got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


def _warms_up(opts: EngineOptions) -> bool:
    if opts.warmup is not None:
        return opts.warmup
    from cuda_kernels.compat import SIMULATOR

    return not SIMULATOR


@dataclass
class _Launched:
    """A step the runner was given: what it computes, where each sampled token goes, the runner's handle."""

    scheduled: list[ScheduledSequence]
    sampled: list[int | None]   # per scheduled sequence: the output index of the token it samples, or None
    handle: object
    rows: list[tuple[Sequence, int]] = field(default_factory=list)  # per sampled row: its sequence, output index
    prompt_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)  # prompt logprobs [first, stop)
    wants_logprobs: bool = False


class LLMEngine:
    def __init__(self, model_dir: Path, tokenizer: Tokenizer, config: ModelConfig, runner, options: EngineOptions):
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.config = config
        self.runner = runner
        self.options = options
        capacity = runner.num_blocks * runner.block_size
        self.max_model_len = min(config.max_position_embeddings, capacity, options.max_model_len or capacity)
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, options.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, options.max_num_seqs, options.max_num_batched_tokens,
                                   options.scheduler)
        self._streams: dict[int, TextStream] = {}
        self._prompts: dict[str, str | None] = {}
        self._by_request: dict[str, list[Sequence]] = {}   # a request's n sequences, completion 0 first
        self._num_special = 0   # unfinished requests with n > 1 or prompt logprobs (each step looks for them)
        self.num_generated_tokens = 0           # over the engine's life: progress bars read it
        self._inflight: _Launched | None = None  # a step launched ahead, its tokens not read yet
        # entered while step() waits for the runner's tokens (on the GPU, the device): the server's engine loop
        # lets its event loop have the interpreter then, and only then
        self.device_wait: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._ids = itertools.count()
        self._seeds = random.Random(options.seed)
        self._eos = set(config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self._eos.add(tokenizer.eos_token_id)

    @classmethod
    def from_options(cls, model: str | os.PathLike | None = None, **options) -> "LLMEngine":
        from tinyvllm.runners import make_runner
        from tinyvllm.default_model import default_model_dir
        from tinyvllm.weights import load_weights

        opts = EngineOptions(**options)
        model_dir = Path(model) if model is not None else default_model_dir()
        config = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        runner = make_runner(opts, config, load_weights(model_dir, config))
        if runner.name == "cuda" and _warms_up(opts):
            from tinyvllm.warmup import warm_up

            warm_up(runner)
        return cls(model_dir, tokenizer, config, runner, opts)

    # -- requests ---------------------------------------------------------------------------------------

    def encode_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt as text and token ids: a string (raw text), token ids, or chat messages (templated)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.apply_chat_template(list(prompt)), self.tokenizer.encode_chat(list(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
            return None, list(prompt)
        raise RequestError("a prompt must be a string, a list of token ids, or a list of chat messages "
                           f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}")

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    final_only: bool = False, detokenize: bool = True) -> str:
        """Queue a request; its outputs come from step(). `final_only` (vLLM's FINAL_ONLY output kind): step()
        reports the request only when it finishes, and its text is decoded once, at the end. `detokenize` False:
        no text and no stop strings here; its tokens come from step_tokens() (see the module docstring)."""
        params = params or SamplingParams()
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise RequestError("the prompt is empty: nothing to generate from")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, but at most {self.max_model_len - 1} fit "
                               f"(max_model_len {self.max_model_len}: the model's context and the KV cache)")
        vocab = self.config.vocab_size
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise RequestError(f"SamplingParams.logit_bias has token id {bad[0]}, outside the vocabulary [0, {vocab})")
        if params.n > self.scheduler.max_num_seqs:
            raise RequestError(f"SamplingParams.n is {params.n}, but at most max_num_seqs = "
                               f"{self.scheduler.max_num_seqs} sequences run at once")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._by_request:
            raise RequestError(f"request id {request_id!r} is already in use")
        # masked out of the draws until min_tokens (ids outside the vocabulary cannot be drawn anyway)
        stop_ids = frozenset(self._stop_ids(params))
        masked = tuple(sorted(t for t in stop_ids if t < vocab)) if params.min_tokens else ()
        seqs = []
        for index in range(params.n):
            # completion i of a seeded request draws from seed + i (vLLM's), so each has its own stream
            seed = params.seed + index if params.seed is not None else self._seeds.getrandbits(63)
            seqs.append(Sequence(request_id, ids, params, seed, index=index, masked_ids=masked, stop_ids=stop_ids))
            if detokenize:
                self._streams[seqs[-1].seq_id] = TextStream(self.tokenizer, ids, params.stop, final_only=final_only)
        seqs[0].forks = seqs[1:]
        self._num_special += params.n > 1 or params.prompt_logprobs is not None
        self._by_request[request_id] = seqs
        self._prompts[request_id] = text
        self.scheduler.add(seqs[0])
        return request_id

    def abort(self, request_id: str) -> None:
        seqs = self._by_request.get(request_id)
        if seqs is not None:
            for seq in seqs:  # completion 0 first: it frees the slots of forks it still holds
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
            self._forget(seqs[0])

    def stop_completion(self, request_id: str, index: int, num_tokens: int) -> None:
        """End completion `index` of a request after its first `num_tokens` output tokens, finish reason "stop":
        its reader found a stop string there (a request added with detokenize=False). Tokens computed after
        those are dropped; its KV blocks are freed now."""
        seqs = self._by_request.get(request_id)
        if seqs is None or seqs[index].is_finished:
            return
        self._end_completion(seqs[index], num_tokens, "stop")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: the requests it changed, as outputs with their text (see RequestOutput)."""
        outputs = self._text_outputs(self._read_step())
        self._settle_inflight()
        return outputs

    def step_tokens(self) -> list[TokenRow]:
        """One step, ids only (requests added with detokenize=False): a TokenRow per token read back."""
        rows = []
        for seq, token, count, reason in self._read_step():
            if reason is not None:
                self._end_completion(seq, count, reason)
            rows.append((seq.request_id, seq.index, token, reason, self._row_extra(seq, count, reason)))
        self._settle_inflight()
        return rows

    def _read_step(self) -> list[tuple[Sequence, int, int, str | None]]:
        """Launch a step (or take the one launched ahead), launch the next one when it can, and read this one's
        tokens back: per token, its sequence, the token, its count among the outputs, and why the sequence ends
        with it by id or length (None: it does not, or only a stop string can tell)."""
        if self._inflight is None:
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return []
            current = self._launch(scheduled)
        else:
            current, self._inflight = self._inflight, None
        if self.options.async_scheduling:
            self._inflight = self._launch_next_decode(current)
        with self.device_wait:
            tokens = self.runner.collect(current.handle)
        return self._read_tokens(current, tokens)

    def _settle_inflight(self) -> None:
        """After a step's sequences have stopped: a step launched ahead with none of them left is only waited for."""
        if self._inflight is not None and not self.scheduler.has_unfinished():
            with self.device_wait:
                self.runner.collect(self._inflight.handle)  # every sequence of it stopped: nothing to read
            self._inflight = None

    def _launch(self, scheduled: list[ScheduledSequence], chain_src=None) -> "_Launched":
        """Start a step on the runner and account for it: the sequences' new tokens are computed (their KV
        is written in stream order) and each sampling sequence gets a PENDING output token. A sequence that
        draws its first token with completions still to fork has them draw theirs from its row, and forks them
        (they share its blocks from then on)."""
        prompt_rows = []
        for item in scheduled if self._num_special else ():  # requests with n > 1 or prompt logprobs
            seq = item.seq
            if seq.forks and item.samples:
                item.forks = list(seq.forks)
            if seq.features and seq.params.prompt_logprobs is not None:
                first, stop = prompt_logprob_range(item)
                if stop > first:
                    prompt_rows.append((seq, first, stop))
        handle = self.runner.launch(scheduled, chain_src)
        sampled, rows = [], []
        wants = bool(prompt_rows)
        for item in scheduled:
            seq = item.seq
            samples = item.samples  # NOTE: before the accounting below, which changes what it reads
            seq.num_computed_tokens += item.num_new_tokens
            sampled.append(len(seq.output_token_ids) if samples else None)
            if samples:
                rows.append((seq, len(seq.output_token_ids)))
                seq.output_token_ids.append(PENDING)
                wants = wants or seq.logprobs is not None
            if item.forks:
                self.scheduler.add_forks(seq, item.forks)
                for child in item.forks:
                    rows.append((child, 0))
                    child.output_token_ids.append(PENDING)
                    child.prompt_logprobs_next = len(child.prompt_token_ids)  # completion 0 reports them
        for seq, _, stop in prompt_rows:
            seq.prompt_logprobs_next = stop
        return _Launched(scheduled, sampled, handle, rows, prompt_rows, wants)

    def _launch_next_decode(self, current: "_Launched") -> "_Launched | None":
        """Launch the step after `current` before its tokens are known, when that step can only be the decode
        of the same sequences (see the module docstring); None when it cannot be sure."""
        if any(index is None for index in current.sampled):
            return None  # a prefill chunk that samples nothing: the next step is the scheduler's to choose
        if len(current.rows) != len(current.scheduled):
            return None  # completions were forked: they are new to the scheduler's running list
        seqs, rows = [], []
        for row, (item, index) in enumerate(zip(current.scheduled, current.sampled)):
            if not self._ends_by_length(item.seq, index + 1):
                seqs.append(item.seq)
                rows.append(row)  # its input token is row `row` of current's samples
        nxt = self.scheduler.continue_decodes(seqs, len(current.scheduled) - len(seqs)) if seqs else None
        if nxt is None:
            return None
        return self._launch(nxt, np.asarray(rows, np.int32))

    def _read_tokens(self, current: "_Launched", tokens: list[int]) -> list[tuple[Sequence, int, int, str | None]]:
        """Put a step's sampled tokens (and logprobs) in place and check the stop conditions that need no text
        (see _read_step)."""
        logprobs = self.runner.collect_logprobs(current.handle) if current.wants_logprobs else None
        if current.prompt_rows:
            self._add_prompt_logprobs(current.prompt_rows, logprobs)
        for item, index in zip(current.scheduled, current.sampled):
            if index is None and not item.seq.is_finished:
                self.block_manager.register_full_blocks(item.seq)
        read = []
        for row, ((seq, index), token) in enumerate(zip(current.rows, tokens)):
            if seq.is_finished:
                continue  # stopped (or aborted) while this step ran: the token is not its
            seq.output_token_ids[index] = token
            if seq.counts_outputs:
                seq.output_counts[token] = seq.output_counts.get(token, 0) + 1
            if seq.logprobs is not None:
                self._add_logprobs(seq, logprobs, row)
            count = index + 1
            self.num_generated_tokens += 1
            seq.last_token_time = time.perf_counter()
            if seq.first_token_time is None:
                seq.first_token_time = seq.last_token_time
            self.block_manager.register_full_blocks(seq)
            read.append((seq, token, count, self._stop_reason(seq, token, count)))
        return read

    def _finish(self, seq: Sequence, count: int, reason: str) -> None:
        del seq.output_token_ids[count:]  # a token the next step samples for it is not its
        self.scheduler.finish(seq, reason)

    def _end_completion(self, seq: Sequence, count: int, reason: str) -> None:
        """_finish, and forget the request once every completion of it has ended (a request whose reader takes
        token ids: no output of it is built later)."""
        self._finish(seq, count, reason)
        if all(s.is_finished for s in self._by_request[seq.request_id]):
            self._forget(seq)

    def _text_outputs(self, read) -> list[RequestOutput]:
        """The tokens read back as text, stop strings looked for; an output per request it changed (a final_only
        request: once, when it finishes)."""
        changed: dict[str, str] = {}  # request id -> completion 0's new text, in the order of their rows
        for seq, token, count, reason in read:
            stream = self._streams[seq.seq_id]
            new_text, reason = stream.advance(token, reason, check_stop=count > seq.params.min_tokens)
            if reason is not None:
                self._finish(seq, count, reason)
            elif stream.final_only:
                continue  # reported once, when it finishes
            text = changed.get(seq.request_id, "")
            changed[seq.request_id] = text + new_text if seq.index == 0 else text
        outputs = []
        for request_id, new_text in changed.items():
            seqs = self._by_request[request_id]
            finished = seqs[0].is_finished if len(seqs) == 1 else all(seq.is_finished for seq in seqs)
            if finished or not self._streams[seqs[0].seq_id].final_only:
                outputs.append(self._output(seqs, new_text))
            if finished:
                self._forget(seqs[0])
        return outputs

    @staticmethod
    def _row_extra(seq: Sequence, count: int, reason: str | None) -> dict | None:
        """What a TokenRow carries beyond the token, only where there is something: the token's logprobs, and on
        completion 0's first and last token the prompt tokens the prefix cache served (and prompt logprobs)."""
        extra = None
        if seq.logprobs is not None:
            extra = {"logprobs": seq.logprobs[count - 1], "cumulative_logprob": seq.cumulative_logprob}
        if seq.index == 0 and (count == 1 or reason is not None):
            extra = extra or {}
            extra["num_cached_tokens"] = seq.num_cached_prompt_tokens
            if count == 1 and seq.prompt_logprobs is not None:
                extra["prompt_logprobs"] = seq.prompt_logprobs
        return extra

    def _decoded(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _logprob_dict(self, ids, values, rank: int, num: int) -> dict[int, Logprob]:
        """vLLM's dict for one position: the chosen token (its own rank), then the num most likely (ranks 1..num;
        one of them may be the chosen token again, which then keeps that entry)."""
        out = {int(ids[0]): Logprob(float(values[0]), int(rank), self._decoded(int(ids[0])))}
        for k in range(num):
            token = int(ids[1 + k])
            if token < 0:  # the vocabulary is smaller than num
                break
            out[token] = Logprob(float(values[1 + k]), k + 1, self._decoded(token))
        return out

    def _add_logprobs(self, seq: Sequence, logprobs, row: int) -> None:
        ids, values, ranks = logprobs.sampled
        seq.logprobs.append(self._logprob_dict(ids[row], values[row], ranks[row], seq.params.logprobs))
        seq.cumulative_logprob += float(values[row, 0])

    def _add_prompt_logprobs(self, prompt_rows, logprobs) -> None:
        ids, values, ranks = logprobs.prompt
        row = 0
        for seq, first, stop in prompt_rows:
            for position in range(first, stop):  # the logits at `position` predict prompt token position + 1
                assert len(seq.prompt_logprobs) == position + 1
                seq.prompt_logprobs.append(self._logprob_dict(ids[row], values[row], ranks[row],
                                                              seq.params.prompt_logprobs))
                row += 1

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        return ids if params.ignore_eos else ids | self._eos

    def _stop_reason(self, seq: Sequence, token: int, count: int) -> str | None:
        """Why `seq` ends with `token` as its count-th output token, or None."""
        if count > seq.params.min_tokens and token in seq.stop_ids:
            return "stop"
        return "length" if self._ends_by_length(seq, count) else None

    def _ends_by_length(self, seq: Sequence, count: int) -> bool:
        """Whether `seq` is done once it has `count` output tokens, whatever they are."""
        return count >= seq.params.max_tokens or len(seq.prompt_token_ids) + count >= self.max_model_len

    def _output(self, seqs: list[Sequence], new_text: str) -> RequestOutput:
        """The request's state: its n completions, each up to its last token read back. new_text: what this
        step released of completion 0 (for n > 1 each completion's text is in outputs[i].text).
        NOTE: a streamed request gets one every step: at hundreds of streams this is a good part of a step's
        host time, hence the plain loops (no generator, nothing computed twice)."""
        completions = []
        finished = True
        for seq in seqs:
            ids = seq.output_token_ids
            count = len(ids)
            while count and ids[count - 1] == PENDING:  # launched, not read back yet
                count -= 1
            done = seq.status is SequenceStatus.FINISHED
            finished = finished and done
            completions.append(CompletionOutput(
                seq.index, self._streams[seq.seq_id].text, ids[:count] if done else TokenIdsSoFar(ids, count),
                seq.finish_reason, None if seq.logprobs is None else seq.logprobs[:count], seq.cumulative_logprob))
        first = seqs[0]
        if len(seqs) == 1:
            preemptions, last_time = first.num_preemptions, first.last_token_time
        else:
            preemptions = sum(seq.num_preemptions for seq in seqs)
            last_times = [seq.last_token_time for seq in seqs if seq.last_token_time is not None]
            last_time = max(last_times) if last_times else None
        return RequestOutput(
            request_id=first.request_id, prompt=self._prompts[first.request_id],
            prompt_token_ids=first.prompt_token_ids, outputs=completions, finished=finished, new_text=new_text,
            num_cached_tokens=first.num_cached_prompt_tokens, prompt_logprobs=first.prompt_logprobs,
            metrics={"preemptions": preemptions, "arrival_time": first.arrival_time,
                     "first_token_time": first.first_token_time, "last_token_time": last_time})

    def _forget(self, first: Sequence) -> None:
        seqs = self._by_request.pop(first.request_id, None)
        if seqs is None:
            return
        self._num_special -= first.params.n > 1 or first.params.prompt_logprobs is not None
        for seq in seqs:
            self._streams.pop(seq.seq_id, None)
        self._prompts.pop(first.request_id, None)

