"""`python -m benchmarks.tensor_parallel`: decode speed of 2 ranks x 1 thread against one
process x 2 threads, and the all-reduce that the ranks pay per layer.

Each configuration decodes `--tokens` greedy tokens for each of `--batch` sequences through the
engine (`LLM.generate`, as the server runs it) after a warm-up, and reports ms per decode step.
One process runs the native decode step (its default) and the per-op forward
(KVSERVE_NATIVE_DECODE=0 semantics, by dropping the runner's native step), since tensor
parallelism runs the per-op forward. The gloo all-reduce of one hidden vector is timed alone
between the two ranks' processes: a step pays it twice per layer.
On a machine shared with other work the figures are noisy: compare those of one run.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from datetime import timedelta

import torch

from kvserve import LLM, CacheConfig, SamplingParams


def _decode_ms(llm: LLM, batch: int, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [[1, 2, 3, 4 + i] for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - t0) * 1e3 / tokens  # (the prefill of 4 tokens is noise here)


def _all_reduce_rank(rank: int, port: int, width: int, reps: int, out: mp.Queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    t = torch.zeros(1, width)
    for _ in range(50):
        pg.allreduce([t]).wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        pg.allreduce([t]).wait()
    if rank == 0:
        out.put((time.perf_counter() - t0) * 1e6 / reps)


def all_reduce_us(width: int, reps: int = 1000) -> float:
    from kvserve.parallel.group import free_port

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, port, width, reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    us = q.get(timeout=300)
    for p in procs:
        p.join()
    return us


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    cache = CacheConfig(num_blocks=256)
    rows = []
    torch.set_num_threads(2)
    one = LLM(args.model, cache=cache)
    for b in args.batch:
        rows.append(("1 process x 2 threads, native step", b, _decode_ms(one, b, args.tokens)))
    native, one.runner.native = one.runner.native, None
    for b in args.batch:
        rows.append(("1 process x 2 threads, per-op", b, _decode_ms(one, b, args.tokens)))
    one.runner.native = native
    torch.set_num_threads(1)  # no OpenMP barriers: on a busy machine the steadier single-process figure
    for b in args.batch:
        rows.append(("1 process x 1 thread, native step", b, _decode_ms(one, b, args.tokens)))
    del one
    two = LLM(args.model, cache=cache, tensor_parallel_size=2)
    for b in args.batch:
        rows.append(("2 ranks x 1 thread (per-op)", b, _decode_ms(two, b, args.tokens)))
    layers = two.config.num_hidden_layers
    two.model.close()
    us = all_reduce_us(two.config.hidden_size)
    print("| configuration | batch | ms per decode step |\n|---|---:|---:|")
    for name, b, ms in rows:
        print(f"| {name} | {b} | {ms:.1f} |")
    print(f"\ngloo all-reduce of [1, {two.config.hidden_size}] float32 between 2 processes: {us:.0f} us; "
          f"{2 * layers} per step = {2 * layers * us / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
