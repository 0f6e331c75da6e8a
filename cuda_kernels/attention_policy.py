"""The decode attention's policies: which configuration of paged_attention_gqa runs for a shape.

Pure functions of the shapes (batch, heads, head_dim, block-table width), never of the context lengths, so a
captured CUDA graph stays valid; paged_attention_gqa.paged_attention applies them unless told otherwise.
- decode_warps_policy: warps per block, SMALL_GRID_WARPS when the grid has no more blocks than the GPU has
  SMs, MAX_WARPS otherwise (both capped by what the kernel's shared memory holds, fast_warps).
- decode_partitions: split-K or not; none while each warp walks at most SPLIT_ROUNDS KV blocks, else
  partitions of PARTITION_ROUNDS blocks per warp, as many as keep the grid at about TARGET_BLOCKS blocks.
- decode_lanes_policy: lanes per key, 4 for a grid of at most TARGET_BLOCKS blocks whose warps each walk
  LONG_WALK_ROUNDS KV blocks or more, DEFAULT_LANES_PER_KEY (8) otherwise.
- decode_workspace_size: the split's workspace for every batch up to a size (the runner allocates it once).
The numbers behind each choice are in docs/performance.md, "decode attention".
"""

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.paged_attention import MAX_WARPS
from cuda_kernels.paged_attention_gqa import fast_warps, heads_per_block

# Lanes sharing one key by default (decode_lanes_policy picks 4 for some shapes).
DEFAULT_LANES_PER_KEY = 8
# NOTE: 4 lanes per key won where the grid has at most TARGET_BLOCKS blocks and each warp walks at least
# LONG_WALK_ROUNDS KV blocks (512 blocks are two full waves of 2 blocks per SM at 4 lanes, 1.3 waves of 3 at
# 8); everywhere else 8 lanes tied or won. At head_dim 128, 4 lanes spill (docs/performance.md).
LONG_WALK_ROUNDS = 16
# NOTE: the reduce kernel and the partials cost about two rounds of a warp's walk, so a split pays only for
# long contexts at small batches; a short context takes one pass of more warps (docs/performance.md).
SMALL_GRID_WARPS = MAX_WARPS if SIMULATOR else 8
SM_COUNT = 132                      # H200
SPLIT_ROUNDS = 4
PARTITION_ROUNDS = 2
TARGET_BLOCKS = 512


def _grid_blocks(num_seqs, num_heads, num_kv_heads):
    """Blocks of the fast kernel's grid per partition: (sequence, KV head, chunk of query heads)."""
    group = num_heads // num_kv_heads
    return int(num_seqs) * num_kv_heads * -(-group // heads_per_block(group))


def decode_warps_policy(num_seqs, num_heads, num_kv_heads, head_dim, lanes_per_key=DEFAULT_LANES_PER_KEY) -> int:
    """Warps per block of the fast kernel by default: more for a grid that does not fill the SMs."""
    small = _grid_blocks(num_seqs, num_heads, num_kv_heads) <= SM_COUNT
    return fast_warps(head_dim, num_heads // num_kv_heads, lanes_per_key,
                      most=SMALL_GRID_WARPS if small else MAX_WARPS)


def decode_lanes_policy(num_seqs, num_heads, num_kv_heads, head_dim, max_blocks) -> int:
    """Lanes per key of the fast kernel by default, from shapes only (max_blocks = block_tables.shape[1]):
    4 for a grid of at most TARGET_BLOCKS blocks whose warps each walk LONG_WALK_ROUNDS KV blocks or more
    (long contexts at mid-size batches), 8 otherwise (see the NOTE at LONG_WALK_ROUNDS)."""
    warps = decode_warps_policy(num_seqs, num_heads, num_kv_heads, head_dim, DEFAULT_LANES_PER_KEY)
    parts, partition_blocks = decode_partitions(num_seqs, num_heads, num_kv_heads, max_blocks, warps)
    blocks = parts * _grid_blocks(num_seqs, num_heads, num_kv_heads)
    long_walk = partition_blocks >= LONG_WALK_ROUNDS * warps
    return 4 if head_dim <= 64 and blocks <= TARGET_BLOCKS and long_walk else DEFAULT_LANES_PER_KEY


def decode_partitions(num_seqs, num_heads, num_kv_heads, max_blocks, warps):
    """(partitions, KV blocks per partition) of the fast kernel with a workspace and `warps` warps per block
    (decode_warps_policy), from shapes only: max_blocks = block_tables.shape[1]. No split (1 partition) while
    a warp walks at most SPLIT_ROUNDS KV blocks; else partitions of PARTITION_ROUNDS blocks per warp, at most
    as many as give the grid about TARGET_BLOCKS blocks."""
    width = max(int(max_blocks), 1)
    parts = 1
    if width > SPLIT_ROUNDS * warps:
        longest = -(-width // (PARTITION_ROUNDS * warps))
        wanted = -(-TARGET_BLOCKS // max(1, _grid_blocks(num_seqs, num_heads, num_kv_heads)))
        parts = max(1, min(longest, wanted))
    partition_blocks = -(-width // parts)
    return -(-width // partition_blocks), partition_blocks


def decode_workspace_size(max_num_seqs, num_heads, num_kv_heads, head_dim, max_blocks) -> int:
    """float32 elements of the fast kernel's workspace for every batch of up to max_num_seqs sequences and
    block tables up to max_blocks wide, at either lanes_per_key (the runner allocates it once;
    `paged_attention_gqa.paged_attention(..., workspace=)`)."""
    most = 0
    for s in range(1, int(max_num_seqs) + 1):
        for lanes in (4, 8):
            warps = decode_warps_policy(s, num_heads, num_kv_heads, head_dim, lanes)
            parts, _ = decode_partitions(s, num_heads, num_kv_heads, max_blocks, warps)
            if parts > 1:
                most = max(most, s * num_heads * parts * (head_dim + 2))
    return most
