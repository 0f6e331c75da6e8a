"""One engine step's inputs in one host-to-device transfer.

Every step the runner needs the token ids, positions and cache slots of its T new tokens; the offsets,
context lengths and block tables of its S sequences; and, for its N sampled rows, which row of the hidden
states to sample and the sampling parameters. Copied as twelve small arrays that is twelve transfers of a
few microseconds of latency each, plus Python. Here they are packed on the host into one pinned int32
buffer (float32 parameters stored as their bits) and copied with one asynchronous transfer into one device
buffer, of which the kernels read typed views.

Layout, in int32 words, compact for the step's shape (t, s, n, w, m) so that the copy moves only used words:

    token_ids[t] chain_src[t] positions[t] slot_mapping[t] cu_seqlens_q[s+1] context_lens[s]
    logits_indices[n] top_k[n] temperature[n] top_p[n] min_p[n] uniform[n]
    pending[n] repetition_penalty[n] presence_penalty[n] frequency_penalty[n] num_logprobs[n] entry_offsets[n+1]
    prompt_rows[m] prompt_targets[m] prompt_num_logprobs[m] block_tables[s*w] | entries[E*4]

The penalty entries (cuda_kernels/penalties.py) follow the shape's words: E varies from step to step, and
their view covers the buffer's whole entry capacity (fixed, so a graph keeps its address); only the used
E*4 words are copied. A step with more entries than the capacity makes the runner grow it (`grow_entries`),
which replaces the buffers (and so the captured graphs). m, the prompt-logprob rows, is 0 in every decode
step (the only ones captured).

chain_src[i] >= 0 says that token i is row chain_src[i] of the previous step's samples, which the host does
not know yet (the engine's async scheduling launches a decode step before it has read the previous one's
tokens): the step's first kernel copies it from the device (cuda_kernels/embedding.chain_tokens).

The offsets depend on the shape alone, so a CUDA graph captured for a shape finds the same views at the same
addresses at every replay. A step may be padded to a larger shape (a graph's batch-size bucket): padding
rows get context length 0 (attention writes zeros), cache slot -1 (no KV write) and greedy sampling,
so they change nothing that a real row reads.

The host buffer is double: while a step's copy may still be waiting in the stream (behind the step before
it), the next step is written into the other buffer. An event after each copy says when its buffer is free.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np
from numba import cuda

from tinyvllm.cuda_driver import PinnedCopy

# (name, length in the shape's terms, dtype, value of padding entries)
_FIELDS = (
    ("token_ids", "t", np.int32, 0),
    ("chain_src", "t", np.int32, -1),          # -1: the token id is the host's
    ("positions", "t", np.int32, 0),
    ("slot_mapping", "t", np.int32, -1),
    ("cu_seqlens_q", "s+1", np.int32, None),   # padding continues the offsets, one token per padding row
    ("context_lens", "s", np.int32, 0),
    ("logits_indices", "n", np.int32, None),   # padding rows sample their own row
    ("top_k", "n", np.int32, 0),
    ("temperature", "n", np.float32, 0.0),
    ("top_p", "n", np.float32, 1.0),
    ("min_p", "n", np.float32, 0.0),
    ("uniform", "n", np.float32, 0.0),
    ("pending", "n", np.int32, 0),
    ("repetition_penalty", "n", np.float32, 1.0),
    ("presence_penalty", "n", np.float32, 0.0),
    ("frequency_penalty", "n", np.float32, 0.0),
    ("num_logprobs", "n", np.int32, -1),       # -1: no logprobs
    ("entry_offsets", "n+1", np.int32, None),  # padding rows: empty ranges at the end
    ("prompt_rows", "m", np.int32, 0),
    ("prompt_targets", "m", np.int32, 0),
    ("prompt_num_logprobs", "m", np.int32, -1),
    ("block_tables", "s*w", np.int32, -1),
)
ENTRY_WORDS = 4           # token, output count, in prompt, bias bits
DEFAULT_ENTRY_CAPACITY = 4096


class StepShape(NamedTuple):
    tokens: int     # t
    seqs: int       # s
    sampled: int    # n
    width: int      # w: block-table columns
    prompt_rows: int = 0   # m: rows whose logits give prompt logprobs


@lru_cache(maxsize=256)
def layout(shape: StepShape) -> tuple[dict[str, tuple[int, int]], int]:
    """{field: (offset, length)} in int32 words, and the total length."""
    t, s, n, w, m = shape
    lengths = {"t": t, "s+1": s + 1, "s": s, "n": n, "n+1": n + 1, "m": m, "s*w": s * w}
    offsets, at = {}, 0
    for name, kind, _, _ in _FIELDS:
        offsets[name] = (at, lengths[kind])
        at += lengths[kind]
    return offsets, at


class StepInputs:
    """Two pinned host buffers and a device buffer big enough for the largest step, and its typed views."""

    def __init__(self, max_tokens: int, max_seqs: int, max_width: int, entry_capacity: int | None = None):
        self._words = layout(StepShape(max_tokens, max_seqs, max_seqs, max_width, max_tokens))[1]
        self._allocate(entry_capacity or DEFAULT_ENTRY_CAPACITY)

    def _allocate(self, entry_capacity: int) -> None:
        self.entry_capacity = entry_capacity
        words = self._words + ENTRY_WORDS * entry_capacity
        self._hosts = [cuda.pinned_array(words, np.int32) for _ in range(2)]
        self._copied = [None, None]    # per host buffer: an event recorded after its last copy
        self._copiers = [None, None]   # per host buffer: a PinnedCopy for the stream of its last copy
        self._entry_words = [0, 0]     # per host buffer: the entry words its last write used
        self._slot = 0                 # the host buffer the last write used
        self.device = cuda.device_array(words, np.int32)
        self._views = lru_cache(maxsize=256)(self._make_views)

    def grow_entries(self, entries: int) -> None:
        """Room for at least `entries` penalty entries: new buffers, so the caller must have synchronized its
        stream (nothing may still read or copy the old ones) and drop what holds the old views (graphs)."""
        capacity = self.entry_capacity
        while capacity < entries:
            capacity *= 2
        self._allocate(capacity)

    @property
    def host(self) -> np.ndarray:
        """The host buffer of the last write."""
        return self._hosts[self._slot]

    def write(self, shape: StepShape, batch, sampling, chain_src: np.ndarray | None = None) -> None:
        """Pack a ForwardBatch and SamplingBatch (and the chained rows, -1 where none) into a free host
        buffer in `shape`'s layout, padding as above."""
        self._slot ^= 1
        if self._copied[self._slot] is not None:
            self._copied[self._slot].synchronize()  # its previous step's copy has left it
        offsets, words = layout(shape)
        chain = np.full(len(batch.token_ids), -1, np.int32) if chain_src is None else chain_src
        values = {**vars(batch), **vars(sampling), "chain_src": chain}
        empty = np.zeros(0, np.int32)
        for name, _, dtype, pad in _FIELDS:
            at, length = offsets[name]
            dst = self.host[at: at + length].view(dtype)
            if name == "block_tables":
                table = dst.reshape(shape.seqs, shape.width)
                src = values[name]
                table[: src.shape[0], : src.shape[1]] = src
                table[src.shape[0]:] = pad
                table[: src.shape[0], src.shape[1]:] = pad
                continue
            src = values[name]
            if src is None:  # a SamplingBatch field the step does not use: every row is padding
                src = np.zeros(1, np.int32) if name == "entry_offsets" else empty
            dst[: len(src)] = src
            if name == "cu_seqlens_q":
                dst[len(src):] = src[-1] + np.arange(1, length - len(src) + 1)
            elif name == "logits_indices":
                dst[len(src):] = np.arange(len(src), length)
            elif name == "entry_offsets":
                dst[len(src):] = src[-1]
            else:
                dst[len(src):] = pad
        entries = sampling.entries if sampling.entries is not None else np.zeros((0, ENTRY_WORDS), np.int32)
        if len(entries) > self.entry_capacity:
            raise ValueError(f"{len(entries)} penalty entries, the buffers hold {self.entry_capacity} "
                             "(grow_entries first)")
        self.host[words: words + entries.size] = entries.reshape(-1)
        self._entry_words[self._slot] = entries.size

    def upload(self, shape: StepShape, stream) -> None:
        """One asynchronous copy of the words `shape` uses (the host buffer is pinned)."""
        slot = self._slot
        words = layout(shape)[1] + self._entry_words[slot]
        # NOTE: one driver call; Numba's copy_to_device of a slice took ~130 us of Python per step on the
        # H200 machine, while the GPU waited for it
        copier = self._copiers[slot]
        if copier is None or copier.stream is not stream:
            copier = self._copiers[slot] = PinnedCopy(self.host, self.device, stream)
        copier.to_device(4 * words)
        if self._copied[slot] is None:
            self._copied[slot] = cuda.event()
        self._copied[slot].record(stream)

    def views(self, shape: StepShape) -> dict[str, object]:
        """The device views of `shape`'s layout, typed and shaped (block_tables is (s, w))."""
        return self._views(shape)

    def _make_views(self, shape: StepShape) -> dict[str, object]:
        offsets, _ = layout(shape)
        views = {}
        for name, _, dtype, _ in _FIELDS:
            at, length = offsets[name]
            view = self.device[at: at + length]
            views[name] = view.view(np.float32) if dtype == np.float32 else view
        views["block_tables"] = views["block_tables"].reshape(shape.seqs, shape.width)
        words = layout(shape)[1]
        views["entries"] = self.device[words: words + ENTRY_WORDS * self.entry_capacity].reshape(
            self.entry_capacity, ENTRY_WORDS)
        return views
