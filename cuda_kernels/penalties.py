"""Penalties and logit bias on the GPU: the sampled rows' logits processed in place before the draw.

Math (per entry e = (token i, output count c, in prompt q, bias b) of row s; exactly
reference/sampling.apply_penalties, float32, in this order, which is vLLM's):

    l = l[s, i] + b
    if q or c > 0:  l = l / r[s] if l > 0 else l * r[s]                  repetition_penalty (HF, vLLM)
    l = l - f[s] * c                                                      frequency_penalty  (OpenAI)
    if c > 0:       l = l - p[s]                                          presence_penalty   (OpenAI)
    l[s, i] = l

The host packs, each step, one entry per token a row's processing touches (tinyvllm/batch.py): its prompt's
tokens when r != 1, its output's when any penalty is on, its logit_bias, and -inf biases on EOS and the
stop ids while min_tokens holds them back. Logits without an entry are not touched, so a row with no
entries samples exactly what it would without this kernel.
pending[s] = 1: the row's newest output token is not among its counts (the host had not read it back when it
packed the step: the engine's async scheduling). It is the row's last input token, token_ids[logits_indices[s]]
(the step's first kernel put it there), and counts once more: its entry's count + 1, or if no entry holds it,
the entry (it, 1, 0, 0).

Shapes and dtypes (device arrays):
    logits (S, V) float32, in place
    token_ids (T,) int32; logits_indices, pending (S,) int32
    repetition_penalty, presence_penalty, frequency_penalty (S,) float32
    entry_offsets (S + 1,) int32: row s owns entries[entry_offsets[s]:entry_offsets[s + 1]]
    entries (E, 4) int32: token, output count, in prompt (0 / 1), bias as float32 bits; E is the buffer's
        capacity (a CUDA graph keeps one buffer), rows read only their own range; tokens distinct within a row
    saved (E,) float32, extra_token (S,) int32, extra_saved (S,) float32: the logits the step overwrote, for
        `restore_logits` (the pending token's own entry, when it had none, in extra_*; extra_token -1: none)

Thread mapping: grid = (S,), one block of THREADS threads per row; thread t takes the row's entries t,
t + THREADS, ...; no two threads touch one logit (distinct tokens). After a barrier thread 0 applies the
pending token if no entry held it.
restore_logits: the same grid; writes the saved logits back, so that the logprobs reported for the step are
the model's own (vLLM's default), not the processed ones the draw used.

NOTE: the products go through `mul_rn` (libdevice's __fmul_rn on the GPU): NVVM contracts a multiply and a
following add into one fused multiply-add by default, which rounds once where the reference rounds twice,
and the processed logits are meant to equal the reference's bit for bit (a greedy row's token is their
argmax).

Versions: v1 only: one read and one write per entry, at most a row's distinct context tokens.
"""

from functools import lru_cache

import numpy as np

from cuda_kernels import compat  # noqa: F401  (the numpy shim precedes numba.cuda)
from numba import cuda, float32, int32

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch, view

THREADS = 32 if SIMULATOR else 128
ENTRY_WORDS = 4

# --- device helpers ---------------------------------------------------------------------------------------

if SIMULATOR:
    @cuda.jit(device=True)
    def mul_rn(a, b):
        """a * b rounded once to float32 (the simulator's numpy float32 product)."""
        return float32(a) * float32(b)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def mul_rn(a, b):
        """a * b rounded once to float32, never fused with a neighbouring add (see the module NOTE)."""
        return libdevice.fmul_rn(float32(a), float32(b))


@cuda.jit(device=True)
def _penalized(x, bias, count, in_prompt, repetition, presence, frequency):
    """One logit's processed value, in the reference's order of operations (reference.penalized_logit)."""
    x = float32(x + bias)
    if in_prompt != 0 or count > 0:
        if x > float32(0):
            x = float32(x / repetition)
        else:
            x = mul_rn(x, repetition)
    x = float32(x - mul_rn(frequency, float32(count)))
    if count > 0:
        x = float32(x - presence)
    return x


# --- kernels ----------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _penalties_kernel():
    @cuda.jit
    def penalties_kernel(logits, token_ids, logits_indices, pending, repetition, presence, frequency, offsets,
                         entries, bias, saved, extra_token, extra_saved):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        found = cuda.shared.array(1, int32)
        if tid == 0:
            found[0] = 0
        cuda.syncthreads()
        pend = int32(-1)
        if pending[row] != 0:
            pend = token_ids[logits_indices[row]]
        r, p, f = repetition[row], presence[row], frequency[row]
        for e in range(offsets[row] + tid, offsets[row + 1], cuda.blockDim.x):
            token = entries[e, 0]
            count = entries[e, 1]
            if token == pend:
                count += 1
                found[0] = 1  # the one entry that holds it: no other thread writes
            x = logits[row, token]
            saved[e] = x
            logits[row, token] = _penalized(x, bias[e, 3], count, entries[e, 2], r, p, f)
        cuda.syncthreads()
        if tid == 0:
            extra_token[row] = -1
            if pend >= 0 and found[0] == 0:
                x = logits[row, pend]
                extra_token[row] = pend
                extra_saved[row] = x
                logits[row, pend] = _penalized(x, float32(0), 1, 0, r, p, f)

    return penalties_kernel


@lru_cache(maxsize=None)
def _restore_kernel():
    @cuda.jit
    def restore_kernel(logits, offsets, entries, saved, extra_token, extra_saved):
        row = cuda.blockIdx.x
        for e in range(offsets[row] + cuda.threadIdx.x, offsets[row + 1], cuda.blockDim.x):
            logits[row, entries[e, 0]] = saved[e]
        if cuda.threadIdx.x == 0 and extra_token[row] >= 0:
            logits[row, extra_token[row]] = extra_saved[row]

    return restore_kernel


# --- launchers --------------------------------------------------------------------------------------------

def _check(name, array, dtype, shape=None, ndim=None):
    if isinstance(array, np.ndarray) or not hasattr(array, "shape"):
        raise TypeError(f"{name} must be a device array, got {type(array).__name__}")
    if np.dtype(array.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {np.dtype(array.dtype).name}")
    if shape is not None and tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(array.shape)}")
    if ndim is not None and len(array.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(array.shape)}")


def _check_rows(logits, entry_offsets, entries, saved, extra_token, extra_saved):
    _check("logits", logits, np.float32, ndim=2)
    rows = logits.shape[0]
    _check("entry_offsets", entry_offsets, np.int32, (rows + 1,))
    _check("entries", entries, np.int32, ndim=2)
    if entries.shape[1] != ENTRY_WORDS:
        raise ValueError(f"entries must be (E, {ENTRY_WORDS}), got shape {tuple(entries.shape)}")
    _check("saved", saved, np.float32, (entries.shape[0],))
    _check("extra_token", extra_token, np.int32, (rows,))
    _check("extra_saved", extra_saved, np.float32, (rows,))
    return rows


def apply_penalties(logits, token_ids, logits_indices, pending, repetition_penalty, presence_penalty,
                    frequency_penalty, entry_offsets, entries, saved, extra_token, extra_saved, stream=0):
    """Process each row's entries in place (module docstring); what it overwrote goes to saved / extra_*.
    entries must be C-contiguous (its bias column is read through a float32 view of the same words)."""
    rows = _check_rows(logits, entry_offsets, entries, saved, extra_token, extra_saved)
    _check("token_ids", token_ids, np.int32, ndim=1)
    for name, array, dtype in (("logits_indices", logits_indices, np.int32), ("pending", pending, np.int32),
                               ("repetition_penalty", repetition_penalty, np.float32),
                               ("presence_penalty", presence_penalty, np.float32),
                               ("frequency_penalty", frequency_penalty, np.float32)):
        _check(name, array, dtype, (rows,))
    if rows:
        launch(_penalties_kernel(), rows, THREADS, stream, logits, token_ids, logits_indices, pending,
               repetition_penalty, presence_penalty, frequency_penalty, entry_offsets, entries,
               view(entries, None, np.float32), saved, extra_token, extra_saved)


def restore_logits(logits, entry_offsets, entries, saved, extra_token, extra_saved, stream=0):
    """Undo the last apply_penalties on these rows (same arguments as it got): logits as they were before."""
    rows = _check_rows(logits, entry_offsets, entries, saved, extra_token, extra_saved)
    if rows:
        launch(_restore_kernel(), rows, THREADS, stream, logits, entry_offsets, entries, saved, extra_token,
               extra_saved)
