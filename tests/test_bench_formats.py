"""`make bench-formats`' table: alternated rounds pair kvserve's round r with llama-server's round r,
and each figure is the median over the rounds (a shared VM drifts between minutes)."""
from __future__ import annotations

from pathlib import Path

from benchmarks import formats


def point(tok_s: float, itl_ms: float, ttft_ms: float = 100.0, rss: float = 400.0, **more: float) -> dict:
    """A saved point; its TPOT is its ITL (a server that streams every token alone)."""
    return {"metrics": {"output_throughput": tok_s, "itl": {"median_ms": itl_ms}, "ttft": {"median_ms": ttft_ms},
                        "tpot": {"median_ms": itl_ms}}, "rss_mib": rss, **more}


def test_ratio_is_the_median_of_paired_rounds_with_their_range():
    kv = [point(100.0, 5.0, pss_mib=380.0, pss_loaded_mib=300.0), point(150.0, 4.0, pss_mib=390.0, pss_loaded_mib=310.0),
          point(120.0, 4.5, pss_mib=385.0, pss_loaded_mib=305.0)]
    ll = [point(100.0, 6.0), point(100.0, 6.5), point(80.0, 7.0)]
    # rounds' ratios 1.00, 1.50, 1.50: the median of medians would say 120 / 100 = 1.20
    assert formats.ratio_cell(kv, ll) == "**1.50x** (1.00-1.50)"
    assert formats.ratio_cell(kv[:1], ll[:1]) == "**1.00x**"
    rows = formats.table({("kvserve", "Q4_0", 1): kv, ("llama", "Q4_0", 1): ll},
                         {"bandwidth_gbs": 30.0}, {"Q4_0": 90_000_000}, {"Q4_0": 250.0})
    # resident: PSS where the point has it, else RSS; loaded 305 MiB of a 250 MiB file; a token's 90 MB at
    # 30 GB/s is 3 ms, against TPOT p50 4.5 ms (67%) and 6.5 ms (46%)
    assert rows[2] == ("| Q4_0 | 1 | 120.0 | 100.0 | **1.50x** (1.00-1.50) | 4.50 / 6.50 | 0.69 | 100 / 100 | "
                       "385 / 400 | 1.22x | 67% / 46% |")


def test_round_zero_keeps_the_single_run_file_name():
    out, model = Path("/r"), Path("/m/smollm2-135m-Q4_0.gguf")
    assert formats.point_path(out, "kvserve", model, 4, 0) == Path("/r/kvserve-smollm2-135m-Q4_0-c4.json")
    assert formats.point_path(out, "llama", model, 4, 2) == Path("/r/llama-smollm2-135m-Q4_0-c4-r2.json")
