"""The sampling family's entry points and policies: how the greedy argmax and the sampler split a batch.

The engine calls greedy and sample; the kernel launchers behind them (argmax.argmax, sampling.sample) take
their configuration explicitly. The policy is a pure function of the shapes (rows, vocabulary), never of the
logits, so a captured CUDA graph stays valid:
- argmax_partitions: the partitions of each row of the split kernels (argmax's v3, sample's v2): enough for
  about TARGET_BLOCKS blocks in all, each chunk at least MIN_CHUNK elements; none (P = 1) once the rows alone
  fill the grid;
- SPLIT_THREADS: their block size;
- argmax_workspace_size, sample_workspace_size: their workspaces, for every batch up to a size (the runner
  allocates them once).
The numbers behind each choice are in docs/performance.md, "split argmax".
"""

from cuda_kernels import argmax as argmax_kernels
from cuda_kernels import sampling as sampling_kernels
from cuda_kernels.compat import SIMULATOR

# NOTE: 128 threads per block was the best, or within 1% of it, of 128, 256 and 512 at 1, 64 and 256 rows of
# V = 128256 (docs/performance.md, "split argmax"). The simulator runs a Python thread per CUDA thread.
SPLIT_THREADS = 32 if SIMULATOR else 128
# The grid the split kernels aim for (about 8 blocks per SM of the H200's 132) and the smallest chunk worth a
# block.
TARGET_BLOCKS = 1024
MIN_CHUNK = 2048


def argmax_partitions(num_rows, vocab) -> tuple[int, int]:
    """(P, chunk) of the split kernels from shapes only (CUDA-graph safe): enough partitions per row for about
    TARGET_BLOCKS blocks in all, each chunk at least MIN_CHUNK elements (so P <= V // MIN_CHUNK); P = 1 (no
    stage 2, no workspace for the argmax) once the rows alone fill the grid or V < 2 * MIN_CHUNK. Llama 3's
    V = 128256: 62 x 2069 at 1 row, 16 x 8016 at 64 rows, 4 x 32064 at 256 (1 row: 62 blocks, at most one
    per SM)."""
    wanted = -(-TARGET_BLOCKS // max(1, int(num_rows)))
    most = int(vocab) // MIN_CHUNK
    return argmax_kernels.partition(vocab, max(1, min(wanted, most)))


def argmax_workspace_size(num_rows, vocab) -> int:
    """int32 elements of the split argmax's workspace for every batch of up to num_rows rows of V logits (the
    runner allocates it once for max_num_seqs; greedy(..., workspace=)). At least 1, so it can be allocated."""
    most = 0
    for s in range(1, min(int(num_rows), TARGET_BLOCKS) + 1):  # from TARGET_BLOCKS rows on, P = 1
        parts, _ = argmax_partitions(s, vocab)
        if parts > 1:
            most = max(most, s * parts)
    return max(1, most)


def sample_workspace_size(num_rows, vocab, threads=SPLIT_THREADS) -> int:
    """uint64 elements of the split sample's workspace for every batch of up to num_rows rows of V logits, at
    argmax_partitions and `threads`: the runner allocates it once for max_num_seqs (sample(..., workspace=)).
    At least 1, so it can be allocated. Llama 3's V = 128256 at 128 threads: 256 rows need 7.4 MB, one row
    0.09 MB."""
    # from TARGET_BLOCKS rows on P = 1, and the size only grows with the rows
    counts = list(range(1, min(int(num_rows), TARGET_BLOCKS) + 1)) + [int(num_rows)]
    return max([1] + [sampling_kernels.workspace_elements(s, argmax_partitions(s, vocab)[0], threads)
                      for s in counts if s > 0])


def greedy(logits, out, stream=0, *, workspace):
    """out (S,) int32 <- the greedy tokens of logits (S, V) float32, as the engine runs them: the split argmax
    (argmax.argmax's v3) over argmax_partitions(S, V) partitions of SPLIT_THREADS threads. workspace: an
    int32 device array of at least argmax_workspace_size(max rows, V) elements."""
    parts, _ = argmax_partitions(*logits.shape)
    argmax_kernels.argmax(logits, out, stream, SPLIT_THREADS, workspace=workspace, partitions=parts)


def sample(logits, temperature, top_k, top_p, min_p, uniform, out, stream=0, *, workspace):
    """out (S,) int32 <- the sampled tokens (sampling.sample's arguments and result), as the engine runs them:
    the split sample (its v2) over argmax_partitions(S, V) partitions of SPLIT_THREADS threads. workspace: a
    uint64 device array of at least sample_workspace_size(max rows, V) elements."""
    parts, _ = argmax_partitions(*logits.shape)
    sampling_kernels.sample(logits, temperature, top_k, top_p, min_p, uniform, out, stream, SPLIT_THREADS,
                            workspace=workspace, partitions=parts)
