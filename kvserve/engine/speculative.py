"""Speculative decoding's planning: which sequences draft this step, and how many tokens.

A decoding sequence normally computes one token per step. With a draft of k tokens it computes
1 + k (its last token and the draft, as 1 + k rows of the step's batch) and emits 1 to k + 1 of
them (engine/verify.py). On a CPU the extra rows cost little while a step is bound by reading the
weights, but not nothing, so each sequence drafts only as far as its own record says pays:

  alpha = a decayed estimate of the chance that a drafted token is accepted (tokens accepted /
          tokens tried, a try ending at the first rejection), starting optimistic;
  k     = the largest k with alpha^k >= MIN_GAIN (the k-th drafted token is emitted with
          probability alpha^k; MIN_GAIN is what one more row must bring to be worth it),
          capped by num_speculative_tokens, max_tokens and the model length (never drafted past);
  and per step: drafted rows stop when the step's decode rows and drafts reach max_step_rows,
  the sequences with the best acceptance drafting first (past a few rows a CPU step costs each
  row its share, and a draft that is rejected costs a whole row).
A sequence whose k falls to 0 stops drafting and probes again after PROBE_EVERY steps, twice as
long after each probe that fails (up to MAX_PROBE_EVERY), so text that never repeats itself costs
a probe row now and then, not a row per step.

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
        if self.idle_steps >= self.probe_every:
            return min(PROBE_TOKENS, limit)
        return 0

    def observe(self, drafted: int, accepted: int) -> None:
        tried = accepted + (accepted < drafted)  # a try ends at the first rejection
        was_idle = self.idle_steps >= self.probe_every
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + tried
        if was_idle:  # a probe: back off further if it failed
            self.idle_steps = 0
            self.probe_every = PROBE_EVERY if accepted else min(2 * self.probe_every, MAX_PROBE_EVERY)


class Speculator:
    """Plans each step's drafts (for the scheduler) and keeps the acceptance counters."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter: Drafter | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter or NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        self._state: dict[str, SpecState] = {}
        self.num_drafted = 0  # tokens drafted and verified
        self.num_accepted = 0  # of which accepted
        self.num_draft_steps = 0  # sequence-steps that verified a draft

    def eligible(self, seq: Sequence) -> bool:
        """A decoding sequence that may draft: one token to compute (its newest), no grammar."""
        return (seq.params.speculative and seq.matcher is None and seq.num_uncomputed == 1
                and seq.prompt_done and not seq.request.prefill_only)

    def plan(self, seqs: list[Sequence]) -> dict[Sequence, list[int]]:
        """Drafts for those of seqs that draft this step (non-empty lists only)."""
        wants: list[tuple[float, Sequence, int]] = []
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
            if k > 0:
                wants.append((state.alpha, seq, k))
        rows_left = self.config.max_step_rows - decoding
        asks: list[tuple[Sequence, int]] = []
        for _, seq, k in sorted(wants, key=lambda w: -w[0]):  # the best acceptance first
            if rows_left <= 0:
                break
            asks.append((seq, min(k, rows_left)))
            rows_left -= asks[-1][1]
        if not asks:
            return {}
        drafts = self.drafter.propose(asks)
        return {seq: d[:k] for (seq, k), d in zip(asks, drafts) if d}

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
        forget = getattr(self.drafter, "forget", None)
        if forget is not None:
            forget(seq)
