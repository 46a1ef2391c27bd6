"""Prometheus metrics, on a registry of the app's own (two apps in one process never mix).

Latency histograms are observed by the server as requests progress; the engine's gauges and
counters (running, waiting, KV usage, prefix cache, tokens) are read from its last step's stats
at scrape time, with the same figures under vLLM's names beside them (kvserve/server/vllm_metrics.py).
All times are from the request's arrival at the server.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.engine import EngineStats
from kvserve.kv.disk_tier import DiskStats
from kvserve.outputs import RequestMetrics
from kvserve.server.vllm_metrics import CacheInfo, vllm_families

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], admitted: Callable[[], int], model_name: str,
                 cache: Callable[[], CacheInfo | None]) -> None:
        self._stats = stats
        self._admitted = admitted
        self._model_name = model_name
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvserve_requests_admitted", "Requests admitted and not yet answered.",
                                value=self._admitted())
        s = self._stats()
        if s is None:  # still loading
            return
        gauges = {
            "kvserve_num_requests_running": ("Sequences in the engine's running batch.", s.num_running),
            "kvserve_num_requests_waiting": ("Sequences waiting to be scheduled.", s.num_waiting),
            "kvserve_kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0 to 1).", s.kv_usage),
            "kvserve_kv_cache_blocks_used": ("KV cache blocks held by requests.", s.kv_blocks_used),
            "kvserve_kv_cache_blocks_total": ("KV cache blocks in the pool.", s.kv_blocks_total),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "kvserve_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            "kvserve_prefix_cache_hits": ("Prompt tokens found in the prefix cache (RAM or disk).", s.prefix_cache_hits),
            "kvserve_prompt_tokens": ("Prompt tokens computed (prefix cache hits excluded).", s.prompt_tokens),
            "kvserve_generation_tokens": ("Tokens generated.", s.generation_tokens),
            "kvserve_num_preemptions": ("Sequences preempted for lack of KV blocks.", s.num_preemptions),
            "kvserve_spec_decode_num_draft_tokens": ("Drafted tokens verified (speculative decoding).",
                                                     s.spec_draft_tokens),
            "kvserve_spec_decode_num_accepted_tokens": ("Drafted tokens accepted.", s.spec_accepted_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        if s.disk is not None:
            yield from _disk_families(s.disk)
        yield GaugeMetricFamily("kvserve_spec_decode_acceptance_rate",
                                "Accepted / drafted tokens since start (0 before any draft).",
                                value=s.spec_acceptance_rate)
        yield from vllm_families(s, self._model_name, self._cache())  # the same snapshot, vLLM's names


def _disk_families(d: DiskStats) -> Iterator[Metric]:
    """The KV disk tier (--kv-disk-path): what it holds, wrote, served and refused."""
    for name, doc, value in (
            ("kvserve_kv_disk_bytes_used", "Bytes of disk allocated to the disk tier's KV block files.", d.bytes_used),
            ("kvserve_kv_disk_bytes_capacity", "The disk tier's bound in bytes (--kv-disk-gib).", d.capacity_bytes),
            ("kvserve_kv_disk_blocks", "KV block files in the disk tier.", d.blocks)):
        yield GaugeMetricFamily(name, doc, value=value)
    for name, doc, value in (
            ("kvserve_kv_disk_blocks_written", "KV blocks evicted from RAM and written to disk.", d.blocks_written),
            ("kvserve_kv_disk_writes_dropped", "Evicted KV blocks not saved: the writer's queue was full.",
             d.writes_dropped),
            ("kvserve_kv_disk_hit_blocks", "Prefix cache hits read from the disk tier, in blocks.", d.hit_blocks),
            ("kvserve_kv_disk_hit_tokens", "Prefix cache hits read from the disk tier, in tokens.", d.hit_tokens),
            ("kvserve_kv_disk_load_errors", "KV block files that failed their checks on read (deleted, not served).",
             d.load_errors)):
        yield CounterMetricFamily(name, doc, value=value)


class _GrammarCollector(Collector):
    """The compiled-grammar cache and the compile pool (kvserve/structured/grammar_cache.py,
    kvserve/server/grammar_pool.py), read at scrape time."""

    def __init__(self, grammar: Callable[[], dict[str, float] | None]) -> None:
        self._grammar = grammar

    def collect(self) -> Iterator[Metric]:
        g = self._grammar()
        if g is None:  # still loading
            return
        for name, doc in (("hits", "Structured-output requests whose grammar was in the cache."),
                          ("misses", "Structured-output requests whose grammar had to be compiled."),
                          ("evictions", "Compiled grammars dropped from the cache (least recently used first)."),
                          ("compile_timeouts", "Grammar compiles that passed --grammar-compile-timeout.")):
            yield CounterMetricFamily(f"kvserve_grammar_{name}" if name == "compile_timeouts"
                                      else f"kvserve_grammar_cache_{name}", doc, value=g[name])
        yield GaugeMetricFamily("kvserve_grammar_cache_bytes", "Bytes of compiled grammars in the cache.",
                                value=g["bytes"])
        yield GaugeMetricFamily("kvserve_grammar_cache_entries", "Compiled grammars in the cache.", value=g["entries"])
        yield GaugeMetricFamily("kvserve_grammar_compiles_pending", "Grammar compiles queued or running.",
                                value=g["pending"])


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None], admitted: Callable[[], int],
                 grammar: Callable[[], dict[str, float] | None] = lambda: None, model_name: str = "",
                 cache: Callable[[], CacheInfo | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "kvserve_time_to_first_token_seconds", "From the request's arrival to its first generated token.",
            buckets=_LATENCY, registry=r)
        self.inter_token_latency = Histogram(
            "kvserve_inter_token_latency_seconds", "Between successive engine outputs of a request.",
            buckets=_TOKEN_GAP, registry=r)
        self.e2e_latency = Histogram(
            "kvserve_e2e_request_latency_seconds", "From the request's arrival to its last token.",
            buckets=_LATENCY, registry=r)
        self.queue_time = Histogram(
            "kvserve_request_queue_time_seconds", "From the request's arrival to its first scheduling.",
            buckets=_LATENCY, registry=r)
        self.finished = Counter(
            "kvserve_request_finished", "Completions ended, by finish reason (stop, length, abort, error).",
            ["finish_reason"], registry=r)
        r.register(_EngineCollector(stats, admitted, model_name, cache))
        r.register(_GrammarCollector(grammar))

    def observe_finished(self, m: RequestMetrics | None, reasons: list[str], end: float) -> None:
        """A request ended (finished, aborted or failed); `end` is time.monotonic() then."""
        for reason in reasons:
            self.finished.labels(finish_reason=reason).inc()
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
        self.e2e_latency.observe((m.finished_time or end) - m.arrival_time)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
