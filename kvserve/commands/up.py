"""`kvserve up --replicas N`: N kvserve servers on this host and a router in front, in one command.

The CPU threads are divided between the servers (one process each: they share nothing, so N
engines step in parallel instead of contending for one). Each server's log is prefixed with its
number. The first Ctrl-C or SIGTERM drains the router (requests in flight finish), then each
server drains in turn, and the command exits 0 with no process left; a second signal hurries
it. The servers die with this process even if it is killed outright (PR_SET_PDEATHSIG, Linux).
Without --admin-key a random admin key is made for the run (the router's admin API is never
open), and handed to the servers as $KVSERVE_ROUTER_ADMIN_KEY.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from kvserve.commands.route import add_router_args, settings_from_args

log = logging.getLogger("kvserve.router")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="start N servers and a router in front of them")
    p.add_argument("--replicas", type=int, default=2, help="servers to start (default: 2)")
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or Hugging Face directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads in all, divided between the servers (default: every core)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (the servers stay on loopback)")
    p.add_argument("--port", type=int, default=8000, help="the router's port; servers take the next N ports")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache per server")
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"), help="the servers' API key")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every `kvserve serve` (repeat), e.g. --serve-arg=--max-num-seqs=32")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the servers get to load")
    add_router_args(p)
    p.set_defaults(func=run)


def die_with_parent() -> None:
    """For subprocess.Popen(preexec_fn=...): the child gets SIGTERM when this process dies, even killed outright."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the servers are still stopped on a clean exit


class Replicas:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def start(self) -> None:
        a = self.args
        threads = max(1, a.threads // a.replicas)
        for i in range(a.replicas):
            port = a.port + 1 + i
            cmd = [sys.executable, "-m", "kvserve", "serve", "--model", a.model, "--dtype", a.dtype,
                   "--host", "127.0.0.1", "--port", str(port), "--no-access-log"]
            if a.served_model_name:
                cmd += ["--served-model-name", a.served_model_name]
            if a.kv_cache_gib:
                cmd += ["--kv-cache-gib", str(a.kv_cache_gib)]
            cmd += a.serve_arg
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
            if a.api_key:
                env["KVSERVE_API_KEY"] = a.api_key
            if a.admin_key:  # the router's: a replica that (re)joins with --join needs it
                env["KVSERVE_ROUTER_ADMIN_KEY"] = a.admin_key
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                    start_new_session=True, preexec_fn=die_with_parent)
            threading.Thread(target=_prefix_lines, args=(proc, f"[replica {i + 1}] "), daemon=True).start()
            self.procs.append(proc)
            self.urls.append(f"http://127.0.0.1:{port}")
            print(f"kvserve up: replica {i + 1}/{a.replicas} starting at {self.urls[-1]} "
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


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _check_ports_free(args: argparse.Namespace) -> None:
    """Fail before any model loads if the router's port or a server's is taken."""
    wanted = [(args.host, args.port, "the router")]
    wanted += [("127.0.0.1", args.port + 1 + i, f"replica {i + 1}") for i in range(args.replicas)]
    for host, port, who in wanted:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except OSError as e:
                raise ValueError(f"port {port} on {host} ({who}) cannot be bound: {e.strerror}; `kvserve up` needs "
                                 f"--port P and the {args.replicas} ports after it free: choose another --port") from None


def run(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    _check_ports_free(args)
    if args.api_key and not args.replica_api_key:
        args.replica_api_key = args.api_key  # the router reads the servers' /kv/events with it
    if not args.admin_key:  # the admin API is never open without a key under `up`
        args.admin_key = secrets.token_urlsafe(24)
        print("kvserve up: the router's admin API needs a key; none was given, so one was made for this run and "
              "handed to the replicas (set --admin-key or $KVSERVE_ROUTER_ADMIN_KEY to use /admin/replicas "
              "yourself)", file=sys.stderr, flush=True)
    replicas, rc = Replicas(args), 0
    previous = signal.signal(signal.SIGTERM, _interrupt)  # until the router takes over the signals
    try:
        replicas.start()
        replicas.wait_ready(args.startup_timeout)
        from kvserve.router.app import make_server

        settings = settings_from_args(args, replicas.urls)
        server = make_server(settings)
        print(f"kvserve up: router at {settings.url}/v1 in front of {args.replicas} replica(s), policy "
              f"{settings.policy.name} (Ctrl-C or SIGTERM stops everything)", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, previous)
        server.run()  # returns after the drain
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        print(f"kvserve up: error: {e}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop must not be interrupted half-way
        replicas.stop(args.drain_timeout + 10)
        signal.signal(signal.SIGTERM, previous)
        print("kvserve up: stopped", file=sys.stderr, flush=True)
    return rc
