"""What speculative decoding by prompt lookup gives, in one process: `python -m kvserve.bench.speculative`.

One `LLM` with speculation on; each run generates the same prompts with `speculative` false, then
true (the order alternates between repetitions), so both settings share the process, the weights
and whatever else the machine is doing. Workloads are `kvserve bench serve`'s: `copy` (rewrite a
passage of kvserve's source with one word changed) and `random` (random words), chat-templated,
greedy, a fixed number of output tokens. Reported: the best tokens/s of each setting and their
ratio, at each number of users (prompts generated together).
"""
from __future__ import annotations

import argparse
import time

from kvserve import LLM, CacheConfig, SamplingParams, SpeculativeConfig
from kvserve.bench.datasets import DatasetConfig, load_samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", default="1,4", help="comma-separated prompts generated together (default: 1,4)")
    p.add_argument("--datasets", default="copy,random")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs of each setting; the best counts (default: 2)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    args = p.parse_args()
    users = [int(u) for u in args.users.split(",")]
    # No prefix cache: the second setting's prompt would otherwise be prefilled from it.
    llm = LLM(speculative=SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens),
              cache=CacheConfig(enable_prefix_caching=False))
    print("| workload | users | off (tok/s) | on (tok/s) | ratio | drafted | accepted |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for ds in args.datasets.split(","):
        cfg = DatasetConfig(name=ds, num_prompts=max(users), input_len=args.input_len, output_len=args.output_len)
        prompts = [llm.encode_chat([{"role": "user", "content": s.prompt}]) for s in load_samples(cfg, llm.tokenizer)]
        for n in users:
            best: dict[bool, float] = {}
            before = llm.engine.stats()
            for r in range(args.repeats):
                for spec in (False, True) if r % 2 == 0 else (True, False):
                    sp = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0,
                                        ignore_eos=True, speculative=spec)
                    t = time.perf_counter()
                    outs = llm.generate(prompts[:n], sp, use_tqdm=False)
                    rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
                    best[spec] = max(best.get(spec, 0.0), rate)
            s = llm.engine.stats()
            print(f"| {ds} | {n} | {best[False]:.1f} | {best[True]:.1f} | {best[True] / best[False]:.2f} | "
                  f"{s.spec_draft_tokens - before.spec_draft_tokens} | "
                  f"{s.spec_accepted_tokens - before.spec_accepted_tokens} |", flush=True)


if __name__ == "__main__":
    main()
