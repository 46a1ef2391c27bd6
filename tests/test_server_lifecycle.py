"""Admission control (429), loading (503), and the drain on SIGTERM, against real server processes."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_harness import MODEL_NAME, REPO, ServerProcess, start_server, tiny_model_dir


def body(max_tokens: int, stream: bool, **kw) -> dict:
    return {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, **kw}


async def read_stream(client: httpx.AsyncClient, started: asyncio.Event, **kw) -> tuple[int, str | None, bool]:
    """(tokens received, last finish_reason or "error: <code>", saw [DONE]) of one streamed completion.
    Tokens are counted from each event's logprobs: a reader slower than the engine gets several
    tokens in one event."""
    tokens, finish, done = 0, None, False
    async with client.stream("POST", "/v1/completions", json=body(stream=True, logprobs=0, **kw)) as r:
        assert r.status_code == 200
        try:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        finish = f"error: {event['error']['code']}"
                        continue
                    choice = event["choices"][0]
                    tokens += len(choice["logprobs"]["tokens"]) if choice["logprobs"] else 0
                    finish = choice["finish_reason"] or finish
                    started.set()
        except httpx.RemoteProtocolError:  # the server cut the stream
            pass
    return tokens, finish, done


def test_over_the_queue_limit_is_429_and_admitted_requests_finish(tmp_path_factory):
    server = start_server(tmp_path_factory, "--max-num-seqs", "2", "--max-queued-requests", "2")
    try:
        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as client:
                events = [asyncio.Event() for _ in range(4)]
                admitted = [asyncio.create_task(read_stream(client, e, max_tokens=150)) for e in events]
                while server.metric("kvserve_requests_admitted") < 4:  # 2 running + 2 queued
                    await asyncio.sleep(0.01)
                for extra in (body(5, False), body(5, True), body(1, False, n=2)):
                    r = await client.post("/v1/completions", json=extra)
                    assert r.status_code == 429, r.text
                    assert r.headers["retry-after"] == "1"
                    assert r.json()["error"]["type"] == "rate_limit_error"
                chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                assert (await client.post("/v1/chat/completions", json=chat)).status_code == 429
                assert (await client.get("/health")).status_code == 200  # busy is not unhealthy
                results = await asyncio.gather(*admitted)
                assert results == [(150, "length", True)] * 4
                r = await client.post("/v1/completions", json=body(5, False))
                assert r.status_code == 200  # room again

        asyncio.run(scenario())
        assert server.metric("kvserve_requests_admitted") == 0
    finally:
        server.stop()


def test_sigterm_drains_and_exits(tmp_path_factory):
    log = tmp_path_factory.mktemp("drain") / "server.log"
    server = ServerProcess(tiny_model_dir(tmp_path_factory), log)
    try:
        seen = server.wait_ready()
        assert set(seen[:-1]) <= {0, 503}, seen  # refused, then 503 while loading (when the poll catches it)

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as client:
                events = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.create_task(read_stream(client, e, max_tokens=300)) for e in events]
                await asyncio.gather(*(e.wait() for e in events))  # all three are generating
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.1)
                health = await client.get("/health")
                assert health.status_code == 503 and health.json() == {"status": "draining"}
                r = await client.post("/v1/completions", json=body(5, False))
                assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
                assert server.proc.poll() is None  # still serving the admitted ones
                assert await asyncio.gather(*streams) == [(300, "length", True)] * 3

        asyncio.run(scenario())
        assert server.proc.wait(15) == 0
        assert "draining, 3 request(s) in flight" in server.log()
    finally:
        server.stop()


def test_drain_timeout_cuts_off_what_does_not_finish(tmp_path_factory):
    server = start_server(tmp_path_factory, "--drain-timeout", "0.5")
    try:
        async def scenario() -> tuple[int, str | None, bool]:
            async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as client:
                started = asyncio.Event()
                stream = asyncio.create_task(read_stream(client, started, max_tokens=2000))
                await started.wait()
                server.proc.send_signal(signal.SIGTERM)
                return await stream

        t0 = time.monotonic()
        tokens, finish, done = asyncio.run(scenario())
        assert server.proc.wait(15) == 0
        assert time.monotonic() - t0 < 8
        assert tokens < 2000 and finish == "error: shutdown" and done  # an error event, then [DONE]
        assert "drain timeout: 1 request(s) still in flight" in server.log()
    finally:
        server.stop()


@pytest.mark.parametrize("args, message", [
    ([], "kvserve: error: "),  # the model does not exist
    (["--max-n", "0"], "--max-n must be at least 1"),
    (["--max-logprobs", "21"], "--max-logprobs must be in [0, 20]"),
])
def test_bad_command_line_fails_in_one_line(args, message):
    cmd = [sys.executable, "-m", "kvserve", "serve", "--model", "/nonexistent/model.gguf", *args, "--port", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


# One streamed request of each other API: (path, body, the text its stream ends with when whole,
# the 503's body while draining in that API's own shape).
OTHER_APIS = [
    ("/v1/responses", {"model": MODEL_NAME, "input": "Once upon a time", "max_output_tokens": 300, "temperature": 0,
                       "stream": True},
     "response.incomplete", lambda b: b["error"]["type"] == "service_unavailable_error"),
    ("/v1/messages", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Once upon a time"}],
                      "max_tokens": 300, "temperature": 0, "stream": True},
     "event: message_stop", lambda b: b["type"] == "error" and b["error"]["type"] == "overloaded_error"),
    ("/api/chat", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Once upon a time"}],
                   "options": {"num_predict": 300, "temperature": 0}},
     '"done":true', lambda b: isinstance(b["error"], str)),
]


def test_sigterm_drains_the_other_apis_streams_too(tmp_path_factory):
    """Responses, Anthropic Messages and Ollama chat streams admitted before SIGTERM run to their
    end (300 tokens: the tiny model's random weights seldom say EOS sooner); new ones get the 503
    in their API's own error shape; all three counted as running in /metrics meanwhile."""
    log = tmp_path_factory.mktemp("drain-apis") / "server.log"
    server = ServerProcess(tiny_model_dir(tmp_path_factory), log)
    try:
        server.wait_ready()

        async def stream(client: httpx.AsyncClient, path: str, payload: dict, started: asyncio.Event) -> str:
            text = ""
            async with client.stream("POST", path, json=payload) as r:
                assert r.status_code == 200
                async for chunk in r.aiter_text():
                    text += chunk
                    started.set()
            return text

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as client:
                started = [asyncio.Event() for _ in OTHER_APIS]
                tasks = [asyncio.create_task(stream(client, path, payload, s))
                         for (path, payload, _, _), s in zip(OTHER_APIS, started)]
                await asyncio.gather(*(s.wait() for s in started))
                # A stream's first bytes (response.created, message_start) may precede its first step.
                running, deadline = 0.0, time.monotonic() + 10
                while running < len(OTHER_APIS) and time.monotonic() < deadline:
                    metrics = (await client.get("/metrics")).text
                    running = float(metrics.split("\nkvserve_num_requests_running ")[1].split()[0])
                    await asyncio.sleep(0.01)
                assert running == len(OTHER_APIS)
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.1)
                for path, payload, _, refused in OTHER_APIS:
                    r = await client.post(path, json={**payload, "stream": False})
                    assert r.status_code == 503 and refused(r.json()), (path, r.text)
                for (path, _, end, _), text in zip(OTHER_APIS, await asyncio.gather(*tasks)):
                    assert end in text, (path, text[-300:])

        asyncio.run(scenario())
        assert server.proc.wait(15) == 0
        assert f"draining, {len(OTHER_APIS)} request(s) in flight" in server.log()
    finally:
        server.stop()
