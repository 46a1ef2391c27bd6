"""Drafters: guesses of the tokens that follow a sequence, for the engine to verify in one step.

A `Drafter` is asked, once per step, for up to k tokens after each of a batch of sequences; it may
return fewer or none. Anything may propose (another model, a lookup table): a wrong guess costs
compute, never correctness, since every drafted token is checked against the target model
(engine/verify.py). The interface is batched so that a draft model can run one forward for all.

`NgramDrafter` is prompt lookup: the latest n-gram of a sequence's tokens (n from
prompt_lookup_max down to prompt_lookup_min) is searched for earlier in its own prompt + output,
and the tokens that followed its most recent earlier occurrence are proposed, with the length of
the match (`peek`): a 1-token match is a weak guess, an 8-token one a strong one. Answers that copy
from the prompt (rewriting, quoting, code edits) and repetitive output are where it pays. The
search is one vectorised pass over an int32 copy of the tokens, kept per sequence and
extended with each step's new tokens (microseconds for thousands of tokens).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from kvserve.engine.request import Sequence


class Drafter(Protocol):
    """What every drafter does. A drafter may also offer any of the protocols below; the speculator
    (engine/speculative.py) uses each one it has and does without the others."""

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, k): at most k tokens to follow its token_ids, in order."""
        ...


@runtime_checkable
class Peeks(Protocol):
    """Shows its drafts before the plan, with the length of the match each continues (prompt lookup,
    whose lookups cost microseconds): the speculator weighs each draft by its match and drafts those."""

    def peek(self, requests: list[tuple[Sequence, int]]) -> list[tuple[int, list[int]]]: ...


@runtime_checkable
class FallsBehind(Protocol):
    """Reads a sequence's tokens before it can draft for it (a draft model's catch-up)."""

    def behind(self, seq: Sequence) -> int:
        """Tokens of seq it has yet to read."""
        ...


@runtime_checkable
class TimesForwards(Protocol):
    """Runs forwards of its own (a draft model); its last propose() timed them."""

    forward_times: list[tuple[int, float]]  # (rows, seconds) per forward of the last propose()


@runtime_checkable
class TimesCatchUp(Protocol):
    """Caught up in its last propose(): how many tokens it read, in how long."""

    prefill_tokens: int
    prefill_seconds: float


@runtime_checkable
class Forgets(Protocol):
    """Keeps something per sequence (a lookup's tokens, a draft model's KV blocks)."""

    def forget(self, seq: Sequence) -> None:
        """seq finished or was preempted: drop what was kept for it."""
        ...


class _Tokens:
    """A sequence's tokens as a growing int32 array (appended to, never rewritten)."""

    def __init__(self) -> None:
        self.buf = np.zeros(256, dtype=np.int32)
        self.n = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        new = len(token_ids)
        if new > self.buf.size:
            grown = np.zeros(max(new, 2 * self.buf.size), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if new > self.n:
            self.buf[self.n : new] = token_ids[self.n : new]
            self.n = new
        return self.buf[:new]


def lookup(a: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    of a (n_max >= n >= n_min); [] when no suffix of n_min tokens occurred before."""
    return match(a, k, n_min, n_max)[1]


def match(a: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[int, list[int]]:
    """lookup()'s tokens and the length n of the n-gram they continue ((0, []) when none): the
    longer the match, the likelier its continuation is what the model writes next."""
    L = a.size
    if L < 2 or k < 1:
        return 0, []
    ends = np.flatnonzero(a[: L - 1] == a[L - 1])  # j: a[j] matches the last token; a[j + 1] followed it
    if ends.size == 0:
        return 0, []
    # The suffix matched ending at each j, all lengths in one pass: token j - i against L - 1 - i
    # for i = 1 .. n_max - 1, the run of agreements from i = 1 on (cut at the array's start).
    back = np.arange(1, min(n_max, L - 1), dtype=np.int64)
    before = ends[:, None] - back
    agree = (a[np.maximum(before, 0)] == a[L - 1 - back]) & (before >= 0)
    matched = 1 + np.cumprod(agree, axis=1).sum(axis=1)
    best = int(matched.max())
    if best < n_min:
        return 0, []
    j = int(ends[np.flatnonzero(matched == best)[-1]])  # the most recent of the longest
    return best, a[j + 1 : min(j + 1 + k, L)].tolist()


class NgramDrafter:
    """Prompt lookup over each sequence's own tokens (see the module docstring)."""

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 8) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self._tokens: dict[str, _Tokens] = {}  # per sequence id, dropped by forget()

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [tokens for _, tokens in self.peek(requests)]

    def peek(self, requests: list[tuple[Sequence, int]]) -> list[tuple[int, list[int]]]:
        """propose()'s drafts with the length of the match each continues, before any is planned
        (a lookup costs microseconds, so the speculator weighs each draft by its match)."""
        out = []
        for seq, k in requests:
            arr = self._tokens.setdefault(seq.seq_id, _Tokens()).sync(seq.token_ids)
            out.append(match(arr, k, self.n_min, self.n_max))
        return out

    def forget(self, seq: Sequence) -> None:
        """The sequence finished: drop what was kept for it."""
        self._tokens.pop(seq.seq_id, None)
