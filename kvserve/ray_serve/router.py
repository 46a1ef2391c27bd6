"""kvserve's cache-aware policy (kvserve/router/policies.py `CacheAware`) as Ray Serve's request
router for the KvserveReplica deployment.

Serve calls `choose_replicas` with the request the ingress sent (a ForwardedRequest: the body is
there, so the prompt is), and takes back ranks of replicas, trying each rank in turn and, within
one, the replica with the fewest ongoing requests that accepts (its `max_ongoing_requests`). So:
  - prefix hit: rank 1 is the replicas holding the longest prefix of the prompt (ties broken by
    Serve's queue lengths), rank 2 the rest, for when those are full;
  - no match, or loads imbalanced past the policy's thresholds (outstanding work routed by this
    router): one rank of all, i.e. the least busy replica (Serve's queue lengths).
"Holds" is precise (stats_index.py: the replicas' own block hashes) where this router can render
prompts as the replica does, else approximate (the text this router sent each replica), as
`kvserve route`'s policy does. Options (`request_router_kwargs`): PolicySettings' cache_source,
balance_abs_tokens, balance_rel, min_match_tokens, tree_chunk_chars, tree_max_chunks, and
default_max_tokens (the output a request that names none is expected to cost).
"""
from __future__ import annotations

import logging
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.ray_serve.forwarding import ForwardedRequest
from kvserve.ray_serve.stats_index import StatsIndex
from kvserve.router.policies import CacheAware, Decision
from kvserve.router.replicas import HEALTHY, Load, Replica
from kvserve.router.request import RoutedRequest, parse_request
from kvserve.router.settings import PolicySettings

log = logging.getLogger("kvserve.ray_serve")

_OPTIONS = ("cache_source", "balance_abs_tokens", "balance_rel", "min_match_tokens", "tree_chunk_chars",
            "tree_max_chunks")
_KEPT_REQUESTS = 4096  # parsed requests waiting for a replica (past it, the oldest are dropped: cancelled ones)


class CacheAwareRouter(RequestRouter):
    def initialize_state(self, default_max_tokens: int = 256, **options) -> None:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"request_router_kwargs: unknown {', '.join(unknown)}; known: default_max_tokens, "
                             f"{', '.join(_OPTIONS)}")
        self.settings = PolicySettings(name="cache_aware", **options)
        self.default_max_tokens = default_max_tokens
        self.index = StatsIndex()
        self.policy = CacheAware(self.settings, self.index)
        self._kv: dict[ReplicaID, Replica] = {}
        self._requests: OrderedDict[str, RoutedRequest] = OrderedDict()
        self._in_flight: dict[str, tuple[Load, Decision]] = {}

    def _replica(self, r: RunningReplica) -> Replica:
        """The policy's view of r: this router's load on it and, from its stats, its blocks."""
        kv = self._kv.get(r.replica_id)
        if kv is None:
            kv = self._kv[r.replica_id] = Replica(r.replica_id.unique_id, state=HEALTHY)
        self.index.update(kv, r.routing_stats)
        return kv

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for replica_id in [i for i in self._kv if i not in self._replicas]:
            self._forget(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        kv = self._kv.pop(replica_id, None)
        if kv is not None:
            kv.removed = True
            self.policy.forget(kv)
            self.index.forget(kv)

    async def _routed_request(self, pending: PendingRequest) -> RoutedRequest:
        key = pending.metadata.internal_request_id
        req = self._requests.get(key)
        if req is None:
            fwd = pending.args[0] if pending.args and isinstance(pending.args[0], ForwardedRequest) else None
            req = parse_request(fwd.path, fwd.body) if fwd is not None else RoutedRequest("")
            self._requests[key] = req
            while len(self._requests) > _KEPT_REQUESTS:
                self._requests.popitem(last=False)
        await self.index.prepare(req)  # (renderers loaded since its last try are added)
        return req

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or len(candidate_replicas) < 2:
            return [candidate_replicas] if candidate_replicas else []
        pending_request.routing_context.should_backoff = True  # every replica full: wait before trying again
        req = await self._routed_request(pending_request)
        pairs = [(c, self._replica(c)) for c in candidate_replicas]
        decision = self.policy.choose([kv for _, kv in pairs], req)
        log.debug("request %s: %s, %d tokens matched", pending_request.metadata.request_id, decision.outcome,
                  decision.matched_tokens)
        if decision.outcome != "prefix_hit":  # the least busy; equals in random order (Serve takes the first)
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        best = [c for c, kv in pairs if self.policy.match(kv, req)[0] >= decision.matched_tokens]
        rest = [c for c in candidate_replicas if c not in best]
        return [best, rest] if rest else [best]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        key = pending_request.metadata.internal_request_id
        req, kv = self._requests.pop(key, None), self._kv.get(replica_id)
        if req is None or kv is None:
            return
        tokens, source, hashes = self.policy.match(kv, req) if req.routable else (0, None, None)
        decision = Decision(kv, "routed", tokens, source, hashes)
        prompt_tokens = self.index.prompt_tokens(req) or req.estimated_prompt_tokens()
        max_tokens = (req.max_tokens if req.max_tokens is not None else self.default_max_tokens) * req.n
        self._in_flight[key] = (kv.start(prompt_tokens, max_tokens, tokens), decision)
        self.policy.routed(decision, req)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        done = self._in_flight.pop(internal_request_id, None)
        if done is not None:
            load, decision = done
            load.release()
            self.policy.finished(decision)
