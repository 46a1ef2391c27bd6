"""A request's timeline, recorded by the engine, read from a real server."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from kvserve import LLM
from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.timeline import TimelineRecorder
from kvserve.sampling_params import SamplingParams
from server_harness import API_KEY, MODEL_NAME, start_server

MESSAGES = [{"role": "user", "content": "Count from one to twenty."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _monotone(events: list[dict]) -> bool:
    return all(a["t"] <= b["t"] for a, b in zip(events, events[1:])) and all(e.get("end", e["t"]) >= e["t"] for e in events)


def test_streamed_request_timeline_is_consistent(server, client) -> None:
    sent = time.monotonic()  # the server's clock is the same CLOCK_MONOTONIC (one machine)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True, "kvserve": {"timeline": True}})
    first_text = None
    chunks = []
    for c in stream:
        if first_text is None and c.choices and c.choices[0].delta.content:
            first_text = time.monotonic()
        chunks.append(c)
    final = chunks[-1]
    assert final.choices[0].finish_reason == "length"
    assert all("kvserve" not in (c.model_extra or {}) for c in chunks[:-1])  # only the final chunk has it
    body = final.model_extra["kvserve"]["timeline"]
    assert body["id"] == final.id and len(body["prompts"]) == 1
    tl = body["prompts"][0]
    events, summary = tl["events"], tl["summary"]
    kinds = [e["event"] for e in events]
    assert kinds[:3] == ["arrival", "tokenized", "queued"] and kinds[-1] == "finished"
    assert events[-1]["finish_reasons"] == ["length"] and tl["finished"]
    assert _monotone(events)
    # 16 tokens: the prefill samples the first, each decode step one more.
    assert summary["decode_steps"] == kinds.count("decode") == 16 - 1
    assert summary["prefill_chunks"] == kinds.count("prefill") >= 1 and summary["preemptions"] == 0
    first = next(e for e in events if e["event"] == "first_token")
    assert kinds.index("first_token") > kinds.index("prefill") and first["t"] == summary["time_to_first_token"]
    assert all(e["batch_seqs"] >= 1 and e["batch_tokens"] >= e["tokens"] for e in events if "tokens" in e)
    # Against the client's clock: sent <= arrival <= first token <= the client saw it.
    arrival = tl["arrival_monotonic"]
    assert sent <= arrival <= arrival + first["t"] <= first_text
    assert first_text - (arrival + first["t"]) < 1.0  # delivery: the SSE hop to this process (loaded machine)
    # The endpoint returns the same record.
    got = httpx.get(f"{server.url}/v1/requests/{final.id}/timeline", headers=server.headers, timeout=10)
    assert got.status_code == 200 and got.json() == body


def test_unknown_id_is_404_and_whole_response_carries_it(server, client) -> None:
    r = httpx.get(f"{server.url}/v1/requests/chatcmpl-nope/timeline", headers=server.headers, timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["message"].startswith("no timeline for request 'chatcmpl-nope': the server keeps the last")
    whole = client.completions.create(model=MODEL_NAME, prompt=["One", "Two"], max_tokens=4, temperature=0,
                                      extra_body={"kvserve": {"timeline": True}})
    prompts = whole.model_extra["kvserve"]["timeline"]["prompts"]
    assert len(prompts) == 2 and all(p["summary"]["decode_steps"] <= 3 for p in prompts)
    plain = client.completions.create(model=MODEL_NAME, prompt="One", max_tokens=2)
    assert "kvserve" not in (plain.model_extra or {})


def test_preemption_and_chunks_are_recorded(tiny_llama_dir) -> None:
    # A pool of 6 blocks of 16 and 8-token chunks: three 30-token prompts cannot all stay.
    llm = LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=6, enable_prefix_caching=False),
              scheduler=SchedulerConfig(max_num_batched_tokens=32))
    prompts = [list(range(100 + 30 * i, 130 + 30 * i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tls = [llm.engine.timeline.get(o.request_id) for o in outs]
    assert sum(t["summary"]["preemptions"] for t in tls) >= 1
    for t in tls:
        s = t["summary"]
        assert _monotone(t["events"]) and t["finished"]
        assert s["decode_steps"] + s["prefill_chunks"] >= 1
        if s["preemptions"] == 0:
            assert s["decode_steps"] == 20 - 1
        else:
            assert s["recompute_chunks"] >= 1
    assert any(t["summary"]["prefill_chunks"] > 1 for t in tls)  # 30 tokens, budget 32 shared: chunked


def test_recorder_memory_is_bounded(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=32))
    llm.engine.timeline = TimelineRecorder(keep=3, max_events=5)
    outs = llm.generate([[5, 6, 7]] * 5, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [llm.engine.timeline.get(o.request_id) is None for o in outs] == [True, True, False, False, False]
    t = llm.engine.timeline.get(outs[-1].request_id)
    assert t["summary"]["decode_steps"] == 9 and t["summary"]["events_dropped"] > 0
