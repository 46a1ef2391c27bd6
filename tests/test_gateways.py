"""Other gateways in front of kvserve, each a real process before the same two real replicas,
spoken to with the openai client: smg (the `smg` package of the test extra, a Rust binary) and
vllm-router (`vllm-router`), whose kv_aware policy routes on the replicas' own KV events (ZMQ,
vLLM's map form: `--kv-events-format map`)."""
from __future__ import annotations

import re
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
    servers = [ServerProcess(model, tmp_path_factory.mktemp("server") / "server.log", "--kv-events-format", "map",
                             "--kv-events-endpoint", f"tcp://*:{free_port()}",
                             "--kv-events-replay-endpoint", f"tcp://*:{free_port()}", api_key=None)
               for _ in range(2)]
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


def _head(replica: ServerProcess) -> dict:
    """The replica's KV events fields: its endpoints and the last batch it has sent."""
    return httpx.get(replica.url + "/kv/events", params={"head": "true"}, timeout=10).json()


def _loopback(endpoint: str) -> str:
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:")


@pytest.fixture(scope="module")
def vllm_router(replicas, tmp_path_factory):
    exe = Path(sys.executable).parent / "vllm-router"
    if not exe.is_file():
        pytest.fail(f"{exe} is missing: the test extra installs vllm-router (pip install -e '.[test]')")
    port, metrics_port = free_port(), free_port()
    argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
            "--policy", "kv_aware", "--worker-urls", *(r.url for r in replicas),
            "--kv-event-block-size", "16", "--kv-event-model", MODEL_NAME,
            "--log-level", "debug"]  # it logs each batch it applies: the test waits for its replica's last
    for r in replicas:  # each replica's endpoints as its /kv/events answer names them
        head = _head(r)
        argv += ["--kv-event-source", f"{r.url}={_loopback(head['kv_events_endpoint'])}",
                 "--kv-event-replay-source", f"{r.url}={_loopback(head['kv_events_replay_endpoint'])}"]
    log = tmp_path_factory.mktemp("vllm-router") / "vllm-router.log"
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        text = _plain(log)
        try:
            healthy = httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False
        return healthy and all(f"kv_index subscriber for {r.url} rank0 on" in text for r in replicas)

    deadline = time.monotonic() + 30
    while not ready():
        assert proc.poll() is None, f"vllm-router exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"vllm-router has not subscribed to both replicas in 30 s:\n{log.read_text()}"
        time.sleep(0.05)
    time.sleep(0.3)  # its SUB sockets join a moment after they connect (ZMQ's slow joiner)
    yield url, f"http://127.0.0.1:{metrics_port}", log
    proc.terminate()
    proc.wait(10)


def _plain(log: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())  # its log is coloured


def _published(replica: ServerProcess, after: int) -> int:
    """The replica's last batch, once it has sent batches past `after` and then nothing for 0.3 s."""
    deadline = time.monotonic() + 10
    last = after
    while True:
        seq = _head(replica)["kv_events_seq"]
        if seq > after and seq == last:
            return seq
        assert time.monotonic() < deadline, f"{replica.url} sent no KV events past batch {after} in 10 s"
        last = seq
        time.sleep(0.3)


def _applied(log: Path, replica: ServerProcess, seq: int) -> None:
    """Wait (up to 5 s) for vllm-router's log to say it applied the replica's batch `seq`. A batch
    it took from the replay socket is logged otherwise: then the 5 s are its margin."""
    line = f"kv_index live sequence advanced source={replica.url} rank=0 seq={seq}"
    deadline = time.monotonic() + 5
    while line not in _plain(log) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_vllm_router_kv_aware_sends_a_prefix_to_the_replica_whose_map_form_events_hold_it(replicas, vllm_router):
    url, metrics_url, log = vllm_router
    systems = [" ".join(f"Rule {i}: answer in the manner of a careful librarian." for i in range(12)),
               " ".join(f"Law {i}: reply as a ship's navigator would, briefly." for i in range(12))]
    questions = ["Where are the atlases?", "Is the map room open?"]

    def messages(i: int, q: str) -> list[dict]:
        return [{"role": "system", "content": systems[i]}, {"role": "user", "content": q}]

    # Prefix i goes straight to replica i, which publishes its blocks; the answers are the reference.
    expected = {}
    for i, r in enumerate(replicas):
        seq = _head(r)["kv_events_seq"]
        direct = openai.OpenAI(base_url=r.url + "/v1", api_key="unused")
        for q in questions:
            expected[i, q] = direct.chat.completions.create(model=MODEL_NAME, messages=messages(i, q), max_tokens=8,
                                                            temperature=0)
        _applied(log, r, _published(r, seq))

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    landed = []
    for q, stream in [(questions[0], False), (questions[1], True)]:
        for i in (0, 1):
            before = [r.metric(FINISHED) for r in replicas]
            want = expected[i, q]
            if stream:
                chunks = client.chat.completions.create(model=MODEL_NAME, messages=messages(i, q), max_tokens=8,
                                                        temperature=0, stream=True)
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
                    want.choices[0].message.content
            else:
                answer = client.chat.completions.create(model=MODEL_NAME, messages=messages(i, q), max_tokens=8,
                                                        temperature=0)
                assert answer.choices[0].message.content == want.choices[0].message.content
                assert answer.usage.prompt_tokens == want.usage.prompt_tokens > 100
                # Every full block but the one holding the last token was already on that replica.
                assert answer.usage.prompt_tokens_details.cached_tokens == (want.usage.prompt_tokens - 1) // 16 * 16
            landed.append([r.metric(FINISHED) - b for r, b in zip(replicas, before)])
    # Each request on the replica holding its prefix. With the events unread (replicas in the array
    # form) it routes on load alone: the first request then went to replica 1, nothing cached.
    assert landed == [[1, 0], [0, 1], [1, 0], [0, 1]], _plain(log)[-4000:]
    metrics = httpx.get(metrics_url + "/metrics", timeout=10).text
    assert 'vllm_router_kv_placement_lookups_total{result="hit"} 4' in metrics.splitlines()
    assert "KV event must be a tagged map" not in log.read_text()
