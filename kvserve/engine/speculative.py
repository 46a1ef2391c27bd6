"""Speculative decoding's planning: which sequences draft this step, and how many tokens.

A decoding sequence normally computes one token per step. With a draft of k tokens it computes
1 + k (its last token and the draft, as 1 + k rows of the step's batch) and emits 1 to k + 1 of
them (engine/verify.py). A drafted row pays only when what it is expected to bring beats what
it costs, and both are measured, not assumed:

  alpha  = a decayed estimate of the chance that a sequence's drafted token is accepted (tokens
           accepted / tokens tried, a try ending at the first rejection), starting optimistic;
           its j-th drafted token is emitted with probability alpha^j.
  T(R)   = the time of the target's decode step of R rows (StepTimes: fitted as a + b·R to this
           engine's own decode steps, so it knows whether a row is nearly free — a float model
           reading its weights once for any batch — or costs a share of the step, as in the
           integer kernels).
  D(n)   = with a draft model: the time of one of its forwards over n rows, d0 + d1·n, fitted the
           same way to its own timed forwards (and taken out of the step's time before StepTimes
           sees it). A step's drafting is a forward over the drafting sequences' newest tokens
           (giving d_1), then one per further draft position j over those drafting past j. So a
           drafted row costs b + d1, and the first row at a new depth j a whole forward's d0 too:
           with several users, one sequence drafting 4 costs four draft forwards where four
           sequences drafting 1 cost one. A linear fit of whole steps by rows cannot see that.
  A step starts with its decode rows (N expected tokens, one each); candidate drafted tokens are
  taken best gain first, each adding its gain to the expected tokens and its cost to the step's
  time, and the prefix with the most expected tokens per second is drafted (none, if no prefix
  beats the plain step). Costs linear in rows make that the marginal rule, gain · time > N · b;
  the draft's fixed forward costs are why the whole prefix is weighed. The per-sequence cap k
  (alpha^k >= MIN_GAIN), the request's max_tokens, the model length and max_step_rows bound it
  too. After EXPLORE_EVERY steps in a row of refused drafts, one step drafts one token anyway,
  so the cost of rows is measured afresh.
A drafter may have to read a sequence's tokens before its first draft (a draft model's KV starts
empty: it reads the whole prompt, and again whatever a sequence emitted while it did not draft).
That catch-up is paid once per sequence, not per step, so it is not a row of T(R): a sequence that
is P tokens behind starts drafting only when what its drafts are expected to save over its remaining
budget (max_tokens left, at most HORIZON) repays P · c, c the drafter's measured seconds per
catch-up token (CatchUpCost), and the catch-up's time is taken out of the step's before StepTimes
sees it. Saved time is counted at the step's rate: a drafted token of gain g is worth (step time) /
N seconds times g, less the b + d1 its row costs, over its share of the step's drafted rows, and
the sequence has about left / (1 + those gains) steps to go. While the step times or the catch-up
cost are not measured yet, one sequence a step catches up unweighed (and is timed), not all at once. (Catching up in chunks over several steps would spread the same work, not
save it: what pays is not starting a catch-up that the sequence's remaining tokens cannot repay.)
A sequence whose k falls to 0 stops drafting and probes again after PROBE_EVERY steps, twice as
long after each probe that fails (up to MAX_PROBE_EVERY), so text that never repeats itself costs
a probe row now and then, not a row per step. Probes are drafted whatever the cost model says.

A drafter that can show its drafts before the plan (`peek`: prompt lookup, whose lookups cost
microseconds) is weighed draft by draft instead: a drafted token's chance is that of the n-gram
match it extends (MatchAcceptance: accepted / tried by match length, learned from every verified
draft; a 1-token match is right about one time in four on copied text, an 8-token one nine in ten),
and each accepted token lengthens the match for the next, so the j-th token's gain is the product
of alpha(n), alpha(n + 1), ... alpha(n + j - 1). Each sequence scales those chances by its own
record (accepted / expected, fading towards 1 while it does not draft), which is how it adapts
to its text: a sequence the table over-rates drafts less, then not at all, and tries again later.
Only matches are drafted, so there is nothing to probe.

The drafter is prompt lookup (engine/drafter.py) or, with method "draft", a draft model's greedy
tokens (engine/draft_model.py): it runs its own forwards, so each drafted row costs a draft step too.

Sequences with a grammar (their token masks would have to advance along the draft) and
prefill-only requests never draft; a request opts out with SamplingParams(speculative=False).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.config import SpeculativeConfig
from kvserve.engine.drafter import Drafter, FallsBehind, Forgets, NgramDrafter, Peeks, TimesCatchUp, TimesForwards
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
# The most of a sequence's remaining max_tokens that its drafts' savings are counted over, when
# weighing its catch-up: a stop often comes first, and a request without max_tokens has the model's length.
HORIZON = 256
CATCH_UP_FORGET = 0.9  # per measured catch-up, the weight of older ones
MATCH_CAP = 8  # match lengths from this one on share an acceptance record
MATCH_PRIOR = 2.0  # pseudo-tries behind each match length's prior chance, n / (n + 1)
MATCH_FORGET = 0.995  # per try at a match length, the weight of older tries at it
IDLE_FORGET = 0.95  # per step a sequence does not draft, the weight of its own record
SEQ_PRIOR = 0.5  # pseudo-tokens, accepted as expected, behind a sequence's own record: drafts that
# keep failing bring its scale to ~0.1 (DECAY keeps ~5 drafts), and ~15 idle steps back over MIN_GAIN
MAX_ALPHA = 0.99


@dataclass
class SpecState:
    """One sequence's acceptance record."""

    accepted: float = 1.0  # decayed counts; the prior says "accepted", so a sequence starts drafting
    tried: float = 1.0
    idle_steps: int = 0  # steps without a draft while its k is 0
    probe_every: int = PROBE_EVERY
    got: float = 0.0  # with a peeking drafter: tokens accepted, and those its matches predicted
    expected: float = 0.0

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

    @property
    def factor(self) -> float:
        """This sequence's accepted tokens over the table's expectation (1 with no record)."""
        return (self.got + SEQ_PRIOR) / (self.expected + SEQ_PRIOR)

    def observe_match(self, expected: float, accepted: int) -> None:
        self.got = DECAY * self.got + accepted
        self.expected = DECAY * self.expected + expected

    def idle(self) -> None:
        self.got *= IDLE_FORGET
        self.expected *= IDLE_FORGET


class MatchAcceptance:
    """The chance that a prompt-lookup token is accepted, by the length of the match it extends
    (lengths from MATCH_CAP on share a record): decayed counts of every drafted token tried at
    that length (a try ends at the first rejection), from a prior of n / (n + 1)."""

    def __init__(self) -> None:
        self.accepted = [MATCH_PRIOR * n / (n + 1) for n in range(MATCH_CAP + 1)]
        self.tried = [MATCH_PRIOR] * (MATCH_CAP + 1)

    def alpha(self, n: int) -> float:
        b = min(n, MATCH_CAP)
        return self.accepted[b] / self.tried[b]

    def chances(self, n: int, k: int, factor: float = 1.0) -> list[float]:
        """The chance that each of k tokens drafted after a match of n is emitted."""
        g, out = 1.0, []
        for i in range(k):
            g *= min(MAX_ALPHA, self.alpha(n + i) * factor)
            out.append(g)
        return out

    def observe(self, n: int, drafted: int, accepted: int) -> None:
        for q in range(min(accepted + 1, drafted)):
            b = min(n + q, MATCH_CAP)
            self.accepted[b] = MATCH_FORGET * self.accepted[b] + (q < accepted)
            self.tried[b] = MATCH_FORGET * self.tried[b] + 1.0


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

    @property
    def measured(self) -> bool:
        """Whether line() is in seconds (a step was timed), not in units of a one-row step."""
        return bool(self._by_rows)

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


class CatchUpCost:
    """Seconds per token of the drafter's catch-up (a decayed ratio of measured seconds to tokens).
    Nothing measured: 0 (the speculator then lets one catch-up a step go ahead, to be timed).
    `fixed` sets the cost instead."""

    def __init__(self, fixed: float | None = None) -> None:
        self.fixed = fixed
        self._tokens = self._seconds = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        self._tokens = CATCH_UP_FORGET * self._tokens + tokens
        self._seconds = CATCH_UP_FORGET * self._seconds + seconds

    @property
    def measured(self) -> bool:
        return self.fixed is not None or self._tokens > 0

    @property
    def per_token(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return self._seconds / self._tokens if self._tokens else 0.0


class Speculator:
    """Plans each step's drafts (for the scheduler) and keeps the acceptance counters."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter: Drafter | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.drafter: Drafter = drafter or NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        # The drafter's optional parts (engine/drafter.py), looked up once: its methods do not change.
        self._peek = self.drafter.peek if isinstance(self.drafter, Peeks) else None  # drafts before the plan
        self._behind = self.drafter.behind if isinstance(self.drafter, FallsBehind) else None
        self._forget = self.drafter.forget if isinstance(self.drafter, Forgets) else None
        self._state: dict[str, SpecState] = {}
        self.matches = MatchAcceptance()
        self._matched: dict[str, tuple[int, float]] = {}  # planned drafts' match lengths and expected accepts
        self.step_times = StepTimes(config.row_cost)
        self.catch_up = CatchUpCost()
        self.draft_times = StepTimes()  # a draft model's forwards (not its catch-up), by rows
        self._draft_seconds = 0.0  # this step's drafting, timed apart from its rows
        self._blind_catch_up = False
        self.num_catch_up_tokens = 0  # tokens the drafter read to catch up (prompts, idle stretches)
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
        candidates: list[tuple[float, bool, int, Sequence]] = []  # (gain, probe, j, seq), one per drafted token
        left: dict[Sequence, tuple[int, list[float]]] = {}  # tokens each may still emit (up to HORIZON), its gains
        decoding = 0
        peek = self._peek
        peeked: dict[Sequence, tuple[int, list[int]]] = {}
        self._draft_seconds = 0.0
        self._blind_catch_up = False  # one catch-up a step may go unweighed, while costs are unmeasured
        for seq in seqs:
            decoding += seq.num_uncomputed == 1
            if not self.eligible(seq):
                continue
            room = min(seq.request.max_output_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids)) - 1
            limit = min(self.config.num_speculative_tokens, room)
            if limit <= 0:
                continue
            state = self._state.setdefault(seq.seq_id, SpecState())
            if peek is not None:
                [(n, tokens)] = peek([(seq, limit)])
                peeked[seq] = (n, tokens)
                gains = [g for g in self.matches.chances(n, len(tokens), state.factor) if g >= MIN_GAIN]
                probe = False
            else:
                k = state.k(limit)
                probe = state.probing
                gains = [state.alpha ** j for j in range(1, k + 1)]
            candidates += [(g, probe, j, seq) for j, g in enumerate(gains, 1)]
            left[seq] = (min(room + 1, HORIZON), gains)
        self._matched.clear()
        if not candidates:
            self._idle(left, {})
            return {}
        # A sequence's catch-up is weighed against the drafts it can expect per step: its share of
        # the step's rows (with four users and max_step_rows 8, one each), not its k.
        share = max(1, (self.config.max_step_rows - decoding) // len(left))
        left = {seq: (n, gains[:share]) for seq, (n, gains) in left.items()}
        a, b = self.step_times.line()
        # A draft model's forwards, timed apart (zero for a drafter that runs none, or unmeasured):
        # one reads the drafting sequences' newest tokens and gives d_1, the j-th after it gives
        # d_{j+1} for those drafting more than j. A row costs d1 in each; a forward d0 more.
        # row_cost 0 makes every row free, the draft model's too (a catch-up is still weighed).
        timed = self.draft_times.measured and self.step_times.measured and self.config.row_cost != 0
        d0, d1 = self.draft_times.line() if timed else (0.0, 0.0)
        explore = self._refused >= EXPLORE_EVERY
        rows, expected, seconds = decoding, float(decoding), a + b * decoding
        taken: list[Sequence] = []  # candidates taken, in order; the best prefix of them is planned
        best, best_rate = 0, expected / seconds
        depth: dict[int, int] = {}  # j -> sequences drafting at least j tokens
        skipped: set[Sequence] = set()  # behind by more than their drafts would repay
        # Probes, then best gain; among equal gains the shallower (untried sequences draft side by
        # side: one draft forward for all, where one drafting deep costs a forward per token).
        for gain, probe, j, seq in sorted(candidates, key=lambda c: (not c[1], -c[0], c[2])):
            if rows >= self.config.max_step_rows:
                break
            if seq in skipped:
                continue
            if j == 1 and not probe and not self._repays(seq, *left[seq], seconds / expected, b + d1):
                skipped.add(seq)
                continue
            seconds += b + d1 + (d0 if not depth.get(j) else 0.0)
            depth[j] = depth.get(j, 0) + 1
            rows += 1
            expected += gain
            taken.append(seq)
            if probe or expected / seconds > best_rate:  # probes go whatever the cost
                best, best_rate = len(taken), max(best_rate, expected / seconds)
        if explore and best < len(taken):
            best += 1  # one row more than pays: enough to time a step one row longer
        self._refused = 0 if best else self._refused + 1
        if not best:
            self._idle(left, {})
            return {}
        counts: dict[Sequence, int] = {}
        for seq in taken[:best]:
            counts[seq] = counts.get(seq, 0) + 1
        asks = list(counts.items())
        if peek is not None:  # the drafts are the peeked ones
            self._idle(left, counts)
            for seq, k in asks:
                self._matched[seq.seq_id] = (peeked[seq][0], sum(self.matches.chances(peeked[seq][0], k)))
            return {seq: peeked[seq][1][:k] for seq, k in asks}
        drafts = self.drafter.propose(asks)
        self._draft_seconds = 0.0
        if isinstance(self.drafter, TimesForwards):
            for n, t in self.drafter.forward_times:
                self.draft_times.record(n, t)
                self._draft_seconds += t
        if isinstance(self.drafter, TimesCatchUp) and (read := self.drafter.prefill_tokens):
            self._draft_seconds += self.drafter.prefill_seconds
            self.catch_up.record(read, self.drafter.prefill_seconds)
            self.num_catch_up_tokens += read
        return {seq: d[:k] for (seq, k), d in zip(asks, drafts) if d}

    def _idle(self, eligible: Iterable[Sequence], drafting: dict[Sequence, int]) -> None:
        """Eligible sequences that draft nothing this step let their own record fade (peeking only:
        the other drafters' records count idle steps towards a probe instead)."""
        if self._peek is not None:
            for seq in eligible:
                if seq not in drafting:
                    self._state[seq.seq_id].idle()

    def _repays(self, seq: Sequence, left: int, gains: list[float], per_token: float, row: float) -> bool:
        """Whether seq's drafts save more than its catch-up costs (the module docstring's rule):
        `left` tokens to emit, `gains` its drafted tokens', `per_token` seconds a token is worth,
        `row` seconds a drafted row costs."""
        lag = self._behind(seq) if self._behind is not None else 0
        if lag == 0:
            return True
        if not (self.step_times.measured and self.catch_up.measured):  # nothing to weigh it with yet:
            go, self._blind_catch_up = not self._blind_catch_up, True  # one a step goes, and is timed
            return go
        saved_per_step = sum(max(0.0, g * per_token - row) for g in gains)
        return left / (1 + sum(gains)) * saved_per_step > lag * self.catch_up.per_token

    def record_step(self, rows: int, seconds: float) -> None:
        """A decode step (every row a decoding sequence's token or a drafted one) took this long,
        drafting included: the draft model's forwards are taken out here (they are timed apart, and
        a catch-up is charged per sequence), so StepTimes fits the target's rows alone."""
        self.step_times.record(rows, seconds - self._draft_seconds)
        self._draft_seconds = 0.0

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens was verified, and `accepted` of them kept."""
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_draft_steps += 1
        state = self._state.get(seq.seq_id)
        matched = self._matched.pop(seq.seq_id, None)
        if matched is not None:
            n, expected = matched
            self.matches.observe(n, drafted, accepted)
            if state is not None:
                state.observe_match(expected, accepted)
        elif state is not None:
            state.observe(drafted, accepted)

    def forget(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """What the drafter keeps for seq goes (a draft model's KV blocks); its record stays. Called
        on preemption too."""
        if self._forget is not None:
            self._forget(seq)
