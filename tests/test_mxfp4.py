"""model/mxfp4.py and the MXFP4 kernels: gpt-oss's published blocks become ggml's block_mxfp4 with the
same values, checked against gguf's own decoder; the kernels' dequantization is exact at every scale byte
(the kernels' matmul at each ISA level: test_quant.py's check_kernels); kv-size counts the file's bytes."""
from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gpt_oss_models import make_gpt_oss, write_gpt_oss_gguf

from kvserve.kernels import quant_matmul
from kvserve.kv.kv_size import stored_weights
from kvserve.model import mxfp4
from kvserve.model.loader import load_checkpoint
from kvserve.model.quant import QuantizedWeight


def test_published_blocks_become_ggml_blocks_of_the_same_values() -> None:
    """OpenAI's layout (value 2j in the low nibble of byte j) against transformers' decoding of it."""
    rng = np.random.default_rng(0)
    blocks = torch.from_numpy(rng.integers(0, 256, (3, 5, 16), dtype=np.uint8))  # [rows, blocks, 16]
    scales = torch.from_numpy(rng.integers(110, 140, (3, 5), dtype=np.uint8))
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # value order
    want = torch.ldexp(mxfp4.E2M1_DOUBLED[codes] / 2, scales.to(torch.int32).unsqueeze(-1) - 127).reshape(3, -1)
    ours = mxfp4.hf_blocks(blocks, scales)
    assert ours.shape == (3, 5 * 17)
    got = gguf.quants.dequantize(ours.numpy(), Q.MXFP4)
    assert np.array_equal(got, want.numpy())


def test_the_kernels_decode_every_scale_byte_exactly() -> None:
    """All 256 scale bytes (the subnormal half scales of bytes 0 and 1, and 255's 2^127 included) and every
    code, stored and in the x8 layout, against gguf's decoder (ggml's e8m0_to_fp32_half)."""
    if not quant_matmul.available():
        return
    rng = np.random.default_rng(1)
    rows, cols = 16, 32 * 20  # 20 blocks a row: two x8 groups, two tail pairs
    b = rng.integers(0, 256, (rows * 20, 17), dtype=np.uint8)
    b[:256, 0] = np.arange(256)
    blocks = b.reshape(rows, -1)
    with np.errstate(over="ignore"):  # 255's 2^127 times 12 is inf in float32, in gguf's decoder as in ours
        want = torch.from_numpy(gguf.quants.dequantize(blocks, Q.MXFP4))
    stored = torch.from_numpy(blocks).reshape(-1)
    x8 = quant_matmul.pack_x8(stored, int(Q.MXFP4), rows, cols)
    assert torch.equal(quant_matmul.dequantize_rows(stored, int(Q.MXFP4), rows, cols), want)
    assert torch.equal(quant_matmul.dequantize_rows(x8, quant_matmul.X8 + int(Q.MXFP4), rows, cols), want)


def test_kv_size_counts_the_files_bytes(tmp_path) -> None:
    """`kvserve kv-size` counts an MXFP4 file's weights as the loader keeps them: MXFP4 experts as stored,
    the float rest as float32. A token reads its chosen experts and, beside gpt-oss's own LM head, one row of
    the embedding table."""
    hf, _ = make_gpt_oss(tmp_path / "hf", seed=1)
    path = write_gpt_oss_gguf(tmp_path / "m.gguf", hf)
    kept = load_checkpoint(path, quantization="auto").tensors
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    stored = stored_weights(path, experts=4, chosen=2)
    assert stored.nbytes == sum(w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * 4 for w in kept.values())
    assert stored.nbytes == sum(int(t.n_bytes) for t in tensors.values())
    assert stored.types == "F32 + MXFP4"
    experts = sum(int(t.n_bytes) for name, t in tensors.items() if "_exps." in name)
    embedding = tensors["token_embd.weight"]
    assert "output.weight" in tensors and stored.active_bytes == (
        stored.nbytes - experts // 2 - int(embedding.n_bytes) + int(embedding.n_bytes) // int(embedding.shape[-1]))
