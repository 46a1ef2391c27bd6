"""One token budget per step: running sequences first, then waiting ones.

There are no prefill and decode phases. Each sequence has num_computed_tokens catching up with
its tokens; a step gives it min(what it lacks, what the budget has left), so a long prompt is
prefilled in chunks while the others keep decoding, and a new request joins the next step.
When the pool runs dry the most recently admitted running sequence is preempted: its blocks
are freed and it returns to the head of the queue, to be recomputed (mostly from the prefix
cache). The head of the queue is never overtaken, so nothing starves.

With a Speculator, a decoding sequence that drafts k tokens is given 1 + k slots (its newest token
and the draft, counted in the budget, with blocks for them); if the pool cannot cover the draft it
decodes one token as usual, so a draft never preempts anyone. After the step it keeps the K/V of
its newest token and of the accepted draft tokens only: num_computed_tokens moves by 1 + accepted,
only those tokens' full blocks are published, and the blocks past them go back to the pool.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.engine.request import SeqStatus, Sequence
from kvserve.engine.speculative import Speculator
from kvserve.kv.manager import KVCacheManager


@dataclass
class SchedulerOutput:
    """What one step computes: the only thing that crosses from the scheduler to the runner."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # per scheduled sequence, its block ids
    # Sequences that verify a draft this step: their scheduled count is 1 + len(draft).
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, manager: KVCacheManager, speculator: Speculator | None = None) -> None:
        if config.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduler policy must be 'fcfs' or 'priority', got {config.policy!r}")
        self.config = config
        self.manager = manager
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = 0  # admission counter: the latest admitted is preempted first
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prefix-cache hits excluded

    def add(self, seq: Sequence) -> None:
        if self.config.policy == "priority":
            key = self._order_key(seq)
            pos = next((i for i, s in enumerate(self.waiting) if self._order_key(s) > key), len(self.waiting))
            self.waiting.insert(pos, seq)
        else:
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its blocks back (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.manager.free(seq.seq_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _order_key(self, seq: Sequence) -> tuple:
        return (seq.params.priority, seq.request.metrics.arrival_time, seq.index)

    def _victim(self) -> Sequence:
        if self.config.policy == "priority":
            return max(self.running, key=lambda s: (s.params.priority, s.admitted_at))
        return max(self.running, key=lambda s: s.admitted_at)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.manager.free(seq.seq_id)
        if self.speculator:  # a draft model's blocks for it go too
            self.speculator.release(seq)
        if seq.wants_prompt_outputs:  # its prompt's outputs so far are of blocks now gone
            seq.request.reset_prompt_outputs()
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bs = self.manager.block_size
        drafts = self.speculator.plan(self.running) if self.speculator else {}

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            if n == 0:
                continue
            draft = drafts.get(seq)
            if draft:
                draft = draft[: budget - 1]
                if draft and self.manager.allocate(seq.seq_id, seq.num_computed_tokens + 1 + len(draft)):
                    out.drafts[seq] = draft
                    n = 1 + len(draft)
            while not self.manager.allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = self._victim()
                self._preempt(victim, out)
                for j, (s, k) in enumerate(out.scheduled):  # priority order may pick one already in
                    if s is victim:
                        del out.scheduled[j]
                        out.drafts.pop(s, None)
                        budget += k
                        break
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                out.scheduled.append((seq, n))
                budget -= n

        if out.preempted:  # the pool is tight: admit nobody this step
            return self._with_tables(out)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.index > 0 and not seq.request.prompt_cached and self.manager.pool.enable_caching:
                break  # siblings wait for the first completion's prompt blocks, then share them
            # A sequence that must yield every prompt token's outputs computes them all.
            lookup = seq.num_computed_tokens == 0 and not seq.wants_prompt_outputs
            prefix = self.manager.find_prefix(seq.token_ids) if lookup else []
            computed = seq.num_computed_tokens or len(prefix) * bs
            n = min(len(seq.token_ids) - computed, budget)
            if not self.manager.allocate(seq.seq_id, computed + n, prefix):
                break
            if not seq.wants_prompt_outputs:  # (a lookup was made)
                self.manager.record_prefix_query(len(seq.token_ids), prefix)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = len(prefix) * bs
            seq.num_computed_tokens = computed
            seq.status = SeqStatus.RUNNING
            self._admissions += 1
            seq.admitted_at = self._admissions
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.monotonic()
            self.waiting.popleft()
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return self._with_tables(out)

    def _with_tables(self, out: SchedulerOutput) -> SchedulerOutput:
        out.block_tables = [self.manager.block_ids(seq.seq_id) for seq, _ in out.scheduled]
        return out

    def update(self, out: SchedulerOutput, accepted: dict[Sequence, int] | None = None) -> None:
        """After the step's forward: the scheduled tokens' K/V are in the cache, and the blocks
        they filled are published for prefix reuse. `accepted`: how many of each draft were kept
        (the rest of a draft's slots are rolled back)."""
        for seq, n in out.scheduled:
            if not seq.prompt_done:
                self.num_prompt_tokens_computed += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            draft = out.drafts.get(seq)
            if draft is None:
                seq.num_computed_tokens += n
                tokens = seq.token_ids
            else:  # the newest token and the accepted draft tokens are computed and verified
                a = accepted.get(seq, 0) if accepted else 0
                seq.num_computed_tokens += 1 + a
                tokens = seq.token_ids + draft[:a] if a else seq.token_ids  # as they will be once appended
                self.manager.trim(seq.seq_id, seq.num_computed_tokens)
            self.manager.cache_computed(seq.seq_id, tokens, seq.num_computed_tokens)
            if self.manager.sliding_window:  # blocks that left the window go back to the pool
                self.manager.slide(seq.seq_id, seq.num_computed_tokens)
            if seq.prompt_done:
                seq.request.prompt_cached = True

    def stalled(self) -> bool:
        """Whether nothing can ever be scheduled as things stand: no sequence runs (so none will
        finish and free blocks) while the head of the queue does not fit in the free blocks.
        Only blocks held outside the scheduler (e.g. LLM.prefill caches) can cause this."""
        return bool(self.waiting) and not self.running
