"""`python -m benchmarks.quality`: how far a fast path's answers are from the exact path's.

The exact path is the float one (`LLM(dtype="float32", quantization="none")`: the GGUF's blocks
dequantized once, float32 activations), the one tests/test_model.py matches to transformers. A
fast path multiplies the same blocks with the integer kernels (activations quantized at one or
two int8 levels, model/quant.py's ACTIVATIONS) over a float16 or int8 KV cache, on this CPU's ISA
level. Both read a text teacher-forced, in chunks of 32 prompt rows (the per-op forward, whose bits
the native step's are, tests/test_native_decode.py), and at every position this compares their
next-token distributions, as llama.cpp's `perplexity --kl-divergence` does:
  - KL(exact || fast), its mean, 99th percentile and maximum over the positions;
  - top-1 agreement: how often both rate the same token most likely (a greedy step's choice);
  - the perplexity of the text under each.
The text (tests/data: the Declaration of Independence, then the Gettysburg Address) is ~2,000
tokens of the default model's vocabulary. `--all-paths` runs the same in a process per kernel path
this CPU can take (KVSERVE_ISA=avx2 / portable, KVSERVE_X8=0) and prints one table; docs/quality.md
holds its figures.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve import LLM, cpu
from kvserve.config import CacheConfig
from kvserve.model.attention import AttentionMetadata

TEXTS = [Path(__file__).parent.parent / "tests" / "data" / name for name in ("declaration.txt", "gettysburg.txt")]
CHUNK = 32  # prompt rows a forward: below every BLAS crossover, so quantized layers run their integer kernels


def text() -> str:
    return "\n\n".join(p.read_text() for p in TEXTS)


def exact(model: str = "smollm2-135m", num_blocks: int = 256) -> LLM:
    return LLM(model, dtype="float32", quantization="none", cache=CacheConfig(num_blocks=num_blocks))


def fast(model: str = "smollm2-135m", activations: str = "auto", kv_dtype: str = "auto",
         num_blocks: int = 256) -> LLM:
    return LLM(model, activations=activations, cache=CacheConfig(num_blocks=num_blocks, dtype=kv_dtype))


def logprobs(llm: LLM, ids: list[int], chunk: int = CHUNK) -> Iterator[torch.Tensor]:
    """Each chunk's next-token log-probabilities [n, V] (float64), the text read teacher-forced."""
    bs = llm.manager.block_size
    if not llm.manager.allocate("quality", len(ids)):
        raise ValueError(f"{len(ids)} tokens do not fit the KV pool")
    try:
        table = llm.manager.block_ids("quality")
        with torch.inference_mode():
            for s in range(0, len(ids), chunk):
                pos = range(s, min(s + chunk, len(ids)))
                meta = AttentionMetadata(slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in pos]),
                                         query_lens=[len(pos)], seq_lens=[pos[-1] + 1], block_tables=[table],
                                         block_size=bs)
                hidden = llm.model.forward(torch.tensor(ids[s : pos[-1] + 1]), torch.tensor(pos), llm.runner.kv_caches,
                                           meta, llm.runner.kv_scales)
                yield torch.log_softmax(llm.model.logits(hidden).double(), -1)
    finally:
        llm.manager.free("quality")


@dataclass(frozen=True)
class Quality:
    """A fast path against the exact one over `tokens` positions."""

    tokens: int
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float  # share of positions whose most likely token is the exact path's
    ppl: float
    ppl_exact: float

    def row(self, name: str) -> str:
        return (f"| {name} | {self.kl_mean:.2e} | {self.kl_p99:.2e} | {self.kl_max:.2e} | {100 * self.top1:.2f}% | "
                f"{self.ppl:.4f} | {self.ppl_exact:.4f} |")


HEADER = ("| path | KL mean | KL p99 | KL max | top-1 agreement | perplexity | exact perplexity |\n"
          "|---|---|---|---|---|---|---|")


def compare(reference: LLM, others: dict[str, LLM], ids: list[int]) -> dict[str, Quality]:
    """Each of `others` against `reference` over the text `ids`, chunk by chunk (no whole-text logits kept)."""
    kls: dict[str, list[torch.Tensor]] = {n: [] for n in others}
    same = {n: 0 for n in others}
    nll = {n: 0.0 for n in [*others, ""]}
    target = torch.tensor(ids[1:] + [ids[-1]]).unsqueeze(1)  # (the last position has no next token: not scored)
    at = 0
    for ref, *outs in zip(logprobs(reference, ids), *(logprobs(llm, ids) for llm in others.values())):
        n = ref.shape[0]
        scored = min(n, len(ids) - 1 - at)
        t = target[at : at + scored]
        nll[""] -= ref[:scored].gather(1, t).sum().item()
        p = ref.exp()
        for name, lp in zip(others, outs):
            kls[name].append((p * (ref - lp)).sum(-1))
            same[name] += int((ref.argmax(-1) == lp.argmax(-1)).sum())
            nll[name] -= lp[:scored].gather(1, t).sum().item()
        at += n
    out = {}
    for name in others:
        kl = torch.cat(kls[name])
        out[name] = Quality(len(ids), kl.mean().item(), kl.quantile(0.99).item(), kl.max().item(), same[name] / len(ids),
                            math.exp(nll[name] / (len(ids) - 1)), math.exp(nll[""] / (len(ids) - 1)))
    return out


# The fast paths measured, by name: (activations, KV cache dtype).
PATHS = {"int8x2 + float16 KV (default)": ("int8x2", "auto"), "int8x2 + int8 KV": ("int8x2", "int8"),
         "int8 + float16 KV": ("int8", "auto"), "int8 + int8 KV": ("int8", "int8")}
# Kernel paths a process can take on this CPU, as the environment that selects them.
KERNEL_PATHS = {"native": {}, "x8 off": {"KVSERVE_X8": "0"}, "avx2": {"KVSERVE_ISA": "avx2"},
                "portable": {"KVSERVE_ISA": "portable"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}")
    ap.add_argument("--all-paths", action="store_true", help="also every lower kernel path, a process each")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.all_paths:
        print(f"{cpu.describe()}\n\n{HEADER}")
        for kernel, env in KERNEL_PATHS.items():
            if cpu.LEVELS.index(env.get("KVSERVE_ISA", "avx512")) > cpu.LEVELS.index(cpu.native_isa()):
                continue
            cmd = [sys.executable, "-m", "benchmarks.quality", "--model", args.model, "--paths", args.paths,
                   "--threads", str(args.threads)]
            rows = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
            print("\n".join(f"| {kernel}, {line[2:]}" for line in rows.splitlines() if line.startswith("| ") and
                            not line.startswith(("| path", "|---"))), flush=True)
        return
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.paths.split(",")]
    ref = exact(args.model)
    ids = ref.tokenizer.encode(text())
    results = compare(ref, {n: fast(args.model, *PATHS[n]) for n in names}, ids)  # (activations, KV dtype)
    print(f"{cpu.describe()}; {len(ids)} tokens\n\n{HEADER}")
    for name, q in results.items():
        print(q.row(name))


if __name__ == "__main__":
    main()
