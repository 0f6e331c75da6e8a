"""The CPU backend: the NumPy reference Llama over a paged KV cache held in host memory."""

from __future__ import annotations

import numpy as np

from reference.llama import ReferenceLlama
from reference.sampling import sample
from tinyvllm.batch import pack
from tinyvllm.scheduler import ScheduledSequence

# Host memory is plentiful but allocation of a huge NaN-filled pool is not free: a modest default.
DEFAULT_CPU_KV_TOKENS = 16384


class CPURunner:
    name = "cpu"

    def __init__(self, config, weights: dict[str, np.ndarray], block_size: int, num_blocks: int | None = None,
                 matmul_precision: str = "fp32"):
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks or -(-DEFAULT_CPU_KV_TOKENS // block_size)
        self.model = ReferenceLlama(config, weights, matmul_precision)
        self.kv = self.model.new_kv_cache(self.num_blocks, block_size)

    def execute(self, scheduled: list[ScheduledSequence]) -> list[int]:
        """Run one step; the sampled token of each scheduled sequence that reached its last token, in order."""
        batch, sampling = pack(scheduled, self.block_size)
        logits = self.model.forward(batch, self.kv)
        if not len(batch.logits_indices):
            return []
        return sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                      sampling.uniform).tolist()
