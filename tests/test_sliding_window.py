"""Sliding-window attention (Mistral) against transformers, and the blocks it frees.

A tiny random MistralForCausalLM with sliding_window 8 and 4-token blocks, prompts several
windows long: kvserve's logits and greedy tokens through prefill, decode and chunked prefill
equal transformers' eager attention (mask: key > query - window), on the float32 path. Blocks
wholly before every window go back to the pool (exact counts), and a prefix hit on a block
that slid out is taken only while its K/V are still there. Qwen2 and Qwen3 with windowed and full
layers mixed (max_window_layers, layer_types), from their HF directories and GGUFs: transformers'
greedy tokens, which neither all-full nor all-windowed layers give, and the native step's per layer.
"""
from __future__ import annotations

import copy

import pytest
import torch

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.runner import SeqChunk
from kvserve.kernels import decode_step
from kvserve.kv.block_pool import prefix_block_hashes
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

WINDOW, BS = 8, 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(transformers reference with eager attention, its HF directory)."""
    from tiny_models import make_tiny_hf_model
    from transformers import MistralForCausalLM

    _, path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-mistral"), arch="mistral", sliding_window=WINDOW)
    hf = MistralForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    return hf, path


def load(path, num_blocks: int = 64, **kw) -> LLM:
    return LLM(str(path), dtype="float32", cache=CacheConfig(block_size=BS, num_blocks=num_blocks), **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_the_window_is_read_and_not_capped(mistral) -> None:
    _, path = mistral
    llm = load(path)
    assert llm.config.sliding_window == WINDOW and all(lw.window == WINDOW for lw in llm.model.layers)
    assert llm.max_model_len == 64 * BS  # the pool's tokens, not the window
    assert llm.manager.sliding_window == WINDOW


@pytest.mark.parametrize("chunk", [None, 5, 8, 13])
def test_logits_match_transformers_through_prefill_chunks_and_decode(mistral, chunk) -> None:
    """Logits at each prefill chunk's last position (the prompt whole or in chunks), then at every
    position decoded one token at a time, blocks sliding out as it goes."""
    hf, path = mistral
    llm = load(path)
    ids = prompt(41)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [T, V]
    m, n0 = llm.manager, 29
    got, done = [], 0
    step = chunk or n0
    while done < n0:  # the prompt's 29 tokens in chunks; logits of each chunk's last token
        n = min(step, n0 - done)
        m.allocate("s", done + n)
        got.append((done + n - 1, llm.runner.run([SeqChunk(ids[done : done + n], done, m.block_ids("s"), True)])[0]))
        done += n
        m.cache_computed("s", ids, done)
        m.slide("s", done)
    for p in range(n0, len(ids)):
        m.allocate("s", p + 1)
        got.append((p, llm.runner.run([SeqChunk([ids[p]], p, m.block_ids("s"), True)])[0]))
        m.slide("s", p + 1)
        assert m.num_held_blocks("s") <= -(-(WINDOW + BS) // BS)  # the window's blocks, and the one being filled
    for p, logits in got:
        assert rel_err(logits, ref[p]) < 1e-5, p
    # The window matters here: transformers attending to all 41 tokens gives other logits.
    hf.config.sliding_window = None
    try:
        with torch.no_grad():
            full_attention = hf(torch.tensor([ids])).logits[0, -1]
    finally:
        hf.config.sliding_window = WINDOW
    assert rel_err(full_attention, ref[-1]) > 1e-2
    m.free("s")
    m.pool.check_invariant()


@pytest.mark.parametrize("max_batched", [512, 6])
def test_greedy_generate_equals_transformers(mistral, max_batched) -> None:
    """The engine (continuous batching, chunked prefill at a 6-token budget) gives transformers'
    greedy tokens for prompts several windows long, decoding well past the window."""
    hf, path = mistral
    llm = load(path, scheduler=SchedulerConfig(max_num_batched_tokens=max_batched))
    prompts = [prompt(n, seed) for seed, n in enumerate((3, 9, 30, 47))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 24)
    llm.manager.pool.check_invariant()
    assert llm.manager.pool.num_used_blocks == 0


def test_prefill_and_decode_free_blocks_out_of_the_window(mistral) -> None:
    """LLM.prefill / decode: exact block counts as the window slides, and transformers' tokens."""
    hf, path = mistral
    llm = load(path, num_blocks=32)
    pool, ids = llm.manager.pool, prompt(29, seed=7)
    cache, token = llm.prefill(ids)
    # 29 tokens in 8 blocks; the next query (position 29) sees 22 .. 29: blocks 0-4 (tokens 0-19) are out.
    assert cache.block_ids[:5] == [-1] * 5 and -1 not in cache.block_ids[5:]
    assert cache.num_blocks == 3 and pool.num_used_blocks == 3
    mine = [token]
    for p in range(29, 45):
        cache, token = llm.decode(cache, token)
        mine.append(token)
        # after position p the next query sees p - 6 .. p + 1: blocks wholly before p - 6 are freed
        assert cache.num_blocks == -(-(p + 1) // BS) - (p - 6) // BS, p
        assert pool.num_used_blocks == cache.num_blocks
    assert mine == hf_greedy(hf, ids, 17)
    cache.close()
    pool.check_invariant()
    assert pool.num_used_blocks == 0


def test_a_prefix_hit_on_slid_out_blocks_only_while_they_hold_their_kv(mistral) -> None:
    """Blocks that slid out keep their hash while free: a later prompt that shares them reads
    their K/V (the same tokens as a fresh prefill). Once the pool hands them out again the hash
    is gone, and the lookup stops at the first reused block: no stale hit."""
    hf, path = mistral
    llm = load(path, num_blocks=12)
    m, pool = llm.manager, llm.manager.pool
    ids = prompt(29, seed=3)
    want = hf_greedy(hf, ids, 6)
    cache, token = llm.prefill(ids)
    assert cache.num_blocks == 3 and pool.num_cached_free_blocks == 5  # 5 slid out, published
    cache.close()
    assert pool.num_cached_free_blocks == 7  # every full block is cached: 7 of 8 (the last is partial)
    assert len(m.find_prefix(ids)) == 7  # prefix_block_hashes: (29 - 1) // 4 blocks

    def greedy(cache, token, n):
        out = [token]
        for _ in range(n - 1):
            cache, token = llm.decode(cache, token)
            out.append(token)
        cache.close()
        return out

    hits_before = m.prefix_stats.hits
    assert greedy(*llm.prefill(ids), 6) == want  # the hit: 7 blocks, 28 tokens taken from the cache
    assert m.prefix_stats.hits - hits_before == 28
    pool.check_invariant()

    # Slid-out blocks join the free queue tail-first (4, 3, 2, 1, 0 at each slide), behind the
    # uncached ones, which go out first. A 10-token prompt takes three blocks: the uncached one
    # and two evicted cached ones, after the decodes above took one: chain blocks 2, 3, 4 are gone.
    chain = [h for h, _ in prefix_block_hashes(ids, BS)]
    with llm.prefill(prompt(10, seed=4))[0] as small:
        assert small.num_blocks == 3
        alive = [pool.lookup(h, ids[i * BS : (i + 1) * BS]) is not None for i, h in enumerate(chain)]
        assert alive == [True, True, False, False, False, True, True]
        assert len(m.find_prefix(ids)) == 2  # the walk stops at block 2: 5 and 6 are valid but unreachable
        pool.check_invariant()
    hits_before = m.prefix_stats.hits
    assert greedy(*llm.prefill(ids), 6) == want
    assert m.prefix_stats.hits - hits_before == 2 * BS

    # A 45-token prompt needs all 12 blocks at once: every cached block is evicted, no hit is left.
    with llm.prefill(prompt(45, seed=5))[0] as big:
        assert big.num_blocks == 3  # 45 tokens, the next query sees 38 .. 45: blocks 0-8 slid out
        assert not m.find_prefix(ids)
    hits_before = m.prefix_stats.hits
    assert greedy(*llm.prefill(ids), 6) == want
    assert m.prefix_stats.hits == hits_before
    pool.check_invariant()
    assert pool.num_used_blocks == 0


def test_the_context_goes_past_the_pool_when_the_window_fits(mistral) -> None:
    """A 12-block pool (48 tokens) under a window of 8 and 8-token steps: a sequence holds at most
    5 blocks, so the context is the model's, not the pool's; 60-token prompts decode to 90 tokens
    with transformers' greedy tokens, through the engine and through prefill / decode."""
    hf, path = mistral
    llm = load(path, num_blocks=12, scheduler=SchedulerConfig(max_num_batched_tokens=8))
    assert llm.max_model_len == 2048
    prompts = [prompt(60, seed=11), prompt(57, seed=12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 30)
    llm.manager.pool.check_invariant()
    assert llm.manager.pool.num_used_blocks == 0
    cache, token = llm.prefill(prompts[0])  # chunk by chunk: never more than 5 blocks held
    mine = [token]
    for _ in range(9):
        cache, token = llm.decode(cache, token)
        assert cache.num_blocks <= 5
        mine.append(token)
    assert mine == outs[0].outputs[0].token_ids[:10]
    cache.close()


def test_a_gguf_mistral_and_a_qwen2_that_slides_match_transformers(mistral, tmp_path) -> None:
    """The window read from GGUF metadata (llama.attention.sliding_window), and Qwen2 with
    use_sliding_window in every layer (max_window_layers 0), against transformers' greedy tokens."""
    from tiny_models import make_tiny_hf_model, write_tiny_gguf
    from transformers import Qwen2ForCausalLM

    hf, _ = mistral
    ids = prompt(33, seed=21)
    gguf_llm = LLM(str(write_tiny_gguf(tmp_path / "mistral.gguf", hf, with_vocab=True)), dtype="float32",
                   cache=CacheConfig(block_size=BS, num_blocks=64))
    assert gguf_llm.config.sliding_window == WINDOW
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert gguf_llm.generate([ids], sp, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, ids, 16)

    _, qdir = make_tiny_hf_model(tmp_path / "qwen2", arch="qwen2", use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=0)
    qwen = Qwen2ForCausalLM.from_pretrained(qdir, attn_implementation="eager", dtype=torch.float32).eval()
    assert qwen.config.layer_types == ["sliding_attention"] * 2
    llm = load(qdir)
    assert llm.config.sliding_window == WINDOW
    assert llm.generate([ids], sp, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(qwen, ids, 16)


# Qwen2 and Qwen3 with windowed and full layers mixed: Qwen2's derived from max_window_layers (layers
# from 1 on slide), Qwen3's listed in layer_types.
MIXED = {"qwen2": dict(max_window_layers=1),
         "qwen3": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"])}
MIXED_WINDOWS = {"qwen2": (0, WINDOW, WINDOW), "qwen3": (WINDOW, 0, WINDOW)}


@pytest.fixture(scope="module", params=list(MIXED))
def mixed(request, tmp_path_factory):
    """(family, transformers' eager model, its directory, its float32 GGUF)."""
    from gguf import GGMLQuantizationType as Q
    from tiny_models import make_tiny_hf_model, write_tiny_gguf

    family, root = request.param, tmp_path_factory.mktemp(f"mixed-{request.param}")
    model, directory = make_tiny_hf_model(root / "hf", arch=family, num_layers=3, seed=11, use_sliding_window=True,
                                          sliding_window=WINDOW, attn_implementation="eager", **MIXED[family])
    assert tuple(WINDOW if t == "sliding_attention" else 0 for t in model.config.layer_types) == MIXED_WINDOWS[family]
    return family, model, directory, write_tiny_gguf(root / "f32.gguf", model, Q.F32, with_vocab=True)


def with_layer_types(hf, kind: str):
    """`hf`'s weights with every layer `kind` ("full_attention" or "sliding_attention")."""
    config = copy.deepcopy(hf.config)
    config.layer_types = [kind] * config.num_hidden_layers
    other = type(hf)(config).eval()
    other.load_state_dict(hf.state_dict())
    return other


def test_mixed_windows_are_read_per_layer_from_both_sources(mixed) -> None:
    """Each layer's window, and no every-layer one: no block leaves the pool (the full layers read it)."""
    family, _, directory, gguf_path = mixed
    for source in (directory, gguf_path):
        llm = load(source)
        assert (llm.config.sliding_window, llm.config.layer_windows) == (None, MIXED_WINDOWS[family]), source
        assert [lw.window for lw in llm.model.layers] == list(MIXED_WINDOWS[family]) and llm.manager.sliding_window is None


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_mixed_windows_greedy_tokens_equal_transformers_and_the_windows_matter(mixed, source) -> None:
    """Prompts several windows long, through the engine (chunked prefill at a 6-token budget too):
    transformers' greedy tokens, which the same weights with every layer full or every layer
    windowed do not give."""
    _, hf, directory, gguf_path = mixed
    batch = [prompt(n, seed) for seed, n in enumerate((33, 21))]
    want = [hf_greedy(hf, ids, 16) for ids in batch]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for budget in (512, 6):
        llm = load(directory if source == "hf" else gguf_path, scheduler=SchedulerConfig(max_num_batched_tokens=budget))
        assert [o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)] == want, budget
        llm.manager.pool.check_invariant()
    if source == "hf":
        for kind in ("full_attention", "sliding_attention"):
            assert hf_greedy(with_layer_types(hf, kind), batch[0], 16) != want[0], kind


@pytest.mark.skipif(decode_step.library() is None, reason="no C compiler: the native step cannot build")
def test_mixed_windows_run_the_native_step_as_the_per_op_path_does(mixed, tmp_path) -> None:
    """The Q8_0 file through the native decode step, each layer with its window, bit for bit the per-op path."""
    from family_checks import native_and_per_op, prompts
    from gguf import GGMLQuantizationType as Q
    from tiny_models import write_tiny_gguf

    family, hf, _, _ = mixed
    llm = LLM(str(write_tiny_gguf(tmp_path / "q8.gguf", hf, Q.Q8_0, with_vocab=True)),
              cache=CacheConfig(block_size=BS, num_blocks=128, enable_prefix_caching=False))
    step = llm.runner.native
    assert step is not None and step._model.window == 0
    assert [step._layers[i].window for i in range(3)] == list(MIXED_WINDOWS[family])
    native, per_op = native_and_per_op(llm, prompts(4, seed=5))
    assert native == per_op
