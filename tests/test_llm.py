"""The seed's API on the embedded default model, against transformers' own load of the GGUF."""
from __future__ import annotations

import gc

import pytest
import torch

from kvserve import LLM, CacheConfig, SamplingParams
from kvserve.errors import CacheClosedError

CHAT = [{"role": "user", "content": "Explain quantum computing like I'm ten."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", dtype="float32", quantization="none", cache=CacheConfig(num_blocks=512))


@pytest.fixture(autouse=True)
def pool_is_whole_afterwards(llm: LLM):
    yield
    gc.collect()  # dropped caches free their blocks through their finalizers
    llm.manager.pool.check_invariant()
    assert llm.manager.pool.num_used_blocks == 0


def test_greedy_chat_continuation_equals_transformers(llm: LLM, hf_model) -> None:
    ids = llm.encode_chat(CHAT)
    cache, token = llm.prefill(ids)
    mine = [token]
    while len(mine) < 40:
        cache, token = llm.decode(cache, token)
        mine.append(token)
    cache.close()
    with torch.no_grad():
        # An explicit mask: the prompt holds <|im_end|> (id 2), which is also the pad id.
        x = torch.tensor([ids])
        ref = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False,
                                eos_token_id=None, pad_token_id=2)
    assert mine == ref[0, len(ids):].tolist()
    # generate() (the engine path) agrees too
    assert llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].token_ids == mine


def test_prefill_logits_match_transformers(llm: LLM, hf_model) -> None:
    ids = llm.encode_chat(CHAT)
    llm.manager.allocate("probe", len(ids))
    try:
        from kvserve.engine.runner import SeqChunk

        logits = llm.runner.run([SeqChunk(ids, 0, llm.manager.block_ids("probe"), True)])[0]
    finally:
        llm.manager.free("probe")
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4


def test_seed_loop_and_the_cache_grows_block_by_block(llm: LLM) -> None:
    cache, token = llm.prefill("Explain quantum computing like I'm ten.")
    n0 = cache.num_tokens
    assert n0 == len(llm.tokenizer.encode("Explain quantum computing like I'm ten."))
    bpt = 2 * 30 * 3 * 64 * 4  # 45 KiB per token in float32
    for _ in range(40):
        assert cache.num_blocks == -(-cache.num_tokens // 16)
        assert cache.nbytes == cache.num_blocks * 16 * bpt
        cache, token = llm.decode(cache, token)
    assert cache.num_tokens == n0 + 40
    used = llm.manager.pool.num_used_blocks
    assert used == cache.num_blocks
    cache.close()
    assert cache.closed and llm.manager.pool.num_used_blocks == 0
    with pytest.raises(CacheClosedError, match="closed"):
        llm.decode(cache, token)
    cache.close()  # twice: harmless


def test_a_dropped_cache_returns_its_blocks(llm: LLM) -> None:
    cache, _ = llm.prefill(list(range(100, 140)))
    assert llm.manager.pool.num_used_blocks == 3
    del cache
    gc.collect()
    assert llm.manager.pool.num_used_blocks == 0


def test_bad_decode_inputs_leave_the_pool_alone(llm: LLM) -> None:
    with llm.prefill([5, 6, 7])[0] as cache:
        with pytest.raises(ValueError, match=r"token must be an id in \[0, 49152\)"):
            llm.decode(cache, 49152)
        assert cache.num_tokens == 3 and llm.manager.pool.num_used_blocks == 1
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.prefill("")


def test_prefix_reuse_between_prefills(llm: LLM) -> None:
    ids = llm.encode_chat(CHAT)
    a, ta = llm.prefill(ids)
    a.close()
    hits = llm.manager.prefix_stats.hits
    b, tb = llm.prefill(ids)
    assert llm.manager.prefix_stats.hits - hits == (len(ids) - 1) // 16 * 16
    assert ta == tb
    b.close()
