"""`make soak`: mixed load through a router to two replicas for a long time while replicas die,
and what is left afterwards. The reliability issue's targets, measured in one run:

- two `kvserve serve` replicas and a `kvserve route` in front, real processes on loopback;
- clients (benchmarks/soak_load.py) send chat, completions and stored Responses, streamed and
  not, structured output and tools, small `max_tokens`; a share of the streams is dropped by its
  client; a hostile client sends a slow schema and over-limit metadata, which must be refused;
- each replica keeps a KV disk tier in a temporary directory, so a restart restarts it too;
- replica 0 is SIGKILLed and restarted every `--kill-every` s; replica 1 is drained once with
  SIGTERM (at `--drain-at` of the run; it must exit 0) and restarted; the two never overlap, so
  one replica is always up;
- the resident memory (VmRSS from /proc) of every process is sampled every `--sample-every` s;
- afterwards: KV blocks in use on each replica (`GET /v1/engine/state`, must be 0), the
  grammar cache and the disk tier (`/metrics`).

Writes `soak.json` (everything), `soak.md` (a summary) and `soak-rss.png` (if matplotlib is
installed) in `--out`. Exit status 1 if a target is missed: a request lost before it reached a
replica, an unexpected failure (a hostile request refused late or accepted included), a kind of
hostile request never refused, a leaked block, a drain that did not exit 0, or resident memory of
the router or of replica 1 (which lives through most of the run) outside ±`--rss-band` of its
median over the last two thirds of the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.soak_load import REFUSALS, classify, run_load


class Proc:
    """One kvserve process (a replica or the router), restartable on the same port."""

    def __init__(self, name: str, cmd: list[str], port: int, logs: Path, threads: int) -> None:
        self.name, self.cmd, self.port, self.logs, self.threads = name, cmd, port, logs, threads
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        from kvserve.router.local_replicas import die_with_parent

        self.starts += 1
        log = open(self.logs / f"{self.name}.log", "a")
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve", *self.cmd], env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)

    async def wait_healthy(self, timeout: float = 120) -> float:
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: see {self.logs}/{self.name}.log")
                try:
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout} s")

    def rss_mib(self) -> float | None:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return None  # dead, or between a kill and its restart

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


async def chaos(args, replicas: list[Proc], t0: float, events: list[dict]) -> None:
    """SIGKILL + restart replica 0 every kill_every s, one SIGTERM drain of replica 1; one at a time."""
    drain_at = args.duration * args.drain_at
    plan = sorted([(drain_at, "drain")] + [(k * args.kill_every, "kill") for k in
                                           range(1, int(args.duration / args.kill_every) + 1)
                                           if k * args.kill_every < args.duration - 5])
    for at, what in plan:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        for r in replicas:  # never take the last one down
            await r.wait_healthy()
        target = replicas[1] if what == "drain" else replicas[0]
        now = time.monotonic() - t0
        if what == "kill":
            target.proc.kill()
            await asyncio.to_thread(target.proc.wait)
            events.append({"t": round(now, 3), "event": "sigkill", "replica": target.name})
            rc = -9
        else:
            target.proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(target.proc.wait, args.drain_timeout + 30)
            events.append({"t": round(now, 3), "event": "sigterm", "replica": target.name, "exit": rc,
                           "drain_seconds": round(time.monotonic() - t0 - now, 2)})
        target.start()
        ready = await target.wait_healthy()
        events.append({"t": round(time.monotonic() - t0, 3), "event": "restarted", "replica": target.name,
                       "after": what, "ready_seconds": round(ready, 2)})


async def sample_rss(procs: list[Proc], t0: float, every: float, until: float, samples: list[dict]) -> None:
    while time.monotonic() < until:
        samples.append({"t": round(time.monotonic() - t0, 2),
                        **{p.name: (None if (m := p.rss_mib()) is None else round(m, 1)) for p in procs},
                        **{p.name + "_pid": p.proc.pid for p in procs}})
        await asyncio.sleep(every)


def flatness(samples: list[dict], name: str, since: float, band: float) -> dict:
    """The process's RSS over [since, end] of its last incarnation: median, min, max, within ±band."""
    pid = samples[-1][name + "_pid"]
    since = max([since] + [s["t"] for s in samples if s[name + "_pid"] != pid])  # after its restart
    vals = [s[name] for s in samples if s["t"] >= since and s[name + "_pid"] == pid and s[name] is not None]
    if len(vals) < 2:
        return {"samples": len(vals), "flat": None}
    med = statistics.median(vals)
    return {"since_s": since, "samples": len(vals), "median_mib": round(med, 1), "min_mib": min(vals), "max_mib": max(vals),
            "first_mib": vals[0], "last_mib": vals[-1],
            "flat": all(abs(v - med) <= band * med for v in vals)}


# What /metrics says after the load (the disk tier's counters are its last incarnation's).
AFTER_LOAD_METRICS = {"grammar_cache_entries": "kvserve_grammar_cache_entries",
                      "grammar_cache_bytes": "kvserve_grammar_cache_bytes",
                      "grammar_cache_hits": "kvserve_grammar_cache_hits_total",
                      "grammar_cache_misses": "kvserve_grammar_cache_misses_total",
                      "grammar_compile_timeouts": "kvserve_grammar_compile_timeouts_total",
                      "disk_blocks": "kvserve_kv_disk_blocks", "disk_bytes_used": "kvserve_kv_disk_bytes_used",
                      "disk_blocks_written": "kvserve_kv_disk_blocks_written_total",
                      "disk_hit_blocks": "kvserve_kv_disk_hit_blocks_total",
                      "disk_load_errors": "kvserve_kv_disk_load_errors_total"}


async def after_load(replicas: list[Proc]) -> dict:
    """Blocks in use and the grammar cache on every replica, once nothing is in flight."""
    out = {}
    async with httpx.AsyncClient(timeout=10) as client:
        for r in replicas:
            for _ in range(50):  # aborted requests free their blocks before the engine's next step
                state = (await client.get(r.url + "/v1/engine/state")).json()
                if state["pool"]["used"] == 0 and state["num_running"] == 0 and state["num_waiting"] == 0:
                    break
                await asyncio.sleep(0.1)
            metrics = (await client.get(r.url + "/metrics")).text
            value = lambda name: next((float(line.split()[-1]) for line in metrics.splitlines()  # noqa: E731
                                       if line.startswith(name + " ")), None)
            out[r.name] = {"blocks_used": state["pool"]["used"], "blocks_total": state["pool"]["num_blocks"],
                           "running": state["num_running"], "waiting": state["num_waiting"],
                           **{key: value(name) for key, name in AFTER_LOAD_METRICS.items()}}
    return out


async def soak(args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-soak-disk-") as disk:  # the replicas' disk tiers
        return await _soak(args, Path(disk))


async def _soak(args, disk: Path) -> dict:
    ports = [args.port, args.port + 1, args.port + 2] if args.port else free_ports(3)
    replicas = [Proc(f"replica{i}", ["serve", "--model", args.model, "--served-model-name", "soak", "--port",
                                     str(ports[1 + i]), "--kv-cache-gib", str(args.kv_cache_gib), "--no-access-log",
                                     "--drain-timeout", str(args.drain_timeout),
                                     "--kv-disk-path", str(disk / f"replica{i}"), "--kv-disk-gib", str(args.kv_disk_gib),
                                     "--grammar-compile-timeout", str(args.grammar_compile_timeout)],
                     ports[1 + i], args.out, args.threads)
                for i in range(2)]
    router = Proc("router", ["route", "--port", str(ports[0]), "--no-access-log", "--health-interval", "0.5",
                             *[a for r in replicas for a in ("--replica", r.url)]], ports[0], args.out, 1)
    procs = [router, *replicas]
    for p in procs:
        (args.out / f"{p.name}.log").write_text("")
    events: list[dict] = []
    samples: list[dict] = []
    try:
        for p in replicas:
            p.start()
        for p in replicas:
            await p.wait_healthy()
        router.start()
        await router.wait_healthy()
        t0 = time.monotonic()
        sampler = asyncio.ensure_future(sample_rss(procs, t0, args.sample_every, t0 + args.duration + 60, samples))
        chaos_task = asyncio.ensure_future(chaos(args, replicas, t0, events))
        outcomes = await run_load(router.url, "soak", args.duration, args.clients, args.max_tokens,
                                  args.disconnect_share, t0, args.seed, args.hostile_every,
                                  args.grammar_compile_timeout + 5)
        load_seconds = time.monotonic() - t0
        await asyncio.wait_for(chaos_task, 180)  # a restart under way finishes
        sampler.cancel()
        leftovers = await after_load(replicas)
        router_metrics = httpx.get(router.url + "/metrics", timeout=10).text
    finally:
        rcs = {p.name: p.stop() for p in (router, *replicas)}
    kills = [e["t"] for e in events if e["event"] == "sigkill"]
    since = args.duration / 3
    ready = {e["replica"]: e["t"] for e in events if e["event"] == "restarted"}  # the last restart of each
    rss = {p.name: flatness(samples, p.name, max(since, ready.get(p.name, 0.0) + args.rss_warmup), args.rss_band)
           for p in procs}
    counts = classify(outcomes, kills)
    served = {}
    for o in outcomes:
        if o.result == "ok":
            served[o.replica or "?"] = served.get(o.replica or "?", 0) + 1
    drains = [e for e in events if e["event"] == "sigterm"]
    retries = {line.split(" ")[0]: float(line.split()[-1]) for line in router_metrics.splitlines()
               if line.startswith(("kvserve_router_retries_total{", "kvserve_router_errors_total{"))}
    misses = []
    if counts["lost_never_reached_replica"]:
        misses.append("requests lost before reaching a replica")
    if counts["failed_unexpected"]:
        misses.append("unexpected failures")
    if any(not counts["results_by_kind"].get(kind, {}).get("refused") for kind in REFUSALS):
        misses.append("a kind of hostile request never refused")
    if any(v["blocks_used"] for v in leftovers.values()):
        misses.append("KV blocks in use after the load")
    if any(e["exit"] != 0 for e in drains):
        misses.append("a drained replica did not exit 0")
    if any(rss[n]["flat"] is not True for n in ("router", "replica1")):
        misses.append(f"resident memory not within ±{args.rss_band:.0%}")
    return {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "load_seconds": round(load_seconds, 1), **counts, "served_by_replica": served,
            "requests_per_second": round(counts["requests"] / load_seconds, 2), "events": events,
            "router_retries_and_errors": retries, "after_load": leftovers, "rss": rss, "rss_since_s": round(since, 1),
            "exit_codes_at_end": rcs, "targets_missed": misses, "rss_samples": samples,
            "outcomes": [o.as_dict() for o in outcomes]}


PROCESSES = ("router", "replica0", "replica1")


def markdown(r: dict) -> str:
    a = r["args"]
    lines = [f"# kvserve soak: {r['load_seconds']} s, {a['clients']} clients, max_tokens {a['max_tokens']}", "",
             f"- requests: {r['requests']} ({r['requests_per_second']}/s): {r['ok']} ok, {r['disconnected']} "
             f"disconnected by their client on purpose, {r['refused']} hostile requests refused as expected, "
             f"{r['failed']} failed",
             f"- refusals by kind and cause: {json.dumps(r['refusals_by_cause'])}",
             "- results by kind: " + "; ".join(f"{kind} {json.dumps(v)}" for kind, v in r["results_by_kind"].items()),
             f"- failures by cause: {json.dumps(r['failures_by_cause'])}",
             f"- allowed (in flight on a SIGKILLed replica): {r['failed_allowed_killed_in_flight']}; "
             f"**lost before reaching a replica: {r['lost_never_reached_replica']}**; "
             f"**unexpected: {r['failed_unexpected']}**",
             f"- served by replica: {json.dumps(r['served_by_replica'])}",
             "- chaos: " + "; ".join(f"{e['t']:.0f}s {e['event']} {e['replica']}" + (f" (exit {e['exit']}, "
                                      f"{e['drain_seconds']} s)" if e["event"] == "sigterm" else "")
                                      for e in r["events"]),
             f"- router retries/errors: {json.dumps(r['router_retries_and_errors'])}", "",
             "After the load (grammar and disk figures: each replica's last incarnation):", "",
             "| replica | KV blocks in use | of | " + " | ".join(k.replace("_", " ") for k in AFTER_LOAD_METRICS) + " |",
             "|---|---:|---:|" + "---:|" * len(AFTER_LOAD_METRICS)]
    for name, v in r["after_load"].items():
        lines.append(f"| {name} | **{v['blocks_used']}** | {v['blocks_total']} | "
                     + " | ".join("" if v[k] is None else f"{v[k]:.0f}" for k in AFTER_LOAD_METRICS) + " |")
    samples = r["rss_samples"]
    lines += ["", "Resident memory over time (MiB; empty: the process was down):", "",
              "| s | " + " | ".join(PROCESSES) + " |", "|---:|" + "---:|" * len(PROCESSES)]
    for s in samples[::max(1, len(samples) // 12)] + samples[-1:]:
        lines.append(f"| {s['t']:.0f} | " + " | ".join("" if s[n] is None else f"{s[n]:.0f}" for n in PROCESSES) + " |")
    lines += ["", f"Flat: every sample of the process's last incarnation from {r['rss_since_s']} s on (the last two "
              f"thirds) and {a['rss_warmup']} s after its restart within ±{float(a['rss_band']):.0%} of their median "
              "(judged for the router and replica1; replica0, restarted every few minutes, is reported):", "",
              "| process | from s | samples | first | last | min | max | median | flat (±" + f"{float(a['rss_band']):.0%}) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, v in r["rss"].items():
        if v.get("median_mib") is None:
            lines.append(f"| {name} | | {v['samples']} | | | | | | n/a |")
            continue
        lines.append(f"| {name} | {v['since_s']} | {v['samples']} | {v['first_mib']} | {v['last_mib']} | {v['min_mib']} | "
                     f"{v['max_mib']} | {v['median_mib']} | {v['flat']} |")
    lines += ["", "Targets missed: " + (", ".join(r["targets_missed"]) or "none")]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 4))
    for name in PROCESSES:
        ax.plot([s["t"] for s in r["rss_samples"]], [s[name] for s in r["rss_samples"]], label=name)
    for e in r["events"]:
        if e["event"] in ("sigkill", "sigterm"):
            ax.axvline(e["t"], color="red" if e["event"] == "sigkill" else "orange", lw=0.6, ls="--")
    ax.set_xlabel("seconds (red: SIGKILL replica0, orange: SIGTERM drain replica1)")
    ax.set_ylabel("VmRSS MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=1800, help="seconds of load (default: 1800)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default: 4)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect-share", type=float, default=0.2, help="share of streams their client drops")
    p.add_argument("--hostile-every", type=float, default=30,
                   help="seconds between the hostile client's rounds (a slow schema, then over-limit metadata)")
    p.add_argument("--grammar-compile-timeout", type=float, default=10,
                   help="the replicas' --grammar-compile-timeout; a slow schema's refusal must come within it + 5 s")
    p.add_argument("--kv-disk-gib", type=float, default=0.25, help="each replica's KV disk tier bound")
    p.add_argument("--kill-every", type=float, default=180, help="seconds between SIGKILLs of replica 0")
    p.add_argument("--drain-at", type=float, default=0.2, help="when replica 1 is drained, as a share of the run")
    p.add_argument("--drain-timeout", type=float, default=30)
    p.add_argument("--sample-every", type=float, default=5, help="seconds between RSS samples")
    p.add_argument("--rss-band", type=float, default=0.10, help="allowed RSS deviation from the median")
    p.add_argument("--rss-warmup", type=float, default=60,
                   help="seconds after a restart before its RSS counts (kernels, grammars and allocator warm up)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-gib", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per replica")
    p.add_argument("--port", type=int, default=8760, help="the router's; replicas take the next two (0: any free ports)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("/tmp/kvserve-soak"))
    args = p.parse_args(argv)
    result = asyncio.run(soak(args))
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    summary = markdown(result)
    if plot(result, args.out / "soak-rss.png"):
        summary += "\n![resident memory](soak-rss.png)\n"
    (args.out / "soak.md").write_text(summary)
    print(summary)
    return 1 if result["targets_missed"] else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the processes on the way out
    sys.exit(main())
