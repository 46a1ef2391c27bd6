"""`make bench-formats`: kvserve beside llama.cpp's llama-server on each weight format users run.

The default model as shipped (Q4_1) and as llama.cpp's `llama-quantize` remakes it (Q4_0, Q8_0,
Q4_K_M: llama.cpp repacks Q4_0, Q8_0 and Q4_K rows for its kernels at load, not Q4_1, so the
shipped file alone would flatter kvserve); and random-weight models with the shapes of Llama-3.2-1B,
Qwen3-4B, Gemma-3-4B and the mixture of experts OLMoE-1B-7B (SHAPES: their layers, heads, FFN and vocabulary sizes; the default model's
tokenizer, padded to the vocabulary), written with the `gguf` library and quantized by
`llama-quantize` — only speed means anything on them, so EOS is ignored everywhere. Both servers get 2 threads
and their best settings (llama-server: one server per concurrency, `-np` = clients), the same
streamed closed-loop load from `kvserve bench serve`, one after the other on a quiet machine.

Each cell: output tok/s, ITL p50, TTFT p50, resident MiB (the server's process tree's PSS; kvserve's
also once loaded, before any request), and decode's fraction of the bytes roofline (1 / TPOT p50
against the weights one sequence's decode step reads over this machine's measured read bandwidth).
A shared VM's speed drifts by a fifth over minutes, so `--rounds N` measures each cell N times,
the two servers alternated (kvserve first in even rounds, llama-server first in odd ones): the
table gives each figure's median over the rounds, and the ratio as the median of the rounds'
ratios with their range.
Points are saved under ~/.cache/kvserve/peers/results/<commit>/formats/ so an interrupted run
resumes (`--results DIR` redraws the table and the plot from a folder of saved points). The plot,
docs/benchmarks/formats.png, draws tok/s and ITL p50 of both servers per format against clients.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import peers
from benchmarks.compare import (CTX_PER_SLOT, REPO, THREADS, Plan, Server, bench_tokenizer, proportional_mib, resident_mib,
                                results_dir)
from kvserve.bench.datasets import DatasetConfig, load_samples
from kvserve.bench.serve import BenchConfig, run

FORMATS = ("Q4_1", "Q4_0", "Q8_0", "Q4_K_M")
ONE_B = "1b-Q4_0"  # the Llama-3.2-1B-shaped random model
# Random-weight models by the name's prefix ("qwen3-4b-Q4_K_M"): the architecture and shapes of a model
# users run (vocab None: the default model's tokenizer's 49152).
SHAPES = {
    "1b": dict(arch="llama", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=None,
               tied=False, stem="llama-1b-shaped"),
    "qwen3-4b": dict(arch="qwen3", hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=9728,
                     vocab=151936, tied=True, stem="qwen3-4b-shaped"),
    "gemma3-4b": dict(arch="gemma3", hidden=2560, layers=34, heads=8, kv_heads=4, head_dim=256, ffn=10240,
                      vocab=262144, tied=True, stem="gemma3-4b-shaped"),
    # OLMoE-1B-7B's shapes as a Qwen3-MoE file (the same layer: q/k norms, 64 SwiGLU experts, top 8)
    "olmoe": dict(arch="qwen3moe", hidden=2048, layers=16, heads=16, kv_heads=16, head_dim=128, ffn=1024,
                  vocab=50304, tied=False, experts=64, experts_used=8, stem="olmoe-1b-7b-shaped"),
    # gpt-oss-20b's shapes at half its depth (12 of 24 layers, so that a load fits this 24 GiB machine beside
    # the page cache): 64 heads of 64, 8 KV heads, 32 experts of 2880, top 4, o200k's vocabulary; windows of
    # 128 in every other layer, YaRN, sinks and the biases. Experts written as MXFP4 (llama.cpp's MXFP4_MOE).
    "gpt-oss-20b": dict(arch="gpt-oss", hidden=2880, layers=12, heads=64, kv_heads=8, head_dim=64, ffn=2880,
                        vocab=201088, tied=False, experts=32, experts_used=4, stem="gpt-oss-20b-shaped-12l"),
}


def _shape_of(name: str) -> tuple[str | None, str]:
    """A format name's random-model shape (None: the default model) and its weight format."""
    shape, _, fmt = name.rpartition("-")
    return (shape if shape in SHAPES else None), fmt
BEGIN, END = "<!-- formats:begin -->", "<!-- formats:end -->"
NO_AMX = "kvserve-noamx"  # kvserve with its AMX tiles turned off (KVSERVE_AMX=0): what they add


def model_file(name: str, progress=print) -> Path:
    """The GGUF for a format name (FORMATS, or ONE_B), made once under the peers cache."""
    from kvserve.model.loader import resolve_model_path

    shipped = resolve_model_path("smollm2-135m")
    if name == "Q4_1":
        return shipped
    root = peers.cache_root() / "models"
    root.mkdir(parents=True, exist_ok=True)
    shape, fmt = _shape_of(name)
    stem = SHAPES[shape]["stem"] if shape else "smollm2-135m"
    out = root / f"{stem}-{fmt}.gguf"
    if out.exists():
        return out
    quantize = peers.quantize_binary(peers.setup_llama_server(progress))
    source = shipped
    if shape:
        source = root / f"{stem}-F16.gguf"
        if not source.exists():
            progress(f"writing the {shape}-shaped random model (F16)")
            write_random(source, shipped, **{k: v for k, v in SHAPES[shape].items() if k != "stem"})
    progress(f"llama-quantize {source.name} -> {out.name}")
    tmp = out.with_suffix(".tmp")
    subprocess.run([str(quantize), "--allow-requantize", str(source), str(tmp), fmt], check=True, capture_output=True)
    tmp.rename(out)
    return out


def write_random(path: Path, vocab_from: Path, arch: str = "llama", hidden: int = 2048, layers: int = 16,
                 heads: int = 32, kv_heads: int = 8, head_dim: int = 64, ffn: int = 8192, vocab: int | None = None,
                 tied: bool = False, seed: int = 0, experts: int = 0, experts_used: int = 0) -> None:
    """A llama / qwen3 / gemma3 / qwen3moe / gpt-oss GGUF of the given shapes, named as llama.cpp names them: F16
    weights ~ N(0, 0.02) (a mixture of experts' router in F32, its experts `ffn` wide; gpt-oss's experts MXFP4 of
    random codes at a scale of 2^-8, its biases and sinks F32 ~ N(0, 0.02)), norms of 1, the default model's
    tokenizer (so any client can talk to it) padded with unused tokens to `vocab`. Gemma 3's windows and RoPE
    bases are Gemma-3-4B's. Only its speed means anything. Tensors are made and written one at a time (an
    OLMoE-shaped file is 14 GB of F16)."""
    import gguf
    import numpy as np

    from kvserve.tokenizer.gguf_vocab import read_gguf_metadata, write_gguf_fields

    fields = {k: v for k, v in read_gguf_metadata(vocab_from).items() if k.startswith("tokenizer.")}
    pad = (vocab or 0) - len(fields["tokenizer.ggml.tokens"])
    if pad > 0:  # unused ids: never produced by the tokenizer, only the LM head's width
        fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.tokens"] + [f"[PAD{i}]" for i in range(pad)]
        fields["tokenizer.ggml.token_type"] = fields["tokenizer.ggml.token_type"] + [5] * pad
    vocab = len(fields["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base({"llama": 500000.0, "gpt-oss": 150000.0}.get(arch, 1e6))
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        w.add_sliding_window(1024)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(8.0)
    if arch == "gpt-oss":
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(experts_used)
        w.add_expert_feed_forward_length(ffn)
    w.add_vocab_size(vocab)
    write_gguf_fields(w, fields)
    rng = np.random.default_rng(seed)
    d = head_dim
    # (name, shape, F16 random or F32 ones / F32 random for a router)
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, hidden), "rand")]
    if not tied:
        tensors.append(("output.weight", (vocab, hidden), "rand"))
    tensors.append(("output_norm.weight", (hidden,), "ones"))
    norms = {"llama": ("attn_norm", "ffn_norm"), "qwen3": ("attn_norm", "ffn_norm"), "qwen3moe": ("attn_norm", "ffn_norm"),
             "gemma3": ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
             "gpt-oss": ("attn_norm", "post_attention_norm")}[arch]
    kind = "mxfp4" if arch == "gpt-oss" else "rand"
    mlp = ([("ffn_gate_inp", (experts, hidden), "router"), ("ffn_gate_exps", (experts, ffn, hidden), kind),
            ("ffn_up_exps", (experts, ffn, hidden), kind), ("ffn_down_exps", (experts, hidden, ffn), kind)]
           if experts else [("ffn_gate", (ffn, hidden), "rand"), ("ffn_up", (ffn, hidden), "rand"),
                            ("ffn_down", (hidden, ffn), "rand")])
    for i in range(layers):
        p = f"blk.{i}."
        for name, shape, kind in (("attn_q", (heads * d, hidden), "rand"), ("attn_k", (kv_heads * d, hidden), "rand"),
                                  ("attn_v", (kv_heads * d, hidden), "rand"), ("attn_output", (hidden, heads * d), "rand"),
                                  *mlp, *((name, (hidden,), "ones") for name in norms)):
            tensors.append((p + name + ".weight", shape, kind))
        if arch in ("qwen3", "qwen3moe", "gemma3"):  # per-head q/k norms
            tensors += [(p + "attn_q_norm.weight", (d,), "ones"), (p + "attn_k_norm.weight", (d,), "ones")]
        if arch == "gpt-oss":  # biases everywhere, each head's sink
            tensors += [(p + name, shape, "router") for name, shape in (
                ("attn_q.bias", (heads * d,)), ("attn_k.bias", (kv_heads * d,)), ("attn_v.bias", (kv_heads * d,)),
                ("attn_output.bias", (hidden,)), ("attn_sinks.weight", (heads,)), ("ffn_gate_inp.bias", (experts,)),
                ("ffn_gate_exps.bias", (experts, ffn)), ("ffn_up_exps.bias", (experts, ffn)),
                ("ffn_down_exps.bias", (experts, hidden)))]

    def make(shape: tuple[int, ...], kind: str) -> np.ndarray:
        if kind == "ones":
            return np.ones(shape, np.float32)
        if kind == "mxfp4":  # [..., blocks, 17]: the scale byte 120 (2^-8 for the doubled codes), random codes
            blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 32, 17), dtype=np.uint8)
            blocks[..., 0] = 120
            return blocks.reshape(*shape[:-1], -1)
        x = rng.standard_normal(shape, dtype=np.float32) * 0.02
        return x if kind == "router" else x.astype(np.float16)

    for name, shape, kind in tensors:
        if kind == "mxfp4":
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) // 32 * 17, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            continue
        dtype = np.float16 if kind == "rand" else np.float32
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape, kind in tensors:
        w.write_tensor_data(make(shape, kind))
    w.close()


def argv_for(who: str, model: Path, slots: int, ctx_per_slot: int = CTX_PER_SLOT):
    if who.startswith("kvserve"):
        return lambda port: [sys.executable, "-m", "kvserve", "serve", "--model", str(model), "--port", str(port),
                             "--no-access-log", "--threads", str(THREADS)]
    binary = peers.setup_llama_server()
    return lambda port: [str(binary), "-m", str(model), "-t", str(THREADS), "-tb", str(THREADS), "-np", str(slots),
                         "-c", str(slots * ctx_per_slot), "--host", "127.0.0.1", "--port", str(port)]


def point_path(out: Path, who: str, model: Path, concurrency: int, round_: int) -> Path:
    return out / f"{who}-{model.stem}-c{concurrency}{f'-r{round_}' if round_ else ''}.json"


def measure(who: str, model: Path, concurrency: int, out: Path, input_len: int, output_len: int,
            round_: int = 0, prompts: int | None = None, path: Path | None = None) -> dict:
    """One cell: `prompts` requests (default max(2 clients, 8)) of random unique prompts, streamed by
    `concurrency` clients to a fresh server; saved at `path` (default point_path) and read back from there."""
    path = path or point_path(out, who, model, concurrency, round_)
    if path.exists():
        return json.loads(path.read_text())
    print(f"== {who} on {model.name}, {concurrency} client(s), {input_len} tokens in, round {round_ + 1}", flush=True)
    ctx = max(CTX_PER_SLOT, input_len + output_len + 64)
    env = {"OMP_NUM_THREADS": str(THREADS), **({"KVSERVE_AMX": "0"} if who == NO_AMX else {})}
    server = Server(argv_for(who, model, concurrency, ctx), env, out / f"{path.stem}.log")
    try:
        name = server.wait_ready()
        loaded = proportional_mib(server.proc.pid)  # weights and runtime, before any request's KV blocks
        dataset = DatasetConfig("random", prompts or max(2 * concurrency, 8), input_len, output_len, seed=concurrency)
        cfg = BenchConfig(base_url=server.url, model=name, dataset=dataset, max_concurrency=concurrency,
                          max_duration=300, timeout=360, num_warmups=1)
        point = run(cfg, load_samples(dataset, bench_tokenizer())).to_dict()
        point["rss_mib"], point["peak_rss_mib"] = resident_mib(server.proc.pid)
        point["pss_mib"], point["pss_loaded_mib"] = proportional_mib(server.proc.pid), loaded
        point["loadavg_1min"] = os.getloadavg()[0]
    finally:
        server.stop()
    path.write_text(json.dumps(point, indent=2) + "\n")
    return point


def _m1(point: dict, key: str) -> float:
    """A metric of a saved point: "output_throughput", or "itl" / "ttft" / "tpot" for their medians (ms)."""
    value = point["metrics"][key]
    return float(value["median_ms"] if isinstance(value, dict) else value)


def _m(rounds: list[dict], key: str) -> float:
    """A metric's median over a cell's rounds."""
    return statistics.median(_m1(p, key) for p in rounds)


def ratio_cell(kv: list[dict], ll: list[dict]) -> str:
    """kvserve / llama-server tok/s: the median of the rounds' ratios (round r against round r),
    with their range when there are several."""
    ratios = sorted(_m1(k, "output_throughput") / _m1(lp, "output_throughput") for k, lp in zip(kv, ll))
    cell = f"**{statistics.median(ratios):.2f}x**"
    return cell + (f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else "")


def table(points: dict[tuple[str, str, int], list[dict]], limits: dict, bytes_per_step: dict[str, int],
          file_mib: dict[str, float]) -> list[str]:
    """One row a cell. Resident memory is the server tree's PSS at the end (summed RSS for points saved
    before PSS was), and kvserve's once loaded, before any request, against the file's size. The
    roofline is decode's: each client's tokens at 1 / TPOT p50 (a request's time past its first token over
    its later tokens; ITL is no measure of it where a server streams some tokens together, as llama-server
    does tokens that decode to no text) against one sequence's bytes a token over the measured bandwidth,
    times the clients (a mixture of experts' batch reads more than one sequence's experts, so past one
    client that roofline is out of reach)."""
    bw = limits["bandwidth_gbs"] * 1e9
    rows = ["| weights | clients | kvserve tok/s | llama-server tok/s | ratio | ITL p50 ms kvserve / llama | "
            "ITL ratio | TTFT p50 ms kvserve / llama | resident MiB kvserve / llama | kvserve loaded / file | "
            "decode (1 / TPOT) of bytes roofline kvserve / llama |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for who, fmt, c in points:
        if who != "kvserve":
            continue
        k, ll = points[(who, fmt, c)], points.get(("llama", fmt, c))
        if not ll:
            continue
        seconds_a_token = bytes_per_step[fmt] / bw  # one sequence's, at the bytes roofline
        tk, tl = _m(k, "output_throughput"), _m(ll, "output_throughput")
        ik, il = _m(k, "itl"), _m(ll, "itl")
        res = [statistics.median(p.get("pss_mib", p.get("rss_mib", 0)) for p in r) for r in (k, ll)]
        loaded = [p["pss_loaded_mib"] for p in k if "pss_loaded_mib" in p]
        rows.append(f"| {fmt} | {c} | {tk:.1f} | {tl:.1f} | {ratio_cell(k, ll)} | {ik:.2f} / {il:.2f} | {ik / il:.2f} | "
                    f"{_m(k, 'ttft'):.0f} / {_m(ll, 'ttft'):.0f} | {res[0]:.0f} / {res[1]:.0f} | "
                    f"{f'{statistics.median(loaded) / file_mib[fmt]:.2f}x' if loaded else 'n/a'} | "
                    f"{seconds_a_token * 1e3 / _m(k, 'tpot'):.0%} / {seconds_a_token * 1e3 / _m(ll, 'tpot'):.0%} |")
    return rows


def plot(points: dict[tuple[str, str, int], list[dict]], path: Path) -> None:
    """tok/s (higher is better) and ITL p50 (lower is better) per format against clients: kvserve
    solid, llama-server dashed, one colour per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    formats = list(dict.fromkeys(fmt for _, fmt, _ in points))
    for n, fmt in enumerate(formats):
        for who, style in (("kvserve", "-"), ("llama", "--")):
            pts = sorted((c, p) for (w, f, c), p in points.items() if w == who and f == fmt)
            if not pts:
                continue
            xs = [c for c, _ in pts]
            label = f"{'kvserve' if who == 'kvserve' else 'llama-server'} {fmt}"
            for ax, key in ((axes[0], "output_throughput"), (axes[1], "itl")):
                ax.plot(xs, [_m(p, key) for _, p in pts], style, marker="o", color=f"C{n}", label=label)
    clients = sorted({c for _, _, c in points})
    for ax, title, ylabel in ((axes[0], "Output tokens/s (higher is better)", "tokens/s"),
                              (axes[1], "ITL p50 (lower is better)", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"kvserve (solid) and llama-server (dashed) on each weight format, {THREADS} threads each")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measured_on(stamps: list[float]) -> str:
    """'Measured <date> on <CPU> (<its AVX2 / AVX-512 / AMX flags>)' for points saved at these times."""
    from kvserve import cpu

    flags = " ".join(sorted(f for f in cpu.cpu_flags() if f.startswith(("avx2", "avx512", "amx"))))
    return f"Measured {time.strftime('%Y-%m-%d', time.localtime(min(stamps)))} on {cpu.cpu_model()} ({flags})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join((*FORMATS, ONE_B)),
                    help=f"of {', '.join(FORMATS)}, or a random model's <shape>-<format> ({', '.join(SHAPES)})")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--input-len", type=int, default=110)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each cell this many times, the servers alternated (default: 1)")
    ap.add_argument("--write", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--results", type=Path, default=None,
                    help="a folder of saved points (default: this commit's); points missing there are measured")
    args = ap.parse_args(argv)
    from benchmarks import limits as limits_mod

    out = args.results or results_dir(args.fresh, Plan(name="formats"))  # the plan names the results folder only
    lim_path = out / "limits.json"
    if not lim_path.exists():
        lim_path.write_text(json.dumps(limits_mod.measure(THREADS).__dict__, indent=2) + "\n")
    lim = json.loads(lim_path.read_text())
    points: dict[tuple[str, str, int], list[dict]] = {}
    bytes_per_step: dict[str, int] = {}
    file_mib: dict[str, float] = {}
    stamps = []  # when each point was saved: a table redrawn from saved points keeps their date and span
    for fmt in args.formats.split(","):
        model = model_file(fmt)
        bytes_per_step[fmt] = limits_mod.gguf_format(model).bytes_per_step
        file_mib[fmt] = model.stat().st_size / 2**20
        levels = [int(c) for c in args.concurrency.split(",")]
        for c in (levels[:2] if fmt == ONE_B else levels):  # the 1B model: 1 and 4 clients (minutes per point)
            for r in range(args.rounds):
                for who in ("kvserve", "llama")[:: 1 if r % 2 == 0 else -1]:
                    points.setdefault((who, fmt, c), []).append(
                        measure(who, model, c, out, args.input_len, args.output_len, r))
                    stamps.append(point_path(out, who, model, c, r).stat().st_mtime)
    section = [BEGIN, "", f"{measured_on(stamps)}, {THREADS} threads each, "
               f"{args.input_len}-token prompts, {args.output_len} tokens out (EOS ignored), "
               f"measured read bandwidth {lim['bandwidth_gbs']:.1f} GB/s; `make bench-formats` "
               f"({(max(stamps) - min(stamps)) / 60 + 1:.0f} min)"
               + (f"; {args.rounds} alternated rounds a cell: medians, the ratio's range in brackets."
                  if args.rounds > 1 else "."), "", *table(points, lim, bytes_per_step, file_mib), "",
               "![formats.png](benchmarks/formats.png)", "", END]
    plot(points, args.write.parent / "benchmarks" / "formats.png")
    doc = args.write.read_text() if args.write.exists() else ""
    if BEGIN in doc and END in doc:
        doc = doc[: doc.index(BEGIN)] + "\n".join(section) + doc[doc.index(END) + len(END):]
    else:
        doc += "\n## kvserve and llama-server on each weight format (`make bench-formats`)\n\n" + "\n".join(section) + "\n"
    args.write.write_text(doc)
    print("\n".join(section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
