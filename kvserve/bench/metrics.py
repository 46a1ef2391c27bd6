"""Request outputs → the serving metrics of `vllm bench serve`, with the same definitions.

- TTFT: time to first token; E2EL: end-to-end latency, both per successful request.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more than one output token.
- ITL: every gap between two text chunks, over all requests.
- Throughputs divide by the benchmark's wall time (first send to last finish).
- Goodput: successful requests per second that met every SLO given (a request with one output
  token has TPOT 0 for this purpose, as in vLLM).
Each latency has mean, median, std and the chosen percentiles (numpy's linear interpolation).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kvserve.bench.client import RequestOutput, failure_kind

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class LatencyStats:
    mean_ms: float = 0.0
    median_ms: float = 0.0
    std_ms: float = 0.0
    percentiles_ms: dict[str, float] = field(default_factory=dict)  # "p90" → ms

    @classmethod
    def of(cls, seconds: list[float], percentiles: tuple[float, ...] = PERCENTILES) -> LatencyStats:
        if not seconds:
            return cls(percentiles_ms={f"p{p:g}": 0.0 for p in percentiles})
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles})


@dataclass
class BenchMetrics:
    completed: int
    failed: int
    failures: dict[str, int]  # cause → count, e.g. {"HTTP 429": 3, "stream dropped": 1}
    duration_s: float
    total_input_tokens: int  # from usage where reported, else the local count
    total_output_tokens: int
    tokens_counted_by: str  # usage | chunks | mixed
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] → {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes NAME:MS with NAME ttft, tpot or e2el, not {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be positive")
    return slos


def tpot_of(o: RequestOutput) -> float | None:
    return (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else None


def compute(outputs: list[RequestOutput], duration_s: float, goodput: dict[str, float] | None = None,
            percentiles: tuple[float, ...] = PERCENTILES) -> BenchMetrics:
    ok = [o for o in outputs if o.success]
    failures = Counter(failure_kind(o.error) for o in outputs if not o.success)
    tpots = [t for t in map(tpot_of, ok) if t is not None]
    good = None
    if goodput:
        def meets(o: RequestOutput) -> bool:
            got = {"ttft": o.ttft, "tpot": tpot_of(o) or 0.0, "e2el": o.latency}
            return all(got[k] * 1000.0 <= limit for k, limit in goodput.items())
        good = sum(map(meets, ok)) / duration_s if duration_s > 0 else 0.0
    inputs = sum(o.prompt_tokens if o.prompt_tokens >= 0 else max(o.prompt_len, 0) for o in ok)
    outs = sum(o.output_tokens for o in ok)
    counted = {o.tokens_counted_by for o in ok}
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return BenchMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        failures=dict(sorted(failures.items())),
        duration_s=duration_s,
        total_input_tokens=inputs,
        total_output_tokens=outs,
        tokens_counted_by=counted.pop() if len(counted) == 1 else ("mixed" if counted else "none"),
        request_throughput=rate(len(ok)),
        request_goodput=good,
        output_throughput=rate(outs),
        total_token_throughput=rate(inputs + outs),
        ttft=LatencyStats.of([o.ttft for o in ok], percentiles),
        tpot=LatencyStats.of(tpots, percentiles),
        itl=LatencyStats.of([g for o in ok for g in o.itl], percentiles),
        e2el=LatencyStats.of([o.latency for o in ok], percentiles),
    )


def summary(m: BenchMetrics) -> str:
    """The text block `vllm bench serve` prints, in kvserve's words."""
    lines = ["============ Serving Benchmark Result ============"]
    row = lambda k, v: lines.append(f"{k:<40}{v}")  # noqa: E731
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    for cause, n in m.failures.items():
        row(f"  {cause}:", n)
    row("Benchmark duration (s):", f"{m.duration_s:.2f}")
    row("Total input tokens:", m.total_input_tokens)
    row(f"Total generated tokens ({m.tokens_counted_by}):", m.total_output_tokens)
    row("Request throughput (req/s):", f"{m.request_throughput:.2f}")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", f"{m.request_goodput:.2f}")
    row("Output token throughput (tok/s):", f"{m.output_throughput:.2f}")
    row("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}")
    for title, key in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                       ("Inter-token Latency", "itl"), ("End-to-end Latency", "e2el")):
        s: LatencyStats = getattr(m, key)
        lines.append(f"{title:-^50}")
        row(f"Mean {key.upper()} (ms):", f"{s.mean_ms:.2f}")
        row(f"Median {key.upper()} (ms):", f"{s.median_ms:.2f}")
        for p, v in s.percentiles_ms.items():
            row(f"P{p[1:]} {key.upper()} (ms):", f"{v:.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
