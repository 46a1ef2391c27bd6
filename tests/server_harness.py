"""A real `kvserve serve` process on loopback, serving a tiny random model, for the server tests."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "tiny"
API_KEY = "test-key"


def slow_schema(tag: str = "p") -> dict:
    """A JSON schema inside the grammar size limits (51 KB, 4,001 nodes) that xgrammar compiles for
    minutes with the default tokenizer: 4,000 optional properties (named tag0, tag1, ...: requests
    for one schema share its compile, so distinct tags make distinct compiles)."""
    return {"type": "object", "properties": {f"{tag}{i}": {} for i in range(4000)}}



def tiny_model_dir(tmp_path_factory) -> Path:
    """One tiny model per test session (building it takes a few seconds)."""
    directory = tmp_path_factory.getbasetemp() / "kvserve-tiny-model"
    if not (directory / "config.json").is_file():
        make_tiny_hf_model(directory)
    return directory


def free_port() -> int:
    """A free port for a server to bind, drawn below the kernel's ephemeral range (free_port_block):
    a port the kernel hands out (bind to 0) may become the local end of some client connection
    before the server binds it ("Address already in use")."""
    return free_port_block(1)


def free_port_block(n: int) -> int:
    """The first of n consecutive free ports, for commands that take `--port P` and use P..P+n-1.

    The block is drawn below the kernel's ephemeral range: a port next to one `free_port()` handed
    out may meanwhile become the local end of any client connection on the machine."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, low - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports between 10000 and {low}")


class ServerProcess:
    def __init__(self, model_dir: Path, log_path: Path, *args: str, api_key: str | None = API_KEY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "kvserve", "serve", "--model", str(model_dir), "--dtype", "float32",
               "--served-model-name", MODEL_NAME, "--port", str(self.port), "--no-access-log",
               "--kv-cache-gib", "0.05", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        # Output to a file, not a pipe: a full pipe would block the server.
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kw)

    def wait_ready(self, timeout: float = 60) -> list[int]:
        """Poll /health until 200; returns every status seen (a refused connection is 0)."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                status = 0
            seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.02)
        log = self.log()
        self.stop()  # a server that never came up is not left running after its test
        raise TimeoutError(f"the server was not ready in {timeout} s:\n{log}")

    def metric(self, name: str) -> float:
        """One series' value from /metrics (0 if absent), e.g. 'kvserve_kv_cache_blocks_used' or
        'kvserve_request_finished_total{finish_reason="abort"}'."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == name:
                return float(value)
        return 0.0

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def wait_for(condition, timeout: float = 10.0) -> float:
    """Seconds until condition() holds (AssertionError past the timeout)."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - t0


def grammar_processes(pid: int) -> tuple[set[int], set[int]]:
    """The grammar fork servers under process pid, and their live workers
    (kvserve/structured/compile_worker.py)."""
    import psutil  # (a test extra: the dependency floors' smoke test imports this module without it)

    servers, workers = set(), set()
    for child in psutil.Process(pid).children():
        try:
            if "kvserve.structured.compile_worker" in child.cmdline():
                servers.add(child.pid)
                workers |= {w.pid for w in child.children() if w.status() != psutil.STATUS_ZOMBIE}
        except psutil.NoSuchProcess:
            pass
    return servers, workers


def gone(pids: set[int]) -> bool:
    """Whether every process in pids has ended (a zombie has: it only waits to be reaped)."""
    import psutil

    def ended(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(ended(pid) for pid in pids)


def start_server(tmp_path_factory, *args: str, api_key: str | None = API_KEY) -> ServerProcess:
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = ServerProcess(tiny_model_dir(tmp_path_factory), log, *args, api_key=api_key)
    server.wait_ready()
    return server


DEFAULT_MODEL = "smollm2-135m"


def start_default_server(tmp_path_factory, *args: str, api_key: str | None = API_KEY) -> ServerProcess:
    """A server of the embedded default model, served under its own name (loading takes longer)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = ServerProcess(DEFAULT_MODEL, log, "--served-model-name", DEFAULT_MODEL, *args, api_key=api_key)  # type: ignore[arg-type]
    try:
        server.wait_ready(timeout=300)
    except BaseException:
        server.stop()
        raise
    return server

