"""Replicas as processes on this host: `kvserve serve` started N times on loopback (each with its
share of the CPU threads, its log prefixed with its number), waited for until healthy, drained
with SIGTERM and killed past a timeout; they die with this process even if it is killed
outright (PR_SET_PDEATHSIG, Linux). `kvserve up` puts a router in front of them.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import httpx


def die_with_parent() -> None:
    """For subprocess.Popen(preexec_fn=...): the child gets SIGTERM when this process dies, even killed outright."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the servers are still stopped on a clean exit


class Replicas:
    """`count` `kvserve serve` processes on loopback, ports first_port.., each with its share of
    `threads` and these `serve` arguments; `api_key` is theirs, `admin_key` the router's (a
    replica that (re)joins with --join needs it)."""

    def __init__(self, count: int, serve_args: list[str], *, threads: int, first_port: int,
                 api_key: str | None = None, admin_key: str | None = None) -> None:
        self.count, self.serve_args, self.threads, self.first_port = count, serve_args, threads, first_port
        self.api_key, self.admin_key = api_key, admin_key
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def start(self) -> None:
        threads = max(1, self.threads // self.count)
        for i in range(self.count):
            port = self.first_port + i
            cmd = [sys.executable, "-m", "kvserve", "serve", *self.serve_args, "--host", "127.0.0.1",
                   "--port", str(port), "--no-access-log"]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
            if self.api_key:
                env["KVSERVE_API_KEY"] = self.api_key
            if self.admin_key:
                env["KVSERVE_ROUTER_ADMIN_KEY"] = self.admin_key
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                    start_new_session=True, preexec_fn=die_with_parent)
            threading.Thread(target=_prefix_lines, args=(proc, f"[replica {i + 1}] "), daemon=True).start()
            self.procs.append(proc)
            self.urls.append(f"http://127.0.0.1:{port}")
            print(f"kvserve up: replica {i + 1}/{self.count} starting at {self.urls[-1]} "
                  f"({threads} thread(s), pid {proc.pid})", file=sys.stderr, flush=True)

    def wait_ready(self, timeout: float) -> None:
        t0 = time.monotonic()
        pending = dict(enumerate(self.urls))
        while pending:
            for i, url in list(pending.items()):
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"replica {i + 1} exited with status {self.procs[i].returncode} while starting")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        print(f"kvserve up: replica {i + 1} ready after {time.monotonic() - t0:.1f} s",
                              file=sys.stderr, flush=True)
                        del pending[i]
                except httpx.HTTPError:
                    pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"replicas {sorted(i + 1 for i in pending)} not ready after {timeout:g} s")
            time.sleep(0.2)

    def stop(self, timeout: float) -> None:
        """SIGTERM each (they drain), then wait; kill whatever outlives the timeout."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for i, p in enumerate(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"kvserve up: replica {i + 1} did not stop in time: killed", file=sys.stderr, flush=True)
                p.kill()
                p.wait()


def _prefix_lines(proc: subprocess.Popen[str], prefix: str) -> None:
    for line in proc.stdout or ():  # (started with stdout=PIPE)
        sys.stderr.write(prefix + line)
    sys.stderr.flush()
