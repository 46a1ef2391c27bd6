"""What the architecture tests (test_qwen3.py, test_phi3.py, test_gemma.py, test_moe.py) check the same
way: random prompts, transformers' greedy tokens, kvserve's, the native step against the per-op
path (their greedy tokens; their logits step by step, decode_both, also test_native_decode.py's), and greedy choices along a given sequence (teacher forcing, tests/test_quant.py's measure of
agreement)."""
from __future__ import annotations

import random

import torch

from kvserve import LLM, SamplingParams
from kvserve.config import CacheConfig
from kvserve.engine.runner import ModelRunner, SeqChunk

TOKENS = 24


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def reference(hf, prompt: list[int], tokens: int = TOKENS) -> list[int]:
    """transformers' greedy continuation."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    return out[0, len(prompt):].tolist()


def greedy(llm: LLM, batch: list[list[int]], tokens: int = TOKENS) -> list[list[int]]:
    """kvserve's greedy continuations, the prompts batched."""
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(batch, sp, use_tqdm=False)]


def native_and_per_op(llm: LLM, batch: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """The greedy tokens through the native step, and through the per-op path (the same kernels);
    batch invariance on, so that the batch and the per-op path's rows multiply alike."""
    assert llm.runner.native is not None
    llm.model.set_batch_invariant(True)
    try:
        native = greedy(llm, batch)
        llm.runner.native, step = None, llm.runner.native
        try:
            per_op = greedy(llm, batch)
        finally:
            llm.runner.native = step
    finally:
        llm.model.set_batch_invariant(llm.batch_invariant)
    return native, per_op


def greedy_along(llm: LLM, ids: list[int], tokens: list[int]) -> list[int]:
    """`llm`'s greedy choice at each step while it is fed `tokens` (teacher forcing)."""
    cache, token = llm.prefill(ids)
    out = [token]
    with cache:
        for t in tokens[:-1]:
            cache, token = llm.decode(cache, t)
            out.append(token)
    return out


def agreement(llm: LLM, hf, batch: list[list[int]]) -> tuple[int, int]:
    """(steps where `llm`'s greedy choice, fed transformers' own tokens, is transformers', steps): a
    quantized model is a slightly different one, so it agrees at nearly every step, not all."""
    steps = agree = 0
    for p in batch:
        want = reference(hf, p)
        got = greedy_along(llm, p, want)
        steps += len(want)
        agree += sum(g == w for g, w in zip(got, want))
    return agree, steps


def float32_tokens(path, hf, n: int = 3, seed: int = 5) -> tuple[list[list[int]], list[list[int]]]:
    """(kvserve's, transformers') greedy tokens for n random prompts, the model at `path` loaded in float32."""
    llm = LLM(str(path), dtype="float32", cache=CacheConfig(num_blocks=64))
    batch = prompts(n, seed)
    return greedy(llm, batch), [reference(hf, p) for p in batch]


def decode_both(runner: ModelRunner, prompts: list[list[int]], steps: int, window: int = 0) -> None:
    """Prefill each prompt, then decode all together `steps` times, each step through the per-op
    path and the native step over the same pool; their logits must be identical. Under a sliding
    window, the blocks wholly before each window are -1 in the tables (freed)."""
    native, blocks, bs = runner.native, iter(range(1, 10_000)), runner.block_size
    tables = [[next(blocks) for _ in range((len(p) + steps) // bs + 1)] for p in prompts]
    seqs = [list(p) for p in prompts]
    runner.native = None
    for seq, table in zip(seqs, tables):
        seq.append(int(runner.run([SeqChunk(seq, 0, table, True)])[0].argmax()))
    holes = 0
    for _ in range(steps):
        for s, t in zip(seqs, tables):  # the next query, at len(s) - 1, sees keys from len(s) - window on
            for j in range(max(0, len(s) - window) // bs if window else 0):
                holes += t[j] != -1
                t[j] = -1
        chunks = [SeqChunk([s[-1]], len(s) - 1, t, True) for s, t in zip(seqs, tables)]
        runner.native = None
        ref = runner.run(chunks).clone()
        runner.native = native
        got = runner.run(chunks).clone()
        assert torch.equal(ref, got), f"max |difference| {(ref - got).abs().max().item()}"
        for s, token in zip(seqs, ref.argmax(-1).tolist()):
            s.append(token)
    assert bool(holes) == bool(window)
