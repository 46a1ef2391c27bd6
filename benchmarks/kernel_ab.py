"""`python -m benchmarks.kernel_ab -D KV_NO_WIDE_TILES`: the quantized matmul kernel built twice,
as kvserve builds it and with one more `-D` define (or, `--against REV`, as committed at a git
revision), timed alternately in one process.

This machine's speed moves by up to a third from one minute to the next, so two runs of
`benchmarks.quant` minutes apart cannot tell a 10% change from the noise. Here both builds
multiply the same x8-packed random weight (the layout the model runs) by the same activations,
round after round, each build's best round kept; their outputs must be the same bits (a change of
tile shape must not change a row's arithmetic). One thread by default. Each build packs the weight
into its own x8 layout (`kvserve_pack_x8`), or keeps the stored one where it has no x8 layout for the
type, so builds whose layouts differ compare too; where one of them sums in another order (a new
layout), `--other-bits` reports the outputs' largest difference instead of requiring the same bits.
`--shapes step` times a whole decode step's matmuls on the shipped file's shapes, ~96 MB of weights
read from memory a pass, as a step reads them (`--threads 2` as the server runs).
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from benchmarks.quant import random_weight
from kvserve import kernels
from kvserve.model.quant import QuantizedWeight

SHAPES = [("576→1536 Q4_1", 1536, 576, Q.Q4_1), ("1536→576 Q4_1", 576, 1536, Q.Q4_1),
          ("576→1536 Q5_0", 1536, 576, Q.Q5_0), ("LM head Q8_0", 49152, 576, Q.Q8_0)]
# Llama-3.2-1B's layers (hidden 2048, 32 / 8 heads of 64, FFN 8192): every width a whole number of 8-block groups.
# K-quants (and MXFP4): the default model's Q4_K_M ffn_down (the one width there that is whole super-blocks), a 1B-shaped
# one, and 38 MB of Q4_K rows, more than an L3 cache holds (read from memory, as a decode step reads its weights).
SHAPES_K = [("1536→576 Q4_K", 576, 1536, Q.Q4_K), ("1536→576 Q5_K", 576, 1536, Q.Q5_K),
            ("1536→576 Q6_K", 576, 1536, Q.Q6_K), ("8192→2048 Q4_K", 2048, 8192, Q.Q4_K),
            ("2048→32768 Q4_K, 38 MB", 32768, 2048, Q.Q4_K),
            # experts: OLMoE-1B-7B's gate_up (2 x 1024 of 2048) and gpt-oss-20b's (2 x 2880 of 2880: 11 groups and a tail pair)
            ("2048→2048 Q4_K expert", 2048, 2048, Q.Q4_K), ("2880→5760 MXFP4 expert", 5760, 2880, Q.MXFP4)]
SHAPES_1B = [("2048→3072 Q4_0", 3072, 2048, Q.Q4_0), ("2048→16384 Q4_0", 16384, 2048, Q.Q4_0),
             ("8192→2048 Q4_0", 2048, 8192, Q.Q4_0), ("2048→3072 Q4_1", 3072, 2048, Q.Q4_1)]
# One decode step's matmuls on the shipped file: 30 layers of Q4_1 qkv, o, gate_up and down, each layer its own
# weights, and the tied Q8_0 LM head: ~96 MB a pass, read from memory as a step reads it (`--shapes step`).
STEP_LAYER = [(960, 576, Q.Q4_1), (576, 576, Q.Q4_1), (3072, 576, Q.Q4_1), (576, 1536, Q.Q4_1)]
STEP = STEP_LAYER * 30 + [(49152, 576, Q.Q8_0)]
# (the last, the activations' int8 levels: a build from before it took one ignores it, so compare at --levels 1)
_ARGS = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
         ctypes.c_int, ctypes.c_int]


def source_at(rev: str, tmp: Path) -> Path:
    """quant_matmul.c (and the headers it includes) as committed at `rev`, written under tmp."""
    where = tmp / rev
    where.mkdir()
    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, "./"], check=True, capture_output=True, text=True,
                            cwd=kernels.SOURCES).stdout.split()
    for name in ["quant_matmul.c", *(n for n in listed if n.endswith(".h"))]:
        text = subprocess.run(["git", "show", f"{rev}:kvserve/kernels/{name}"], check=True, capture_output=True,
                              cwd=kernels.SOURCES).stdout
        (where / name).write_bytes(text)
    return where / "quant_matmul.c"


def build(out: Path, defines: list[str], src: Path | None = None) -> ctypes.CDLL:
    src = src or kernels.SOURCES / "quant_matmul.c"
    subprocess.run(["cc", *kernels.FLAGS, *kernels.arch_flags(), *(f"-D{d}" for d in defines), "-o", str(out),
                    str(src), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.kvserve_quant_matmul.argtypes = _ARGS
    lib.kvserve_pack_x8.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    return lib


def own_layout(lib: ctypes.CDLL, w: QuantizedWeight, stored: torch.Tensor) -> tuple[torch.Tensor, int]:
    """w's blocks as `lib` lays them out, and the kernel type id to pass: repacked by its own
    kvserve_pack_x8 where w is x8 and the build has an x8 layout for the type, else as stored."""
    if not w.x8:
        return w.blocks.contiguous(), w.kernel_type
    out = torch.empty_like(stored)
    if lib.kvserve_pack_x8(int(w.qtype), stored.data_ptr(), out.data_ptr(), *w.shape, 0) != 0:
        return stored, int(w.qtype)
    return out, w.kernel_type


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernel_ab", description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("-D", dest="define", action="append",
                       help="a define the second build adds, e.g. KV_NO_WIDE_TILES (repeat for several)")
    which.add_argument("--against", metavar="REV", help="the second build is the kernel as committed at this git revision")
    ap.add_argument("--batches", default="4,16,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--levels", type=int, choices=(1, 2), default=1,
                    help="int8 levels per activation row (default: 1, which builds from before levels existed run too)")
    ap.add_argument("--other-bits", action="store_true",
                    help="the builds sum in another order: report the outputs' largest difference, not require equal bits")
    ap.add_argument("--shapes", choices=("default", "1b", "k", "step"), default="default",
                    help="the default model's layers, a Llama-3.2-1B-shaped model's, K-quant rows, or a whole "
                         "step's matmuls on the shipped file (each layer its own weights, one pass a call)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            second = {args.against: build(Path(tmp) / "b.so", [], source_at(args.against, Path(tmp)))}
        else:
            second = {" ".join(f"-D{d}" for d in args.define): build(Path(tmp) / "b.so", args.define)}
        libs = {"as built": build(Path(tmp) / "a.so", []), **second}
        names = list(libs)
        print(f"{args.threads} thread(s), µs per call, best of {args.rounds} alternated rounds\n")
        print(f"| shape | B | {names[0]} | {names[1]} | {names[1]} / {names[0]} |")
        print("|---|---:|---:|---:|---:|")
        if args.shapes == "step":
            time_step(libs, args)
            return
        for label, rows, cols, qtype in {"default": SHAPES, "1b": SHAPES_1B, "k": SHAPES_K}[args.shapes]:
            w = random_weight(qtype, rows, cols).packed()
            stored = w.unpacked().blocks.contiguous()
            blocks = {n: own_layout(libs[n], w, stored) for n in names}  # each build reads the layout it packs
            for B in (int(b) for b in args.batches.split(",")):
                x = torch.randn(B, cols)
                ys = {n: torch.empty(B, rows) for n in names}
                calls = max(3, int(2e7 / (rows * cols / 32 * B)))
                best = dict.fromkeys(names, float("inf"))
                for _ in range(args.rounds):
                    for n in names:
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            libs[n].kvserve_quant_matmul(blocks[n][1], blocks[n][0].data_ptr(), rows, cols, x.data_ptr(), B,
                                                         ys[n].data_ptr(), args.threads, args.levels)
                        best[n] = min(best[n], (time.perf_counter() - t0) / calls)
                ya, yb = ys.values()
                note = ""
                if args.other_bits:
                    note = f" largest difference {float((ya - yb).abs().max() / ya.abs().max()):.1e} of the largest output |"
                elif not torch.equal(ya, yb):
                    raise SystemExit(f"{label} B={B}: the two builds' outputs differ (a new order of sums: --other-bits)")
                a, b = (best[n] * 1e6 for n in names)
                print(f"| {label} | {B} | {a:,.1f} | {b:,.1f} | {b / a:.2f} |{note}", flush=True)


def time_step(libs: dict[str, ctypes.CDLL], args: argparse.Namespace) -> None:
    """A pass over STEP's matrices per call and build, the builds alternated, each build's best round."""
    names = list(libs)
    mats = []
    for rows, cols, qtype in STEP:
        w = random_weight(qtype, rows, cols).packed()
        stored = w.unpacked().blocks.contiguous()
        mats.append((rows, cols, {n: own_layout(libs[n], w, stored) for n in names}))
    for B in (int(b) for b in args.batches.split(",")):
        xs = {cols: torch.randn(B, cols) for cols in {c for _, c, _ in STEP}}
        ys = {n: [torch.empty(B, rows) for rows, _, _ in mats] for n in names}
        best = dict.fromkeys(names, float("inf"))
        for _ in range(args.rounds):
            for n in names:
                t0 = time.perf_counter()
                for _ in range(5):
                    for (rows, cols, blocks), y in zip(mats, ys[n]):
                        libs[n].kvserve_quant_matmul(blocks[n][1], blocks[n][0].data_ptr(), rows, cols, xs[cols].data_ptr(),
                                                     B, y.data_ptr(), args.threads, args.levels)
                best[n] = min(best[n], (time.perf_counter() - t0) / 5)
        diff = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(*ys.values()))
        if not args.other_bits and diff:
            raise SystemExit(f"step B={B}: the two builds' outputs differ (a new order of sums: --other-bits)")
        a, b = (best[n] * 1e6 for n in names)
        note = f" largest difference {diff:.1e} of the largest output |" if args.other_bits else ""
        print(f"| a step's matmuls ({len(STEP)}, shipped file) | {B} | {a:,.1f} | {b:,.1f} | {b / a:.2f} |{note}", flush=True)


if __name__ == "__main__":
    main()
