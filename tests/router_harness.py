"""A kvserve router on loopback, run on a thread of the test process, in front of real servers."""
from __future__ import annotations

import dataclasses
import threading
import time

import httpx

from kvserve.router.app import make_server
from kvserve.router.settings import PolicySettings, RouterSettings
from server_harness import API_KEY, free_port

ADMIN_KEY = "admin-key"


class AppThread:
    """An ASGI app (a stand-in replica) served by uvicorn on a free loopback port, on a thread."""

    def __init__(self, app, port: int | None = None) -> None:
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


class RouterThread:
    def __init__(self, replicas: list[str], policy: str = "round_robin", **settings) -> None:
        policy_fields = {f.name for f in dataclasses.fields(PolicySettings)}
        policy_kw = {k: settings.pop(k) for k in list(settings) if k in policy_fields}
        self.settings = RouterSettings(
            replicas=tuple(replicas), port=free_port(), policy=PolicySettings(name=policy, **policy_kw),
            replica_api_key=API_KEY, **{"health_interval": 0.25, "admin_key": ADMIN_KEY, **settings})
        self.server = make_server(self.settings)
        self.state = self.server.router
        self.url = self.settings.url
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the router did not start"
            time.sleep(0.01)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, **kw)

    def admin(self) -> dict:
        r = httpx.get(self.url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
        assert r.status_code == 200, r.text
        return {x["url"]: x for x in r.json()["replicas"]}

    def wait_for(self, condition, timeout: float = 10.0) -> float:
        t0 = time.monotonic()
        while not condition():
            assert time.monotonic() - t0 < timeout, "timed out"
            time.sleep(0.02)
        return time.monotonic() - t0

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(15)


def restart(server) -> None:
    """Start a stopped or killed ServerProcess again, on the same port, with the same arguments."""
    import os
    import subprocess

    from server_harness import REPO

    assert server.proc.poll() is not None, "still running"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    server._log = open(server.log_path, "a")
    server.proc = subprocess.Popen(server.proc.args, cwd=REPO, stdout=server._log, stderr=subprocess.STDOUT, env=env)
    server.wait_ready()
