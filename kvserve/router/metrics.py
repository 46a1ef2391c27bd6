"""The router's Prometheus metrics, on a registry of its own.

Per replica: requests, errors (by kind), retries (by reason), and, read at scrape time, requests
in flight, outstanding tokens and health. Routing: decisions by outcome (prefix hit, load
fallback, no match, or the plain policy's name) and the matched prefix length in tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.router.replicas import HEALTHY, Replica

_PREFIX_TOKENS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("kvserve_router_in_flight", "Requests in flight, per replica.", labels=["replica"])
        tokens = GaugeMetricFamily("kvserve_router_outstanding_tokens",
                                   "Prompt plus remaining max_tokens of requests in flight, per replica.",
                                   labels=["replica"])
        work = GaugeMetricFamily("kvserve_router_outstanding_work",
                                 "Uncached prompt tokens plus remaining max_tokens of requests in flight, per replica.",
                                 labels=["replica"])
        healthy = GaugeMetricFamily("kvserve_router_replica_healthy", "1 if the replica passes its health checks.",
                                    labels=["replica"])
        for r in self._replicas():
            in_flight.add_metric([r.url], r.in_flight)
            tokens.add_metric([r.url], r.outstanding_tokens)
            work.add_metric([r.url], r.outstanding_work)
            healthy.add_metric([r.url], 1.0 if r.state == HEALTHY else 0.0)
        yield from (in_flight, tokens, work, healthy)


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvserve_router_requests", "Requests sent to a replica (retries included).",
                                ["replica"], registry=r)
        self.errors = Counter("kvserve_router_errors",
                              "Failed attempts: connect, status (429/503/5xx), midstream, timeout.",
                              ["replica", "kind"], registry=r)
        self.retries = Counter("kvserve_router_retries", "Requests sent again to another replica, by why.",
                               ["replica", "reason"], registry=r)
        self.decisions = Counter("kvserve_router_decisions", "Routing decisions by outcome.",
                                 ["policy", "outcome"], registry=r)
        self.matched = Histogram("kvserve_router_matched_prefix_tokens",
                                 "Prompt tokens the chosen replica was expected to hold.",
                                 buckets=_PREFIX_TOKENS, registry=r)
        self.first_byte = Histogram("kvserve_router_first_byte_seconds",
                                    "From the request's arrival at the router to the replica's first byte.",
                                    buckets=_LATENCY, registry=r)
        self.rejected = Counter("kvserve_router_rejected", "Requests answered by the router itself, by status.",
                                ["status"], registry=r)
        self.waiting = Gauge("kvserve_router_waiting_requests", "Requests waiting for a replica to come up.",
                             registry=r)
        r.register(_ReplicaCollector(replicas))
        self.rejected_503 = self.rejected.labels("503")
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """metric.labels(*labels), looked up once: labels() takes a lock and builds keys each call."""
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
