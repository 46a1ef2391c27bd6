"""`kvserve route`: the arguments, then the router on uvicorn."""
from __future__ import annotations

import argparse
import os

from kvserve.router.settings import CACHE_SOURCES, POLICIES, PolicySettings, RouterSettings

_P, _R = PolicySettings(), RouterSettings()


def add_router_args(p: argparse.ArgumentParser) -> None:
    """The policy and router knobs shared by `kvserve route` and `kvserve up`."""
    p.add_argument("--policy", choices=POLICIES, default=_P.name, help=f"routing policy (default: {_P.name})")
    p.add_argument("--cache-source", choices=CACHE_SOURCES, default=_P.cache_source,
                   help="cache_aware: replicas' published blocks (precise), text sent (approximate), or "
                        "precise where available (auto, the default)")
    p.add_argument("--balance-abs-tokens", type=int, default=_P.balance_abs_tokens,
                   help=f"cache_aware: gap in outstanding work (uncached prompt + output tokens) beyond which load wins (default: {_P.balance_abs_tokens})")
    p.add_argument("--balance-rel", type=float, default=_P.balance_rel,
                   help=f"cache_aware: load ratio beyond which load wins (default: {_P.balance_rel})")
    p.add_argument("--min-match-tokens", type=int, default=_P.min_match_tokens,
                   help=f"cache_aware: shorter matches do not count (default: {_P.min_match_tokens})")
    p.add_argument("--admin-key", default=os.environ.get("KVSERVE_ROUTER_ADMIN_KEY"),
                   help="Bearer key of /admin/replicas (default: $KVSERVE_ROUTER_ADMIN_KEY; none: loopback only)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host header names answered, e.g. localhost,127.0.0.1,*.internal; others "
                        "get 400 (against DNS rebinding; default: any)")
    p.add_argument("--replica-api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="the replicas' API key, for the router's own calls to /kv/events (default: $KVSERVE_API_KEY)")
    p.add_argument("--health-interval", type=float, default=_R.health_interval,
                   help=f"seconds between health checks (default: {_R.health_interval})")
    p.add_argument("--unhealthy-after", type=int, default=_R.unhealthy_after,
                   help=f"failed checks in a row that take a replica out (default: {_R.unhealthy_after})")
    p.add_argument("--healthy-after", type=int, default=_R.healthy_after,
                   help=f"passed checks in a row that bring it back (default: {_R.healthy_after})")
    p.add_argument("--replica-wait", type=float, default=_R.replica_wait,
                   help=f"seconds a request that finds no healthy replica waits for one to come up; 0: 503 at once "
                        f"(default: {_R.replica_wait:g})")
    p.add_argument("--max-retries", type=int, default=_R.max_retries,
                   help=f"other replicas tried when one fails before the first byte (default: {_R.max_retries})")
    p.add_argument("--max-concurrent-requests", type=int, default=_R.max_concurrent_requests,
                   help=f"more get 503 (default: {_R.max_concurrent_requests})")
    p.add_argument("--header-timeout", type=float, default=_R.header_timeout,
                   help=f"seconds a client has to send a request's headers (default: {_R.header_timeout:g})")
    p.add_argument("--max-connections", type=int, default=_R.max_connections,
                   help=f"open client connections; more are answered 503 and closed (default: {_R.max_connections})")
    p.add_argument("--read-timeout", type=float, default=_R.read_timeout,
                   help=f"seconds of silence from a replica before its answer is given up (default: {_R.read_timeout:g})")
    p.add_argument("--drain-timeout", type=float, default=_R.drain_timeout,
                   help=f"seconds requests in flight get after SIGTERM (default: {_R.drain_timeout:g})")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("route", help="a cache-aware load balancer in front of kvserve servers")
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a kvserve server, e.g. http://10.0.0.2:8000 (repeat; more may join via /admin/replicas)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    add_router_args(p)
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace, replicas: list[str]) -> RouterSettings:
    for name in ("health_interval", "header_timeout", "read_timeout", "drain_timeout", "balance_rel"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("unhealthy_after", "healthy_after", "max_concurrent_requests", "max_connections"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("max_retries", "balance_abs_tokens", "min_match_tokens", "replica_wait"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    policy = PolicySettings(name=args.policy, cache_source=args.cache_source, balance_abs_tokens=args.balance_abs_tokens,
                            balance_rel=args.balance_rel, min_match_tokens=args.min_match_tokens)
    from kvserve.router.replicas import ReplicaSet
    from kvserve.web.hosts import parse_allowed_hosts

    return RouterSettings(
        replicas=tuple(ReplicaSet.normalize(u) for u in replicas), host=args.host, port=args.port, policy=policy,
        admin_key=args.admin_key or None, replica_api_key=args.replica_api_key or None,
        allowed_hosts=parse_allowed_hosts(args.allowed_hosts),
        health_interval=args.health_interval, unhealthy_after=args.unhealthy_after, healthy_after=args.healthy_after,
        replica_wait=args.replica_wait, max_retries=args.max_retries, max_concurrent_requests=args.max_concurrent_requests,
        read_timeout=args.read_timeout, drain_timeout=args.drain_timeout, header_timeout=args.header_timeout,
        max_connections=args.max_connections,
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, args.replica)
    if not settings.replicas and not settings.admin_key:
        print("kvserve route: no --replica yet; servers on this host can join with "
              f"`kvserve serve --join {settings.url}`")
    from kvserve.router.app import make_server

    make_server(settings, access_log=not args.no_access_log).run()
    return 0
