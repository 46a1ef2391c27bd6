"""Another gateway in front of kvserve: smg (the `smg` package of the test extra, a Rust binary)
as a real process before two real replicas, spoken to with the openai client."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, ServerProcess, free_port, tiny_model_dir

pytestmark = pytest.mark.slow

FINISHED = 'kvserve_request_finished_total{finish_reason="length"}'


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory)
    servers = [ServerProcess(model, tmp_path_factory.mktemp("server") / "server.log", api_key=None) for _ in range(2)]
    try:
        for s in servers:  # both load at once
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


def _ready_workers(url: str) -> list[str]:
    try:
        r = httpx.get(url + "/workers", timeout=2)
    except httpx.TransportError:
        return []
    return [w["url"] for w in r.json()["workers"] if w["status"] == "ready"] if r.status_code == 200 else []


@pytest.fixture(scope="module")
def smg(replicas, tmp_path_factory):
    exe = Path(sys.executable).parent / "smg"
    if not exe.is_file():
        pytest.fail(f"{exe} is missing: the test extra installs smg (pip install -e '.[test]')")
    port = free_port()
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    proc = subprocess.Popen([str(exe), "launch", "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-port", str(free_port()), "--policy", "round_robin",
                             "--worker-urls", *(r.url for r in replicas)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while sorted(_ready_workers(url)) != sorted(r.url for r in replicas):  # it registers workers after it starts
        assert proc.poll() is None, f"smg exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"smg has not both replicas ready in 30 s:\n{log.read_text()}"
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


def test_smg_spreads_openai_requests_over_both_replicas_with_their_exact_answers(replicas, smg):
    messages = [{"role": "user", "content": "Name three rivers."}]
    direct = openai.OpenAI(base_url=replicas[0].url + "/v1", api_key="unused")
    expected = direct.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
    before = [r.metric(FINISHED) for r in replicas]

    client = openai.OpenAI(base_url=smg + "/v1", api_key="unused", max_retries=0)
    for _ in range(2):
        answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
        assert answer.choices[0].message.content == expected.choices[0].message.content
        assert answer.choices[0].finish_reason == "length"
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (expected.usage.prompt_tokens, 8)
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == expected.choices[0].message.content

    # round_robin: each replica served two of the four (one plain, one streamed)
    assert [r.metric(FINISHED) - b for r, b in zip(replicas, before)] == [2, 2]
