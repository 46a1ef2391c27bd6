"""Speculative decoding's planning: which sequences draft this step, and how many tokens.

A decoding sequence normally computes one token per step. With a draft of k tokens it computes
1 + k (its last token and the draft, as 1 + k rows of the step's batch) and emits 1 to k + 1 of
them (engine/verify.py). A drafted row pays only when what it is expected to bring beats what
it costs, and both are measured, not assumed:

  alpha  = a decayed estimate of the chance that a sequence's drafted token is accepted (tokens
           accepted / tokens tried, a try ending at the first rejection), starting optimistic;
           its j-th drafted token is emitted with probability alpha^j.
  T(R)   = the time of a decode step of R rows, drafting included (StepTimes: fitted as a + b·R to
           this engine's own decode steps, so it knows whether a row is nearly free — a float model reading its
           weights once for any batch — or costs a share of the step, as in the integer kernels).
  A step starts with its decode rows (N = R expected tokens, one each); candidate drafted tokens
  are added best gain first while gain · T(R) > N · (T(R + 1) - T(R)): each row must raise the
  step's expected tokens per second. The per-sequence cap k (alpha^k >= MIN_GAIN), the request's
  max_tokens, the model length and max_step_rows bound it too. After EXPLORE_EVERY steps in a row
  of refused drafts, one step drafts one token anyway, so the cost of rows is measured afresh.
A sequence whose k falls to 0 stops drafting and probes again after PROBE_EVERY steps, twice as
long after each probe that fails (up to MAX_PROBE_EVERY), so text that never repeats itself costs
a probe row now and then, not a row per step. Probes are drafted whatever the cost model says.

The drafter is prompt lookup (engine/drafter.py) or, with method "draft", a draft model's greedy
tokens (engine/draft_model.py): it runs its own forwards, so each drafted row costs a draft step too.

Sequences with a grammar (their token masks would have to advance along the draft) and
prefill-only requests never draft; a request opts out with SamplingParams(speculative=False).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.config import SpeculativeConfig
from kvserve.engine.drafter import Drafter, NgramDrafter
from kvserve.engine.request import Sequence

MIN_GAIN = 0.2
DECAY = 0.8  # weight of the past in the acceptance estimate, per verified step
PROBE_EVERY, MAX_PROBE_EVERY = 8, 128
PROBE_TOKENS = 2
ROW_SHARE = 0.4  # before two row counts are measured: one more row costs this share of a row's step time
FORGET = 0.98  # per recorded step, the weight of older step times (contexts grow, machines get busy)
# After this many steps in a row where the cost model refused every wanted draft, one step drafts
# one token anyway: its time re-measures what rows cost (an estimate from a few old, slow steps would
# otherwise never be corrected, since refused rows are never timed).
EXPLORE_EVERY = 16


@dataclass
class SpecState:
    """One sequence's acceptance record."""

    accepted: float = 1.0  # decayed counts; the prior says "accepted", so a sequence starts drafting
    tried: float = 1.0
    idle_steps: int = 0  # steps without a draft while its k is 0
    probe_every: int = PROBE_EVERY

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried

    def k(self, limit: int) -> int:
        a = self.alpha
        if a >= 1.0:
            return limit
        k = int(math.log(MIN_GAIN) / math.log(a)) if a > 0 else 0
        if k > 0:
            return min(k, limit)
        self.idle_steps += 1
        if self.probing:
            return min(PROBE_TOKENS, limit)
        return 0

    @property
    def probing(self) -> bool:
        return self.idle_steps >= self.probe_every

    def observe(self, drafted: int, accepted: int) -> None:
        tried = accepted + (accepted < drafted)  # a try ends at the first rejection
        was_idle = self.probing
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + tried
        if was_idle:  # a probe: back off further if it failed
            self.idle_steps = 0
            self.probe_every = PROBE_EVERY if accepted else min(2 * self.probe_every, MAX_PROBE_EVERY)


class StepTimes:
    """Decode steps' times by rows, fitted as T(R) = a + b·R (weighted least squares over a mean
    per row count, older steps fading by FORGET). With one row count measured, b is ROW_SHARE of
    its time per row; with none, times are in units of a one-row step. `row_cost` fixes b as a
    share of T(1) instead (0: rows are free, draft whenever acceptance allows)."""

    def __init__(self, row_cost: float | None = None) -> None:
        self.row_cost = row_cost
        self._by_rows: dict[int, list[float]] = {}  # rows -> [weight, mean seconds]
        self._warm: set[int] = set()

    def record(self, rows: int, seconds: float) -> None:
        if rows not in self._warm:  # a first step of this many rows also grows the native step's buffers
            self._warm.add(rows)
            return
        for point in self._by_rows.values():
            point[0] *= FORGET
        point = self._by_rows.setdefault(rows, [0.0, 0.0])
        point[0] += 1.0
        point[1] += (seconds - point[1]) / point[0]

    def line(self) -> tuple[float, float]:
        """(a, b) of T(R) = a + b·R."""
        pts = [(r, w, t) for r, (w, t) in self._by_rows.items() if w > 0.05]
        if self.row_cost is not None or len(pts) < 2:
            if pts:  # the most weighted row count anchors the line
                r0, _, t0 = max(pts, key=lambda p: p[1])
                per_row = t0 / r0
            else:
                r0, t0, per_row = 1, 1.0, 1.0
            b = (ROW_SHARE if self.row_cost is None else self.row_cost) * per_row
            return t0 - b * r0, b
        w = sum(p[1] for p in pts)
        mr = sum(p[0] * p[1] for p in pts) / w
        mt = sum(p[2] * p[1] for p in pts) / w
        var = sum(p[1] * (p[0] - mr) ** 2 for p in pts)
        b = max(0.0, sum(p[1] * (p[0] - mr) * (p[2] - mt) for p in pts) / var)
        return mt - b * mr, b


class Speculator:
    """Plans each step's drafts (for the scheduler) and keeps the acceptance counters."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter: Drafter | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter or NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        self._state: dict[str, SpecState] = {}
        self.step_times = StepTimes(config.row_cost)
        self._refused = 0  # consecutive steps whose wanted drafts the cost model refused
        self.num_drafted = 0  # tokens drafted and verified
        self.num_accepted = 0  # of which accepted
        self.num_draft_steps = 0  # sequence-steps that verified a draft

    def eligible(self, seq: Sequence) -> bool:
        """A decoding sequence that may draft: one token to compute (its newest), no grammar."""
        return (seq.params.speculative and seq.matcher is None and seq.num_uncomputed == 1
                and seq.prompt_done and not seq.request.prefill_only)

    def plan(self, seqs: list[Sequence]) -> dict[Sequence, list[int]]:
        """Drafts for those of seqs that draft this step (non-empty lists only)."""
        candidates: list[tuple[float, bool, Sequence]] = []  # (gain, probe, seq), one per drafted token
        decoding = 0
        for seq in seqs:
            decoding += seq.num_uncomputed == 1
            if not self.eligible(seq):
                continue
            room = min(seq.request.max_output_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids)) - 1
            limit = min(self.config.num_speculative_tokens, room)
            if limit <= 0:
                continue
            state = self._state.setdefault(seq.seq_id, SpecState())
            k = state.k(limit)
            probe = state.probing
            candidates += [(state.alpha ** j, probe, seq) for j in range(1, k + 1)]
        if not candidates:
            return {}
        a, b = self.step_times.line()
        explore = self._refused >= EXPLORE_EVERY
        rows, expected = decoding, float(decoding)
        counts: dict[Sequence, int] = {}
        for gain, probe, seq in sorted(candidates, key=lambda c: (not c[1], -c[0])):  # probes, then best gain
            if rows >= self.config.max_step_rows:
                break
            if not probe and gain * (a + b * rows) <= expected * b:  # the row would lower tokens per second
                if not explore:
                    break
                explore = False  # one row: enough to time a step one row longer
            counts[seq] = counts.get(seq, 0) + 1
            rows += 1
            expected += gain
        self._refused = 0 if counts else self._refused + 1
        if not counts:
            return {}
        asks = list(counts.items())
        drafts = self.drafter.propose(asks)
        return {seq: d[:k] for (seq, k), d in zip(asks, drafts) if d}

    def record_step(self, rows: int, seconds: float) -> None:
        """A decode step (every row a decoding sequence's token or a drafted one) took this long."""
        self.step_times.record(rows, seconds)

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens was verified, and `accepted` of them kept."""
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_draft_steps += 1
        state = self._state.get(seq.seq_id)
        if state is not None:
            state.observe(drafted, accepted)

    def forget(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """What the drafter keeps for seq goes (a draft model's KV blocks); its record stays. Called
        on preemption too."""
        forget = getattr(self.drafter, "forget", None)
        if forget is not None:
            forget(seq)
