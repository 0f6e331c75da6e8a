"""A stand-in for the CUDA runner on a machine without a GPU: the GPU's timing, none of its work.

    python tools/serve_benchmark.py tinyvllm --model DIR --backend sim --out OUT   # the server's overhead, no GPU

What the server costs at saturation is host time: Python work in the engine's thread (scheduling, packing,
detokenizing) and in the event loop (HTTP, SSE), which share one interpreter. On the GPU the engine's thread
spends most of a step waiting for the device with the GIL released; the CPU backend instead computes the
model in NumPy, much of it holding the GIL, so it shows the server's overhead in the wrong proportion.

SimRunner keeps the host side of a step (tinyvllm/batch.pack, as the CUDA runner does before its copies) and
replaces the model by a timer: a step takes `base_ms + per_token_ms * new tokens` on a device that runs one
step at a time, and `collect` sleeps (GIL released, as a device sync) until that step is done. The sampled
tokens are random ids below the vocabulary, so detokenization does its real work (logprobs are not simulated:
requests asking for them are not for this runner). With the defaults a decode
step of 256 sequences takes 6 + 0.02 * 256 = 11 ms, an H100's on the 1B model before gemm_wgmma (GPU.md);
`serve_benchmark.py --sim-step-ms 2 0.01` gives 4.6 ms, about its step since (BENCHMARKS.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from tinyvllm.batch import pack
from tinyvllm.scheduler import ScheduledSequence

BASE_MS, PER_TOKEN_MS = 6.0, 0.02   # a step's modelled time: BASE_MS + PER_TOKEN_MS * its new tokens


class SimRunner:
    name = "sim"
    matmul_precision = None
    launches_async = True   # as the CUDA runner: collect() waits for the (simulated) device

    def __init__(self, vocab_size: int, block_size: int = 16, num_blocks: int = 65536, base_ms: float = BASE_MS,
                 per_token_ms: float = PER_TOKEN_MS, seed: int = 0):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.base_s = base_ms / 1e3
        self.per_token_s = per_token_ms / 1e3
        self._rng = np.random.default_rng(seed)
        self._free_at = 0.0   # when the simulated device finishes the last step it was given

    def launch(self, scheduled: list[ScheduledSequence], chain_src=None):
        batch, sampling = pack(scheduled, self.block_size)
        start = max(time.perf_counter(), self._free_at)
        self._free_at = start + self.base_s + self.per_token_s * len(batch.token_ids)
        tokens = self._rng.integers(0, self.vocab_size, len(sampling.temperature))  # one per sampled row
        return tokens.tolist(), self._free_at

    def collect(self, handle) -> list[int]:
        tokens, done_at = handle
        wait = done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return tokens

    def collect_logprobs(self, handle):
        return None


def sim_engine(model_dir: str | Path, **runner_options):
    """An LLMEngine over SimRunner: the model's config and tokenizer, no weights. Prefix caching is off (a
    benchmark's runs send the same prompts again). A module-level function, so that an engine process can be
    told to build one (tinyvllm/server/engine_core.EngineProcess's factory)."""
    from tinyvllm.config import ModelConfig
    from tinyvllm.engine import EngineOptions, LLMEngine
    from tinyvllm.tokenizer import Tokenizer

    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    runner = SimRunner(config.vocab_size, **runner_options)
    options = EngineOptions(enable_prefix_caching=False)
    return LLMEngine(model_dir, Tokenizer.from_dir(model_dir), config, runner, options)


def sim_llm(model_dir: str | Path, **runner_options):
    """An LLM (tinyvllm.LLM) over SimRunner (see sim_engine)."""
    from tinyvllm.llm import LLM

    return LLM.from_engine(sim_engine(model_dir, **runner_options))
