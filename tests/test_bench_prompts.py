"""`make bench-prompts`' table: the time to first token's median and 90th percentile; prompt tokens/s is the
completed requests' prompt tokens over the run's duration, and the fraction of the int8 peak is that rate's
matrix work (2 ops a matrix weight a prompt token)."""
from __future__ import annotations

from benchmarks import formats, prompts


def point(tokens: int, seconds: float, ttft_ms: float, p90_ms: float = 0.0) -> dict:
    return {"metrics": {"total_input_tokens": tokens, "duration_s": seconds,
                        "ttft": {"median_ms": ttft_ms, "percentiles_ms": {"p90": p90_ms or ttft_ms}}}}


def test_prompt_rate_ratio_and_fraction_of_the_int8_peak():
    cell = {"kvserve": [point(8192, 16.0, 8000.0, 9000.0)], "llama": [point(8192, 32.0, 16000.0, 31000.0)],
            formats.NO_AMX: [point(8192, 20.0, 10000.0)]}
    rows = prompts.table({("Q4_1", 4096, 1): cell}, peak=1.0, params={"Q4_1": 500_000_000}, amx_llama=True)
    # 512 tok/s x 2 x 0.5e9 = 0.512 T ops/s of a 1.0 T peak; without AMX 409.6 tok/s
    assert rows[2] == "| Q4_1 | 4096 | 1 | 8.00 / 9.00 s | 16.00 / 31.00 s | 512 | 256 | **2.00x** | 51% | 26% | 410 (1.25x) |"
    assert rows[-1].endswith("llama-server with ggml's AMX kernels.")
    assert prompts.prompt_rate(point(0, 0.0, 0.0)) == 0.0
