"""`python -m kvserve.bench.quant`: the quantized matmul kernel per layer shape and batch.

For each of the default model's matmul shapes (Q4_1 576→1536, 1536→576, 576→960; the Q8_0 LM
head 49152×576) and each batch B, µs per call of QuantizedLinear's two paths: the integer kernel
(kernels/quant_matmul.c) and dequantized row tiles + sgemm. This is what `BLAS_FROM_ROWS` in
kvserve/model/quant.py is tuned from, and "cycles per block-row" (at a nominal 3 GHz: seconds ×
3e9 over rows × cols / 32 × B) is the kernel's cost per 32-weight block and activation row.
Weights are random blocks (the cost does not depend on the values). One thread and process CPU
time by default: on a machine shared with other work that is the steadier figure; the minimum of
5 rounds is reported.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from kvserve.model import quant
from kvserve.model.quant import QuantizedLinear, QuantizedWeight

SHAPES = [("576→1536 Q4_1", 1536, 576, Q.Q4_1), ("1536→576 Q4_1", 576, 1536, Q.Q4_1),
          ("576→960 Q4_1", 960, 576, Q.Q4_1), ("LM head Q8_0", 49152, 576, Q.Q8_0)]


def random_weight(qtype: Q, rows: int, cols: int) -> QuantizedWeight:
    """Random blocks with f16 scales 2^-7 (random bytes there would be inf/NaN at times)."""
    per, size = GGML_QUANT_SIZES[qtype]
    b = np.random.default_rng(0).integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
    b[:, 0:2] = np.array([0x2000], dtype=np.uint16).view(np.uint8)  # d (and Q4_1's m below)
    if qtype == Q.Q4_1:
        b[:, 2:4] = b[:, 0:2]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16,32,48,64,128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default="", help="only shapes whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    print(f"{args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time, µs per call (min of 5 rounds)")
    print("| shape | B | integer kernel | cycles/block-row @3 GHz | dequantize + sgemm | faster (used now) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, rows, cols, qtype in SHAPES:
        if args.shapes not in name:
            continue
        lin = QuantizedLinear(random_weight(qtype, rows, cols))
        for B in (int(b) for b in args.batches.split(",")):
            x = torch.randn(B, cols)
            calls = max(1, min(100, int(3e7 / (rows * cols / 32 * B))))
            lin._blas_from = 1 << 30  # the integer kernel at any B
            integer = per_call_us(lambda: lin(x), calls, clock)
            lin._blas_from = 0  # dequantize + sgemm at any B
            blas = per_call_us(lambda: lin(x), calls, clock)
            cyc = integer * 1e-6 * 3e9 / (rows * cols / 32 * B)
            print(f"| {name} | {B} | {integer:,.1f} | {cyc:.2f} | {blas:,.1f} | "
                  f"{'integer' if integer < blas else 'sgemm'} {max(integer, blas) / min(integer, blas):.2f}x "
                  f"(now: {'integer' if B < quant.blas_from_rows(qtype) else 'sgemm'}) |", flush=True)


if __name__ == "__main__":
    main()
