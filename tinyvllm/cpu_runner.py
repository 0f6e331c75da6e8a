"""The CPU backend: the NumPy reference Llama over a paged KV cache held in host memory."""

from __future__ import annotations

import numpy as np

from reference.embedding import chain_tokens
from reference.llama import ReferenceLlama
from reference.kv_cache import copy_blocks
from tinyvllm.batch import block_copies, pack
from tinyvllm.sampler import sample_step, with_prompt_rows
from tinyvllm.scheduler import ScheduledSequence

# Host memory is plentiful but allocation of a huge NaN-filled pool is not free: a modest default.
DEFAULT_CPU_KV_TOKENS = 16384


class CPURunner:
    name = "cpu"
    launches_async = False   # launch() computes the step; collect() waits for nothing

    def __init__(self, config, weights: dict[str, np.ndarray], block_size: int, num_blocks: int | None = None,
                 matmul_precision: str = "fp32", kv_cache_dtype: str = "bf16"):
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks or -(-DEFAULT_CPU_KV_TOKENS // block_size)
        self.matmul_precision = matmul_precision
        self.kv_cache_dtype = kv_cache_dtype
        self.model = ReferenceLlama(config, weights, matmul_precision)
        self.kv = self.model.new_kv_cache(self.num_blocks, block_size, kv_cache_dtype)
        self._last = np.zeros(0, np.int32)   # the last step's samples, which a chained step reads

    def launch(self, scheduled: list[ScheduledSequence], chain_src=None) -> list[int]:
        """Run one step (synchronously: the handle is the tokens). chain_src: per new token, the row of the
        previous step's samples that is its id (-1: the id packed from the sequence), as on the GPU."""
        batch, sampling = pack(scheduled, self.block_size)
        if chain_src is not None:
            batch.token_ids = chain_tokens(batch.token_ids, self._last, chain_src)
        if len(batch.token_ids) and batch.token_ids.min() < 0:  # a PENDING id nothing chained (an engine bug)
            raise RuntimeError(f"step inputs hold unknown token ids: {batch.token_ids.tolist()}")
        copies = block_copies(scheduled)  # copy-on-write of shared blocks, before the step writes them
        for cache in (*self.kv.k, *self.kv.v) if len(copies) else ():
            copy_blocks(cache, copies)
        logits = self.model.forward(with_prompt_rows(batch, sampling), self.kv)
        if not len(logits):
            return [], None
        tokens, logprobs = sample_step(logits, batch, sampling)
        self._last = tokens
        return tokens.tolist(), logprobs

    def collect(self, handle) -> list[int]:
        """The sampled tokens of a launched step, one per sampled row (tinyvllm/batch.py)."""
        return handle[0]

    def collect_logprobs(self, handle):
        """The step's logprobs (tinyvllm/sampler.StepLogprobs), or None when it asked for none."""
        return handle[1]

    def execute(self, scheduled: list[ScheduledSequence]) -> list[int]:
        return self.collect(self.launch(scheduled))
