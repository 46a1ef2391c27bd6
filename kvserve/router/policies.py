"""Routing policies: which eligible replica gets a request.

round_robin   in turn, blind to load: the baseline.
least_load    fewest outstanding tokens (prompt + max_tokens still to come, counted by the router).
power_of_two  the less loaded of two picked at random: near least_load, without herding every
              router of a fleet onto the same idlest replica.
cache_aware   the replica where the request's first token is expected soonest, the prefix
              counted: each replica's cost is its outstanding work (prompt tokens it must still
              compute, output still to come) plus the prompt tokens this request would compute
              there (all but the prefix it holds). "Holds" is precise (the replica's published
              block hashes) or approximate (a prefix tree of the text sent). The replica holding
              the longest prefix wins unless its cost exceeds the cheapest replica's beyond both
              thresholds (then the cheapest): a short wait behind a busy replica costs less than
              computing the prefix again elsewhere and caching it twice. Counting the request's own
              uncached tokens is what makes this fair: an idle replica without the prefix is not
              "free", it must compute the whole prompt first.
              A prompt no replica holds goes to the replica this router has sent the least
              prompt text (then the cheapest): new prefixes are dealt out by footprint, so
              each replica keeps an even share of the prefixes in its cache and, prefixes being
              equally popular, of the requests. Dealing them out by momentary load instead left
              one replica with more prefixes than it could cache and more of the requests.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvserve.router.kv_blocks import ReplicaBlocks
from kvserve.router.prefix_tree import PrefixTree
from kvserve.router.replicas import Replica
from kvserve.router.request import RoutedRequest
from kvserve.router.settings import PolicySettings

APPROX_CHARS_PER_TOKEN = 4  # to compare the text tree's characters with tokens


class BlockIndex(Protocol):
    """cache_aware's precise source: the KV blocks each replica holds, and the prompt's block hashes
    as each replica's renderer makes them. The HTTP router's KVIndex (router/kv_index.py, from the
    replicas' /kv/events) and Ray Serve's StatsIndex (ray_serve/stats_index.py, from their routing
    stats) are the two."""

    async def prepare(self, req: RoutedRequest) -> None:
        """Tokenize and hash req's prompt for every renderer the replicas use (before choose)."""
        ...

    def usable(self, replica: Replica) -> ReplicaBlocks | None:
        """The replica's blocks, where its prompts can be hashed here as it hashes them."""
        ...

    def hashes(self, req: RoutedRequest, b: ReplicaBlocks) -> list[bytes] | None:
        """req's block hashes for b's renderer and block size (None: not prepared for them)."""
        ...

    def prompt_tokens(self, req: RoutedRequest) -> int | None:
        """req's prompt length in tokens, where prepare() tokenized it."""
        ...

    def mark_pending(self, replica: Replica, hashes: list[bytes]) -> None:
        """A request with these blocks was routed to replica: count them held while it runs."""
        ...

    def unmark_pending(self, replica: Replica, hashes: list[bytes]) -> None:
        """Its answer ended: they stay held a little longer (until the replica's own word)."""
        ...


@dataclass
class Decision:
    replica: Replica
    outcome: str  # round_robin | least_load | power_of_two | prefix_hit | load_fallback | no_match
    matched_tokens: int = 0
    source: str | None = None  # precise | approximate, when a prefix decided
    hashes: list[bytes] | None = None  # the prompt's blocks on that replica (precise)
    cost: int | None = None  # cache_aware: tokens that replica was expected to compute before this one's first


def _load(r: Replica) -> tuple[int, int]:
    return r.outstanding_tokens, r.in_flight


class Policy:
    name = "policy"

    def choose(self, candidates: list[Replica], req: RoutedRequest) -> Decision:
        raise NotImplementedError

    def routed(self, decision: Decision, req: RoutedRequest) -> None:
        """The request went to decision.replica."""

    def finished(self, decision: Decision) -> None:
        """Its answer ended (successfully or not)."""

    def forget(self, replica: Replica) -> None:
        """The replica left, or came back and may hold nothing."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, candidates: list[Replica], req: RoutedRequest) -> Decision:
        return Decision(candidates[next(self._next) % len(candidates)], self.name)


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self, load: Callable[[Replica], tuple[int, int]] = _load) -> None:
        self._turn = itertools.count()
        self._key = load

    def choose(self, candidates: list[Replica], req: RoutedRequest) -> Decision:
        # Ties (e.g. all idle) go round, so an idle fleet still spreads its requests.
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return Decision(min(rotated, key=self._key), self.name)


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: list[Replica], req: RoutedRequest) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], self.name)
        a, b = self._rng.sample(candidates, 2)
        return Decision(a if _load(a) <= _load(b) else b, self.name)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, settings: PolicySettings, index: BlockIndex | None) -> None:
        self.settings = settings
        self.index = index if settings.cache_source != "approximate" else None
        self.trees: dict[Replica, PrefixTree] = {}
        self._turn = itertools.count()

    def tree(self, r: Replica) -> PrefixTree:
        if r not in self.trees:
            self.trees[r] = PrefixTree(self.settings.tree_chunk_chars, self.settings.tree_max_chunks)
        return self.trees[r]

    def cost(self, r: Replica, prompt_tokens: int, matched: int) -> int:
        """Tokens r must compute before this request's first token (roughly): its outstanding work
        plus the prompt tokens it does not hold. Time to first token grows with it on a busy replica."""
        return r.outstanding_work + max(0, prompt_tokens - matched)

    def much_dearer(self, a: int, b: int) -> bool:
        """Cost a is beyond both thresholds above cost b: a small gap is noise, and between two busy
        replicas a large one still costs less than a prefix computed twice (as SGLang's router's)."""
        return a - b > self.settings.balance_abs_tokens and a > self.settings.balance_rel * b

    def match(self, r: Replica, req: RoutedRequest) -> tuple[int, str | None, list[bytes] | None]:
        """Tokens of req's prompt that r holds, by which source, and the prompt's block hashes."""
        if self.index is not None and (b := self.index.usable(r)) is not None:
            hashes = self.index.hashes(req, b)
            if hashes is not None:
                return b.match(hashes), "precise", hashes
        if self.settings.cache_source == "precise":
            return 0, None, None  # only published blocks count
        return self.tree(r).match(req.text) // APPROX_CHARS_PER_TOKEN, "approximate", None

    def choose(self, candidates: list[Replica], req: RoutedRequest) -> Decision:
        # Ties (all idle, say) go round, so an idle fleet still spreads its requests.
        start = next(self._turn) % len(candidates)
        candidates = candidates[start:] + candidates[:start]
        none = (0, None, None)
        matches = {r: self.match(r, req) for r in candidates} if req.routable else {}
        prompt = (self.index.prompt_tokens(req) if self.index is not None else None) or req.estimated_prompt_tokens()
        cost = {r: self.cost(r, prompt, matches.get(r, none)[0]) for r in candidates}
        cheapest = min(candidates, key=lambda r: (cost[r], r.in_flight))
        best = max(candidates, key=lambda r: (matches.get(r, none)[0], -cost[r]))
        tokens = matches.get(best, none)[0]
        if tokens < max(1, self.settings.min_match_tokens):
            best = min(candidates, key=lambda r: (self.footprint(r), cost[r]))
            outcome = "no_match"
        else:
            outcome = "prefix_hit"
        if self.much_dearer(cost[best], cost[cheapest]):
            best, outcome = cheapest, "load_fallback"
        m = matches.get(best, none)
        return Decision(best, outcome, m[0], m[1], m[2], cost[best])

    def footprint(self, r: Replica) -> int:
        """Tokens of prompt text this router has sent r (its text tree, least recently used
        dropped first), to deal new prefixes out evenly. Not the blocks r publishes: a replica's
        pool is full of whatever it cached last, so after a while every pool looks as full as
        the next."""
        return len(self.tree(r)) * self.settings.tree_chunk_chars // APPROX_CHARS_PER_TOKEN

    def routed(self, decision: Decision, req: RoutedRequest) -> None:
        if req.text:  # the approximate source's match, and every source's footprint
            self.tree(decision.replica).insert(req.text)
        if self.index is not None and decision.hashes:
            self.index.mark_pending(decision.replica, decision.hashes)

    def finished(self, decision: Decision) -> None:
        if self.index is not None and decision.hashes:
            self.index.unmark_pending(decision.replica, decision.hashes)

    def forget(self, replica: Replica) -> None:
        self.trees.pop(replica, None)


def make_policy(settings: PolicySettings, index: BlockIndex | None) -> Policy:
    if settings.name == "round_robin":
        return RoundRobin()
    if settings.name == "least_load":
        return LeastLoad()
    if settings.name == "power_of_two":
        return PowerOfTwo()
    if settings.name == "cache_aware":
        return CacheAware(settings, index)
    raise ValueError(f"unknown policy {settings.name!r}: use round_robin, least_load, power_of_two or cache_aware")
