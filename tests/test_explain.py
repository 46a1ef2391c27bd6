"""kvserve explain: the numbers it reports are the pipeline's own."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve import LLM
from kvserve.config import CacheConfig
from kvserve.explain import explain, format_explanation, sparkline


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", dtype="float32", cache=CacheConfig(num_blocks=64))


def test_cache_size_after_each_step_is_the_pools_accounting(llm: LLM) -> None:
    pool, bs = llm.manager.pool, llm.manager.block_size
    # The pool tensors' real size per block: K and V of every layer.
    block_bytes = sum(t.nbytes for t in llm.runner.kv_caches) // pool.num_blocks
    seen: list[tuple[int, int, int]] = []

    def on_step(step, cache) -> None:
        pool.check_invariant()
        # This cache is the pool's only user: blocks out of the free queue are exactly its blocks.
        seen.append((step.cache_blocks, pool.num_used_blocks, len(set(cache.block_ids))))
        assert step.cache_bytes == pool.num_used_blocks * block_bytes

    prompt = "The quick brown fox jumps over the lazy dog, and then it"
    e = explain(llm, prompt, max_tokens=20, measure=False, on_step=on_step)
    n = len(llm.tokenizer.encode(prompt))
    assert e.prompt_ids == llm.tokenizer.encode(prompt) and "".join(e.pieces) == llm.tokenizer.decode(e.prompt_ids)
    assert [s.cache_tokens for s in e.steps] == [n + i for i in range(len(e.steps))]
    assert [s.cache_blocks for s in e.steps] == [-(-(n + i) // bs) for i in range(len(e.steps))]
    assert all(reported == used == held for reported, used, held in seen)
    assert len(seen) == len(e.steps) and e.steps[0].tokens_in == n
    # The same greedy tokens the engine generates.
    ref = llm.generate(prompt, max_tokens_params(len(e.steps)), use_tqdm=False)[0]
    assert [s.token_id for s in e.steps] == ref.outputs[0].token_ids
    assert pool.num_used_blocks == 0  # everything returned (prefix blocks stay cached-free)


def max_tokens_params(n: int):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


def test_report_has_every_stage(llm: LLM) -> None:
    e = explain(llm, "Hello there", max_tokens=4)
    assert e.ceilings is not None and e.ceilings.matmul_flops > 1e8 and e.ceilings.read_bytes > 1e8
    text = format_explanation(e)
    for heading in ("1. Tokenize: the model reads", "2. Prefill:", "First token:", "3. Decode:", "4. Why:"):
        assert heading in text
    # The default GGUF's quantized weights: a float16 KV cache, 2 x 30 x 3 x 64 x 2 bytes per token.
    assert "float32 activations, float16 KV cache" in text and "22.5 KiB per token" in text
    assert sparkline([1.0, 2.0, 3.0]) == "▁▅█" and sparkline([5.0, 5.0]) == "▁▁"


def test_cli_explain_errors_are_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "kvserve", "explain", "hi", "--max-tokens", "0", "--dtype", "float32"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "kvserve: error: max_tokens must be at least 1, got 0"
