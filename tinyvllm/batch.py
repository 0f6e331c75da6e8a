"""Packing one scheduled step into the flat arrays the model runs on (host side, NumPy).

Both runners use this: the CPU runner hands the arrays to the NumPy reference, the CUDA runner copies them
into its fixed device buffers. Layout (S sequences, T new tokens in all), as reference/llama.ForwardBatch:
token ids, positions and cache slots per new token; per-sequence offsets, context lengths and block tables;
the rows whose logits are sampled; and per-sampled-row sampling parameters with their uniform numbers.

Sampled rows: one per scheduled sequence that reaches its last token, and one more for each completion forked
from it at that step (ScheduledSequence.forks: the n completions of one prompt each draw their first token
from the prompt's last logits, so their rows repeat its logits index).

Per sampled row also (SamplingBatch): the penalties and the packed entries of cuda_kernels/penalties.py (one
(token, output count, in prompt, bias) entry per token the row's processing touches), how many logprobs it
wants; and for prompt_logprobs, the rows of the step's tokens whose logits are wanted, with the prompt token
each one predicts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from reference.llama import ForwardBatch
from tinyvllm.scheduler import ScheduledSequence
from tinyvllm.sequence import PENDING, Sequence

_MIX = np.uint64(0x9E3779B97F4A7C15)
ENTRY_WORDS = 4   # token, output count, in prompt, bias (float32 bits): cuda_kernels/penalties.py


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
    """Per sampled row: temperature, top_k, top_p, min_p, uniform; the penalties (repetition, presence,
    frequency), pending (1: the row's newest output token is not in its counts: the step's input is),
    entry_offsets (rows + 1) into entries (E, 4) int32; num_logprobs (-1: none). Prompt logprobs: prompt_rows
    (rows of the step's tokens), prompt_targets (the prompt token each predicts), prompt_num_logprobs.
    Fields left None read as "nothing": neutral penalties, no entries, no logprobs, no prompt rows."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    uniform: np.ndarray
    repetition_penalty: np.ndarray | None = None
    presence_penalty: np.ndarray | None = None
    frequency_penalty: np.ndarray | None = None
    pending: np.ndarray | None = None
    entry_offsets: np.ndarray | None = None
    entries: np.ndarray | None = None
    num_logprobs: np.ndarray | None = None
    prompt_rows: np.ndarray | None = None
    prompt_targets: np.ndarray | None = None
    prompt_num_logprobs: np.ndarray | None = None

    @property
    def processes_logits(self) -> bool:
        """Whether a row's logits change before the draw (penalties, bias, min_tokens masks)."""
        return self.pending is not None and (bool(self.pending.any()) or int(self.entry_offsets[-1]) > 0)

    @property
    def wants_logprobs(self) -> bool:
        return self.num_logprobs is not None and bool((self.num_logprobs >= 0).any())

    @property
    def num_prompt_rows(self) -> int:
        return 0 if self.prompt_rows is None else len(self.prompt_rows)


def prompt_logprob_range(item: ScheduledSequence) -> tuple[int, int]:
    """[first, stop): the positions among item's new tokens whose logits give prompt logprobs (position j
    predicts prompt token j + 1), past those an earlier step gave (seq.prompt_logprobs_next)."""
    seq = item.seq
    if seq.params.prompt_logprobs is None:
        return 0, 0
    start = seq.num_computed_tokens
    first = max(start, seq.prompt_logprobs_next)
    return first, max(first, min(start + item.num_new_tokens, len(seq.prompt_token_ids) - 1))


def masked_ids(seq: Sequence) -> tuple[int, ...]:
    """The ids masked out of the row's next draw: EOS (unless ignore_eos) and stop_token_ids, until
    min_tokens tokens are out (seq.masked_ids holds them; len(output_token_ids) is the draw's index)."""
    return seq.masked_ids if len(seq.output_token_ids) < seq.params.min_tokens else ()


def row_entries(seq: Sequence) -> tuple[np.ndarray | None, bool]:
    """(The row's penalty entries (E, 4) int32, or None when it has none; whether its newest output token is
    pending, i.e. not in seq.output_counts yet: the kernel then counts the step's input token once more)."""
    params = seq.params
    masked = masked_ids(seq)
    penalties = params.uses_penalties
    if not (penalties or params.logit_bias or masked):
        return None, False
    parts = []
    if params.repetition_penalty != 1:
        if seq.prompt_unique is None:
            seq.prompt_unique = np.unique(np.asarray(seq.prompt_token_ids, np.int32))
        parts.append(seq.prompt_unique)
    if penalties and seq.output_counts:
        out_ids = np.fromiter(seq.output_counts.keys(), np.int32, len(seq.output_counts))
        out_counts = np.fromiter(seq.output_counts.values(), np.int32, len(seq.output_counts))
        parts.append(out_ids)
    bias = params.logit_bias or {}
    if bias:
        bias_ids = np.fromiter(bias.keys(), np.int32, len(bias))
        parts.append(bias_ids)
    if masked:
        parts.append(np.asarray(masked, np.int32))
    pending = penalties and bool(seq.output_token_ids) and seq.output_token_ids[-1] == PENDING
    if not parts:
        return None, pending
    tokens = np.unique(np.concatenate(parts))
    entries = np.zeros((len(tokens), ENTRY_WORDS), np.int32)
    entries[:, 0] = tokens
    if penalties and seq.output_counts:
        entries[np.searchsorted(tokens, out_ids), 1] = out_counts
    if params.repetition_penalty != 1:
        entries[np.searchsorted(tokens, seq.prompt_unique), 2] = 1
    values = np.zeros(len(tokens), np.float32)
    if bias:
        values[np.searchsorted(tokens, bias_ids)] = np.fromiter(bias.values(), np.float32, len(bias))
    if masked:
        values[np.searchsorted(tokens, np.asarray(masked, np.int32))] = -np.inf
    entries[:, 3] = values.view(np.int32)
    return entries, pending


def _penalty_inputs(rows: list[Sequence]) -> dict[str, np.ndarray]:
    """The SamplingBatch fields of the penalties for these sampled rows."""
    n = len(rows)
    offsets = np.zeros(n + 1, np.int32)
    pending = np.zeros(n, np.int32)
    chunks = []
    for r, seq in enumerate(rows):
        entries, pend = row_entries(seq)
        pending[r] = pend
        if entries is not None:
            chunks.append(entries)
        offsets[r + 1] = offsets[r] + (0 if entries is None else len(entries))
    return dict(
        repetition_penalty=np.array([s.params.repetition_penalty for s in rows], np.float32),
        presence_penalty=np.array([s.params.presence_penalty for s in rows], np.float32),
        frequency_penalty=np.array([s.params.frequency_penalty for s in rows], np.float32),
        pending=pending, entry_offsets=offsets,
        entries=np.concatenate(chunks) if chunks else np.zeros((0, ENTRY_WORDS), np.int32))


def block_copies(scheduled: list[ScheduledSequence]) -> np.ndarray:
    """(P, 2) int32 (source, destination) block copies the step needs first: the copy-on-write of blocks its
    sequences shared (ScheduledSequence.copy, from the block manager)."""
    pairs = [item.copy for item in scheduled if item.copy is not None]
    return np.asarray(pairs, np.int32).reshape(-1, 2)


def pack(scheduled: list[ScheduledSequence], block_size: int) -> tuple[ForwardBatch, SamplingBatch]:
    # NOTE: one pass of plain Python over the sequences and a few whole-array NumPy operations: this runs on
    # the host every step, for up to hundreds of sequences, while the GPU waits. The penalties, logprobs and
    # prompt logprobs cost more only when some row asks for them.
    token_ids, starts, lengths, tables, samplers, repeats, prompt = [], [], [], [], [], [], []
    features = False
    for i, item in enumerate(scheduled):
        seq, start = item.seq, item.seq.num_computed_tokens
        token_ids.extend(seq.token_ids_slice(start, start + item.num_new_tokens))
        starts.append(start)
        lengths.append(item.num_new_tokens)
        tables.append(seq.block_table)
        if not item.samples:
            repeats.append(0)
        elif item.forks:
            samplers.append(seq)
            samplers.extend(item.forks)
            repeats.append(1 + len(item.forks))
        else:
            samplers.append(seq)
            repeats.append(1)
        if seq.features:
            features = True
            if seq.params.prompt_logprobs is not None:
                first, stop = prompt_logprob_range(item)
                if stop > first:
                    prompt.append((i, first, stop, seq))
    lengths = np.asarray(lengths, np.int32)
    cu = np.zeros(len(scheduled) + 1, np.int32)
    np.cumsum(lengths, out=cu[1:])
    starts = np.asarray(starts, np.int32)
    context_lens = starts + lengths
    seq_of_token = np.repeat(np.arange(len(scheduled)), lengths)
    positions = np.arange(cu[-1], dtype=np.int32) - cu[seq_of_token] + starts[seq_of_token]
    logits_indices = np.repeat(cu[1:] - 1, repeats)
    # NOTE: every table's ids in one np.fromiter, spread over the padded rows by a mask (row-major, so in
    # order): the largest host cost of a decode step's packing (256 long sequences, ~100 blocks each), about
    # half the time of filling a row at a time
    widths = np.fromiter(map(len, tables), np.int64, len(tables))
    block_tables = np.full((len(tables), int(widths.max())), -1, np.int32)
    block_tables[np.arange(block_tables.shape[1]) < widths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), np.int32, int(widths.sum()))
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
    if features:
        for name, value in _penalty_inputs(samplers).items():
            setattr(sampling, name, value)
        sampling.num_logprobs = np.array([-1 if s.params.logprobs is None else s.params.logprobs for s in samplers],
                                         np.int32)
        rows, targets, nums = [], [], []
        for i, first, stop, seq in prompt:
            rows.append(cu[i] + np.arange(first, stop, dtype=np.int32) - starts[i])
            targets.append(np.asarray(seq.prompt_token_ids[first + 1: stop + 1], np.int32))
            nums.append(np.full(stop - first, seq.params.prompt_logprobs, np.int32))
        if rows:
            sampling.prompt_rows, sampling.prompt_targets, sampling.prompt_num_logprobs = (
                np.concatenate(rows).astype(np.int32), np.concatenate(targets), np.concatenate(nums))
    return batch, sampling
