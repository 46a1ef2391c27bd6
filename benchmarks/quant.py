"""`python -m benchmarks.quant`: the quantized matmul kernel per layer shape and batch.

For each of the default model's matmul shapes (Q4_1 576→1536, 1536→576, 576→960; the Q8_0 LM
head 49152×576) and each batch B, µs per call of QuantizedLinear's two paths: the integer kernel
(kernels/quant_matmul.c) and dequantized row tiles + sgemm. This is what `BLAS_FROM_ROWS` in
kvserve/model/quant.py is tuned from, and "cycles per block-row" (at a nominal 3 GHz: seconds ×
3e9 over rows × cols / 32 × B) is the kernel's cost per 32-weight block and activation row.
Weights are random blocks (the cost does not depend on the values). One thread and process CPU
time by default: on a machine shared with other work that is the steadier figure; the minimum of
5 rounds is reported.

`--library` measures instead what torch itself offers for the same shapes, so the choice of
kvserve's own kernel can be rechecked on any CPU: float32 and bfloat16 `F.linear`, FBGEMM's
dynamic int8 linear on prepacked per-channel weights, `_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu` (groups of 32) and `_int_mm` (given int8 activations, i.e. without
quantizing them) beside kvserve's integer kernel. A kernel this torch build lacks prints "n/a".
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from kvserve.model import quant
from kvserve.model.linear import Linear
from kvserve.model.quant import QuantizedLinear, QuantizedWeight

SHAPES = [("576→1536 Q4_1", 1536, 576, Q.Q4_1), ("1536→576 Q4_1", 576, 1536, Q.Q4_1),
          ("576→960 Q4_1", 960, 576, Q.Q4_1), ("LM head Q8_0", 49152, 576, Q.Q8_0)]


def random_weight(qtype: Q, rows: int, cols: int) -> QuantizedWeight:
    """Random blocks with f16 scales 2^-7 (random bytes there would be inf/NaN at times, and the
    arithmetic on them other than on a real file's)."""
    per, size = GGML_QUANT_SIZES[qtype]
    b = np.random.default_rng(0).integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
    f16 = np.array([0x2000], dtype=np.uint16).view(np.uint8)
    if qtype == Q.Q6_K:
        b[:, 208:210] = f16  # d, after the codes and the int8 scales
    else:
        b[:, 0:2] = f16  # d
        if qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K):
            b[:, 2:4] = f16  # m, or a K-quant's dmin
    return QuantizedWeight(torch.from_numpy(b.reshape(rows, -1)), qtype, (rows, cols))


def per_call_us(fn, calls: int, clock) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - t0) / calls)
    return best * 1e6


def library_kernels(rows: int, cols: int) -> dict[str, object]:
    """Callables x -> y for torch's own kernels on a random [rows, cols] weight (the layouts each
    one wants, prepared once as at load time). A kernel this build lacks is left out."""
    w = torch.randn(rows, cols) * 0.02
    fns: dict[str, object] = {"F.linear float32": lambda x: torch.nn.functional.linear(x, w)}
    wb = w.bfloat16()
    fns["F.linear bfloat16"] = lambda x: torch.nn.functional.linear(x.bfloat16(), wb)
    klin = Linear(wb)  # oneDNN-packed where the CPU has bf16 arithmetic, else widened in registers
    fns[f"kvserve Linear bfloat16 ({'oneDNN packed' if klin.packed is not None else 'widened'})"] = (
        lambda x: klin(x.bfloat16()))
    scale = w.abs().amax(dim=1) / 127
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    try:  # torch 2.13 warns that quantized tensors are deprecated; the kernel is still measured
        warnings.filterwarnings("ignore", message="torch.quantize_per_tensor")
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(rows, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qw, None)
        fns["FBGEMM dynamic int8 (prepacked)"] = lambda x: torch.ops.quantized.linear_dynamic(x, packed, False)
    except (RuntimeError, AttributeError):
        pass
    if hasattr(torch, "_weight_int8pack_mm"):
        fns["_weight_int8pack_mm (bf16 activations)"] = lambda x: torch._weight_int8pack_mm(x.bfloat16(), w8, scale.bfloat16())
    try:
        g = w.reshape(rows, cols // 32, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        s4 = ((hi - lo) / 15).clamp_min(1e-8)
        q4 = torch.round((g - lo[..., None]) / s4[..., None]).clamp(0, 15).to(torch.int32).reshape(rows, cols)
        w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        # scales_and_zeros [groups, rows, 2]; w = (q - 8) * s + zero, so zero = lo + 8 s
        sz = torch.stack([s4, lo + 8 * s4], dim=-1).transpose(0, 1).contiguous().bfloat16()
        fns["_weight_int4pack_mm_for_cpu g32 (bf16 activations)"] = (
            lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), w4, 32, sz))
    except (RuntimeError, AttributeError):
        pass
    w8t = w8.t().contiguous()
    fns["_int_mm (int8 activations given)"] = lambda x8: torch._int_mm(x8, w8t)
    return fns


def library(args, clock) -> None:
    """One table per shape: µs per call of each kernel at each B (a markdown table)."""
    batches = [int(b) for b in args.batches.split(",")]
    for name, rows, cols, qtype in SHAPES:
        if args.shapes not in name:
            continue
        print(f"\n{name}: µs per call\n")
        print("| kernel | " + " | ".join(f"B={B}" for B in batches) + " |")
        print("|---|" + "---:|" * len(batches))
        lin = QuantizedLinear(random_weight(qtype, rows, cols).packed())  # the layout the model runs (x8 where it exists)
        lin.blas_from = 1 << 30
        fns = {f"kvserve {qtype.name} integer kernel": lin, **library_kernels(rows, cols)}
        for kname, fn in fns.items():
            cells = []
            for B in batches:
                x = torch.randn(B, cols)
                if kname.startswith("_int_mm"):
                    x = torch.randint(-127, 128, (B, cols), dtype=torch.int8)
                calls = max(1, min(100, int(3e7 / (rows * cols / 32 * B))))
                try:
                    cells.append(f"{per_call_us(lambda: fn(x), calls, clock):,.0f}")
                except RuntimeError:
                    cells.append("n/a")
            print(f"| {kname} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16,32,48,64,128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default="", help="only shapes whose name contains this")
    ap.add_argument("--library", action="store_true", help="torch's own kernels beside kvserve's instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    if args.library:
        print(f"{args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time (min of 5 rounds)")
        return library(args, clock)
    print(f"{args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time, µs per call (min of 5 rounds)")
    print("| shape | B | integer kernel | cycles/block-row @3 GHz | dequantize + sgemm | faster (used now) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, rows, cols, qtype in SHAPES:
        if args.shapes not in name:
            continue
        lin = QuantizedLinear(random_weight(qtype, rows, cols).packed())  # the layout the model runs (x8 where it exists)
        for B in (int(b) for b in args.batches.split(",")):
            x = torch.randn(B, cols)
            calls = max(1, min(100, int(3e7 / (rows * cols / 32 * B))))
            lin.blas_from = 1 << 30  # the integer kernel at any B
            integer = per_call_us(lambda: lin(x), calls, clock)
            lin.blas_from = 0  # dequantize + sgemm at any B
            blas = per_call_us(lambda: lin(x), calls, clock)
            cyc = integer * 1e-6 * 3e9 / (rows * cols / 32 * B)
            print(f"| {name} | {B} | {integer:,.1f} | {cyc:.2f} | {blas:,.1f} | "
                  f"{'integer' if integer < blas else 'sgemm'} {max(integer, blas) / min(integer, blas):.2f}x "
                  f"(now: {'integer' if B < quant.blas_from_rows(qtype) else 'sgemm'}) |", flush=True)


if __name__ == "__main__":
    main()
