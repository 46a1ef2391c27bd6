"""`kvserve bench serve`: load an OpenAI-compatible server the way users do, and measure it.

Two ways to send load, as `vllm bench serve` does, usable together:
- open loop: requests arrive at --request-rate per second whatever the server does, with gaps
  drawn from a gamma distribution (--burstiness 1 is a Poisson process; lower is burstier,
  higher more even); the gaps are scaled so N requests span exactly N / rate seconds;
- closed loop: at most --max-concurrency requests in flight, the next sent as one finishes.
The run is bounded by --num-prompts and, optionally, --max-duration: at that time no more are
sent and those in flight are cancelled (counted as unfinished, not as failures).

Python: `run(BenchConfig(base_url=..., max_concurrency=4)) -> BenchResult`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvserve.bench import metrics as bench_metrics
from kvserve.bench.client import RequestOutput, RequestSpec, send
from kvserve.bench.datasets import DatasetConfig, Sample, default_tokenizer, load_samples


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None = None  # None: the first model the server lists at /v1/models
    endpoint: str = "completions"  # completions | chat
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tokenizer: str | None = None  # a model kvserve can load; None: the default model's tokenizer
    max_concurrency: int | None = None  # None: no limit (open loop only)
    request_rate: float = math.inf  # requests per second; inf sends all at once
    burstiness: float = 1.0
    max_duration: float | None = None  # seconds; stop sending and cancel what is in flight
    timeout: float = 600.0  # per request, seconds
    goodput: dict[str, float] = field(default_factory=dict)  # ttft|tpot|e2el → ms
    ignore_eos: bool = True
    num_warmups: int = 1
    api_key: str | None = None
    seed: int = 0
    percentiles: tuple[float, ...] = bench_metrics.PERCENTILES
    progress: bool = True


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    date: str
    metrics: bench_metrics.BenchMetrics
    unfinished: int  # in flight when --max-duration ended the run
    not_sent: int  # never sent because --max-duration came first
    max_in_flight: int  # most requests in flight at once, as the client saw it
    outputs: list[RequestOutput]

    def to_dict(self, detailed: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"date": self.date, "model": self.model, "config": dataclasses.asdict(self.config),
             "metrics": dataclasses.asdict(self.metrics), "unfinished": self.unfinished,
             "not_sent": self.not_sent, "max_in_flight": self.max_in_flight}
        d["config"]["request_rate"] = str(self.config.request_rate)  # JSON has no inf
        if detailed:
            d["requests"] = [dataclasses.asdict(o) for o in self.outputs]
        return d


def _api_url(cfg: BenchConfig) -> str:
    base = cfg.base_url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    if cfg.endpoint not in ("completions", "chat"):
        raise ValueError(f"--endpoint must be completions or chat, not {cfg.endpoint!r}")
    return f"{base}/v1/chat/completions" if cfg.endpoint == "chat" else f"{base}/v1/completions"


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def first_model(base_url: str, headers: dict[str, str] | None = None) -> str:
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        r = httpx.get(url, headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"could not ask {url} for its model ({e}); is the server up? or pass --model") from None


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (all 0 for an infinite rate)."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, not {burstiness}")
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive, not {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = np.full(n, 1.0 / rate) if math.isinf(burstiness) else rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    times = np.cumsum(gaps)
    times *= (n / rate) / times[-1]  # n requests span exactly n / rate seconds, whatever the draw
    return times.tolist()


class _Runner:
    def __init__(self, cfg: BenchConfig, model: str, samples: list[Sample]) -> None:
        self.cfg, self.samples = cfg, samples
        self.specs = [RequestSpec(_api_url(cfg), model, s.prompt, s.prompt_len, s.output_len,
                                  chat=cfg.endpoint == "chat", ignore_eos=cfg.ignore_eos, headers=_headers(cfg))
                      for s in samples]
        self.in_flight = self.max_in_flight = 0

    async def _one(self, client: httpx.AsyncClient, spec: RequestSpec, sem: asyncio.Semaphore | None,
                   bar: Any) -> RequestOutput:
        async with sem if sem is not None else _nullcontext():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await send(client, spec, self.cfg.timeout)
            finally:
                self.in_flight -= 1
                if bar is not None:
                    bar.update(1)

    async def warmup(self, client: httpx.AsyncClient) -> None:
        for _ in range(self.cfg.num_warmups):
            # A prompt no measured request starts with: a warm-up of the first request's own prompt would leave it
            # in the server's prefix cache and halve a two-request cell's TTFT.
            first = self.specs[0]
            spec = dataclasses.replace(first, prompt="Warm-up. " + first.prompt, output_len=min(first.output_len, 8))
            out = await send(client, spec, self.cfg.timeout)
            if not out.success:
                raise ValueError(f"the warm-up request to {spec.api_url} failed: {out.error}")

    async def run(self) -> tuple[list[RequestOutput], float, int, int]:
        cfg = self.cfg
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        limits = httpx.Limits(max_connections=cfg.max_concurrency or len(self.specs),
                              max_keepalive_connections=cfg.max_concurrency or len(self.specs))
        offsets = arrival_offsets(len(self.specs), cfg.request_rate, cfg.burstiness, cfg.seed)
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(self.specs), unit="req", desc="requests")
        async with httpx.AsyncClient(limits=limits) as client:
            await self.warmup(client)
            start = time.perf_counter()
            deadline = start + cfg.max_duration if cfg.max_duration else math.inf
            tasks: list[asyncio.Task] = []
            for spec, at in zip(self.specs, offsets):
                wait = start + at - time.perf_counter()
                if start + at >= deadline:
                    break
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(self._one(client, spec, sem, bar)))
            remaining = deadline - time.perf_counter()
            done: set[asyncio.Task] = set()
            pending: set[asyncio.Task] = set()
            if tasks:
                done, pending = await asyncio.wait(tasks, timeout=None if math.isinf(remaining) else max(remaining, 0))
            unfinished = self.in_flight  # sent and not answered; the rest of `pending` still wait for a slot
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        outputs = [t.result() for t in tasks if t in done]
        return outputs, duration, unfinished, len(self.specs) - len(outputs) - unfinished


class _nullcontext:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def run(cfg: BenchConfig, samples: list[Sample] | None = None) -> BenchResult:
    """Send the workload, wait for it (or for max_duration), and compute the metrics."""
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, not {cfg.max_concurrency}")
    model = cfg.model or first_model(cfg.base_url, _headers(cfg))
    if samples is None:
        tokenizer = None if cfg.dataset.name == "jsonl" and cfg.tokenizer is None else default_tokenizer(cfg.tokenizer)
        samples = load_samples(cfg.dataset, tokenizer)
    runner = _Runner(cfg, model, samples)
    outputs, duration, unfinished, not_sent = asyncio.run(runner.run())
    m = bench_metrics.compute(outputs, duration, cfg.goodput, cfg.percentiles)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return BenchResult(cfg, model, date, m, unfinished, not_sent, runner.max_in_flight, outputs)


def save(result: BenchResult, path: str | Path, detailed: bool = False) -> None:
    Path(path).write_text(json.dumps(result.to_dict(detailed), indent=2) + "\n")
