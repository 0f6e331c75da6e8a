"""Which sequences run in the next step, and how many of their tokens.

Continuous batching (the default): every step is filled up to `max_num_batched_tokens` tokens and
`max_num_seqs` sequences. Running sequences go first, in arrival order: a decode costs one token, a prompt
still being prefilled costs the rest of its prompt or whatever budget is left (chunked prefill), so a long
prompt never stalls the decodes of others. Waiting sequences are then admitted while budget, sequence slots
and KV blocks last, after taking whatever their prompt finds in the prefix cache.

When a running sequence needs a new KV block and none is free, the most recently admitted running sequence
is preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later
(recomputation rather than swapping, as vLLM does by default). The engine keeps every sequence within
max_model_len <= the cache's capacity, so a sequence alone always fits and the loop always makes progress.

A request with n > 1 takes n sequence slots from its admission on (its first completion holds the other n - 1
in `forks` until the engine forks them at its first token), so the step that forks never exceeds
max_num_seqs sampled rows.

Static batching (`policy="static"`, for comparison and teaching): a batch is admitted only when the previous
one has completely finished, and then runs until its longest member ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyvllm.block_manager import BlockManager
from tinyvllm.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int          # tokens fed to the model for this sequence in this step
    copy: tuple[int, int] | None = None   # (source, destination) block to copy before the step (copy-on-write)
    forks: list[Sequence] = field(default_factory=list)  # completions that draw their first token from this row

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "continuous"):
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduler policy must be 'continuous' or 'static', got {policy!r}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_slots = 0     # sequence slots the running sequences take (with their forks to come)
        self._forming = True   # static policy: the current batch still admits sequences

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSequence]:
        try:
            return self._schedule()
        finally:
            self.blocks.end_plan()

    def _schedule(self) -> list[ScheduledSequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        # 1. running sequences, oldest first; preempt the youngest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_allocate(seq, n) and self.running[-1] is not seq:
                self._preempt(self.running.pop())
            if not self.blocks.can_allocate(seq, n):
                self._preempt(self.running.pop(i))  # it is the youngest: it waits for the others to finish
                continue
            scheduled.append(ScheduledSequence(seq, n, self.blocks.allocate(seq, n)))
            budget -= n
            i += 1
        # 2. waiting sequences. A static batch forms once the previous one has drained; it keeps admitting over
        # as many steps as the token budget needs, until it is full (max_num_seqs or the cache) or nothing waits.
        if self.policy == "static":
            self._forming = self._forming or not self.running
            if not self._forming:
                return scheduled
        while self.waiting and budget > 0 and self.num_slots + 1 + len(self.waiting[0].forks) <= self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                seq.num_computed_tokens = self.blocks.allocate_cached_prefix(seq)
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt_tokens = seq.num_computed_tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_allocate(seq, n):
                # give back the prefix blocks it took, so that a waiting sequence never holds blocks
                self.blocks.free_sequence(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            copy = self.blocks.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.num_slots += 1 + len(seq.forks)
            scheduled.append(ScheduledSequence(seq, n, copy))
            budget -= n
        if self.policy == "static" and budget > 0:  # admission stopped, and not for the budget: batch complete
            self._forming = False
        return scheduled

    def continue_decodes(self, seqs: list[Sequence], num_ending: int) -> list[ScheduledSequence] | None:
        """The next step, planned before the current one's tokens are known (the engine's async scheduling):
        one new token for each of `seqs`, if that is surely what schedule() would then run. `seqs` are the
        running sequences, in order, but for the `num_ending` the current step ends by length.

        None (and nothing allocated) when it is not sure: a waiting sequence could be admitted (a free
        sequence slot and token budget, and for static batching a batch still forming), some running
        sequence is not among them, or their new blocks would need a preemption."""
        if len(self.running) != len(seqs) + num_ending or len(seqs) > self.max_num_batched_tokens:
            return None
        admits = self.policy == "continuous" or self._forming
        slots = self.num_slots - num_ending
        if self.waiting and admits and (len(seqs) < self.max_num_batched_tokens and
                                        slots + 1 + len(self.waiting[0].forks) <= self.max_num_seqs):
            return None
        running = iter(self.running)
        if not all(any(seq is r for r in running) for seq in seqs):  # in running's order
            return None
        blocks = self.blocks
        needed = sum(blocks.blocks_needed(seq, 1) for seq in seqs)
        if needed > blocks.num_free_blocks:
            return None
        planned = [ScheduledSequence(seq, 1, blocks.allocate(seq, 1)) for seq in seqs]
        blocks.end_plan()
        return planned

    def add_forks(self, parent: Sequence, children: list[Sequence]) -> None:
        """The completions parent held in its forks start running beside it, sharing its blocks (the engine
        calls this in the step that draws their first tokens); the slots were taken at admission."""
        assert parent.forks == children and parent in self.running
        for child in children:
            self.blocks.fork(parent, child)
            child.status = SequenceStatus.RUNNING
        self.running.extend(children)
        parent.forks = []

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (stop, length or abort), wherever it is, and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.num_slots -= 1 + len(seq.forks)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.num_slots -= 1 + len(seq.forks)
        self.blocks.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
