"""What prompt lookup could give at best on a workload: `python -m benchmarks.draft_ceiling`.

Generates `benchmarks.speculative`'s prompts greedily without speculation, then replays each
output: at every step the drafter looks up the sequence's tokens so far (engine/drafter.py's
`match`), and the step emits the drafted tokens the output agrees with, plus one. Printed:

- how often a draft's first token is right, and how many of 8 are accepted, by the length of the
  match it continues (what `MatchAcceptance` learns online);
- the speed-up over decoding without drafts, for fixed draft lengths and for an oracle that drafts
  exactly the tokens that will be accepted (up to 16), where a step of R rows costs 1 + r·(R - 1)
  one-row steps (T(R) = a + b·R with r = b / T(1)), for each row share r given: the oracle is a
  ceiling no drafting policy can pass on this model's outputs. With `--users n` the outputs step
  in groups of n, as n users' sequences share each step (the baseline: n rows a step). Decode
  steps only, then whole requests: each group's prompts prefilled as one step of their rows on both
  sides (drafting does not shorten a prefill). That the row model holds for a prefill is checked
  against one: a prompt's prefill is timed in one-row steps beside what the model makes of it.
  Replayed, not timed: the speed-ups are arithmetic on the replay (`benchmarks.speculative`
  measures them).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator

import numpy as np

from kvserve import LLM, CacheConfig, SamplingParams
from kvserve.bench.datasets import DatasetConfig, load_samples
from kvserve.engine.drafter import match


def walk(pairs: list[tuple[list[int], list[int]]], k: int) -> Iterator[tuple[int, int, int, int]]:
    """Each step of each output replayed with lookup drafts of up to k tokens: (match length, tokens
    drafted, tokens accepted, tokens emitted: the accepted ones and the model's own next, if the
    output goes on)."""
    for prompt, out in pairs:
        seq, i = list(prompt), 0
        while i < len(out):
            n, draft = match(np.array(seq, dtype=np.int32), k, 1, 8)
            m = 0
            while m < len(draft) and i + m < len(out) and draft[m] == out[i + m]:
                m += 1
            emit = min(m + 1, len(out) - i)
            yield n, len(draft), m, emit
            seq += out[i : i + emit]
            i += emit


def replay(pairs: list[tuple[list[int], list[int]]], k: int, r: float, oracle: bool = False, users: int = 1,
           prefill: bool = False) -> float:
    """Speed-up over no drafting, drafting k tokens by lookup (oracle: only those accepted), the
    sequences stepping in groups of `users`; a step of R rows costs 1 + r·(R - 1) one-row steps
    (with `prefill`, a group's prompts too, as one step on both sides)."""
    on = off = 0.0
    for g in range(0, len(pairs), users):
        group = pairs[g : g + users]
        # each sequence's steps: (rows, tokens emitted)
        steps = [[(1 + (m if oracle else drafted), emit) for _, drafted, m, emit in walk([pair], k)] for pair in group]
        for s in range(max(len(st) for st in steps)):
            on += 1 + r * (sum(st[s][0] for st in steps if s < len(st)) - 1)
        for s in range(max(len(out) for _, out in group)):
            off += 1 + r * (sum(s < len(out) for _, out in group) - 1)
        if prefill:
            rows = sum(len(prompt) for prompt, _ in group)
            on += 1 + r * (rows - 1)
            off += 1 + r * (rows - 1)
    return off / on


def by_match(pairs: list[tuple[list[int], list[int]]]) -> dict[int, list[int]]:
    """match length (8: 8 or more) -> [steps, first token right, tokens accepted of 8]."""
    stats: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for n, _, m, _ in walk(pairs, 8):
        s = stats[min(n, 8)]
        s[0] += 1
        s[1] += m >= 1
        s[2] += m
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default="copy,random")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--row-shares", default="0.2,0.25,0.35", help="what a drafted row costs, in one-row steps")
    p.add_argument("--users", default="1", help="comma-separated sequences stepping together (default: 1)")
    args = p.parse_args()
    llm = LLM(cache=CacheConfig(enable_prefix_caching=False))
    sp = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for ds in args.datasets.split(","):
        cfg = DatasetConfig(name=ds, num_prompts=args.prompts, input_len=args.input_len, output_len=args.output_len)
        prompts = [llm.encode_chat([{"role": "user", "content": s.prompt}]) for s in load_samples(cfg, llm.tokenizer)]
        pairs = [(list(pr), list(o.token_ids)) for pr, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False))]
        timed = prefill_steps(llm, prompts[:4], args.output_len)
        mean_len = statistics.mean(len(p) for p in prompts[:4])
        model = ", ".join(f"{1 + float(r) * (mean_len - 1):.1f} at r = {r}" for r in args.row_shares.split(","))
        print(f"\n{ds}: {len(pairs)} greedy outputs of {args.output_len} tokens; a prompt's prefill "
              f"({mean_len:.0f} tokens) took {timed:.1f} one-row steps (the row model: {model})\n")
        print("| match length | steps | first token right | accepted of 8 |")
        print("|---:|---:|---:|---:|")
        for n, (c, first, acc) in sorted(by_match(pairs).items()):
            print(f"| {n if n < 8 else '8+'} | {c} | {first / c:.2f} | {acc / c:.2f} |")
        print("\nspeed-up over no drafting: decode steps only / whole requests (prefill included)\n")
        print("| users | row share | " + " | ".join(f"k={k}" for k in (1, 2, 4, 8)) + " | oracle (k ≤ 16) |")
        print("|---:|---:|" + "---:|" * 5)
        for n in (int(u) for u in args.users.split(",")):
            for r in (float(x) for x in args.row_shares.split(",")):
                cells = [f"{replay(pairs, k, r, oracle=k == 16, users=n):.2f} / "
                         f"{replay(pairs, k, r, oracle=k == 16, users=n, prefill=True):.2f}" for k in (1, 2, 4, 8, 16)]
                print(f"| {n} | {r} | " + " | ".join(cells) + " |")


def prefill_steps(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """A prompt's prefill in one-row decode steps, timed one prompt at a time: (the time of one
    token) against (the time of output_len tokens - it) / (output_len - 1), the best of each."""
    one = SamplingParams(max_tokens=1, temperature=0.0)
    full = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True)
    ratios = []
    for prompt in prompts:
        t1, tn = [], []
        for _ in range(3):
            for sp, times in ((one, t1), (full, tn)):
                t = time.perf_counter()
                llm.generate([prompt], sp, use_tqdm=False)
                times.append(time.perf_counter() - t)
        ratios.append(min(t1) / ((min(tn) - min(t1)) / (output_len - 1)))
    return statistics.median(ratios)


if __name__ == "__main__":
    main()
