"""LLMEngine: requests in, tokens out, one scheduled step at a time (the layer servers build on).

    engine = LLMEngine.from_options(model="path/to/model")
    rid = engine.add_request("Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.request_id, out.new_text, out.finished)

A step asks the scheduler for a batch, has the runner (CPU reference or CUDA) compute it and sample, then
appends the sampled tokens, checks stop conditions, registers newly full KV blocks with the prefix cache,
and frees the blocks of finished sequences.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from reference.llama import MATMUL_PRECISIONS
from tinyvllm.block_manager import BlockManager
from tinyvllm.config import ModelConfig
from tinyvllm.scheduler import Scheduler
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import Sequence
from tinyvllm.text_stream import TextStream
from tinyvllm.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request the engine cannot serve: empty, too long for the context, malformed."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


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
    matmul_precision: str = "fp32"            # fp32 | bf16: inputs of the matmuls rounded to bf16 (vLLM's numerics)

    def __post_init__(self):
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {self.backend!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {self.matmul_precision!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


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
        self._prompts: dict[int, str | None] = {}
        self._by_request: dict[str, Sequence] = {}
        self.num_generated_tokens = 0           # over the engine's life: progress bars read it
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
                    final_only: bool = False) -> str:
        """Queue a request; its outputs come from step(). `final_only` (vLLM's FINAL_ONLY output kind): step()
        reports the request only when it finishes, and its text is decoded once, at the end."""
        params = params or SamplingParams()
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise RequestError("the prompt is empty: nothing to generate from")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, but at most {self.max_model_len - 1} fit "
                               f"(max_model_len {self.max_model_len}: the model's context and the KV cache)")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._by_request:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(request_id, ids, params, seed)
        self._by_request[request_id] = seq
        self._prompts[seq.seq_id] = text
        self._streams[seq.seq_id] = TextStream(self.tokenizer, ids, params.stop, final_only=final_only)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self._by_request.get(request_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self._forget(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        tokens = iter(self.runner.execute(scheduled))
        outputs = []
        for item in scheduled:
            seq = item.seq
            samples = item.samples
            seq.num_computed_tokens += item.num_new_tokens
            if not samples:
                self.block_manager.register_full_blocks(seq)
                continue
            token = next(tokens)
            self.num_generated_tokens += 1
            seq.output_token_ids.append(token)
            seq.last_token_time = time.perf_counter()
            if seq.first_token_time is None:
                seq.first_token_time = seq.last_token_time
            self.block_manager.register_full_blocks(seq)
            stream = self._streams[seq.seq_id]
            reason = self._stop_reason(seq, token)
            new_text = "" if reason == "stop" else stream.push(token)  # a stop token adds no text
            if reason is None and stream.stopped:
                reason = "stop"
            if reason is not None:
                new_text += stream.finish()
                self.scheduler.finish(seq, reason)
            elif stream.final_only:
                continue
            outputs.append(self._output(seq, new_text))
            if reason is not None:
                self._forget(seq)
        return outputs

    def _stop_ids(self, seq: Sequence) -> set[int]:
        ids = set(seq.params.stop_token_ids)
        return ids if seq.params.ignore_eos else ids | self._eos

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        n = len(seq.output_token_ids)
        if n > seq.params.min_tokens and token in self._stop_ids(seq):
            return "stop"
        if n >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new_text: str) -> RequestOutput:
        stream = self._streams[seq.seq_id]
        return RequestOutput(
            request_id=seq.request_id, prompt=self._prompts[seq.seq_id], prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(0, stream.text, list(seq.output_token_ids), seq.finish_reason)],
            finished=seq.is_finished, new_text=new_text, num_cached_tokens=seq.num_cached_prompt_tokens,
            metrics={"preemptions": seq.num_preemptions, "arrival_time": seq.arrival_time,
                     "first_token_time": seq.first_token_time, "last_token_time": seq.last_token_time})

    def _forget(self, seq: Sequence) -> None:
        self._streams.pop(seq.seq_id, None)
        self._prompts.pop(seq.seq_id, None)
        self._by_request.pop(seq.request_id, None)

