"""The paged KV cache's bookkeeping: which fixed-size blocks each sequence owns, and the prefix cache.

The cache is one pool of `num_blocks` blocks of `block_size` token slots. A sequence's block table lists its
blocks in order; token j lives in slot `block_table[j // block_size] * block_size + j % block_size`.

Automatic prefix caching: a block that is full is identified by a hash of its tokens chained with the hash
of the block before it, so equal hashes mean equal whole prefixes. Full blocks are registered under their
hash; a new sequence whose prompt starts with the same tokens takes those blocks (their reference count goes
up) instead of computing them again. A block whose reference count drops to zero is not wiped: it goes to
the end of the free list, still registered, and can be revived by a later hit; blocks are reused for new
data from the front of the free list, least recently freed first, and lose their registration then (LRU).

Parallel sampling (a request with n > 1, the PagedAttention paper's scheme): when the first completion has
computed the prompt, `fork` gives each other completion the same block table, every block's reference count
going up by one. A block is written by one sequence only: before a step writes into a block that others
still hold (the partly filled last block of the prompt), `allocate` gives the writer a fresh block and
returns (shared, fresh) for the runner to copy first (copy-on-write); the last holder writes in place. So a
prompt's blocks are stored once, and each completion owns only the blocks it writes.
While a step is planned, a block it copies from stays out of the free list even if a preemption in the same
plan drops its last holder (`held`), until the plan is complete (`end_plan`): the step's copies run side by
side in one kernel, so a source must not become another copy's destination in the same step. Later steps'
writes run after the copies (one stream).

Invariants (checked by tests/test_block_manager.py under hypothesis): between plans every block is either
free (ref count 0, in the free list) or used (ref count > 0, not in the free list); free + used == num_blocks;
no copy of a step writes a block another copy of it reads; ref counts never go negative; a registered hash
maps to a block whose tokens are exactly the hashed ones.
"""

from __future__ import annotations

from collections import OrderedDict

from tinyvllm.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None          # set once the block is full and registered
        self.token_ids: tuple[int, ...] = ()   # the tokens a registered block holds (collision check)


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: its tokens and everything before it (through `parent`)."""
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}      # hash -> block id
        self.copy_sources: set[int] = set()   # blocks this step's copies read
        self.held: OrderedDict[int, None] = OrderedDict()   # copy sources whose last holder left this plan

    def end_plan(self) -> None:
        """A step's plan is complete (the scheduler calls this): its copies will run before any later step
        writes, so the copy sources held back return to the free list."""
        self.free.update(self.held)
        self.held.clear()
        self.copy_sources.clear()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission --------------------------------------------------------------------------------------

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the registered blocks its tokens start with; returns the tokens they cover.

        At most (num_tokens - 1) // block_size blocks are taken, so at least one token is left to compute
        (the model must run on the last token to produce the next one's logits).
        """
        assert not seq.block_table, "sequence already holds blocks"
        # NOTE: a sequence that wants prompt logprobs computes its whole prompt (vLLM does the same): a cached
        # block's logits are gone
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0
        tokens = seq.all_token_ids
        parent = None
        for b in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[b * self.block_size:(b + 1) * self.block_size])
            key = chain_hash(parent, chunk)
            block_id = self.cached.get(key)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            parent = key
        seq.num_hashed_blocks = len(seq.block_table)
        return len(seq.block_table) * self.block_size

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """The index in seq's block table of the block its next token goes to, if other sequences hold it.
        NOTE: only a forked sequence can write into a shared block (the prefix cache shares full blocks, never
        written again), so the others skip the lookup: this runs for every sequence at every step."""
        if not seq.forked:
            return None
        b = seq.num_computed_tokens // self.block_size
        if b < len(seq.block_table) and self.blocks[seq.block_table[b]].ref_count > 1:
            return b
        return None

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks the next `num_new_tokens` tokens of `seq` take (a copy-on-write block included)."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        return needed + 1 if seq.forked and self._shared_write_block(seq) is not None else needed

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> tuple[int, int] | None:
        """Make room for the next `num_new_tokens` tokens of `seq` (call can_allocate first). Returns the
        (source, destination) block copy the runner must make before the step, or None: when the first new
        token goes to a block other sequences hold, seq gets a private copy of it (copy-on-write)."""
        shared = self._shared_write_block(seq) if seq.forked else None
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        needed += shared is not None
        if needed > self.num_free_blocks:
            raise RuntimeError(f"KV cache exhausted: need {needed} blocks, {self.num_free_blocks} free")
        copy = None
        if shared is not None:
            source, fresh = seq.block_table[shared], self._fresh()
            self.blocks[source].ref_count -= 1   # still >= 1: the other holders keep it
            self.copy_sources.add(source)
            seq.block_table[shared] = fresh
            copy = (source, fresh)
        for _ in range(self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            seq.block_table.append(self._fresh())
        return copy

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks and its computed tokens (a completion of the same prompt)."""
        assert not child.block_table, "sequence already holds blocks"
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1   # in use already: never in the free list
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks
        parent.forked = child.forked = True

    def _fresh(self) -> int:
        """Take the least recently freed block for new data (its prefix-cache entry, if any, is dropped)."""
        block_id = next(iter(self.free))
        block = self.blocks[block_id]
        if block.hash is not None:         # evict its prefix-cache entry: its data is about to change
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        self._take(block_id)
        return block_id

    # -- after a step -----------------------------------------------------------------------------------

    def register_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that became full of computed tokens since the last call.

        Only the new ones are hashed (seq.num_hashed_blocks counts the others), so a step costs O(new blocks)
        per sequence, not O(length).
        """
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        start = seq.num_hashed_blocks
        parent = self.blocks[seq.block_table[start - 1]].hash if start else None
        for b in range(start, full):
            block = self.blocks[seq.block_table[b]]
            chunk = tuple(seq.token_ids_slice(b * self.block_size, (b + 1) * self.block_size))
            block.hash, block.token_ids = chain_hash(parent, chunk), chunk
            # an equal block registered earlier keeps its entry; this one stays private to seq
            self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash
        seq.num_hashed_blocks = max(start, full)

    def free_sequence(self, seq: Sequence) -> None:
        """Return the blocks of a finished or preempted sequence (most recently used go to the back)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than taken"
            if block.ref_count == 0:
                if block_id in self.copy_sources:
                    self.held[block_id] = None
                else:
                    self.free[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:   # a prefix-cache hit may revive a held-back block: it is only read
            (self.held if block_id in self.held else self.free).pop(block_id)
        block.ref_count += 1
