"""`python -m benchmarks.hugepages --model FILE`: one model loaded twice in one process, its
repacked weights on plain pages (KVSERVE_HUGEPAGES=0) and on huge pages (kvserve/hugepages.py),
greedy generations of one prompt alternated between the two; the best time per token of each,
and whether their tokens agree (they must: the same bytes, elsewhere in memory)."""
from __future__ import annotations

import os
import time

import torch

from benchmarks import one_model_ab_parser
from kvserve.hugepages import thp_mode
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

PROMPT = "Write a long story about a cat who learns to read the source code of a web server. " * 6


def main(argv: list[str] | None = None) -> None:
    args = one_model_ab_parser("hugepages", __doc__, "tokens generated per timed run (EOS ignored)").parse_args(argv)
    torch.set_num_threads(args.threads)
    llms = {}
    for name, env in (("plain pages", "0"), ("huge pages", "1")):
        os.environ["KVSERVE_HUGEPAGES"] = env  # read when the model's weight arena is made
        llms[name] = LLM(args.model)
    os.environ.pop("KVSERVE_HUGEPAGES")
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    best = dict.fromkeys(llms, float("inf"))
    tokens = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            llm.generate([PROMPT], params, use_tqdm=False)  # its weights back in cache and TLB as a server's would be
            t0 = time.perf_counter()
            out = llm.generate([PROMPT], params, use_tqdm=False)
            best[name] = min(best[name], time.perf_counter() - t0)
            tokens[name] = out[0].outputs[0].token_ids
    print(f"{args.model}: THP {thp_mode()}, {args.threads} threads, {args.tokens} tokens after a "
          f"{len(llms['plain pages'].tokenizer.encode(PROMPT))}-token prompt, best of {args.rounds} alternated rounds")
    for name in llms:
        print(f"  {name}: {best[name] * 1e3 / args.tokens:.2f} ms per token (prefill included)")
    print(f"  huge / plain: {best['huge pages'] / best['plain pages']:.3f}; same tokens: "
          f"{tokens['plain pages'] == tokens['huge pages']}")


if __name__ == "__main__":
    main()
