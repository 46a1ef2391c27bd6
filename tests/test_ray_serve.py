"""kvserve under Ray Serve on a real two-node Ray cluster (tests/ray_harness.py), deployed from
deploy/ray/kvserve.yaml with a tiny model: OpenAI answers through Serve's proxy, prompts sharing a
prefix routed to the replica holding it, and a replica killed under load. First, in this process:
a request forwarded to kvserve's app as a replica runs it, and the arguments refused."""
from __future__ import annotations

import asyncio
import json
import time
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from server_harness import MODEL_NAME, REPO, tiny_model_dir

pytest.importorskip("ray.serve")
from ray_harness import RayCluster, free_port, wait_http  # noqa: E402

from kvserve.ray_serve.forwarding import ForwardedRequest, ResponseHead, call_app  # noqa: E402

REPLICA_HEADER = "x-kvserve-replica"
SYSTEM = ("You are the archivist of a very long and winding library. " * 40).strip()  # ~30 KV blocks


def forwarded(body: dict) -> ForwardedRequest:
    return ForwardedRequest("POST", "/v1/chat/completions", b"", ((b"content-type", b"application/json"),
                                                                  (b"transfer-encoding", b"chunked")),
                            json.dumps(body).encode())


def test_forwarded_request_gets_the_apps_answer_and_a_client_that_leaves_frees_its_blocks(make_llm):
    from fastapi.testclient import TestClient

    from kvserve.server.app import ServerSettings, build_app

    llm = make_llm()
    app = build_app(ServerSettings(model_name=MODEL_NAME), llm=llm)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0}

    async def run() -> tuple[list, list]:
        whole = [item async for item in call_app(app, forwarded(body))]
        stream = call_app(app, forwarded({**body, "max_tokens": 500, "stream": True}))
        first = [await anext(stream), await anext(stream)]
        await stream.aclose()  # the ingress's client left
        deadline = time.monotonic() + 10
        while llm.engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the abandoned stream was not aborted"
            await asyncio.sleep(0.01)
        return whole, first

    try:
        whole, first = asyncio.run(run())
        direct = TestClient(app).post("/v1/chat/completions", json=body)
    finally:
        app.state.ctx.state.shutdown()
    head, *chunks = whole
    assert isinstance(head, ResponseHead) and head.status == 200
    assert json.loads(b"".join(chunks))["choices"] == direct.json()["choices"]
    assert head.header(b"content-type") == b"application/json"
    assert isinstance(first[0], ResponseHead) and first[0].header(b"content-type").startswith(b"text/event-stream")
    assert first[1].startswith(b"data: ")
    assert llm.manager.pool.num_used_blocks == 0


def test_serve_args_that_do_not_apply_and_unknown_app_args_are_refused():
    from kvserve.ray_serve.app import build
    from kvserve.ray_serve.replica import parse_serve_args

    with pytest.raises(ValueError) as e:
        parse_serve_args("--model smollm2-135m --port=9000 --join http://router:8080")
    assert str(e.value) == ("serve_args: --port=9000, --join do not apply under Ray Serve (its proxy serves HTTP and "
                            "places replicas); leave them out")
    with pytest.raises(ValueError) as e:
        build({"serve_arg": "--model smollm2-135m"})
    assert str(e.value) == "unknown application args serve_arg: give serve_args and retries"
    assert parse_serve_args(["--threads", 2, "--max-num-seqs", "4"]).max_num_seqs == 4


def test_the_shipped_config_is_a_valid_serve_config_and_its_router_options_are_known():
    from ray.serve.schema import ServeDeploySchema

    from kvserve.ray_serve.app import build
    from kvserve.ray_serve.router import _OPTIONS

    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "deploy/ray/kvserve.yaml").read_text()))
    app = config.applications[0]
    build(app.args)  # the arguments parse; nothing loads yet
    replica = next(d for d in app.deployments if d.name == "KvserveReplica")
    assert replica.autoscaling_config["target_ongoing_requests"] == 16
    assert replica.request_router_config["request_router_class"] == "kvserve.ray_serve.router.CacheAwareRouter"
    assert set(replica.request_router_config["request_router_kwargs"]) <= {"default_max_tokens", *_OPTIONS}


def small_config(model_dir: Path, port: int) -> dict:
    """deploy/ray/kvserve.yaml, made small: the tiny model, two fixed replicas, one per node."""
    config = yaml.safe_load((REPO / "deploy/ray/kvserve.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    app["args"]["serve_args"] = (f"--model {model_dir} --dtype float32 --served-model-name {MODEL_NAME} "
                                 "--threads 1 --kv-cache-gib 0.02 --max-num-seqs 8")
    replica = next(d for d in app["deployments"] if d["name"] == "KvserveReplica")
    del replica["autoscaling_config"]
    replica.update(num_replicas=2, max_replicas_per_node=1, max_ongoing_requests=8,
                   ray_actor_options={"num_cpus": 0.5})
    replica["request_router_config"]["request_routing_stats_period_s"] = 0.3
    return config


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory)
    cluster = RayCluster()
    try:
        port = free_port()
        cluster.serve_run(small_config(model_dir, port))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/v1/models", 90)
        seen: set[str] = set()
        # Both replicas up: idle ones are picked at random, once Serve's router knows the second
        # (on a loaded machine the second node's replica can come up minutes after the first: past 2 in a
        # full `make test` on 2 cores, where the same test alone takes 45 s).
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=url, timeout=30) as http:
            while len(seen) < 2 and time.monotonic() < deadline:
                seen.add(http.get("/v1/models").headers[REPLICA_HEADER])
                time.sleep(0.05)
        assert len(seen) == 2, f"one replica answered: {seen}"
        yield url, cluster
    finally:
        cluster.stop()


def chat(http: httpx.Client, user: str, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, **extra}
    return http.post("/v1/chat/completions", json=body)


@pytest.mark.slow
def test_serve_answers_routes_by_prefix_and_survives_a_killed_replica(serve_url, tmp_path_factory):
    url, cluster = serve_url
    from openai import OpenAI

    from kvserve import LLM, CacheConfig, SamplingParams
    from kvserve.tokenizer.chat_template import ChatPrompt

    # Correct answers through Serve's proxy: the same greedy tokens as the engine run here.
    llm = LLM(str(tiny_model_dir(tmp_path_factory)), dtype="float32", cache=CacheConfig(num_blocks=64))
    want = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    got = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert got.choices[0].text == want
    whole = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=6, temperature=0)
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content

    # A shared system prompt: the first request lands somewhere; every later one follows it and
    # finds the prefix cached there (its whole blocks), in the second round its whole prompt.
    def ids(user: str) -> list[int]:
        return llm.tokenizer.encode_prompt(ChatPrompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]))

    shared = next(i for i, (a, b) in enumerate(zip(ids("Question 0?"), ids("Question 1?"))) if a != b)
    with httpx.Client(base_url=url, timeout=60) as http:
        first = chat(http, "Question 0?")
        assert first.status_code == 200, first.text
        holder = first.headers[REPLICA_HEADER]
        for round_ in range(2):
            with ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(lambda i: chat(http, f"Question {i}?"), range(1, 4)))
            for i, a in enumerate(answers, 1):
                assert a.status_code == 200, a.text
                assert a.headers[REPLICA_HEADER] == holder, f"round {round_}: routed away from the prefix's replica"
                cached = shared // 16 * 16 if round_ == 0 else (len(ids(f"Question {i}?")) - 1) // 16 * 16
                assert a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached

        # Kill the holder under load: streams in flight there, whole answers in flight there,
        # and requests sent after the kill.
        events: dict[int, list[str]] = {}
        started = threading.Barrier(3)

        def stream(i: int) -> str:
            body = {"model": MODEL_NAME, "messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": f"Tell story {i}."}],
                    "max_tokens": 1500, "temperature": 0, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = events.setdefault(i, [])
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 2:
                            started.wait(30)
                return r.headers[REPLICA_HEADER]

        with ThreadPoolExecutor(8) as pool:
            in_flight = [pool.submit(chat, http, f"Long question {i}?", 1000) for i in range(2)]
            streams = [pool.submit(stream, i) for i in range(2)]
            started.wait(30)  # (the whole answers, sent first, run there by now: most likely)
            os.kill(cluster.replica_pid(holder), signal.SIGKILL)
            after = [pool.submit(chat, http, f"After {i}?", 8) for i in range(4)]
            stream_replicas = [f.result(60) for f in streams]
            whole_answers = [f.result(60) for f in in_flight + after]

    # Not one request that had not started failed; whole answers cut by the kill were sent again.
    assert [a.status_code for a in whole_answers] == [200] * 6, [a.text for a in whole_answers]
    assert all(a.headers[REPLICA_HEADER] != holder for a in whole_answers[2:])
    # A stream on the killed replica ends with the error event (its tokens so far were sent).
    for i, replica in enumerate(stream_replicas):
        assert replica == holder
        assert json.loads(events[i][-2]) == {"error": {
            "message": "the replica serving this stream died mid-answer: retry the request",
            "type": "service_unavailable_error", "param": None, "code": "replica_failed"}}
        assert events[i][-1] == "[DONE]"
