"""What batch invariance costs: time to first token of one prompt on the default model with the
integer kernel at every batch size (`batch_invariant=True`) against sgemm past the crossover (the
default). Same process, interleaved, median of 5, prefix cache off.

    python -m benchmarks.batch_invariance
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import LLM, CacheConfig, SamplingParams


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m benchmarks.batch_invariance", description=__doc__.split("\n\n")[0]).parse_args(argv)
    torch.set_num_threads(2)
    llm = LLM(cache=CacheConfig(enable_prefix_caching=False))
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'grey'][i % 4]} box holds {i * 7 % 13} marbles."
                    for i in range(200))
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    for n in (128, 512, 1024):
        ids = llm.tokenizer.encode(text)[:n]
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(5):
            for invariant in (True, False):
                llm.model.set_batch_invariant(invariant)
                t0 = time.perf_counter()
                llm.generate([ids + [rep]], sp, use_tqdm=False)
                times[invariant].append(time.perf_counter() - t0)
        a, b = statistics.median(times[True]), statistics.median(times[False])
        print(f"{n:5d} prompt tokens: batch-invariant {a * 1e3:7.1f} ms, default {b * 1e3:7.1f} ms, ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
