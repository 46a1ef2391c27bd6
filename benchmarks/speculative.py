"""What speculative decoding gives, in one process: `python -m benchmarks.speculative`.

One `LLM` with speculation on; each run generates the same prompts with `speculative` false, then
true (the order alternates between repetitions), so both settings share the process, the weights
and whatever else the machine is doing. `--method ngram` (default): prompt lookup on the default
model as served by default; `--method draft`: the default model decoded to float32 (`quantization
"none"`) drafted for by `--draft-model` (default: its own Q4_1 file). Workloads are `kvserve bench
serve`'s: `copy` (rewrite a passage of kvserve's source, frozen in kvserve/bench/copy_corpus.txt,
with one word changed) and `random` (random words), chat-templated, greedy, a fixed number of
output tokens; at n users a run generates
`--groups` groups of n distinct prompts, one group after another. Reported: the best tokens/s of each
setting and their ratio, at each number of users (prompts generated together), the drafted and
accepted tokens, what one more row cost a step by the speculator's own fit (in ms, and as the share
of a one-row step that `benchmarks.draft_ceiling` reads its ceilings at), and whether every
greedy output was the same with speculation as without.
"""
from __future__ import annotations

import argparse
import time

from kvserve import LLM, CacheConfig, SamplingParams, SpeculativeConfig
from kvserve.bench.datasets import DatasetConfig, load_samples


def row_share(llm: LLM) -> str:
    """What one more row costs a step, in ms and as a share of a one-row step: the speculator's own fit
    of its steps so far (T(R) = a + b·R; engine/speculative.py's StepTimes), e.g. "0.9 ms (0.21)"."""
    times = llm.engine.speculator.step_times
    if not times.measured:
        return "-"
    a, b = times.line()
    return f"{b * 1e3:.2f} ms ({b / (a + b):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", default="1,4", help="comma-separated prompts generated together (default: 1,4)")
    p.add_argument("--datasets", default="copy,random")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs of each setting; the best counts (default: 2)")
    p.add_argument("--groups", type=int, default=4,
                   help="distinct prompt groups per run (n users: n prompts at a time, one group after another; "
                        "one passage alone says little about a workload) (default: 4)")
    p.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens)
    p.add_argument("--prompt-lookup-min", type=int, default=SpeculativeConfig.prompt_lookup_min,
                   help="ngram: the shortest n-gram matched (default: SpeculativeConfig's)")
    p.add_argument("--prompt-lookup-max", type=int, default=SpeculativeConfig.prompt_lookup_max,
                   help="ngram: the longest n-gram matched (default: SpeculativeConfig's)")
    p.add_argument("--method", default="ngram", choices=("ngram", "draft"))
    p.add_argument("--draft-model", default="smollm2-135m", help="with --method draft (default: smollm2-135m, Q4_1)")
    args = p.parse_args()
    users = [int(u) for u in args.users.split(",")]
    # No prefix cache: the second setting's prompt would otherwise be prefilled from it.
    cache = CacheConfig(enable_prefix_caching=False)
    if args.method == "draft":
        llm = LLM(dtype="float32", quantization="none", cache=cache, speculative=SpeculativeConfig(
            method="draft", draft_model=args.draft_model, num_speculative_tokens=args.num_speculative_tokens))
    else:
        llm = LLM(speculative=SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens,
                                                prompt_lookup_min=args.prompt_lookup_min,
                                                prompt_lookup_max=max(args.prompt_lookup_max, args.prompt_lookup_min)),
                  cache=cache)
    print("| workload | users | off (tok/s) | on (tok/s) | ratio | drafted | accepted | acceptance | row cost | same output |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for ds in args.datasets.split(","):
        cfg = DatasetConfig(name=ds, num_prompts=args.groups * max(users), input_len=args.input_len,
                            output_len=args.output_len)
        prompts = [llm.encode_chat([{"role": "user", "content": s.prompt}]) for s in load_samples(cfg, llm.tokenizer)]
        for n in users:
            best: dict[bool, float] = {}
            tokens: dict[bool, set[tuple[tuple[int, ...], ...]]] = {False: set(), True: set()}
            before = llm.engine.stats()
            for r in range(args.repeats):
                for spec in (False, True) if r % 2 == 0 else (True, False):
                    sp = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0,
                                        ignore_eos=True, speculative=spec)
                    t = time.perf_counter()
                    outs = [o for g in range(args.groups) for o in
                            llm.generate(prompts[g * n:(g + 1) * n], sp, use_tqdm=False)]
                    rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
                    best[spec] = max(best.get(spec, 0.0), rate)
                    tokens[spec].add(tuple(tuple(o.token_ids) for o in outs))
            s = llm.engine.stats()
            drafted = s.spec_draft_tokens - before.spec_draft_tokens
            accepted = s.spec_accepted_tokens - before.spec_accepted_tokens
            same = "yes" if len(tokens[False]) == 1 and tokens[False] == tokens[True] else "NO"
            print(f"| {ds} | {n} | {best[False]:.1f} | {best[True]:.1f} | {best[True] / best[False]:.2f} | "
                  f"{drafted} | {accepted} | {accepted / drafted if drafted else 0:.2f} | {row_share(llm)} | {same} |",
                  flush=True)


if __name__ == "__main__":
    main()
