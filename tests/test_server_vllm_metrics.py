"""vLLM's metric names on a real server's /metrics, as the Gateway API Inference Extension's
endpoint picker and llm-d scrape them: parsed with prometheus_client's own parser, each value
equal to kvserve's own metric of the same meaning in the same scrape, while requests run and wait.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import MODEL_NAME, start_server

LABELS = {"model_name": MODEL_NAME, "engine": "0"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--max-num-seqs", "1")  # a second request waits
    yield s
    s.stop()


def scrape(url: str) -> dict[str, tuple[str, dict, float]]:
    """{sample name: (family type, labels, value)}, one sample per name (those used here have one)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            out[sample.name] = (family.type, sample.labels, sample.value)
    return out


def test_vllm_names_carry_kvserves_figures_under_a_running_and_a_waiting_request(server):
    body = {"model": MODEL_NAME, "prompt": " ".join(f"word{i}" for i in range(40)), "max_tokens": 1900,
            "ignore_eos": True, "temperature": 0, "stream": True}
    stop = threading.Event()

    def stream() -> None:
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    with server.client() as c:  # a finished request first: the prefix cache has been asked
        assert c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1}).status_code == 200
    threads = [threading.Thread(target=stream, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            m = scrape(server.url)
            if m["kvserve_num_requests_running"][2] == 1 and m["kvserve_num_requests_waiting"][2] == 1:
                break
            assert time.monotonic() < deadline, "the two requests were never running and waiting together"
            time.sleep(0.01)
    finally:
        stop.set()
    same = {"vllm:num_requests_running": ("gauge", "kvserve_num_requests_running"),
            "vllm:num_requests_waiting": ("gauge", "kvserve_num_requests_waiting"),
            "vllm:kv_cache_usage_perc": ("gauge", "kvserve_kv_cache_usage_perc"),
            "vllm:gpu_cache_usage_perc": ("gauge", "kvserve_kv_cache_usage_perc"),
            "vllm:prefix_cache_queries_total": ("counter", "kvserve_prefix_cache_queries_total"),
            "vllm:prefix_cache_hits_total": ("counter", "kvserve_prefix_cache_hits_total")}
    for name, (kind, ours) in same.items():
        assert m[name] == (kind, LABELS, m[ours][2]), name
    assert m["vllm:num_requests_running"][2] == 1 and m["vllm:num_requests_waiting"][2] == 1
    used, total = m["kvserve_kv_cache_blocks_used"][2], m["kvserve_kv_cache_blocks_total"][2]
    assert used > 0 and m["vllm:kv_cache_usage_perc"][2] == used / total
    assert m["vllm:prefix_cache_queries_total"][2] >= 40 and m["vllm:prefix_cache_hits_total"][2] > 0
    assert m["vllm:cache_config_info"] == ("gauge", {"block_size": "16", "cache_dtype": "float32",
                                                     "enable_prefix_caching": "True", "engine": "0",
                                                     "num_gpu_blocks": str(int(total))}, 1.0)
    assert not any(name.startswith("vllm:lora") for name in m)  # no LoRA adapters here
    for t in threads:
        t.join(30)
