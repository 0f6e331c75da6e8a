"""Packing one scheduled step into the flat arrays the model runs on (host side, NumPy).

Both runners use this: the CPU runner hands the arrays to the NumPy reference, the CUDA runner copies them
into its fixed device buffers. Layout (S sequences, T new tokens in all), as reference/llama.ForwardBatch:
token ids, positions and cache slots per new token; per-sequence offsets, context lengths and block tables;
the rows whose logits are sampled; and per-sampled-row sampling parameters with their uniform numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference.llama import ForwardBatch
from tinyvllm.scheduler import ScheduledSequence

_MIX = np.uint64(0x9E3779B97F4A7C15)


def uniform_for(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) for each (seed, output index) pair: the splitmix64 finaliser of a counter.

    Counter-based rather than a stream, so the draw for a request's k-th token depends only on its seed and
    k: the same whether it runs alone, in a batch, or is recomputed after preemption.
    """
    with np.errstate(over="ignore"):
        z = np.asarray(seeds, np.uint64) * _MIX + np.asarray(steps, np.uint64) + _MIX
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.float64) / float(1 << 24)).astype(np.float32)  # 24 bits: exact in fp32


@dataclass
class SamplingBatch:
    """Per sampled row: temperature, top_k, top_p, min_p, uniform."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    uniform: np.ndarray


def pack(scheduled: list[ScheduledSequence], block_size: int) -> tuple[ForwardBatch, SamplingBatch]:
    # NOTE: one pass of plain Python over the sequences and a few whole-array NumPy operations: this runs on
    # the host every step, for up to hundreds of sequences, while the GPU waits.
    token_ids, starts, lengths, sampled, samplers, tables = [], [], [], [], [], []
    for item in scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        token_ids.extend(seq.token_ids_slice(start, start + item.num_new_tokens))
        starts.append(start)
        lengths.append(item.num_new_tokens)
        tables.append(seq.block_table)
        sampled.append(item.samples)
        if sampled[-1]:
            samplers.append(seq)
    lengths = np.asarray(lengths, np.int32)
    cu = np.zeros(len(scheduled) + 1, np.int32)
    np.cumsum(lengths, out=cu[1:])
    starts = np.asarray(starts, np.int32)
    context_lens = starts + lengths
    seq_of_token = np.repeat(np.arange(len(scheduled)), lengths)
    positions = np.arange(cu[-1], dtype=np.int32) - cu[seq_of_token] + starts[seq_of_token]
    logits_indices = cu[1:][np.asarray(sampled, bool)] - 1
    max_blocks = max(len(t) for t in tables)
    block_tables = np.array([t + [-1] * (max_blocks - len(t)) for t in tables], np.int32)
    slots = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    batch = ForwardBatch(
        token_ids=np.asarray(token_ids, np.int32), positions=positions, slot_mapping=slots.astype(np.int32),
        cu_seqlens_q=cu, context_lens=context_lens, block_tables=block_tables,
        logits_indices=logits_indices.astype(np.int32))
    sampling = SamplingBatch(
        temperature=np.array([s.params.temperature for s in samplers], np.float32),
        top_k=np.array([s.params.top_k for s in samplers], np.int32),
        top_p=np.array([s.params.top_p for s in samplers], np.float32),
        min_p=np.array([s.params.min_p for s in samplers], np.float32),
        uniform=uniform_for(np.array([s.seed for s in samplers], np.uint64),
                            np.array([len(s.output_token_ids) for s in samplers], np.uint64)))
    return batch, sampling
