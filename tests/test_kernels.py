"""kvserve's native CPU kernels and packed linear layers against plain torch."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve import cpu, kernels
from kvserve.kernels import layer_ops, paged_attention
from kvserve.model.attention import AttentionMetadata, CpuPagedAttention, TorchAttention, default_backend, store_kv
from kvserve.model.linear import Linear, bf16_packing_available
from kvserve.model.ops import LayerOps, rms_norm


def test_the_kernel_builds_where_a_compiler_exists() -> None:
    assert shutil.which("cc") or shutil.which("gcc"), "this suite expects a C compiler (CI installs gcc)"
    assert paged_attention.available()
    assert isinstance(default_backend(), CpuPagedAttention)


def random_case(B, H, Hkv, D, bs, lens, dtype, seed=0):
    """A pool with random contents and each sequence's blocks scattered through it."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-n // bs) for n in lens)
    num_blocks = need + 5
    kv = torch.randn(2, Hkv, num_blocks, bs, D, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, k = [], 0
    for n in lens:
        tables.append(perm[k : k + -(-n // bs)])
        k += len(tables[-1])
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return q, kv, tables


def exact(q, kv, tables, lens, bs, scale, window=0, sinks=None):
    """float64 attention of each query over its own context (its last `window` keys, if given); sinks [H]:
    each head's sink logit in its softmax, its share dropped (gpt-oss)."""
    B, H, D = q.shape
    Hkv = kv.shape[1]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        ctx = kv[:, :, tables[b]].reshape(2, Hkv, -1, D)[:, :, : lens[b]].double()  # [2, Hkv, L, D]
        if window:
            ctx = ctx[:, :, -window:]
        k = ctx[0].repeat_interleave(H // Hkv, 0)
        v = ctx[1].repeat_interleave(H // Hkv, 0)
        scores = (k @ q[b].double().unsqueeze(-1)).squeeze(-1) * scale  # [H, L]
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().unsqueeze(1)], 1)
        p = torch.softmax(scores, -1)[:, : ctx.shape[2]]
        out[b] = (p.unsqueeze(1) @ v).squeeze(1)
    return out


def as_tensors(tables, lens):
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32), torch.tensor(lens)


# (activations, pool, tolerance): a float16 pool under float32 activations is read exactly (every
# half value is a float32), so it meets float32's tolerance; bfloat16 rounds q and the output.
PAIRS = [(torch.float32, torch.float32, 2e-6), (torch.bfloat16, torch.bfloat16, 8e-3),
         (torch.float32, torch.float16, 2e-6), (torch.float32, torch.bfloat16, 2e-6)]


@pytest.mark.parametrize("dtype,kv_dtype,tol", PAIRS)
@pytest.mark.parametrize(
    "H,Hkv,D,bs",
    [(9, 3, 64, 16), (4, 4, 32, 16), (8, 1, 128, 8), (6, 2, 24, 4), (16, 4, 256, 16)],
)
def test_paged_decode_matches_exact_attention(H, Hkv, D, bs, dtype, kv_dtype, tol) -> None:
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 70]
    q, kv, tables = random_case(len(lens), H, Hkv, D, bs, lens, dtype)
    kv = kv.to(kv_dtype)
    bt, sl = as_tensors(tables, lens)
    out = paged_attention.paged_decode(q, kv, bt, sl, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.double() - exact(q, kv, tables, lens, bs, D**-0.5)).abs().max().item() < tol


def test_paged_decode_never_reads_past_a_context() -> None:
    """Slots after a sequence's last token (stale or never written) do not reach its output."""
    lens = [5, 17, 33]
    q, kv, tables = random_case(3, 9, 3, 64, 16, lens, torch.float32)
    ref = paged_attention.paged_decode(q, kv, *as_tensors(tables, lens), 0.125)
    poisoned = kv.clone()
    used = torch.zeros(kv.shape[2] * 16, dtype=torch.bool)
    for t, n in zip(tables, lens):
        for i in range(n):
            used[t[i // 16] * 16 + i % 16] = True
    poisoned.view(2, 3, -1, 64)[:, :, ~used] = float("nan")
    out = paged_attention.paged_decode(q, poisoned, *as_tensors(tables, lens), 0.125)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype,kv_dtype,tol", PAIRS)
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_paged_decode_sliding_window_matches_exact_attention(window, dtype, kv_dtype, tol) -> None:
    """Each query sees its last `window` keys only (transformers: key > query - window); contexts
    shorter than the window see all of theirs."""
    bs, lens = 16, [1, 4, 16, 17, 37, 38, 70, 100]
    q, kv, tables = random_case(len(lens), 9, 3, 64, bs, lens, dtype)
    kv = kv.to(kv_dtype)
    out = paged_attention.paged_decode(q, kv, *as_tensors(tables, lens), 0.125, window=window)
    assert (out.double() - exact(q, kv, tables, lens, bs, 0.125, window)).abs().max().item() < tol
    full = paged_attention.paged_decode(q, kv, *as_tensors(tables, lens), 0.125)
    assert not torch.equal(out[6], full[6])  # the window changes a long context's output


@pytest.mark.parametrize("window", [0, 5])
def test_paged_decode_with_sinks_matches_exact_attention(window) -> None:
    """gpt-oss's sinks: each head's logit joins its softmax and takes no value; sinks of -inf change no bit."""
    bs, lens, H = 16, [1, 4, 17, 38, 70], 8
    q, kv, tables = random_case(len(lens), H, 2, 64, bs, lens, torch.float32)
    sinks = 2.0 * torch.randn(H, generator=torch.Generator().manual_seed(1))
    out = paged_attention.paged_decode(q, kv, *as_tensors(tables, lens), 0.125, window=window, sinks=sinks)
    assert (out.double() - exact(q, kv, tables, lens, bs, 0.125, window, sinks)).abs().max().item() < 2e-6
    plain = paged_attention.paged_decode(q, kv, *as_tensors(tables, lens), 0.125, window=window)
    assert (out - plain).abs().max().item() > 1e-2
    none = torch.full((H,), float("-inf"))
    assert torch.equal(paged_attention.paged_decode(q, kv, *as_tensors(tables, lens), 0.125, window=window, sinks=none),
                       plain)


def slid_out(tables, lens, bs, window, pool, poison=float("nan")):
    """The tables with blocks wholly before each window as -1 (freed), and the pool with every
    slot outside the windows poisoned: what a sliding-window step may find there. The torch
    reference multiplies masked rows by 0, so it takes a finite poison (the runner zeroes each
    block on its first write: stale slots are finite); the kernel never reads them, NaN or not."""
    holes = [[-1 if (j + 1) * bs <= max(0, n - window) else b for j, b in enumerate(t)] for t, n in zip(tables, lens)]
    poisoned = pool.clone()
    seen = torch.zeros(pool.shape[2] * bs, dtype=torch.bool)
    for t, n in zip(tables, lens):
        for i in range(max(0, n - window), n):
            seen[t[i // bs] * bs + i % bs] = True
    poisoned.view(2, pool.shape[1], -1, pool.shape[-1])[:, :, ~seen] = poison
    return holes, poisoned


@pytest.mark.parametrize("backend,poison", [(TorchAttention, 1e4), (CpuPagedAttention, float("nan"))])
def test_sliding_window_decode_reads_nothing_before_the_window(backend, poison) -> None:
    """Freed blocks (-1 in the table) and stale slots before the window never reach the output."""
    bs, window, lens = 16, 20, [5, 20, 21, 36, 37, 70, 100]
    q, kv, tables = random_case(len(lens), 9, 3, 64, bs, lens, torch.float32)
    holes, poisoned = slid_out(tables, lens, bs, window, kv, poison)
    assert any(-1 in t for t in holes)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), [1] * len(lens), lens, holes, bs)
    out = backend().forward(q, poisoned, None, poisoned, meta, 0.125, window)
    assert (out.double() - exact(q, kv, tables, lens, bs, 0.125, window)).abs().max().item() < 2e-6


def test_sliding_window_prefill_chunks_match_exact_attention() -> None:
    """Prefill chunks (whole prompts and later chunks) under a window, torch reference and kernel
    backend, with the blocks before each chunk's first window freed and poisoned."""
    H, Hkv, D, bs, window = 9, 3, 64, 8, 11
    lens, query_lens = [30, 9, 50, 40, 25], [30, 9, 12, 1, 7]  # whole prompts, a chunk, a decode, a chunk
    _, kv, tables = random_case(len(lens), H, Hkv, D, bs, lens, torch.float32)
    g = torch.Generator().manual_seed(5)
    T = sum(query_lens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, Hkv, Hkv))
    slots = [t[p // bs] * bs + p % bs for t, n, L in zip(tables, query_lens, lens) for p in range(L - n, L)]
    store_kv(k, v, kv, torch.tensor(slots))
    firsts = [L - n for n, L in zip(query_lens, lens)]  # each chunk's first query's window starts there
    holes, poisoned = slid_out(tables, firsts, bs, window - 1, kv, 1e4)  # keys from first - window + 1 on
    store_kv(k, v, poisoned, torch.tensor(slots))  # slid_out poisoned the chunks' own slots: restore them
    want = torch.empty(T, H, D, dtype=torch.float64)
    row = 0
    for t, n, L in zip(tables, query_lens, lens):
        for j in range(n):
            pos = L - n + j
            want[row] = exact(q[row : row + 1], kv, [t], [pos + 1], bs, 0.125, window)[0]
            row += 1
    for backend in (TorchAttention(), CpuPagedAttention()):
        meta = AttentionMetadata(torch.tensor(slots), query_lens, lens, holes, bs)
        out = backend.forward(q, k, v, poisoned, meta, 0.125, window)
        assert (out.double() - want).abs().max().item() < 2e-6


def test_paged_decode_is_batch_invariant() -> None:
    """A sequence's output is bit-identical alone and inside any batch."""
    lens = [40, 7, 129, 16, 1]
    q, kv, tables = random_case(5, 9, 3, 64, 16, lens, torch.bfloat16)
    together = paged_attention.paged_decode(q, kv, *as_tensors(tables, lens), 0.125)
    for b in range(5):
        alone = paged_attention.paged_decode(q[b : b + 1], kv, *as_tensors([tables[b]], [lens[b]]), 0.125)
        assert torch.equal(alone[0], together[b])


@pytest.mark.skipif(cpu.isa() != "avx512", reason="the 512-bit attention passes are built at the avx512 level only")
def test_the_512_bit_attention_passes_give_the_256_bit_passes_bits(monkeypatch) -> None:
    """paged_attention.c's AVX-512 passes run its AVX2 passes' operations lane for lane (two keys' partial sums to a
    vector, added up in the same pairs): the same bits at either level, for every pool format the vector passes
    take, head sizes of 32 to 256 (96: a 64-value and a 32-value pass) and GQA groups of 1 to 8 heads, every
    tail of keys past a multiple of 4, under a window, sinks and a soft cap."""
    wide = paged_attention._lib()
    monkeypatch.setenv("KVSERVE_ISA", "avx2")
    narrow = ctypes.CDLL(str(kernels._compile("paged_attention")))
    narrow.kvserve_paged_decode.argtypes = paged_attention._SIGNATURES["kvserve_paged_decode"]
    g = torch.Generator().manual_seed(3)
    lens = [1, 2, 3, 4, 5, 7, 16, 33, 130, 301]
    for H, Hkv, D in [(32, 8, 64), (9, 3, 64), (8, 4, 256), (24, 8, 96), (16, 8, 128), (8, 8, 32), (16, 2, 64)]:
        for dtype, kv_dtype in [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
                                (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.int8)]:
            q, kv, tables = random_case(len(lens), H, Hkv, D, 16, lens, torch.float32, seed=H + D)
            scales = None
            if kv_dtype == torch.int8:
                kv = torch.randint(-127, 128, kv.shape, dtype=torch.int8, generator=g)
                scales = (torch.rand(kv.shape[:-1], generator=g) * 0.05).half()
            kv, q = kv.to(kv_dtype), q.to(dtype)
            variants = [{}] if (H, D) != (32, 64) else [{}, {"window": 20}, {"sinks": torch.randn(H, generator=g)},
                                                        {"softcap": 5.0}]
            for extra in variants:
                outs = []
                for lib in (wide, narrow):
                    monkeypatch.setattr(paged_attention, "_bound", [lib])
                    outs.append(paged_attention.paged_decode(q, kv, *as_tensors(tables, lens), D**-0.5, kv_scale=scales,
                                                             **extra))
                assert torch.equal(outs[0], outs[1]), (H, Hkv, D, dtype, kv_dtype, extra)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.float16)])
def test_backends_agree_on_a_mixed_step(dtype, kv_dtype) -> None:
    """A step of prefill chunks and decode tokens: the kernel backend equals the torch reference."""
    H, Hkv, D, bs = 9, 3, 64, 16
    lens = [20, 1, 50, 33]
    query_lens = [1, 1, 10, 1]  # sequence 2 prefills its last 10 tokens
    _, kv, tables = random_case(4, H, Hkv, D, bs, lens, kv_dtype)
    g = torch.Generator().manual_seed(3)
    T = sum(query_lens)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype)
    slots = []
    for t, n, L in zip(tables, query_lens, lens):
        slots += [t[p // bs] * bs + p % bs for p in range(L - n, L)]

    pool = kv.clone()
    store_kv(k, v, pool, torch.tensor(slots))

    def run(backend):
        meta = AttentionMetadata(torch.tensor(slots), query_lens, lens, tables, bs)
        return backend.forward(q, k, v, pool, meta, D**-0.5)

    a, b = run(TorchAttention()), run(CpuPagedAttention())
    assert (a.float() - b.float()).abs().max().item() < (2e-6 if dtype == torch.float32 else 2e-2)


def test_unsupported_inputs_fall_back_to_torch() -> None:
    lens = [3, 20]
    q, kv, tables = random_case(2, 4, 2, 16, 16, lens, torch.float16)
    assert not paged_attention.supports(q, kv)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), [1, 1], lens, tables, 16)
    out = CpuPagedAttention()._decode(q, kv, meta, [0, 1], 0.25)
    ref = TorchAttention()._decode(q, kv, meta, [0, 1], 0.25)
    assert torch.equal(out, ref)


def _backend_in_subprocess(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "from kvserve.model.attention import default_backend; print(type(default_backend()).__name__)"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_native_kernels_can_be_turned_off() -> None:
    r = _backend_in_subprocess({"KVSERVE_NATIVE": "0"})
    assert r.returncode == 0 and r.stdout.strip() == "TorchAttention"


def test_a_failing_compiler_means_the_torch_path_and_one_warning(tmp_path) -> None:
    r = _backend_in_subprocess({"CC": "/bin/false", "KVSERVE_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0 and r.stdout.strip() == "TorchAttention"
    assert "native kernel paged_attention unavailable, using the torch path" in r.stderr
    assert list(tmp_path.rglob("*.so")) == [] and list(tmp_path.rglob("*")) in ([], [tmp_path / "kernels"])


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_is_packed_or_widened_in_registers(rows, bias) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(320, 96, generator=g).bfloat16()
    b = torch.randn(320, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 96, generator=g).bfloat16()
    lin = Linear(w, b)
    # Packed where this CPU computes bfloat16 natively; elsewhere the bfloat16 weight stays and
    # kernels/quant_matmul.c widens it in registers (float32 sums, then one rounding to bfloat16).
    if bf16_packing_available():
        assert lin.packed is not None and lin.weight is None
        assert torch.equal(lin(x), F.linear(x, w, b))
    else:
        assert lin.packed is None and lin.weight is w and lin.weight.dtype == torch.bfloat16
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        # float32 sums of 96 products, then bfloat16 rounding of the output (2^-8 relative)
        assert torch.allclose(lin(x).double(), exact, rtol=2**-8, atol=1e-3)


def test_float32_linear_stays_on_f_linear() -> None:
    w = torch.randn(32, 16)
    lin = Linear(w)
    assert lin.packed is None
    x = torch.randn(3, 16)
    assert torch.equal(lin(x), F.linear(x, w))


def test_layer_ops_build_here() -> None:
    assert layer_ops.available()


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal up to the summation order of RMSNorm: 1e-6 relative in float32,
    a rare one-unit rounding flip in bfloat16."""
    if dtype == torch.float32:
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    differ = (a != b).float().mean().item()
    return differ < 0.01 and torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 700])
def test_fused_add_rms_norm_matches_torch(dtype, rows) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    d = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    x_ref, h_ref = LayerOps(native=False).add_rms_norm(x.clone(), d, w, 1e-5)
    x_nat, h_nat = LayerOps(native=True).add_rms_norm(x.clone(), d, w, 1e-5)
    assert torch.equal(x_nat, x_ref)  # the residual add rounds exactly as torch does
    assert _close(h_nat, h_ref, dtype)
    _, h0 = LayerOps(native=True).add_rms_norm(x.clone(), None, w, 1e-5)
    assert _close(h0, rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.float16)])
def test_fused_rope_and_store_is_bit_identical_to_torch(dtype, kv_dtype) -> None:
    H, Hkv, D, bs, T = 9, 3, 64, 16, 37
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    angles = torch.rand(T, D, generator=g) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(8 * bs, generator=g)[:T]
    pools = [torch.zeros(2, Hkv, 8, bs, D, dtype=kv_dtype) for _ in range(2)]
    ref = LayerOps(native=False).rope_and_store(qkv, cos, sin, pools[0], slots, H)
    nat = LayerOps(native=True).rope_and_store(qkv, cos, sin, pools[1], slots, H)
    for a, b in zip(nat, ref):
        assert torch.equal(a, b)
    assert torch.equal(pools[1], pools[0]) and pools[0].abs().sum() > 0


def test_a_float16_pool_stores_values_as_torch_rounds_them() -> None:
    """float32 -> float16 in the kernel (F16C or the portable integer version): round to nearest
    even, overflow to infinity, subnormals, signed zeros and NaN, each as torch converts it."""
    H, Hkv, D = 1, 1, 64
    tiny, big = 2.0**-24, 65504.0
    edge = [0.0, -0.0, 1.0, -1.0, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-11 + 2**-20, tiny, tiny / 2, tiny * 0.75,
            tiny * 1.5, 2**-14, 2**-14 * (1 - 2**-11), 6.1e-5, -6.1e-5, big, 65519.0, 65520.0, -65520.0, 1e6,
            float("inf"), float("-inf"), float("nan"), 3.14159, -2.71828, 1e-3, 333.333, -0.1]
    g = torch.Generator().manual_seed(1)
    values = torch.cat([torch.tensor(edge), torch.randn(8 * D - len(edge), generator=g) * 100]).view(8, D)
    qkv = torch.zeros(8, (H + 2 * Hkv) * D)
    qkv[:, (H + Hkv) * D :] = values  # v is stored as it comes (k goes through the rotation)
    ones, zeros = torch.ones(8, D), torch.zeros(8, D)
    pool = torch.zeros(2, Hkv, 1, 8, D, dtype=torch.float16)
    layer_ops.rope_store(qkv, ones, zeros, pool, torch.arange(8), H)
    got, want = pool[1, 0, 0], values.to(torch.float16)
    assert torch.equal(got.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
    assert got.isnan().equal(want.isnan())


def test_paged_decode_refuses_tables_that_point_outside_the_pool() -> None:
    q, kv, tables = random_case(2, 9, 3, 64, 16, [20, 5], torch.float32)
    bt, sl = as_tensors(tables, [20, 5])
    for bad_tables, bad_lens in (
        (bt, torch.tensor([20, 0])),  # an empty context
        (bt, torch.tensor([20, 33])),  # longer than its table
        (torch.where(bt == bt[0, 1], kv.shape[2], bt), sl),  # a block id past the pool
        (torch.where(bt == bt[1, 0], -1, bt), sl),
    ):
        with pytest.raises(RuntimeError, match=r"paged decode kernel failed \(code -3\)"):
            paged_attention.paged_decode(q, kv, bad_tables, bad_lens, 0.125)
    # Under a window only the blocks it reads are checked: a freed block before it is fine, one inside is not.
    freed = bt.clone()
    freed[0, 0] = -1
    paged_attention.paged_decode(q, kv, freed, sl, 0.125, window=4)  # sequence 0 reads positions 16 .. 19
    with pytest.raises(RuntimeError, match=r"code -3"):
        paged_attention.paged_decode(q, kv, freed, sl, 0.125, window=5)  # ... and 15, in block 0


def test_rope_store_refuses_slots_outside_the_pool_and_writes_nothing() -> None:
    qkv = torch.randn(2, 15 * 64)
    cs = torch.ones(2, 64)
    pool = torch.zeros(2, 3, 4, 16, 64)
    with pytest.raises(RuntimeError, match="KV slots outside the pool of 64 slots: 3..64"):
        layer_ops.rope_store(qkv, cs, cs, pool, torch.tensor([3, 64]), 9)
    assert pool.abs().sum() == 0


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_the_glu_kernels_match_torch(act) -> None:
    """SiLU * up and tanh-GELU * up (Gemma's GeGLU) as the native step computes them, over gates from
    -30 to 30 (a sigmoid's both tails) and ordinary ones: within float32 rounding of torch's (where
    torch's tanh saturates to an exact 0, the kernel's x * sigmoid(2u) keeps a value below 1e-6)."""
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.linspace(-30, 30, 960).reshape(3, 320), 3 * torch.randn(5, 320, generator=g)])
    gu = torch.cat([gate, torch.randn(8, 320, generator=g)], dim=1)
    want = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * gu[:, 320:]
    got = getattr(layer_ops, f"{act}_mul")(gu.clone())
    assert torch.allclose(got, want, rtol=2e-6, atol=1e-6), (got - want).abs().max()
