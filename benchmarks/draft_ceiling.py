"""What prompt lookup could give at best on a workload: `python -m benchmarks.draft_ceiling`.

Generates `benchmarks.speculative`'s prompts greedily without speculation, then replays each
output: at every step the drafter looks up the sequence's tokens so far (engine/drafter.py's
`match`), and the step emits the drafted tokens the output agrees with, plus one. Printed:

- how often a draft's first token is right, and how many of 8 are accepted, by the length of the
  match it continues (what `MatchAcceptance` learns online);
- tokens per unit of time for fixed draft lengths and for an oracle that drafts exactly the tokens
  that will be accepted (up to 16), where a step of 1 + k rows costs 1 + r·k one-row steps, for
  each row share r given: the oracle is a ceiling no drafting policy can pass on this model's
  outputs. Replayed, not timed: no speed is measured here (`benchmarks.speculative` measures).
"""
from __future__ import annotations

import argparse
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


def replay(pairs: list[tuple[list[int], list[int]]], k: int, r: float, oracle: bool = False) -> float:
    """Tokens per one-row-step unit of time, drafting k tokens by lookup (oracle: only those accepted);
    a step of 1 + d rows costs 1 + r·d."""
    tokens = cost = 0.0
    for _, drafted, m, emit in walk(pairs, k):
        tokens += emit
        cost += 1 + r * (m if oracle else drafted)
    return tokens / cost


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
    args = p.parse_args()
    llm = LLM(cache=CacheConfig(enable_prefix_caching=False))
    sp = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for ds in args.datasets.split(","):
        cfg = DatasetConfig(name=ds, num_prompts=args.prompts, input_len=args.input_len, output_len=args.output_len)
        prompts = [llm.encode_chat([{"role": "user", "content": s.prompt}]) for s in load_samples(cfg, llm.tokenizer)]
        pairs = [(list(pr), list(o.token_ids)) for pr, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False))]
        print(f"\n{ds}: {len(pairs)} greedy outputs of {args.output_len} tokens\n")
        print("| match length | steps | first token right | accepted of 8 |")
        print("|---:|---:|---:|---:|")
        for n, (c, first, acc) in sorted(by_match(pairs).items()):
            print(f"| {n if n < 8 else '8+'} | {c} | {first / c:.2f} | {acc / c:.2f} |")
        print("\n| row share | " + " | ".join(f"k={k}" for k in (1, 2, 4, 8)) + " | oracle (k ≤ 16) |")
        print("|---:|" + "---:|" * 5)
        for r in (float(x) for x in args.row_shares.split(",")):
            cells = [f"{replay(pairs, k, r):.2f}" for k in (1, 2, 4, 8)] + [f"{replay(pairs, 16, r, oracle=True):.2f}"]
            print(f"| {r} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
