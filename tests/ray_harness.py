"""A real two-node Ray cluster on this machine (a head and a second node, one CPU each), and
kvserve's Serve application on it from deploy/ray/kvserve.yaml.

Each `ray start --block` runs in a session of its own, and everything Ray starts for it stays in
that session: stopping kills exactly those processes (never by name, so other Ray clusters on the
machine are left alone).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from server_harness import REPO

RAY = str(Path(sys.executable).parent / "ray")
SERVE = str(Path(sys.executable).parent / "serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports() -> list[str]:
    names = ("--node-manager-port", "--object-manager-port", "--min-worker-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
    out = [x for name in names for x in (name, str(free_port()))]
    return out + ["--max-worker-port", "0", "--object-store-memory", str(80 << 20), "--disable-usage-stats",
                  "--include-log-monitor=false"]


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state ppid pgrp session
            if int(fields[3]) == sid:
                pids.append(int(entry))
    return pids


class RayCluster:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvray-"))  # short: Ray's socket paths must fit
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        # No idle workers started ahead of need: on two cores each is seconds of CPU.
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
                    "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0",
                    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        self.nodes: list[subprocess.Popen] = []
        self._start(["--head", "--port", str(self.gcs_port), "--include-dashboard=false",
                     "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()),
                     "--temp-dir", str(self.dir)], "head")
        self._wait(self._gcs_listens, 60, "the head")
        self._start(["--address", self.address, '--resources={"node2": 1}'], "node2")

    def _start(self, args: list[str], name: str) -> None:
        log = open(self.dir / f"{name}.log", "w")
        self.nodes.append(subprocess.Popen([RAY, "start", "--block", "--num-cpus=1", *args, *_ports()], env=self.env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _gcs_listens(self) -> bool:
        """(`ray status` would be one more Python process importing Ray, each time.)"""
        try:
            socket.create_connection(("127.0.0.1", self.gcs_port), timeout=1).close()
            return True
        except OSError:
            return False

    def _wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if any(p.poll() is not None for p in self.nodes):
                raise RuntimeError(f"a ray node exited while waiting for {what}:\n{self.logs()}")
            assert time.monotonic() < deadline, f"{what} did not start in {timeout} s:\n{self.logs()}"
            time.sleep(0.3)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.dir.glob("*.log"))

    def serve_run(self, config: dict) -> None:
        path = self.dir / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
        r = subprocess.run([SERVE, "run", "--non-blocking", "--address", self.address, str(path)], env=self.env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr

    def replica_pid(self, replica_id: str) -> int:
        """The process of the Serve replica with this id (it holds its own log file open)."""
        for node in self.nodes:
            for pid in session_pids(node.pid):
                try:
                    fds = os.listdir(f"/proc/{pid}/fd")
                except OSError:
                    continue
                for fd in fds:
                    try:
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    except OSError:
                        continue
                    if "/serve/replica_" in target and target.endswith(f"_{replica_id}.log"):
                        return pid
        raise LookupError(f"no process holds the log of replica {replica_id}")

    def stop(self) -> None:
        for p in self.nodes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        for p in self.nodes:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
            for pid in session_pids(p.pid):  # whatever outlived it (workers, actors)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if p.poll() is None:
                p.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer 200 in {timeout} s"
        time.sleep(0.3)
