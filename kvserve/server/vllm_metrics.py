"""kvserve's engine figures under vLLM's metric names, so gateways built for vLLM route on kvserve.

The Gateway API Inference Extension's model-server protocol (docs/proposals/003-model-server-
protocol) reads, by default, `vllm:num_requests_waiting`, `vllm:num_requests_running` and
`vllm:kv_cache_usage_perc` (its releases before v1.3 read `vllm:gpu_cache_usage_perc`, which vLLM
deprecated in 0.9; both are given), and optionally `vllm:cache_config_info`'s `block_size` and
`num_gpu_blocks` labels for its prefix-cache scorer; llm-d's scorers read the same. vLLM's
`vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (tokens) are given too. Names, types, help
and labels (`model_name`, `engine`) are vLLM's; each value is the one kvserve's own metric of the
same meaning shows, from the same snapshot of the engine's stats. `vllm:lora_requests_info` is not
given: kvserve serves no LoRA adapters (vLLM without --enable-lora gives none either).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.engine.engine import EngineStats

LABELS = ("model_name", "engine")


@dataclass(frozen=True)
class CacheInfo:
    """What `vllm:cache_config_info` labels: the KV pool's shape."""
    block_size: int
    num_blocks: int  # vLLM's `num_gpu_blocks`: every block of the pool (kvserve's is in main memory)
    dtype: str
    prefix_caching: bool


def vllm_families(s: EngineStats, model_name: str, cache: CacheInfo | None) -> Iterator[Metric]:
    values = (model_name, "0")  # one engine
    gauges = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
        ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use "
         "vllm:kv_cache_usage_perc instead.", s.kv_usage),
    )
    for name, doc, value in gauges:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(values, value)
        yield g
    counters = (
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
         s.prefix_cache_queries),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits),
    )
    for name, doc, value in counters:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(values, value)
        yield c
    if cache is not None:
        info = {"block_size": str(cache.block_size), "cache_dtype": cache.dtype,
                "enable_prefix_caching": str(cache.prefix_caching), "num_gpu_blocks": str(cache.num_blocks),
                "engine": "0"}
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info))
        g.add_metric(list(info.values()), 1)
        yield g
