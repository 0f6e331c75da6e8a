"""Attention's entry points and policies: which kernel, in which configuration, runs for a shape.

The engine calls decode_attention and prefill_attention; the kernel launchers behind them take their
configuration explicitly. Every policy is a pure function of the shapes (batch, heads, head_dim, block-table
width, KV format), never of the context lengths, so a captured CUDA graph stays valid.

Decode, paged_attention_gqa.paged_attention (decode_config gathers the three choices):
- decode_warps_policy: warps per block, SMALL_GRID_WARPS when the grid has no more blocks than the GPU has
  SMs, LARGE_GRID_WARPS from LARGE_GRID_MIN_BLOCKS blocks, MID_GRID_WARPS between (all capped by what the
  kernel's shared memory holds, fast_warps).
- decode_partitions: split-K or not; none while each warp walks at most SPLIT_ROUNDS KV blocks, else
  partitions of PARTITION_ROUNDS blocks per warp, as many as keep the grid at about TARGET_BLOCKS blocks.
- decode_lanes_policy: lanes per key, 4 for a grid of at most FOUR_LANES_MAX_BLOCKS blocks whose warps each walk
  LONG_WALK_ROUNDS KV blocks or more, DEFAULT_LANES_PER_KEY (8) otherwise.
- decode_workspace_size: the split's workspace for every batch up to a size (the runner allocates it once).
Prefill:
- uses_prefill_tc: a tensor-core kernel where the head size and the KV format allow, else
  attention.prefill_attention (the SIMT flash kernel); uses_prefill_pipelined: which one,
  attention_tc_pipelined.prefill_attention_tc_pipelined or attention_tc.prefill_attention_tc;
- prefill_tc_config, prefill_pipelined_config: their warps and keys per K/V tile, by head_dim;
- prefill_flash_config: the SIMT flash kernel's warps and query rows per block, by head_dim.
The numbers behind each choice are in docs/performance.md, "decode attention" and "prefill attention (tensor
cores)".
"""

from cuda_kernels import attention, attention_tc, attention_tc_pipelined, kv_format, paged_attention_gqa
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.paged_attention import MAX_WARPS
from cuda_kernels.paged_attention_gqa import fast_warps, heads_per_block
from cuda_kernels.primitives import SM_COUNT

# Lanes sharing one key by default (decode_lanes_policy picks 4 for some shapes).
DEFAULT_LANES_PER_KEY = 8
# NOTE: 4 lanes per key won where the grid has at most FOUR_LANES_MAX_BLOCKS blocks and each warp walks at least
# LONG_WALK_ROUNDS KV blocks (512 blocks are two full waves of 2 blocks per SM at 4 lanes, 1.3 waves of 3 at
# 8); everywhere else 8 lanes tied or won. At head_dim 128, 4 lanes spill (docs/performance.md).
LONG_WALK_ROUNDS = 16
# NOTE: the reduce kernel and the partials cost about two rounds of a warp's walk, so a split pays only for
# long contexts at small batches; a short context takes one pass of more warps (docs/performance.md).
SMALL_GRID_WARPS = MAX_WARPS if SIMULATOR else 8
SPLIT_ROUNDS = 4
PARTITION_ROUNDS = 2
TARGET_BLOCKS = 512
# Warps per block where the grid has more blocks than the GPU has SMs: MID_GRID_WARPS up to LARGE_GRID_MIN_BLOCKS
# blocks, LARGE_GRID_WARPS from there. NOTE: a kernel sweep found 2 warps faster than 4 at every such shape it
# timed; inside the decode step (context 256) 2 warps took batch 64, 128 and 256 (512 blocks and more) 2% below 4,
# and batch 32 (256 blocks) 9% above (docs/performance.md, "decode attention").
MID_GRID_WARPS = MAX_WARPS
LARGE_GRID_WARPS = 2
LARGE_GRID_MIN_BLOCKS = TARGET_BLOCKS
# NOTE: 1,024, not TARGET_BLOCKS: with 2 warps, 4 lanes also won at batch 128 (the same step, 1,024 blocks).
FOUR_LANES_MAX_BLOCKS = 2 * TARGET_BLOCKS
# The SIMT flash prefill's warps per block, and the query rows per block it tries, most first. The simulator
# runs one Python thread per CUDA thread and every warp reduction there is two block barriers: it gets smaller
# blocks (same code path).
PREFILL_FLASH_WARPS = 2 if SIMULATOR else 4
PREFILL_FLASH_ROWS = (16, 8) if SIMULATOR else (64, 32, 16)


# ---------------------------------------------------------------------------------------------------------
# decode policies


def _grid_blocks(num_seqs, num_heads, num_kv_heads):
    """Blocks of the fast kernel's grid per partition: (sequence, KV head, chunk of query heads)."""
    group = num_heads // num_kv_heads
    return int(num_seqs) * num_kv_heads * -(-group // heads_per_block(group))


def decode_warps_policy(num_seqs, num_heads, num_kv_heads, head_dim, lanes_per_key=DEFAULT_LANES_PER_KEY) -> int:
    """Warps per block of the fast kernel: more for a grid that does not fill the SMs, fewer for a large one."""
    blocks = _grid_blocks(num_seqs, num_heads, num_kv_heads)
    most = (SMALL_GRID_WARPS if blocks <= SM_COUNT
            else LARGE_GRID_WARPS if blocks >= LARGE_GRID_MIN_BLOCKS else MID_GRID_WARPS)
    return fast_warps(head_dim, num_heads // num_kv_heads, lanes_per_key, most=most)


def decode_lanes_policy(num_seqs, num_heads, num_kv_heads, head_dim, max_blocks) -> int:
    """Lanes per key of the fast kernel, from shapes only (max_blocks = block_tables.shape[1]):
    4 for a grid of at most FOUR_LANES_MAX_BLOCKS blocks whose warps each walk LONG_WALK_ROUNDS KV blocks or more
    (long contexts at mid-size batches), 8 otherwise (see the NOTE at LONG_WALK_ROUNDS)."""
    warps = decode_warps_policy(num_seqs, num_heads, num_kv_heads, head_dim, DEFAULT_LANES_PER_KEY)
    parts, partition_blocks = decode_partitions(num_seqs, num_heads, num_kv_heads, max_blocks, warps)
    blocks = parts * _grid_blocks(num_seqs, num_heads, num_kv_heads)
    long_walk = partition_blocks >= LONG_WALK_ROUNDS * warps
    return 4 if head_dim <= 64 and blocks <= FOUR_LANES_MAX_BLOCKS and long_walk else DEFAULT_LANES_PER_KEY


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


def decode_config(num_seqs, num_heads, num_kv_heads, head_dim, max_blocks) -> tuple[int, int, int]:
    """(lanes per key, warps, KV blocks per partition) of the fast kernel with a workspace: decode_lanes_policy,
    decode_warps_policy at those lanes, decode_partitions at those warps (max_blocks = block_tables.shape[1])."""
    lanes = decode_lanes_policy(num_seqs, num_heads, num_kv_heads, head_dim, max_blocks)
    warps = decode_warps_policy(num_seqs, num_heads, num_kv_heads, head_dim, lanes)
    return lanes, warps, decode_partitions(num_seqs, num_heads, num_kv_heads, max_blocks, warps)[1]


def decode_workspace_size(max_num_seqs, num_heads, num_kv_heads, head_dim, max_blocks) -> int:
    """float32 elements of the fast kernel's workspace for every batch of up to max_num_seqs sequences and
    block tables up to max_blocks wide, at either lanes_per_key (the runner allocates it once;
    decode_attention(..., workspace=))."""
    most = 0
    for s in range(1, int(max_num_seqs) + 1):
        for lanes in (4, 8):
            warps = decode_warps_policy(s, num_heads, num_kv_heads, head_dim, lanes)
            parts, _ = decode_partitions(s, num_heads, num_kv_heads, max_blocks, warps)
            if parts > 1:
                most = max(most, s * num_heads * parts * (head_dim + 2))
    return most


# ---------------------------------------------------------------------------------------------------------
# prefill policies


# NOTE: the pipelined kernel, the step after attention_tc in the prefill ladder, runs where a GPU has checked
# it against the reference and timed it faster (bf16 caches, head_dim up to 64: docs/performance.md, "prefill
# attention (tensor cores)"); elsewhere attention_tc. False runs attention_tc everywhere, for side-by-side runs.
PREFILL_PIPELINED = True
PIPELINED_FORMATS = ("bf16",)
PIPELINED_MAX_HEAD_DIM = 64


def uses_prefill_tc(head_dim: int, fmt: str) -> bool:
    """Whether prefill_attention takes the tensor-core kernel for this head size and KV format.

    NOTE: wherever it can (an fp32 cache, the checking format, takes the SIMT kernel); never in the simulator,
    where every emulated mma costs two block barriers over Python threads (the kernel tests cover both)."""
    return not SIMULATOR and head_dim in attention_tc.TC_HEAD_DIMS and fmt in attention_tc.TC_FORMATS


def uses_prefill_pipelined(head_dim: int, fmt: str) -> bool:
    """Whether prefill_attention's tensor-core kernel is the pipelined one (PREFILL_PIPELINED, and a format
    and head size it has been verified and timed at on a GPU) rather than attention_tc."""
    return PREFILL_PIPELINED and fmt in PIPELINED_FORMATS and head_dim <= PIPELINED_MAX_HEAD_DIM


def prefill_tc_config(head_dim: int) -> tuple[int, int]:
    """(warps per block, keys per K/V tile) of attention_tc.prefill_attention_tc for head_dim.

    NOTE: the largest tiles and most warps that fit the registers without spills (64-key tiles and 4 warps
    at head_dim up to 64, 16-key tiles and 2 warps at 128; register counts: docs/performance.md, "prefill
    attention (tensor cores)"). The simulator's emulated mma costs two block barriers per call: 2 warps
    and 16-key tiles there, so that tiny contexts still walk several tiles (the rescaling path)."""
    if SIMULATOR:
        return 2, 16
    return (4, 64) if head_dim <= 64 else (2, 16)


def prefill_pipelined_config(head_dim: int) -> tuple[int, int]:
    """(warps per block, keys per K/V tile) of attention_tc_pipelined.prefill_attention_tc_pipelined.

    NOTE: 4 warps and 64-key tiles at head_dim up to 64 (the fastest of the four timed on one 1,024-token
    prompt, with 32-key tiles within 0.3%), 32-key tiles at 128 (not timed yet); none spills registers
    (docs/performance.md, "prefill attention (tensor cores)"); the simulator's is prefill_tc_config's."""
    if SIMULATOR:
        return prefill_tc_config(head_dim)
    return (4, 64) if head_dim <= 64 else (4, 32)


def prefill_flash_config(head_dim: int) -> tuple[int, int]:
    """(warps per block, query rows per block) of attention.prefill_attention for head_dim: PREFILL_FLASH_WARPS,
    and the most rows of PREFILL_FLASH_ROWS whose block fits the kernel's static shared memory
    (attention.SHARED_BUDGET; 64, 32 or 16 for head_dim up to 128, the kernel's limit; past it the fewest, for
    the launcher to refuse)."""
    fits = (r for r in PREFILL_FLASH_ROWS if attention.flash_shared_bytes(head_dim, r) <= attention.SHARED_BUDGET)
    return PREFILL_FLASH_WARPS, next(fits, PREFILL_FLASH_ROWS[-1])


# ---------------------------------------------------------------------------------------------------------
# entry points


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out, stream=0, *, workspace=None,
                     k_scale=1.0, v_scale=1.0, planes=None, bf16_inputs: bool = False):
    """out (S, Hq, d) <- decode attention, as the engine runs it: paged_attention_gqa.paged_attention (same
    arguments) in decode_config's configuration. workspace: a float32 device array of at least
    decode_workspace_size(...) elements, or None. With it the context is split into decode_partitions(...)
    partitions and a second kernel merges them; without it one pass per (sequence, KV head), fine for big
    batches. planes, bf16_inputs: out's bf16 planes as well, for the O projection (paged_attention's)."""
    num_seqs, num_heads, head_dim = q.shape
    lanes, warps, partition_blocks = decode_config(num_seqs, num_heads, k_cache.shape[2], head_dim,
                                                   block_tables.shape[1])
    paged_attention_gqa.paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out, stream,
                                        lanes_per_key=lanes, warps=warps,
                                        partition_blocks=None if workspace is None else partition_blocks,
                                        workspace=workspace, k_scale=k_scale, v_scale=v_scale, planes=planes,
                                        bf16_inputs=bf16_inputs)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, max_q_len,
                      stream=0, k_scale=1.0, v_scale=1.0):
    """out (T, Hq, d) <- causal prefill attention, as the engine runs it (attention.prefill_attention's
    arguments and result): a tensor-core kernel (PREFILL_PIPELINED) in its configuration where uses_prefill_tc
    says, else the SIMT flash kernel in prefill_flash_config's."""
    head_dim = q.shape[2]
    fmt = kv_format.format_of(k_cache)
    if uses_prefill_tc(head_dim, fmt):
        if uses_prefill_pipelined(head_dim, fmt):
            warps, keys = prefill_pipelined_config(head_dim)
            kernel = attention_tc_pipelined.prefill_attention_tc_pipelined
        else:
            warps, keys = prefill_tc_config(head_dim)
            kernel = attention_tc.prefill_attention_tc
        kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, max_q_len, stream,
               warps=warps, keys_per_tile=keys, k_scale=k_scale, v_scale=v_scale)
    else:
        warps, rows = prefill_flash_config(head_dim)
        attention.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out,
                                    max_q_len, stream, warps=warps, rows=rows, k_scale=k_scale, v_scale=v_scale)
