"""`make bench-prompts`: long unique prompts, kvserve beside llama.cpp's llama-server, against the matrix units' peak.

What agents, RAG and chat history send: prompts of 1k and 4k random tokens (nothing shared, so no prefix
cache helps), one token out, 1 and 4 clients, on the default model (Q4_1) and the Llama-3.2-1B-shaped random
model (Q4_0, benchmarks/formats.py). Both servers get 2 threads and a fresh process per cell; llama-server
is built with clang where it is installed, so that ggml's AMX kernels run on a CPU that has AMX
(benchmarks/peers.py says why gcc's build cannot), and the table says whether they did.

Each cell: TTFT p50, prompt tokens/s (the completed requests' prompt tokens over the run's duration), and
that rate's matrix work (2 multiply-adds' worth per weight of the model's matrices per prompt token, the
LM head and embedding left out: a prompt needs the head at its last token only) as a fraction of this
machine's int8 matrix peak, measured in the same run by a oneDNN int8 matmul (`torch._int_mm`: AMX where the
CPU has it, VNNI elsewhere). Points are saved under the results folder so an interrupted run resumes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import formats, limits, peers
from benchmarks.compare import REPO, THREADS, Plan, results_dir
from benchmarks.router import write_section

MODELS = ("Q4_1", formats.ONE_B)  # the default model as shipped; the 1B shape


def int8_peak(threads: int = THREADS, repeats: int = 5) -> float:
    """T int8 ops/s of a 512 x 2048 x 8192 oneDNN int8 matmul (a prompt chunk's FFN shape), best of several."""
    torch.set_num_threads(threads)
    a = torch.randint(-128, 127, (512, 2048), dtype=torch.int8)
    b = torch.randint(-128, 127, (2048, 8192), dtype=torch.int8)
    return 2 * 512 * 2048 * 8192 / limits._best(lambda: torch._int_mm(a, b), repeats) / 1e12


def matrix_params(model: Path) -> int:
    """Weights of the layers' matrices (the embedding and LM head left out)."""
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(model).tensors
               if len(t.shape) > 1 and not t.name.startswith(("token_embd", "output")))


def prompt_rate(point: dict) -> float:
    """Prompt tokens per second of a saved point: its completed requests' prompt tokens over its duration."""
    m = point["metrics"]
    return m["total_input_tokens"] / m["duration_s"] if m["duration_s"] else 0.0


def table(points: dict, peak: float, params: dict[str, int], amx_llama: bool) -> list[str]:
    without = any(formats.NO_AMX in cell for cell in points.values())
    rows = ["| model | prompt | clients | kvserve TTFT p50 / p90 | llama-server TTFT p50 / p90 | kvserve prompt tok/s "
            "| llama-server prompt tok/s | kvserve / llama-server | kvserve of int8 peak | llama-server of int8 peak |"
            + (" kvserve without AMX tiles: prompt tok/s |" if without else ""),
            "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if without else "")]
    for (model, n, c), cell in sorted(points.items(), key=lambda kv: (MODELS.index(kv[0][0]), kv[0][1], kv[0][2])):
        rate = {w: statistics.median(prompt_rate(p) for p in cell[w]) for w in cell}
        kv, ll = rate["kvserve"], rate["llama"]
        ttft = {w: " / ".join(f"{statistics.median(ms(p['metrics']['ttft']) for p in cell[w]) / 1e3:.2f}"
                              for ms in (lambda t: t["median_ms"], lambda t: t["percentiles_ms"]["p90"])) + " s"
                for w in cell}
        frac = {w: r * 2 * params[model] / (peak * 1e12) for w, r in (("kvserve", kv), ("llama", ll))}
        rows.append(f"| {model} | {n} | {c} | {ttft['kvserve']} | {ttft['llama']} | {kv:.0f} | {ll:.0f} "
                    f"| **{kv / ll:.2f}x** | {frac['kvserve']:.0%} | {frac['llama']:.0%} |"
                    + (f" {rate[formats.NO_AMX]:.0f} ({kv / rate[formats.NO_AMX]:.2f}x) |" if formats.NO_AMX in rate else ""))
    rows += ["", f"int8 matrix peak (oneDNN `torch._int_mm`, 512 x 2048 x 8192, {THREADS} threads): {peak:.2f} T ops/s; "
             f"llama-server {'with' if amx_llama else 'without'} ggml's AMX kernels."]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    ap.add_argument("--prompt-lens", default="1024,4096")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=2, help="requests per client in a cell (default: 2)")
    ap.add_argument("--rounds", type=int, default=1, help="measure each cell this many times, servers alternated")
    ap.add_argument("--without-amx", action="store_true",
                    help="also measure kvserve with its AMX tiles off (KVSERVE_AMX=0): what they add")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--write", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.results or results_dir(args.fresh, Plan(name="prompts"))
    out.mkdir(parents=True, exist_ok=True)
    peak_path = out / "int8_peak.json"
    if not peak_path.exists():
        peak_path.write_text(json.dumps({"t_ops": int8_peak()}) + "\n")
    peak = json.loads(peak_path.read_text())["t_ops"]
    points: dict[tuple[str, int, int], dict[str, list[dict]]] = {}
    params: dict[str, int] = {}
    stamps = []
    for name in args.models.split(","):
        model = formats.model_file(name)
        params[name] = matrix_params(model)
        for n in (int(v) for v in args.prompt_lens.split(",")):
            for c in (int(v) for v in args.concurrency.split(",")):
                for r in range(args.rounds):
                    order = ("kvserve", "llama", *([formats.NO_AMX] if args.without_amx else []))
                    for who in order[:: 1 if r % 2 == 0 else -1]:
                        path = out / f"{who}-{model.stem}-p{n}-c{c}-r{r}.json"
                        point = formats.measure(who, model, c, out, n, 1, r, prompts=args.requests * c, path=path)
                        points.setdefault((name, n, c), {}).setdefault(who, []).append(point)
                        stamps.append(path.stat().st_mtime)
    amx_llama = peers.llama_uses_amx(peers.setup_llama_server())
    section = "\n".join([
        "## Long prompts against the matrix units (`make bench-prompts`)", "",
        f"{formats.measured_on(stamps)}, {THREADS} threads each, unique random prompts, 1 token out, "
        f"{args.requests} requests per client; `make bench-prompts` ({(max(stamps) - min(stamps)) / 60 + 1:.0f} min)"
        + (f"; {args.rounds} alternated rounds a cell: medians." if args.rounds > 1 else "."), "",
        *table(points, peak, params, amx_llama)])
    write_section(args.write, section, "bench-prompts")
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
