"""The native decode step (model/native_decode.py, kernels/decode_step.c) against the per-op path.

The step runs the per-op path's own kernels inside one call, so the two must agree bit for bit:
logits at every step, and so every greedy token, in any batch mix. Models it does not take keep
the per-op path; bad tables are refused without writing the pool.
"""
from __future__ import annotations

import ctypes
import dataclasses
import random

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve import LLM, SamplingParams
from kvserve.config import CacheConfig
from kvserve.engine.runner import ModelRunner, SeqChunk
from kvserve.kernels import decode_step
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_checkpoint
from kvserve.model.native_decode import NativeDecode
from kvserve.model.quant import ConcatLinear, quantize
from family_checks import decode_both

pytestmark = pytest.mark.skipif(decode_step.library() is None, reason="no C compiler: the native step cannot build")

BS = 16


@pytest.fixture(scope="module")
def llm() -> LLM:
    # The default model: Q4_1 layers, Q8_0 embedding / LM head. No prefix caching: a second run of
    # the same prompts must compute them again, not attend to the first run's cached K/V.
    return LLM(cache=CacheConfig(num_blocks=256, enable_prefix_caching=False))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


def test_the_default_model_takes_the_native_step(llm: LLM) -> None:
    assert llm.dtype == torch.float32 and llm.kv_dtype == torch.float16
    assert isinstance(llm.runner.native, NativeDecode)


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("levels", [2, 1])
def test_native_step_equals_the_per_op_path_on_the_default_model(llm: LLM, n: int, levels: int) -> None:
    # One row takes its own order (each KV head's rotation with its attention); more rows, a barrier between.
    # Activations at two int8 levels (the default) and at one.
    saved = llm.runner.native
    try:
        llm.model.set_activation_levels(levels)
        llm.runner.native = NativeDecode(llm.model, llm.runner.kv_caches, BS, llm.runner.kv_scales)
        decode_both(llm.runner, _prompts(n), steps=6)
    finally:
        llm.model.set_activation_levels(2)
        llm.runner.native = saved


def test_work_buffers_grow_for_longer_contexts_and_larger_batches(llm: LLM) -> None:
    # Buffers start at one row and 256 tokens of context; these need them grown, mid-run.
    decode_both(llm.runner, [[(7 * i) % 30000 + 100 for i in range(700)], *_prompts(2, seed=4)], steps=2)
    decode_both(llm.runner, _prompts(9, seed=5), steps=2)


def _per_op_one_token_at_a_time(runner: ModelRunner, prompt: list[int], table: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt fed through the per-op path one decode step per token, then `steps` greedy tokens:
    (the logits after the prompt, the tokens)."""
    native, runner.native = runner.native, None
    try:
        for i, t in enumerate(prompt):
            first = runner.run([SeqChunk([t], i, table, True)]).clone()
        seq = [*prompt, int(first.argmax())]
        for _ in range(steps - 1):
            seq.append(int(runner.run([SeqChunk([seq[-1]], len(seq) - 1, table, True)]).argmax()))
        return first, seq[len(prompt):]
    finally:
        runner.native = native


def test_greedy_generation_is_the_same_through_either_path(llm: LLM) -> None:
    """The engine's native path (prompt rows and decode steps in the native step) gives the tokens of the
    per-op path reading each prompt token as a decode step: prompt rows attend as decode rows do. With
    batch invariance on (the SIMD builds' default; the plain C build's turned on here), so that the
    batch of six and the reference's rows of one multiply alike."""
    prompts = _prompts(6, seed=1)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.model.set_batch_invariant(True)
    try:
        native = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        table = list(range(200, 206))  # blocks no request holds once generate() is done
        assert native == [_per_op_one_token_at_a_time(llm.runner, p, table, 24)[1] for p in prompts]
    finally:
        llm.model.set_batch_invariant(llm.batch_invariant)


def test_prompt_rows_give_the_bits_of_decoding_the_prompt(llm: LLM, monkeypatch) -> None:
    """Prompt chunks in the native step: each row a query of its own, so a prompt's logits and K/V are the
    ones decoding it token by token gives, whatever its chunking and whatever else shares its step. Rows
    at or past NATIVE_PROMPT_CONTEXT (24 here) take the per-op forward, by their position alone."""
    from kvserve.engine import runner as runner_mod

    monkeypatch.setattr(runner_mod, "NATIVE_PROMPT_CONTEXT", 24)
    runner = llm.runner
    a, b = _prompts(2, seed=7)
    a, b = (a * 3)[:20], (b * 3)[:40]  # a: every row below 24; b: rows 24.. past it
    ta, tb, tr = [10, 11], [20, 21, 22], [30, 31, 32]
    alone = runner.run([SeqChunk(a, 0, ta, True)]).clone()
    ref, _ = _per_op_one_token_at_a_time(runner, a, tr, 1)
    assert torch.equal(alone[0], ref[0])
    assert torch.equal(runner.kv_caches[3][:, :, 10:12].flatten(2, 3)[:, :, :20],
                       runner.kv_caches[3][:, :, 30:32].flatten(2, 3)[:, :, :20])
    # b across the cutoff, in two chunks, the first beside a's next decode row and a third prompt's chunk
    mixed = runner.run([SeqChunk([5], 20, ta, True), SeqChunk(b[:30], 0, tb, False),
                        SeqChunk(_prompts(1, seed=9)[0], 0, [40, 41, 42, 43, 44], True)]).clone()
    got = runner.run([SeqChunk(b[30:], 30, tb, True)]).clone()
    # reference: b's rows 0..23 as decode steps (= native prompt rows), 24..29 and 30..39 as per-op chunks
    native = runner.native
    for i in range(24):
        runner.run([SeqChunk([b[i]], i, tr, True)])
    runner.native = None
    try:
        runner.run([SeqChunk(b[24:30], 24, tr, False)])
        ref_b = runner.run([SeqChunk(b[30:], 30, tr, True)]).clone()
    finally:
        runner.native = native
    assert torch.equal(got[0], ref_b[0])
    assert torch.equal(runner.kv_caches[7][:, :, 20:23].flatten(2, 3)[:, :, :40],
                       runner.kv_caches[7][:, :, 30:33].flatten(2, 3)[:, :, :40])
    # a's decode row in the mixed step: the bits it has alone
    assert torch.equal(mixed[0], runner.run([SeqChunk([5], 20, ta, True)])[0])


def test_a_prompt_chunk_gets_the_same_bits_on_amx_tiles(llm: LLM) -> None:
    """A prompt chunk of 90 rows (180 activation rows at two levels) runs its linears on AMX tiles where they
    run: the same logits and K/V as on the AVX-512 kernels, so switching them changes no answer. Where they
    do not run, the switch stays off and both runs take the same kernels."""
    from benchmarks.peers import amx_runs
    from kvserve import cpu
    from kvserve.kernels import quant_matmul

    runner, p = llm.runner, (_prompts(1, seed=11)[0] * 30)[:90]
    tables, before = [[60, 61, 62, 63, 64, 65], [70, 71, 72, 73, 74, 75]], quant_matmul.amx()
    try:
        on = quant_matmul.set_amx(True)
        tiles = runner.run([SeqChunk(p, 0, tables[0], True)]).clone()
        assert not quant_matmul.set_amx(False)
        avx512 = runner.run([SeqChunk(p, 0, tables[1], True)]).clone()
    finally:
        quant_matmul.set_amx(before)
    assert on == (cpu.isa() == "avx512" and {"amx_tile", "amx_int8"} <= cpu.cpu_flags() and amx_runs())
    assert torch.equal(tiles, avx512)
    for layer in (0, 15, 29):
        kv = runner.kv_caches[layer]
        assert torch.equal(kv[:, :, 60:66].flatten(2, 3)[:, :, :90], kv[:, :, 70:76].flatten(2, 3)[:, :, :90])


def test_prompt_rows_take_the_per_op_path_past_the_integer_kernels_rows(llm: LLM, monkeypatch) -> None:
    """Without batch invariance the per-op forward leaves the integer kernel from some row count on
    (BLAS, bf16): a chunk of that many rows keeps it, so the native step changes no path's arithmetic."""
    runner = llm.runner
    calls = []
    monkeypatch.setattr(runner, "_native_prompt_rows",
                        lambda *a: calls.append(len(a[1])) or torch.zeros(len(a[1]), llm.config.hidden_size))
    rows = runner.native.integer_rows()
    runner.run([SeqChunk(list(range(100, 110)), 0, [50], True)]) if rows > 10 else None
    monkeypatch.setattr(runner.native, "integer_rows", lambda: 10)
    runner.run([SeqChunk(list(range(100, 110)), 0, [51], True)])  # 10 rows: the per-op forward
    assert calls == ([10] if rows > 10 else [])


def test_a_sequence_gets_the_same_logits_alone_or_in_a_batch(llm: LLM) -> None:
    runner = llm.runner
    prompts = _prompts(4, seed=2)
    tables = [[100 + 10 * i + j for j in range(6)] for i in range(4)]
    for p, t in zip(prompts, tables):
        runner.run([SeqChunk(p, 0, t, True)])
    chunks = [SeqChunk([7], len(p), t, True) for p, t in zip(prompts, tables)]
    together = runner.run(chunks).clone()
    for i, c in enumerate(chunks):
        assert torch.equal(runner.run([c])[0], together[i])


def _tiny_quantized(tiny_llama_dir, qtypes: dict[str, Q], bias: bool = False, window: int | None = None) -> LlamaModel:
    ckpt = load_checkpoint(tiny_llama_dir, torch.float32, "none")
    tensors = ckpt.tensors
    for name in list(tensors):
        if name.endswith("_proj.weight") or name == "model.embed_tokens.weight":
            kind = next((k for k in qtypes if k in name), "other")
            tensors[name] = quantize(tensors[name], qtypes.get(kind, Q.Q8_0))
    if bias:  # Qwen2's q/k/v bias, through the step's bias add
        c = ckpt.config
        for i in range(c.num_hidden_layers):
            for n, rows in (("q", c.num_attention_heads), ("k", c.num_key_value_heads), ("v", c.num_key_value_heads)):
                tensors[f"model.layers.{i}.self_attn.{n}_proj.bias"] = torch.randn(rows * c.head_dim) * 0.1
    return LlamaModel(dataclasses.replace(ckpt.config, sliding_window=window), tensors, torch.float32)


@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_native_step_under_a_sliding_window(tiny_llama_dir, kv_dtype, one_row) -> None:
    """A window of 8 with freed (-1) blocks before it: the step reads only the window, as the
    per-op path does (whose window tests/test_sliding_window.py checks against transformers);
    without the window it would refuse the tables."""
    model = _tiny_quantized(tiny_llama_dir, {}, window=8)
    c = model.config
    pools = [torch.zeros(2, c.num_key_value_heads, 64, BS, c.head_dim, dtype=kv_dtype) for _ in model.layers]
    runner = ModelRunner(model, pools, BS)
    assert runner.native is not None and runner.native._model.window == 8
    prompts = [[(11 * i) % 30000 + 100 for i in range(40)]] if one_row else _prompts(4, seed=6)
    decode_both(runner, prompts, steps=6, window=8)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_native_step_on_mixed_part_linears_and_every_pool_format(tiny_llama_dir, kv_dtype, n) -> None:
    # q in Q8_0 beside k/v in Q4_0: three parts in one fused projection, as K-quant files mix types.
    model = _tiny_quantized(tiny_llama_dir, {"k_proj": Q.Q4_0, "v_proj": Q.Q4_0, "up_proj": Q.Q4_0}, bias=True)
    assert isinstance(model.layers[0].qkv, ConcatLinear) and len(model.layers[0].qkv.parts) == 3
    c = model.config
    pools = [torch.zeros(2, c.num_key_value_heads, 64, BS, c.head_dim, dtype=kv_dtype) for _ in model.layers]
    # an int8 pool's row scales (model/kv_int8.py), one float16 per pool row
    scales = [torch.zeros(pool.shape[:-1], dtype=torch.float16) for pool in pools] if kv_dtype == torch.int8 else None
    runner = ModelRunner(model, pools, BS, kv_scales=scales)
    assert runner.native is not None and (runner.native._layers[0].kv_scale is not None) == (scales is not None)
    decode_both(runner, _prompts(n, seed=3), steps=5)


def test_models_the_step_does_not_take_keep_the_per_op_path(tiny_llama_dir, monkeypatch) -> None:
    float_model = LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=32))
    assert float_model.runner.native is None  # float weights: torch's matmuls, exact against transformers
    monkeypatch.setenv("KVSERVE_NATIVE_DECODE", "0")
    assert LLM(str(tiny_llama_dir), quantization="q8_0", cache=CacheConfig(num_blocks=32)).runner.native is None
    monkeypatch.delenv("KVSERVE_NATIVE_DECODE")
    quantized = LLM(str(tiny_llama_dir), quantization="q8_0", cache=CacheConfig(num_blocks=32))
    assert quantized.runner.native is not None and quantized.dtype == torch.float32


def test_slots_outside_the_pool_are_refused_and_nothing_is_written(llm: LLM) -> None:
    runner = llm.runner
    before = [kv.clone() for kv in runner.kv_caches[:2]]
    num_blocks = runner.kv_caches[0].shape[2]
    with pytest.raises(RuntimeError, match="outside the model's vocabulary or the KV pool"):
        runner.native([5], [3], [num_blocks * BS], [[0]])  # one slot past the pool's end
    with pytest.raises(RuntimeError, match="outside"):
        runner.native([5], [3], [3], [[num_blocks]])  # a block id past the pool
    with pytest.raises(RuntimeError, match="outside"):
        runner.native([llm.config.vocab_size], [3], [3], [[0]])  # a token id past the vocabulary
    # Compared as bytes: blocks never written may hold NaN, which equals nothing.
    assert all(torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))
               for a, b in zip(before, runner.kv_caches[:2]))


def _argmax_native(logits: torch.Tensor, cols: int, threads: int) -> tuple[list[int], list[float]]:
    B = logits.shape[0]
    ids, vals = torch.empty(B, dtype=torch.int64), torch.empty(B)
    rc = decode_step.library().kvserve_argmax(logits.data_ptr(), B, logits.shape[1], cols, ids.data_ptr(),
                                               vals.data_ptr(), threads)
    assert rc == 0
    return ids.tolist(), vals.tolist()


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
def test_the_native_argmax_is_numpys(threads: int) -> None:
    """Each row's argmax as numpy's, whichever thread scanned which columns: the first of equal maxima
    (here on both sides of every thread's boundary), the first NaN before any number, +inf, all -inf,
    -0.0 against 0.0, and only the first `cols` columns."""
    V, cols = 1000, 993
    g = torch.Generator().manual_seed(threads)
    rows = [torch.randn(V, generator=g) for _ in range(4)]
    tied = torch.randn(V, generator=g)
    tied[[7, 250, 251, 500, 749, 992]] = 9.0  # 16-column chunks dealt to 2-7 threads fall between these
    rows.append(tied)
    nan = torch.randn(V, generator=g)
    nan[[300, 800]] = float("nan")
    nan[10] = float("inf")
    rows.append(nan)
    inf = torch.randn(V, generator=g)
    inf[[600, 900]] = float("inf")
    rows.append(inf)
    rows.append(torch.full((V,), float("-inf")))
    zeros = torch.full((V,), -1.0)
    zeros[[400, 401]] = torch.tensor([-0.0, 0.0])
    rows.append(zeros)
    past = torch.randn(V, generator=g)
    past[cols:] = 100.0  # past `cols`: not looked at
    rows.append(past)
    logits = torch.stack(rows)
    ids, vals = _argmax_native(logits, cols, threads)
    want = logits[:, :cols].numpy().argmax(axis=1).tolist()
    assert ids == want
    assert [t[i].item() for t, i in zip(logits, want)] == pytest.approx(vals, nan_ok=True)
    assert want[4:9] == [7, 300, 600, 0, 400]


def test_a_greedy_step_takes_its_tokens_from_the_native_argmax(llm: LLM) -> None:
    """The native step's argmax (what a greedy step samples) is numpy's over the logits it returns, within
    the sampler's vocabulary (here narrower than the LM head's, as with a padded head)."""
    native = llm.runner.native
    ids = [p[0] for p in _prompts(5, seed=7)]
    V = llm.runner.sampler.vocab_size
    for cols in (V, V - 1000):
        # each row a first token: it attends to its own slot alone, which the step writes (no unwritten block is read)
        tables = [[1 + i] for i in range(len(ids))]
        hidden, logits, best = native(ids, [0] * len(ids), [t[0] * BS for t in tables], tables, argmax_cols=cols)
        assert torch.isfinite(logits).all()
        ids, vals = best
        assert ids == logits[:, :cols].numpy().argmax(axis=1).tolist()
        assert vals == [logits[r, i].item() for r, i in enumerate(ids)]
    assert native([1], [0], [BS], [[1]], argmax_cols=0)[2] is None


def test_the_profiling_build_gives_the_same_bits_and_times_every_phase(llm: LLM) -> None:
    """decode_step.library(phases=True) (`python -m benchmarks.step --phases`) adds only clocks and barriers: the
    step's logits and argmax to the bit, and each phase a step runs timed (one row rotates its keys inside attention)."""
    lib, native = decode_step.library(phases=True), llm.runner.native
    n, threads, V = len(decode_step.PHASES), torch.get_num_threads(), llm.runner.sampler.vocab_size
    work, wait = (ctypes.c_double * (threads * n))(), (ctypes.c_double * (threads * n))()
    lib.kvserve_phase_times(work, wait, threads)  # zeroed
    for rows in (1, 3):
        ids = [p[0] for p in _prompts(rows, seed=11)]
        tables = [[1 + i] for i in range(rows)]  # first tokens: each reads only the slot the step writes
        step = (ids, [0] * rows, [t[0] * BS for t in tables], tables)
        _, logits, best = native(*step, argmax_cols=V)
        ref = (logits.clone(), best)
        old = native.use_library(lib)
        try:
            _, logits, best = native(*step, argmax_cols=V)
        finally:
            assert native.use_library(old) is lib
        assert torch.equal(logits, ref[0]) and best == ref[1]
        assert lib.kvserve_phase_times(work, wait, threads) == 1
        timed = [k for k in range(n) if any(work[t * n + k] > 0 for t in range(threads))]
        rope = decode_step.PHASES.index("RoPE + KV store")
        assert timed == [k for k in range(n) if rows > 1 or k != rope]
        assert all(wait[i] >= 0 for i in range(threads * n))
