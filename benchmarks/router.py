"""`make bench-router`: routing policies side by side on a shared-prefix workload, and the latency
the router itself adds on loopback.

Workload (the load balancer issue's): P system prompts of ~T tokens each, R chat requests (a
random system prompt and a short question each), C at a time, streamed, through N replicas of
the model. Every policy runs in the same session against the same replicas, each with a fresh
set of system prompts (so no run reuses another's cache). The replicas' KV cache is sized so that
one replica holds about half the system prompts: the situation a cache-aware router is for (all
of them fitting on every replica would make any policy hit after warm-up).

Router overhead: one replica, requests one at a time, alternately straight to it and through a
round_robin router, so drift in the machine's load hits both alike; the p50 differences of time
to first token and of the mean gap between tokens are the router's cost.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

WORDS = ("river stone lantern archive meadow signal harbor copper violet engine orchard canvas summit "
         "thread marble compass quiet ledger falcon prism cedar anchor velvet beacon glacier ember "
         "quarry saddle timber willow basin crystal delta fable garnet hollow island jasper kettle").split()


def system_prompts(n: int, tokens: int, seed: int, count_tokens) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"You are assistant number {seed}-{i}. Follow these house rules exactly."
        while count_tokens(text) < tokens:
            text += " Rule: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "."
        out.append(text)
    return out


@dataclass
class Result:
    name: str
    ttft: list[float]
    gaps: list[float]  # mean gap between tokens, per request
    output_tokens: int
    cached_tokens: int
    prompt_tokens: int
    seconds: float
    errors: int
    split: str = ""  # requests per replica, from the replicas' own counters

    def row(self) -> str:
        mean, p90 = statistics.fmean(self.ttft), sorted(self.ttft)[int(0.9 * (len(self.ttft) - 1))]
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0
        return (f"| {self.name} | {len(self.ttft)} | {mean:.2f} | {p90:.2f} | {self.output_tokens / self.seconds:.1f} "
                f"| {hit:.0%} | {self.split} | {self.seconds:.0f} | {self.errors} |")


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, int, int, int]:
    """(time to first token, mean gap between tokens, output tokens, cached tokens, prompt tokens)."""
    t0 = time.perf_counter()
    first = last = None
    n_events = 0
    usage = {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
                n_events += 1
    gap = (last - first) / (n_events - 1) if n_events > 1 else 0.0
    return (first or last or time.perf_counter()) - t0, gap, usage.get("completion_tokens", n_events), \
        usage.get("prompt_tokens_details", {}).get("cached_tokens", 0), usage.get("prompt_tokens", 0)


async def run_workload(name: str, url: str, prompts: list[str], args: argparse.Namespace, log: Path) -> Result:
    # The same sequence of prompt numbers and questions for every policy (only the prompts' text is
    # fresh), so that the policies differ in nothing but their routing.
    rng = random.Random(0)
    picks = [(rng.randrange(len(prompts)), rng.choice(WORDS)) for _ in range(args.requests)]
    bodies = [{"model": args.served_name, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True},
               "messages": [{"role": "system", "content": prompts[p]},
                            {"role": "user", "content": f"Question {i}: which rule mentions {word}?"}]}
              for i, (p, word) in enumerate(picks)]
    sem = asyncio.Semaphore(args.concurrency)
    results, errors, records = [], 0, []
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=args.auth) as client:
        async def go(i: int, body: dict) -> None:
            nonlocal errors
            async with sem:
                sent = time.perf_counter() - t0
                try:
                    results.append(r := await one_request(client, url, body))
                    records.append({"i": i, "prompt": picks[i][0], "sent": round(sent, 3), "ttft": round(r[0], 3),
                                    "cached": r[3], "prompt_tokens": r[4]})
                except (RuntimeError, httpx.HTTPError) as e:
                    errors += 1
                    print(f"  {name}: request failed: {e}", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*(go(i, b) for i, b in enumerate(bodies)))
        seconds = time.perf_counter() - t0
    log.write_text("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["i"])))
    return Result(name, [r[0] for r in results], [r[1] for r in results], sum(r[2] for r in results),
                  sum(r[3] for r in results), sum(r[4] for r in results), seconds, errors)


def replica_counters(urls: list[str]) -> list[tuple[float, float]]:
    """(requests finished, prompt tokens computed) of each replica, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        n = computed = 0.0
        for family in text_string_to_metric_families(text):
            if family.name == "kvserve_request_finished":
                n = sum(s.value for s in family.samples if s.name.endswith("_total"))
            elif family.name == "kvserve_prompt_tokens":
                computed = sum(s.value for s in family.samples)
        out.append((n, computed))
    return out


def split(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> str:
    """Requests per replica during a run, and the prompt tokens each computed (k: thousands)."""
    return " / ".join(f"{a[0] - b[0]:.0f} ({(a[1] - b[1]) / 1000:.1f}k)" for b, a in zip(before, after))


async def overhead(direct: str, routed: str, args: argparse.Namespace) -> dict:
    body = {"model": args.served_name, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Say something about rivers."}]}
    out = {"direct": ([], []), "router": ([], [])}
    async with httpx.AsyncClient(timeout=120, headers=args.auth) as client:
        for _ in range(3):  # warm both paths (connections, caches)
            await one_request(client, direct, body)
            await one_request(client, routed, body)
        for i in range(args.overhead_requests):
            for name, url in (("direct", direct), ("router", routed)) if i % 2 else (("router", routed), ("direct", direct)):
                ttft, gap, *_ = await one_request(client, url, body)
                out[name][0].append(ttft)
                out[name][1].append(gap)
    med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in out.items()}
    return {"direct": med["direct"], "router": med["router"], "n": args.overhead_requests}


def synthetic_upstream(port: int, events: int = 32, gap: float = 0.002) -> None:
    """A stand-in replica with no model: each stream's events carry the monotonic time they were
    sent, so a client on the same host sees each event's delivery latency exactly."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def health(request):
        return JSONResponse({"status": "ready"})

    async def chat(request):
        await request.body()

        async def gen():
            for i in range(events):
                if i:
                    await asyncio.sleep(gap)
                yield f'data: {{"t": {time.perf_counter()}, "choices": [{{"delta": {{"content": "x"}}}}]}}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", health), Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def synthetic_overhead(direct: str, routed: str, n: int) -> dict:
    """p50 time to first byte and p50 per-event delivery latency, straight and through the router."""
    body = {"model": "x", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    out = {"direct": ([], []), "router": ([], [])}
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(n + 10):
            for name, url in (("direct", direct), ("router", routed)) if i % 2 else (("router", routed), ("direct", direct)):
                t0 = time.perf_counter()
                first, delays = None, []
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        now = time.perf_counter()
                        if line.startswith("data: {"):
                            first = first or now
                            delays.append(now - json.loads(line[6:])["t"])
                if i >= 10:  # the first ones warm connections and code paths
                    out[name][0].append(first - t0)
                    out[name][1].extend(delays[1:])
    return {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in out.items()} | {"n": n}


GATEWAYS = ("sglang", "smg", "vllm-router")


def kv_events_port(args: argparse.Namespace, replica: int) -> int:
    """Replica i publishes its KV events on this port and replays them on the next."""
    return args.port + 30 + 2 * replica


def gateway(policy: str, source: str, urls: list[str], args: argparse.Namespace, k: int) -> tuple[str, list[str], dict]:
    """(table name, command line, environment) of the k-th run's gateway on args.port in front of urls."""
    source = source or "cache_aware"
    port, metrics_port = str(args.port), str(args.port + 60 + k)  # each binds a Prometheus port of its own
    if policy == "sglang":
        from benchmarks.peers import SGLANG_ROUTER, setup_sglang_router

        return (f"SGLang router {SGLANG_ROUTER} ({source})",
                [str(setup_sglang_router()), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", port,
                 "--policy", source, "--worker-urls", *urls], {})
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version(policy)
    except PackageNotFoundError:
        raise SystemExit(f"{policy} is not installed: pip install -e '.[bench]'") from None
    exe = str(Path(sys.executable).parent / policy)
    if policy == "smg":  # its cache_aware over HTTP workers: a radix tree of the request text
        return (f"smg {release} ({source})",
                [exe, "launch", "--host", "127.0.0.1", "--port", port, "--prometheus-port", metrics_port,
                 "--policy", source, "--worker-urls", *urls], {})
    argv = [exe, "--host", "127.0.0.1", "--port", port, "--prometheus-port", metrics_port, "--policy", source,
            "--worker-urls", *urls]
    if source == "kv_aware":  # the replicas' map-form KV events over ZMQ; prompts rendered by POST /v1/chat/completions/render
        for i, url in enumerate(urls):
            argv += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{kv_events_port(args, i)}",
                     "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{kv_events_port(args, i) + 1}"]
        # kvserve's block size (16), and full credit for its blocks: its events name their medium
        # "CPU" (its KV cache lives in main memory, where it computes), which vllm-router takes for a
        # host offload tier and credits 0.8 of a hit by default, as if each needed a transfer first.
        argv += ["--kv-event-block-size", "16", "--kv-event-model", args.served_name, "--kv-penalty-host", "1.0"]
    return f"vllm-router {release} ({source})", argv, {}


def spawn(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    from kvserve.router.local_replicas import die_with_parent

    return subprocess.Popen([sys.executable, "-m", "kvserve", *cmd], env={**os.environ, **env},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_section(path: Path, section: str, key: str = "bench-router") -> None:
    """Replace (or append) the section between the markers named key."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) + 1 :]
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text)


def measure_synthetic(args: argparse.Namespace) -> dict:
    up_port, router_port = args.port + 50, args.port + 51
    upstream = subprocess.Popen([sys.executable, "-m", "benchmarks.router", "--synthetic-upstream", str(up_port)],
                                cwd=Path(__file__).resolve().parents[1],  # where `benchmarks` imports from
                                start_new_session=True)
    router = spawn(["route", "--port", str(router_port), "--policy", "round_robin", "--no-access-log", "--replica",
                    f"http://127.0.0.1:{up_port}"], {}, args.logs / "router-synthetic.log")
    try:
        wait_healthy(f"http://127.0.0.1:{up_port}", upstream)
        wait_healthy(f"http://127.0.0.1:{router_port}", router)
        return asyncio.run(synthetic_overhead(f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{router_port}",
                                              args.synthetic_requests))
    finally:
        stop(router)
        stop(upstream)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="in all, divided between replicas")
    p.add_argument("--kv-cache-gib", type=float, default=0.125,
                   help="per replica (default 0.125: ~5.8k tokens of the default model's float16 KV, ~5 of the 8 prompts)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--policies", default="round_robin,cache_aware:approximate,cache_aware:precise",
                   help="comma-separated; sglang:cache_aware runs SGLang's router (installed once in a cached venv), "
                        "smg:cache_aware and vllm-router:cache_aware|kv_aware the gateways of the bench extra")
    p.add_argument("--overhead-requests", type=int, default=40)
    p.add_argument("--synthetic-requests", type=int, default=200,
                   help="router overhead against a model-free upstream (0: skip)")
    p.add_argument("--synthetic-only", action="store_true", help="only the router overhead against a model-free upstream")
    p.add_argument("--synthetic-upstream", type=int, default=None, help=argparse.SUPPRESS)  # internal
    p.add_argument("--port", type=int, default=8700, help="first of the ports used")
    p.add_argument("--logs", type=Path, default=Path("/tmp/kvserve-bench-router"))
    p.add_argument("--write", type=Path, default=None, help="put the results in this markdown file")
    p.add_argument("--section", default="bench-router",
                   help="the name of its markers in that file (another name keeps a full run's table beside a short one's)")
    args = p.parse_args(argv)
    if args.synthetic_upstream:
        synthetic_upstream(args.synthetic_upstream)
        return 0
    args.served_name, args.auth = "bench", {}
    args.logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    if args.synthetic_only:
        section = synthetic_section(measure_synthetic(args), argv if argv is not None else sys.argv[1:])
        print(section)
        if args.write:
            write_section(args.write, section, "bench-router-overhead")
        return 0

    from kvserve.model.loader import resolve_model_path
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model_path(args.model))
    threads = max(1, args.threads // args.replicas)
    urls = [f"http://127.0.0.1:{args.port + 1 + i}" for i in range(args.replicas)]
    events = any(spec.startswith("vllm-router:kv_aware") for spec in args.policies.split(","))
    procs = [spawn(["serve", "--model", args.model, "--served-model-name", args.served_name, "--port", str(args.port + 1 + i),
                    "--kv-cache-gib", str(args.kv_cache_gib), "--no-access-log",
                    *(["--kv-events-endpoint", f"tcp://*:{kv_events_port(args, i)}",
                       "--kv-events-replay-endpoint", f"tcp://*:{kv_events_port(args, i) + 1}",
                       "--kv-events-format", "map"] if events else [])],  # the form vllm-router reads
                   {"OMP_NUM_THREADS": str(threads)}, args.logs / f"replica{i}.log") for i in range(args.replicas)]
    results, over, synth = [], None, None
    try:
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc)
        print(f"{args.replicas} replicas ready ({threads} thread(s) each)", file=sys.stderr)
        for k, spec in enumerate(args.policies.split(",")):
            policy, _, source = spec.partition(":")
            prompts = system_prompts(args.prompts, args.prompt_tokens, seed=1000 + k, count_tokens=lambda t: len(tok.encode(t)))
            if policy in GATEWAYS:  # another gateway in kvserve's place, same replicas and load
                name, gw_argv, env = gateway(policy, source, urls, args, k)
                router = subprocess.Popen(gw_argv, env={**os.environ, **env}, stdout=open(args.logs / f"router-{k}.log", "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True)
            else:
                name = f"{policy} ({source})" if source else policy
                cmd = ["route", "--port", str(args.port), "--policy", policy, "--no-access-log"]
                cmd += ["--cache-source", source] if source else []
                for u in urls:
                    cmd += ["--replica", u]
                router = spawn(cmd, {}, args.logs / f"router-{k}.log")
            try:
                wait_healthy(f"http://127.0.0.1:{args.port}", router)
                time.sleep(1.0)  # a gateway subscribes to the replicas' events (kvserve's router waits for them at its start)
                print(f"running {name}: {args.requests} requests, concurrency {args.concurrency}", file=sys.stderr)
                before = replica_counters(urls)
                res = asyncio.run(run_workload(name, f"http://127.0.0.1:{args.port}", prompts, args,
                                               args.logs / f"requests-{k}.jsonl"))
                res.split = split(before, replica_counters(urls))
                print(res.row(), file=sys.stderr)
                results.append(res)
                if k == 0 and args.overhead_requests:
                    over = asyncio.run(overhead(urls[0], f"http://127.0.0.1:{args.port}", args))
            finally:
                stop(router)
        if args.synthetic_requests:
            synth = measure_synthetic(args)
    finally:
        for proc in procs:
            stop(proc)

    lines = ["## Router: policies on a shared-prefix workload", "",
             f"- command: `python -m benchmarks.router {' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"- date: {datetime.date.today()}; machine: {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores (shared with other work: figures are noisy)",
             f"- {args.replicas} replicas of {args.model}, {threads} thread(s) each, {args.kv_cache_gib} GiB KV cache each; "
             f"{args.prompts} system prompts of ~{args.prompt_tokens} tokens, {args.requests} chat requests, "
             f"concurrency {args.concurrency}, {args.max_tokens} output tokens each (ignore_eos), streamed", "",
             "| policy | requests | mean TTFT s | p90 TTFT s | output tok/s | prompt tokens cached "
             "| requests per replica (prompt tokens computed) | seconds | errors |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    lines += [r.row() for r in results]
    base = next((r for r in results if r.name == "round_robin"), None)
    if base:
        lines.append("")
        for r in results:
            if r is not base:
                lines.append(f"- {r.name}: mean TTFT {statistics.fmean(base.ttft) / statistics.fmean(r.ttft):.2f}x better "
                             f"than round_robin, output tok/s {r.output_tokens / r.seconds / (base.output_tokens / base.seconds):.2f}x")
    if over:
        d, r = over["direct"], over["router"]
        lines += ["", f"Router overhead on loopback ({over['n']} requests each way, alternated, one at a time, 16 tokens): "
                  f"p50 TTFT direct {d[0] * 1e3:.2f} ms, through the router {r[0] * 1e3:.2f} ms "
                  f"(**{(r[0] - d[0]) * 1e3:+.2f} ms**); p50 gap between tokens direct {d[1] * 1e3:.3f} ms, "
                  f"through the router {r[1] * 1e3:.3f} ms (**{(r[1] - d[1]) * 1e3:+.3f} ms** per token)."]
    if synth:
        lines += ["", synthetic_section(synth, None)]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(args.write, section, args.section)
    return 0


def synthetic_section(synth: dict, argv: list[str] | None) -> str:
    d, r = synth["direct"], synth["router"]
    how = f"; `python -m benchmarks.router {' '.join(argv)}`, {datetime.date.today()}" if argv is not None else ""
    return (f"Router overhead alone (a model-free upstream streaming 32 events 2 ms apart, each stamped with the "
            f"time it was sent; {synth['n']} requests each way, alternated{how}): p50 time to first byte direct "
            f"{d[0] * 1e3:.2f} ms, through the router {r[0] * 1e3:.2f} ms (**{(r[0] - d[0]) * 1e3:+.2f} ms**); "
            f"p50 delivery latency per event direct {d[1] * 1e3:.3f} ms, through the router {r[1] * 1e3:.3f} ms "
            f"(**{(r[1] - d[1]) * 1e3:+.3f} ms** per token).")


if __name__ == "__main__":
    sys.exit(main())
