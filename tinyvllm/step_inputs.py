"""One engine step's inputs in one host-to-device transfer.

Every step the runner needs the token ids, positions and cache slots of its T new tokens; the offsets,
context lengths and block tables of its S sequences; and, for its N sampled rows, which row of the hidden
states to sample and the sampling parameters. Copied as twelve small arrays that is twelve transfers of a
few microseconds of latency each, plus Python. Here they are packed on the host into one pinned int32
buffer (float32 parameters stored as their bits) and copied with one asynchronous transfer into one device
buffer, of which the kernels read typed views.

Layout, in int32 words, compact for the step's shape (t, s, n, w) so that the copy moves only used words:

    token_ids[t] chain_src[t] positions[t] slot_mapping[t] cu_seqlens_q[s+1] context_lens[s]
    logits_indices[n] top_k[n] temperature[n] top_p[n] min_p[n] uniform[n] block_tables[s*w]

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
    ("block_tables", "s*w", np.int32, -1),
)


class StepShape(NamedTuple):
    tokens: int     # t
    seqs: int       # s
    sampled: int    # n
    width: int      # w: block-table columns


@lru_cache(maxsize=256)
def layout(shape: StepShape) -> tuple[dict[str, tuple[int, int]], int]:
    """{field: (offset, length)} in int32 words, and the total length."""
    t, s, n, w = shape
    lengths = {"t": t, "s+1": s + 1, "s": s, "n": n, "s*w": s * w}
    offsets, at = {}, 0
    for name, kind, _, _ in _FIELDS:
        offsets[name] = (at, lengths[kind])
        at += lengths[kind]
    return offsets, at


class StepInputs:
    """Two pinned host buffers and a device buffer big enough for the largest step, and its typed views."""

    def __init__(self, max_tokens: int, max_seqs: int, max_width: int):
        _, words = layout(StepShape(max_tokens, max_seqs, max_seqs, max_width))
        self._hosts = [cuda.pinned_array(words, np.int32) for _ in range(2)]
        self._copied = [None, None]    # per host buffer: an event recorded after its last copy
        self._copiers = [None, None]   # per host buffer: a PinnedCopy for the stream of its last copy
        self._slot = 0                 # the host buffer the last write used
        self.device = cuda.device_array(words, np.int32)
        self._views = lru_cache(maxsize=256)(self._make_views)

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
        offsets, _ = layout(shape)
        chain = np.full(len(batch.token_ids), -1, np.int32) if chain_src is None else chain_src
        values = {**vars(batch), **vars(sampling), "chain_src": chain}
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
            dst[: len(src)] = src
            if name == "cu_seqlens_q":
                dst[len(src):] = src[-1] + np.arange(1, length - len(src) + 1)
            elif name == "logits_indices":
                dst[len(src):] = np.arange(len(src), length)
            else:
                dst[len(src):] = pad

    def upload(self, shape: StepShape, stream) -> None:
        """One asynchronous copy of the words `shape` uses (the host buffer is pinned)."""
        words, slot = layout(shape)[1], self._slot
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
        return views
