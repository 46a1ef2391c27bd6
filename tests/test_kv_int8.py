"""The int8 KV cache (model/kv_int8.py): the kernels against its torch reference, the native step
against the per-op path, the pool's size and a server that runs on it. (The default model's quality over
an int8 cache, against the exact path: tests/test_quality.py.)

`make test-isa` reruns this file with KVSERVE_ISA=avx2 and portable: the kernels' int8 store and
read at every ISA level.
"""
from __future__ import annotations

import httpx
import pytest
import torch
from kvserve.config import CacheConfig, ModelConfig
from kvserve.kernels import layer_ops, paged_attention
from kvserve.kv.kv_size import kv_size
from kvserve.kv.sizing import size_kv_pool
from kvserve.model import kv_int8
from kvserve.model.attention import AttentionMetadata, CpuPagedAttention, TorchAttention, store_kv
from kvserve.model.ops import LayerOps
from server_harness import MODEL_NAME, start_server

H, HKV, D, BS = 9, 3, 64, 16  # the default model's heads


def _pool(num_blocks: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 pool [2, Hkv, num_blocks, BS, D] of random rows and their float16 scales."""
    g = torch.Generator().manual_seed(seed)
    return kv_int8.quantize(torch.randn(2, HKV, num_blocks, BS, D, generator=g) * 3)


def test_quantize_keeps_each_row_within_half_a_step_and_a_zero_row_exact() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, D, generator=g) * torch.logspace(-3, 3, 50).unsqueeze(1)
    x[7] = 0
    q, s = kv_int8.quantize(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (50,)
    assert q.abs().max().item() == 127 and s[7].item() == 0 and not q[7].any()
    step = s.float().unsqueeze(1)
    assert ((kv_int8.dequantize(q, s, torch.float32) - x).abs() <= step / 2 + 1e-3 * step).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_into_an_int8_pool_writes_the_torch_references_bytes(dtype) -> None:
    T = 37
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(T, (H + 2 * HKV) * D, generator=g) * torch.rand(T, 1, generator=g) * 10).to(dtype)
    qkv[5] = 0  # a row of zeros: scale 0
    angles = torch.rand(T, D, generator=g) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(8 * BS, generator=g)[:T]
    pools = [torch.zeros(2, HKV, 8, BS, D, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(2, HKV, 8, BS, dtype=torch.float16) for _ in range(2)]
    ref = LayerOps(native=False).rope_and_store(qkv, cos, sin, pools[0], slots, H, kv_scale=scales[0])
    nat = LayerOps(native=True).rope_and_store(qkv, cos, sin, pools[1], slots, H, kv_scale=scales[1])
    for a, b in zip(nat, ref):
        assert torch.equal(a, b)
    assert torch.equal(pools[1], pools[0]) and torch.equal(scales[1], scales[0])
    assert pools[0].abs().max().item() == 127 and (scales[0].flatten() > 0).sum().item() == 2 * HKV * (T - 1)


def test_an_int8_pool_without_its_scales_is_refused() -> None:
    qkv, cs = torch.zeros(1, (H + 2 * HKV) * D), torch.zeros(1, D)
    pool = torch.zeros(2, HKV, 2, BS, D, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"an int8 KV pool \(2, 3, 2, 16, 64\) needs its float16 row scales "
                                         r"\(2, 3, 2, 16\), got None"):
        layer_ops.rope_store(qkv, cs, cs, pool, torch.zeros(1, dtype=torch.long), H)
    with pytest.raises(ValueError, match="needs its float16 row scales"):
        paged_attention.paged_decode(torch.zeros(1, H, D), pool, torch.zeros(1, 1, dtype=torch.int32),
                                     torch.ones(1, dtype=torch.int32), 0.125, kv_scale=torch.zeros(2, HKV, 2, BS))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [0, 21])
def test_paged_decode_over_an_int8_pool_is_exact_attention_over_its_dequantized_rows(dtype, tol, window) -> None:
    lens = [1, 16, 17, 70, 129]
    kv, scale = _pool(40)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(40, generator=g).tolist()
    tables, k = [], 0
    for n in lens:
        tables.append(perm[k : k + -(-n // BS)])
        k += len(tables[-1])
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    width = max(len(t) for t in tables)
    t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    got = paged_attention.paged_decode(q, kv, t, torch.tensor(lens, dtype=torch.int32), D**-0.5, window=window,
                                       kv_scale=scale)
    rows = kv_int8.dequantize(kv, scale, torch.float64)  # [2, Hkv, blocks, BS, D]
    for b, n in enumerate(lens):
        ctx = rows[:, :, tables[b]].reshape(2, HKV, -1, D)[:, :, :n][:, :, -window if window else 0 :]
        p = torch.softmax(ctx[0].repeat_interleave(H // HKV, 0) @ q[b].double().unsqueeze(-1) * D**-0.5, 1)
        want = (p.transpose(1, 2) @ ctx[1].repeat_interleave(H // HKV, 0)).squeeze(1)  # [H, D]
        assert ((got[b].double() - want).abs() <= tol * want.abs().clamp(min=1)).all()  # bf16: its rounding


def test_backends_agree_on_a_mixed_step_over_an_int8_pool() -> None:
    """Prefill chunks and decode tokens: the kernel backend equals the torch reference, which
    dequantizes the blocks it gathers (and, for a whole prompt, its own K/V as stored)."""
    lens, query_lens = [20, 1, 50, 33, 12], [1, 1, 10, 1, 12]  # 2 prefills its last 10 tokens, 4 all of its 12
    kv, scale = _pool(30, seed=2)
    tables = [[3, 7], [0], [12, 1, 9, 22], [5, 6, 11], [29]]
    g = torch.Generator().manual_seed(3)
    T = sum(query_lens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, HKV, HKV))
    slots = [t[p // BS] * BS + p % BS for t, n, L in zip(tables, query_lens, lens) for p in range(L - n, L)]
    store_kv(k, v, kv, torch.tensor(slots), scale)
    stored = kv_int8.dequantize(kv, scale, torch.float32).view(2, HKV, -1, D)[:, :, slots].transpose(1, 2)
    assert torch.equal(stored[0], kv_int8.round_trip(k)) and torch.equal(stored[1], kv_int8.round_trip(v))

    def run(backend):
        return backend.forward(q, k, v, kv, AttentionMetadata(torch.tensor(slots), query_lens, lens, tables, BS),
                               D**-0.5, kv_scale=scale)

    assert (run(TorchAttention()) - run(CpuPagedAttention())).abs().max().item() < 1e-5  # float32 sum order


# --- the pool's size -------------------------------------------------------------------------

DEFAULT = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)


def test_the_same_budget_holds_1_94x_the_blocks_of_float16() -> None:
    budget = 64 << 20
    f16 = size_kv_pool(DEFAULT, CacheConfig(memory_bytes=budget), torch.float16)
    i8 = size_kv_pool(DEFAULT, CacheConfig(memory_bytes=budget), torch.int8)
    # per token: 2 x 30 layers x 3 kv-heads x 64 dims x 2 bytes = 23040; int8: x (64 + 2) = 11880
    assert (f16.bytes_per_token, i8.bytes_per_token) == (23040, 11880)
    assert (f16.num_blocks, i8.num_blocks) == (182, 353) and i8.num_blocks >= 1.9 * f16.num_blocks
    assert i8.describe() == ("KV cache: 353 blocks x 16 tokens = 5648 tokens, 11.6 KiB/token "
                             "(2 x 30 layers x 3 kv-heads x (64 dims x 1 byte + 2 bytes of scale))")
    s = kv_size("smollm2-135m", dtype="int8", context=4096, memory=1 << 30, weight_dtype="bf16")
    assert (s.bytes_per_token, s.scale_bytes, s.cache_bytes) == (11880, 2, 11880 * 4096)


# --- the default model over an int8 cache ------------------------------------------------------


def _default_llm(kv_dtype: str):
    from kvserve import LLM

    return LLM(cache=CacheConfig(num_blocks=64, dtype=kv_dtype))


@pytest.fixture(scope="module")
def i8():
    return _default_llm("int8")


def test_native_step_equals_the_per_op_path_over_an_int8_pool(i8) -> None:
    from family_checks import decode_both
    from test_native_decode import _prompts

    saved = i8.runner.native
    try:
        decode_both(i8.runner, _prompts(3, seed=7), steps=3)
    finally:
        i8.runner.native = saved


# --- a server -------------------------------------------------------------------------------


@pytest.mark.slow  # a whole server: make test runs it; make test-isa's per-level kernel runs need not
def test_a_server_on_an_int8_cache_answers_and_reports_it(tmp_path_factory) -> None:
    server = start_server(tmp_path_factory, "--kv-cache-dtype", "int8")
    try:
        body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        # the tiny model: 2 x 2 layers x 2 kv-heads x (16 dims + 2 bytes of scale) = 144 bytes per
        # token, 2304 per block: 0.05 GiB holds 23301 blocks (float16: 13107)
        assert 'cache_dtype="int8"' in metrics and 'num_gpu_blocks="23301"' in metrics
    finally:
        server.stop()
