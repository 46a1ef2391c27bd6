"""`kvserve up` (servers and router in one command) and `kvserve serve --join` (a server that
registers itself), as real processes."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from router_harness import ADMIN_KEY, RouterThread
from server_harness import MODEL_NAME, REPO, free_port_block, start_server, tiny_model_dir

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_starts_replicas_and_a_router_and_stops_them_all_on_sigterm(tmp_path_factory):
    port = free_port_block(3)  # the router's port, then one per replica
    log_path = tmp_path_factory.mktemp("up") / "up.log"
    cmd = [sys.executable, "-m", "kvserve", "up", "--replicas", "2", "--model", str(tiny_model_dir(tmp_path_factory)),
           "--served-model-name", MODEL_NAME, "--dtype", "float32", "--threads", "2", "--port", str(port),
           "--kv-cache-gib", "0.01", "--policy", "round_robin"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "KVSERVE_API_KEY": "",
                                     "KVSERVE_ROUTER_ADMIN_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
        replicas = {httpx.post(url + "/v1/completions", json=body, timeout=30).headers["x-kvserve-replica"]
                    for _ in range(2)}
        assert replicas == {f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"}
        # No --admin-key given: `up` made one, so the admin API is closed even to loopback clients.
        r = httpx.post(url + "/admin/replicas", json={"url": "http://127.0.0.1:1"}, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "one was made for this run and handed to the replicas" in log_path.read_text()
        text = log_path.read_text()
        pids = [int(p) for p in re.findall(r"thread\(s\), pid (\d+)\)", text)]
        assert len(pids) == 2 and "1 thread(s)" in text  # 2 threads divided between 2 servers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
        assert not any(_alive(p) for p in pids)
        assert "[replica 1]" in log_path.read_text() and "kvserve up: stopped" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_join_registers_with_the_router_and_leaves_on_drain(tmp_path_factory):
    router = RouterThread([], "round_robin")
    try:
        server = start_server(tmp_path_factory, "--join", router.url, "--join-key", ADMIN_KEY)
        router.wait_for(lambda: router.admin().get(server.url, {}).get("state") == "healthy")
        with router.client() as c:
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kvserve-replica"] == server.url
        server.proc.send_signal(signal.SIGTERM)
        router.wait_for(lambda: server.url not in router.admin())
        assert server.proc.wait(30) == 0
        assert "joined the router" in server.log() and "left the router" in server.log()
    finally:
        server.stop()
        router.stop()


def test_up_refuses_a_taken_port_before_loading_anything():
    port = free_port_block(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "kvserve", "up", "--replicas", "2", "--model", "/nonexistent/model",
                            "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "KVSERVE_ROUTER_ADMIN_KEY": ""})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"kvserve: error: port {port + 2} on 127.0.0.1 (replica 2) cannot be bound: Address already in use; "
        "`kvserve up` needs --port P and the 2 ports after it free: choose another --port")
