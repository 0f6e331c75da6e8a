"""Row gathers: the token embedding lookup (bf16 table -> fp32 rows), the selection of logit rows, and the
chaining of sampled tokens into the next step's inputs.

    embedding:    out[t, i] = float32(table[token_ids[t], i])    table (V, H) uint16 bf16, out (T, H) float32
    gather_rows:  out[s, i] = x[indices[s], i]                    x (T, H) float32, out (S, H) float32
    chain_tokens: token_ids[t] = sampled[src[t]] where src[t] >= 0, unchanged where src[t] < 0

Thread mapping (embedding, gather_rows): grid = (rows,), one block per output row; the block's threads
stride over the H columns, so consecutive threads touch consecutive addresses (coalesced loads and stores).
chain_tokens: one thread per token, grid = (ceil(T / THREADS),).

chain_tokens is how a decode step is launched before the host knows the tokens it decodes (the engine's
async scheduling): the previous step's sampled ids are still on the device, and the step's first kernel
copies them into its input ids, in stream order, before the embedding reads them.

Versions: v1 only; these are pure memory copies of one row per token and cost little next to the matmuls.
"""

from functools import lru_cache

from numba import cuda, uint32

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch
from cuda_kernels.primitives import bf16_to_f32

# NOTE: 512 threads on the GPU: a 2048-wide row in 4 passes (one memory round trip each at decode, see
# rmsnorm.py); the simulator keeps 256.
THREADS = 256 if SIMULATOR else 512

# ---------------------------------------------------------------------------------------------------------
# kernels


# NOTE: unsigned 32-bit indices and while loops (rows and ids are far below 2^32, and ids are never negative):
# primitives' module docstring, "Index arithmetic".

@lru_cache(maxsize=None)
def _embedding_kernel():
    @cuda.jit
    def embedding_kernel(token_ids, table, out):
        row = uint32(cuda.blockIdx.x)
        token = uint32(token_ids[row])
        width, step = uint32(out.shape[1]), uint32(cuda.blockDim.x)
        col = uint32(cuda.threadIdx.x)
        while col < width:
            out[row, col] = bf16_to_f32(table[token, col])
            col = uint32(col + step)

    return embedding_kernel


@lru_cache(maxsize=None)
def _gather_rows_kernel():
    @cuda.jit
    def gather_rows_kernel(x, indices, out):
        row = uint32(cuda.blockIdx.x)
        src = uint32(indices[row])
        width, step = uint32(out.shape[1]), uint32(cuda.blockDim.x)
        col = uint32(cuda.threadIdx.x)
        while col < width:
            out[row, col] = x[src, col]
            col = uint32(col + step)

    return gather_rows_kernel


@lru_cache(maxsize=None)
def _chain_tokens_kernel():
    @cuda.jit
    def chain_tokens_kernel(token_ids, sampled, src):
        t = cuda.grid(1)
        if t < token_ids.shape[0] and src[t] >= 0:
            token_ids[t] = sampled[src[t]]

    return chain_tokens_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def embedding(token_ids, table, out, stream=0):
    """out (T, H) float32 <- rows token_ids (T,) of the bf16 table (V, H). Ids must be in [0, V)."""
    _check(token_ids.ndim == 1 and token_ids.dtype.kind == "i", "token_ids", "(T,) integer", token_ids)
    _check(table.ndim == 2 and table.dtype.name == "uint16", "table", "(V, H) uint16 bf16", table)
    _check(out.shape == (token_ids.shape[0], table.shape[1]) and out.dtype.name == "float32", "out",
           f"({token_ids.shape[0]}, {table.shape[1]}) float32", out)
    if out.shape[0]:
        launch(_embedding_kernel(), out.shape[0], THREADS, stream, token_ids, table, out)


def gather_rows(x, indices, out, stream=0):
    """out (S, H) float32 <- rows indices (S,) of x (T, H) float32."""
    _check(x.ndim == 2 and x.dtype.name == "float32", "x", "(T, H) float32", x)
    _check(indices.ndim == 1 and indices.dtype.kind == "i", "indices", "(S,) integer", indices)
    _check(out.shape == (indices.shape[0], x.shape[1]) and out.dtype.name == "float32", "out",
           f"({indices.shape[0]}, {x.shape[1]}) float32", out)
    if out.shape[0]:
        launch(_gather_rows_kernel(), out.shape[0], THREADS, stream, x, indices, out)


def chain_tokens(token_ids, sampled, src, stream=0):
    """token_ids (T,) int32, in place: token_ids[t] = sampled[src[t]] where src (T,) int32 is >= 0 (src
    values must index sampled); the other ids stay as they are."""
    _check(token_ids.ndim == 1 and token_ids.dtype.name == "int32", "token_ids", "(T,) int32", token_ids)
    _check(sampled.ndim == 1 and sampled.dtype.name == "int32", "sampled", "(N,) int32", sampled)
    _check(src.shape == token_ids.shape and src.dtype.name == "int32", "src", f"({token_ids.shape[0]},) int32",
           src)
    if token_ids.shape[0]:
        launch(_chain_tokens_kernel(), -(-token_ids.shape[0] // THREADS), THREADS, stream, token_ids, sampled, src)


def _check(ok, name, expected, array):
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got shape {tuple(array.shape)} dtype {array.dtype}")
