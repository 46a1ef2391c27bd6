"""Ctrl-C or SIGTERM at any moment ends `kvserve serve` cleanly: status 0, no traceback, no C++
abort — while Python imports, while the model loads, a second signal during a drain, and the
first one while grammars compile (their processes are killed, nothing waits for them)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_harness import (MODEL_NAME, REPO, ServerProcess, free_port, gone, grammar_processes, slow_schema,
                            tiny_model_dir, wait_for)

BAD_SIGNS = ("Traceback", "terminate called", "Aborted", "core dumped", "CancelledError")


def _spawn(*args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--no-access-log", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env), port


def _maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("when", ["importing", "loading"])
def test_a_signal_while_starting_exits_0(sig, when):
    # The default model: loading it takes seconds, so "loading" is a window a signal can hit.
    proc, port = _spawn("--model", "smollm2-135m")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    if when == "importing":  # torch's libraries are being mapped into the process
        deadline = time.monotonic() + 60
        while "libtorch" not in _maps(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
    else:  # uvicorn is up and /health says loading
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json() == {"status": "loading"}:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            pytest.fail("the server never reported loading:\n" + "".join(lines))
    proc.send_signal(sig)
    rc = proc.wait(30)
    reader.join(5)
    out = "".join(lines)
    assert rc == 0, out
    assert not any(bad in out for bad in BAD_SIGNS), out


@pytest.mark.slow
def test_a_second_signal_during_the_drain_exits_at_once_and_ends_streams_with_an_error(tmp_path_factory):
    server = ServerProcess(tiny_model_dir(tmp_path_factory), tmp_path_factory.mktemp("sig") / "server.log")
    server.wait_ready()
    events: list[str] = []

    def stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 2000, "n": 8, "ignore_eos": True, "stream": True,
                "temperature": 0}
        try:
            with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.HTTPError:
            pass

    reader = threading.Thread(target=stream)
    reader.start()
    while not events:
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(10)
    took = time.monotonic() - t0
    reader.join(10)
    log = server.log()
    server.stop()
    assert rc == 0
    assert took < 3, f"the second signal took {took:.1f} s"
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutdown", events[-3:]
    assert "second SIGTERM during the drain" in log
    assert not any(bad in log for bad in BAD_SIGNS), log


@pytest.mark.slow
@pytest.mark.parametrize("compile_timeout, drain_timeout, status", [(2, 30, 400), (60, 2, 503)],
                         ids=["requests-timed-out", "waits-cut-off-by-the-drain"])
def test_the_first_signal_exits_within_the_drain_while_grammars_compile(tmp_path_factory, compile_timeout,
                                                                         drain_timeout, status):
    # Three slow schemas: two compile in the pool's worker processes (for minutes), one waits in its queue.
    server = ServerProcess(tiny_model_dir(tmp_path_factory), tmp_path_factory.mktemp("sig") / "server.log",
                           "--grammar-compile-timeout", str(compile_timeout), "--drain-timeout", str(drain_timeout))
    server.wait_ready()
    statuses: list[int] = []

    def slow(tag: str) -> None:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": slow_schema(tag)}}}
        with server.client() as c:
            statuses.append(c.post("/v1/chat/completions", json=body).status_code)

    clients = [threading.Thread(target=slow, args=(tag,)) for tag in "abc"]
    try:
        for t in clients:
            t.start()
        wait_for(lambda: server.metric("kvserve_grammar_compiles_pending") == 3)
        wait_for(lambda: len(grammar_processes(server.proc.pid)[1]) == 2)  # a worker forked for each running compile
        servers, workers = grammar_processes(server.proc.pid)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(60)
        took = time.monotonic() - t0
        for t in clients:
            t.join(10)
    finally:
        log = server.log()
        server.stop()
    assert rc == 0, log
    # Each request ends within its compile timeout or the drain's; the process a moment after, no
    # thread left compiling (lifecycle.EXIT_GRACE is not needed), the compile processes with it.
    assert took < min(compile_timeout, drain_timeout) + 3, f"the first SIGTERM took {took:.1f} s:\n{log}"
    assert statuses == [status] * 3
    assert "threads still running after the drain" not in log
    assert len(servers) == 1
    wait_for(lambda: gone(servers | workers), timeout=2)
    assert not any(bad in log for bad in BAD_SIGNS), log
