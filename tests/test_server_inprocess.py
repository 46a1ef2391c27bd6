"""The app in this process (Starlette's TestClient): the states a real process cannot be put in
on demand — a model still loading or failing to load, an engine that dies — plus CORS and the
sandboxed chat template."""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvserve.config import CacheConfig
from kvserve.llm import LLM
from kvserve.server.app import ServerSettings, build_app
from server_harness import tiny_model_dir

SETTINGS = ServerSettings(model_name="tiny")
REQUEST = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


def tiny_llm(directory: Path) -> LLM:
    return LLM(str(directory), dtype="float32", cache=CacheConfig(num_blocks=256))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory)


def test_503_while_loading_then_ready(model_dir):
    release = threading.Event()

    def load() -> LLM:
        release.wait(30)
        return tiny_llm(model_dir)

    with TestClient(build_app(SETTINGS, load=load)) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        r = client.post("/v1/completions", json=REQUEST)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "service_unavailable_error" and r.json()["error"]["code"] == "loading"
        assert client.get("/v1/models").status_code == 503
        assert client.get("/metrics").status_code == 200  # scrapable while loading
        release.set()
        for _ in range(3000):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.01)
        assert client.get("/health").json() == {"status": "ready"}
        assert client.post("/v1/completions", json=REQUEST).status_code == 200


def test_load_failure_is_reported(model_dir):
    failures: list[BaseException] = []

    def load() -> LLM:
        raise FileNotFoundError("no such model")

    with TestClient(build_app(SETTINGS, load=load, on_load_failure=failures.append)) as client:
        for _ in range(500):
            if failures:
                break
            threading.Event().wait(0.01)
        assert [str(e) for e in failures] == ["no such model"]
        assert client.get("/health").json() == {"status": "failed"}
        assert client.post("/v1/completions", json=REQUEST).status_code == 503


def dying_llm(model_dir, steps: int, message: str, error: type[Exception] = RuntimeError):
    """A tiny LLM whose engine step raises after `steps` good steps."""
    llm = tiny_llm(model_dir)
    real_step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > steps:
            raise error(message)
        return real_step()

    llm.engine.step = failing_step
    return llm


# A ValueError raised inside a step is the engine's failure, not the client's bad input.
@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_engine_death_ends_requests_with_an_error_and_health_503(model_dir, error):
    llm = dying_llm(model_dir, 2, "simulated kernel failure in /secret/path.py", error)
    with TestClient(build_app(SETTINGS, llm=llm), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={**REQUEST, "max_tokens": 50, "ignore_eos": True})
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["type"] == "service_unavailable_error" and err["code"] == "engine_dead"
        assert "secret" not in r.text and "Traceback" not in r.text
        health = client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "dead"}
        r = client.post("/v1/completions", json=REQUEST)
        assert r.status_code == 503 and r.json()["error"]["code"] == "dead"


def test_engine_death_mid_stream_ends_the_stream_with_an_error(model_dir):
    llm = dying_llm(model_dir, 3, "boom")
    with TestClient(build_app(SETTINGS, llm=llm)) as client:
        body = {**REQUEST, "max_tokens": 50, "ignore_eos": True, "stream": True}
        r = client.post("/v1/completions", json=body)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"
    assert all("choices" in json.loads(e) for e in events[:-2]) and len(events) >= 3


def test_cors_only_for_allowed_origins(model_dir):
    settings = ServerSettings(model_name="tiny", allowed_origins=("https://ok.example",), api_key="k")
    with TestClient(build_app(settings, llm=tiny_llm(model_dir))) as client:
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = client.options("/v1/completions", headers={"Origin": "https://ok.example", **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
        other = client.options("/v1/completions", headers={"Origin": "https://evil.example", **preflight})
        assert "access-control-allow-origin" not in other.headers
        r = client.get("/v1/models", headers={"Origin": "https://ok.example"})  # no key: 401, still with CORS
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ok.example"
        r = client.get("/v1/models", headers={"Origin": "https://ok.example", "Authorization": "Bearer k"})
        assert r.status_code == 200


def test_each_app_has_its_own_metrics_registry(model_dir):
    a, b = build_app(SETTINGS, llm=tiny_llm(model_dir)), build_app(SETTINGS, llm=tiny_llm(model_dir))
    with TestClient(a) as ca, TestClient(b) as cb:
        assert ca.post("/v1/completions", json=REQUEST).status_code == 200
        count = 'kvserve_e2e_request_latency_seconds_count '
        line_a = next(x for x in ca.get("/metrics").text.splitlines() if x.startswith(count))
        line_b = next(x for x in cb.get("/metrics").text.splitlines() if x.startswith(count))
        assert (line_a, line_b) == (count + "1.0", count + "0.0")


def test_a_hostile_chat_template_is_sandboxed(model_dir, tmp_path):
    hostile = tmp_path / "hostile"
    shutil.copytree(model_dir, hostile)
    (hostile / "chat_template.jinja").write_text(
        "{{ messages.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}")
    with TestClient(build_app(SETTINGS, llm=tiny_llm(hostile))) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "unsafe" in err["message"] and "subclasses" not in r.text.split("unsafe")[0]


def test_no_pickle_on_any_path():
    """The engine runs on a thread: nothing crosses a process boundary, and nothing unpickles."""
    root = Path(__file__).resolve().parent.parent / "kvserve"
    for path in root.rglob("*.py"):
        source = path.read_text()
        assert "pickle" not in source and "torch.load(" not in source, path


def test_a_stalled_engine_turns_health_503_and_recovers(model_dir):
    """A step that makes no progress for longer than the stall timeout is not 'ready'."""
    llm = tiny_llm(model_dir)
    real_step, release = llm.engine.step, threading.Event()

    def stuck_step():
        release.wait(30)
        return real_step()

    llm.engine.step = stuck_step
    settings = ServerSettings(model_name="tiny", stall_timeout=0.5)
    with TestClient(build_app(settings, llm=llm)) as client:
        assert client.get("/health").json() == {"status": "ready"}
        done: list = []
        worker = threading.Thread(target=lambda: done.append(client.post("/v1/completions", json=REQUEST)))
        worker.start()
        for _ in range(300):
            health = client.get("/health")
            if health.status_code == 503:
                break
            threading.Event().wait(0.02)
        assert health.status_code == 503 and health.json() == {"status": "stalled"}
        r = client.post("/v1/completions", json=REQUEST)
        assert r.status_code == 503 and r.json()["error"]["code"] == "stalled"
        release.set()
        worker.join(30)
        assert done[0].status_code == 200
        assert client.get("/health").json() == {"status": "ready"}


def test_a_request_past_the_request_timeout_is_stopped_with_504(model_dir):
    llm = tiny_llm(model_dir)
    real_step = llm.engine.step
    slow = threading.Event()
    slow.set()

    def slow_step():
        if slow.is_set():
            threading.Event().wait(0.05)
        return real_step()

    llm.engine.step = slow_step
    settings = ServerSettings(model_name="tiny", request_timeout=0.5)
    with TestClient(build_app(settings, llm=llm)) as client:
        r = client.post("/v1/completions", json={**REQUEST, "max_tokens": 200, "ignore_eos": True})
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "request_timeout" and "--request-timeout" in r.json()["error"]["message"]
        slow.clear()  # the engine at its own speed again: the next request is not timed against a slowed one
        assert client.post("/v1/completions", json=REQUEST).status_code == 200  # the server carries on
        for _ in range(200):  # the timed-out request's blocks go back to the pool
            if llm.manager.pool.num_used_blocks == 0:
                break
            threading.Event().wait(0.02)
        assert llm.manager.pool.num_used_blocks == 0
