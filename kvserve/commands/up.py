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
import logging
import os
import secrets
import signal
import socket
import sys

from kvserve.commands.route import add_router_args, settings_from_args
from kvserve.router.local_replicas import Replicas

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
    serve = ["--model", args.model, "--dtype", args.dtype]
    serve += ["--served-model-name", args.served_model_name] if args.served_model_name else []
    serve += ["--kv-cache-gib", str(args.kv_cache_gib)] if args.kv_cache_gib else []
    replicas = Replicas(args.replicas, serve + args.serve_arg, threads=args.threads, first_port=args.port + 1,
                        api_key=args.api_key, admin_key=args.admin_key)
    rc = 0
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
