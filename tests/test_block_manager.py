"""The block manager and scheduler as state machines under hypothesis: no block ever leaks or is shared
wrongly, whatever sequence of admissions, steps, preemptions and aborts happens, with requests of n > 1
completions forked at their first token (their shared blocks copied on write, never written shared)."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tinyvllm.block_manager import BlockManager, chain_hash
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.scheduler import Scheduler
from tinyvllm.sequence import Sequence

# a small vocabulary, so prompts share prefixes often and the prefix cache is exercised
token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=40)


class SchedulerMachine(RuleBasedStateMachine):
    """Drives a Scheduler the way the engine does, with a fake model that emits token 1 per sampled step."""

    @initialize(num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4, 8]),
                max_seqs=st.integers(1, 6), budget=st.integers(1, 64), policy=st.sampled_from(["continuous", "static"]),
                prefix=st.booleans())
    def setup(self, num_blocks, block_size, max_seqs, budget, policy, prefix):
        self.bm = BlockManager(num_blocks, block_size, prefix)
        self.scheduler = Scheduler(self.bm, max_seqs, budget, policy)
        self.capacity = num_blocks * block_size
        self.live: list[Sequence] = []
        self.finished: list[Sequence] = []

    @rule(prompt=token_lists, max_tokens=st.integers(1, 12), n=st.sampled_from([1, 1, 2, 3]))
    def add(self, prompt, max_tokens, n):
        if len(prompt) + max_tokens > self.capacity or n > self.scheduler.max_num_seqs:  # the engine's checks
            return
        rid = str(len(self.live) + len(self.finished))
        seqs = [Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n), 0, index=i) for i in range(n)]
        seqs[0].forks = seqs[1:]
        self.live.extend(seqs)
        self.scheduler.add(seqs[0])

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule()
    def step(self):
        scheduled = self.scheduler.schedule()
        assert scheduled, "a step with unfinished work scheduled nothing"
        assert sum(s.num_new_tokens for s in scheduled) <= self.scheduler.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
        assert len({id(s.seq) for s in scheduled}) == len(scheduled)
        assert sum(1 + len(s.seq.forks) for s in scheduled if s.samples) <= self.scheduler.max_num_seqs
        bs = self.bm.block_size
        for item in scheduled:
            seq = item.seq
            # every token about to be computed has a slot in the sequence's own blocks, none of them shared
            assert len(seq.block_table) * bs >= seq.num_computed_tokens + item.num_new_tokens
            first, last = seq.num_computed_tokens // bs, (seq.num_computed_tokens + item.num_new_tokens - 1) // bs
            assert all(self.bm.blocks[b].ref_count == 1 for b in seq.block_table[first:last + 1])
            if item.copy is not None:  # copy-on-write: the fresh block replaced the shared one
                assert seq.block_table[first] == item.copy[1]
                # the step's copies run in parallel: none may write a block another one reads
                assert all(other.copy is None or other.copy[1] != item.copy[0] for other in scheduled)
            samples = item.samples
            seq.num_computed_tokens += item.num_new_tokens
            if samples:
                seq.output_token_ids.append(1)
                if seq.forks:  # as the engine does: completions 1..n-1 draw their first tokens now
                    forks = list(seq.forks)
                    self.scheduler.add_forks(seq, forks)
                    assert all(f.block_table == seq.block_table for f in forks)
                    for fork in forks:
                        fork.output_token_ids.append(1)
                        self._finish_if_done(fork)
            self.bm.register_full_blocks(seq)
            self._finish_if_done(seq)

    def _finish_if_done(self, seq):
        if len(seq.output_token_ids) >= seq.params.max_tokens and not seq.is_finished:
            self.scheduler.finish(seq, "length")
            self.live.remove(seq)
            self.finished.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        rid = self.live[index % len(self.live)].request_id
        for seq in [s for s in self.live if s.request_id == rid]:  # the whole request, completion 0 first
            self.live.remove(seq)
            self.scheduler.finish(seq, "abort")
            self.finished.append(seq)

    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "bm"):
            return
        refs = [0] * self.bm.num_blocks
        for seq in self.live:
            for b in seq.block_table:
                refs[b] += 1
        for block in self.bm.blocks:
            assert block.ref_count == refs[block.block_id] >= 0
            assert (block.ref_count == 0) == (block.block_id in self.bm.free)
        assert not self.bm.held and not self.bm.copy_sources   # nothing held back between plans
        used = sum(1 for r in refs if r)
        assert used + self.bm.num_free_blocks == self.bm.num_blocks
        slots = sum(1 + len(s.forks) for s in self.scheduler.running)
        assert self.scheduler.num_slots == slots <= self.scheduler.max_num_seqs
        for seq in self.finished:
            assert not seq.block_table

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        if not hasattr(self, "bm"):
            return
        for key, block_id in self.bm.cached.items():
            assert self.bm.blocks[block_id].hash == key
        for seq in self.live:
            parent = None
            tokens = seq.all_token_ids
            for b, block_id in enumerate(seq.block_table):
                block = self.bm.blocks[block_id]
                if block.hash is None:
                    break
                chunk = tuple(tokens[b * self.bm.block_size:(b + 1) * self.bm.block_size])
                assert block.token_ids == chunk and block.hash == chain_hash(parent, chunk)
                parent = block.hash

    def teardown(self):
        # drain: every admitted request finishes and the cache is whole again
        if not hasattr(self, "bm"):
            return
        for _ in range(10_000):
            if not self.scheduler.has_unfinished():
                break
            self.step()
        assert not self.scheduler.has_unfinished()
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_prefix_hits_share_blocks_and_leave_one_token_to_compute():
    bm = BlockManager(10, 4)
    a = Sequence("a", list(range(10)), SamplingParams(), 0)
    assert bm.allocate_cached_prefix(a) == 0
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.register_full_blocks(a)                      # blocks 0..7 of a are full: two registered
    b = Sequence("b", list(range(8)), SamplingParams(), 0)
    assert bm.allocate_cached_prefix(b) == 4        # 8 tokens: only the first block, the last token recomputes
    assert b.block_table == a.block_table[:1] and bm.blocks[a.block_table[0]].ref_count == 2
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 10
    c = Sequence("c", list(range(9)), SamplingParams(), 0)
    assert bm.allocate_cached_prefix(c) == 8        # freed blocks stay cached until reused
    bm.free_sequence(c)
    hog = Sequence("hog", [9] * 40, SamplingParams(), 0)
    bm.allocate(hog, 40)                            # takes every block: the cache entries are evicted
    assert not bm.cached


def test_a_static_batch_fills_over_several_steps_then_closes():
    # prompts of 8 tokens under a 10-token budget: admitting them takes several steps
    scheduler = Scheduler(BlockManager(64, 4, False), 8, 10, "static")
    seqs = [Sequence(str(i), [i] * 8, SamplingParams(max_tokens=30), 0) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    late, later = (Sequence(name, [9] * 8, SamplingParams(max_tokens=30), 0) for name in ("late", "later"))
    for step in range(8):
        scheduled = scheduler.schedule()
        for item in scheduled:
            samples = item.samples  # before the update below, as the engine reads it
            item.seq.num_computed_tokens += item.num_new_tokens
            if samples:
                item.seq.output_token_ids.append(1)
        if step == 0:
            scheduler.add(late)   # arrives while the batch still forms: it joins
        if step == 5:
            assert len(scheduled) == 5 and all(item.num_new_tokens == 1 for item in scheduled)
            scheduler.add(later)  # the batch is complete and decoding: it waits for the batch to drain
    assert scheduler.running == seqs + [late] and list(scheduler.waiting) == [later]


def test_forked_completions_share_the_prompt_and_copy_the_last_block_on_write():
    bm = BlockManager(20, 4)
    scheduler = Scheduler(bm, 8, 64)
    params = SamplingParams(n=3, max_tokens=4)
    seqs = [Sequence("r", list(range(10)), params, 0, index=i) for i in range(3)]   # 10 tokens: 2 full + 2
    seqs[0].forks = seqs[1:]
    scheduler.add(seqs[0])
    [item] = scheduler.schedule()
    assert scheduler.num_slots == 3 and item.copy is None and len(seqs[0].block_table) == 3
    seqs[0].num_computed_tokens += item.num_new_tokens
    scheduler.add_forks(seqs[0], seqs[1:])
    assert [bm.blocks[b].ref_count for b in seqs[0].block_table] == [3, 3, 3] and bm.num_free_blocks == 17
    for s in seqs:
        s.output_token_ids.append(5)
    decode = scheduler.schedule()   # each writes token 10 into the shared last block
    copies = [item.copy for item in decode]
    last = seqs[2].block_table[2]
    assert copies[2] is None and [c[0] for c in copies[:2]] == [last, last]   # the last holder writes in place
    assert [s.block_table[:2] for s in seqs] == [seqs[0].block_table[:2]] * 3  # full blocks stay shared
    assert bm.blocks[last].ref_count == 1 and bm.num_free_blocks == 15
    for s in seqs:
        scheduler.finish(s, "length")
    assert bm.num_free_blocks == 20 and scheduler.num_slots == 0


def test_a_copy_source_whose_last_holder_is_preempted_is_held_back_for_the_step():
    """Found by the machine above: A (n = 2) copies its shared last block, then B needs blocks and preempts A's
    fork, the block's last holder, in the same plan. The block must not become another copy's destination
    before the step's copies have run; after the plan it is free again."""
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a, fork = (Sequence("a", [0] * 7, SamplingParams(max_tokens=2, n=2), 0, index=i) for i in range(2))
    bm.allocate(a, 7)
    a.num_computed_tokens = 7
    bm.fork(a, fork)
    source = a.block_table[3]                      # the partly filled last block, now shared
    copy = bm.allocate(a, 1)
    assert copy is not None and copy[0] == source
    bm.free_sequence(fork)                         # the preemption of the last other holder
    assert source in bm.held and source not in bm.free and bm.blocks[source].ref_count == 0
    others = [Sequence(str(i), [0], SamplingParams(max_tokens=1), 0) for i in range(bm.num_free_blocks)]
    assert all(source not in (bm.allocate(s, 1) or ()) and source not in s.block_table for s in others)
    bm.end_plan()
    assert source in bm.free and not bm.held
