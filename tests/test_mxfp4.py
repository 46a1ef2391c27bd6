"""model/mxfp4.py: MXFP4 blocks carried as Q5_0 blocks hold the same values, checked against gguf's own
decoders of both types; scales beyond float16 are refused, and a GGUF with one keeps that tensor in float."""
from __future__ import annotations

import copy
import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gpt_oss_models import make_gpt_oss, write_gpt_oss_gguf

from kvserve.kv.kv_size import stored_weights
from kvserve.model import mxfp4
from kvserve.model.loader import load_checkpoint
from kvserve.model.quant import QuantizedWeight


def _random_blocks(n: int, scales: range) -> np.ndarray:
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, (n, 17), dtype=np.uint8)
    b[:, 0] = rng.integers(scales.start, scales.stop, n)
    return b


def test_q5_0_blocks_hold_the_mxfp4_values_wherever_float16_holds_the_scale() -> None:
    b = _random_blocks(8192, range(104, 144))  # 2^-24 .. 2^15 at the doubled codes' scale
    want = gguf.quants.dequantize(b, Q.MXFP4)
    got = gguf.quants.dequantize(mxfp4.gguf_as_q5_0(torch.from_numpy(b)).numpy(), Q.Q5_0)
    assert np.array_equal(got, want)


def test_smaller_scales_round_to_float16s_smallest_step() -> None:
    b = _random_blocks(4096, range(0, 104))
    want = gguf.quants.dequantize(b, Q.MXFP4)
    got = gguf.quants.dequantize(mxfp4.gguf_as_q5_0(torch.from_numpy(b)).numpy(), Q.Q5_0)
    assert np.abs(got - want).max() <= 2.0 ** -25
    assert not np.array_equal(got, want)


@pytest.mark.parametrize("e", [144, 255])
def test_scales_beyond_float16_are_refused(e: int) -> None:
    b = _random_blocks(16, range(120, 130))
    b[3, 0] = e
    with pytest.raises(mxfp4.ScaleOutOfRange, match=f"scale byte {e}"):
        mxfp4.gguf_as_q5_0(torch.from_numpy(b))


def test_a_gguf_keeps_a_tensor_with_such_a_scale_in_float_and_says_so(tmp_path, caplog) -> None:
    hf, _ = make_gpt_oss(tmp_path / "hf", seed=1)
    big = copy.deepcopy(hf)
    with torch.no_grad():
        big.model.layers[1].mlp.experts.down_proj.mul_(2.0 ** 40)  # its MXFP4 scales past float16's
    path = write_gpt_oss_gguf(tmp_path / "big.gguf", big)
    with caplog.at_level(logging.WARNING, logger="kvserve.model"):
        tensors = load_checkpoint(path, quantization="auto").tensors
    assert "blk.1.ffn_down_exps.weight" in caplog.text and "beyond float16's range" in caplog.text
    assert isinstance(tensors["model.layers.1.mlp.experts.0.down_proj.weight"], torch.Tensor)
    assert isinstance(tensors["model.layers.0.mlp.experts.0.down_proj.weight"], QuantizedWeight)


def test_kv_size_counts_the_experts_as_kept(tmp_path) -> None:
    """`kvserve kv-size` counts an MXFP4 file's weights as the loader keeps them (Q5_0 experts, float rest),
    the benchmarks as the file stores them."""
    hf, _ = make_gpt_oss(tmp_path / "hf", seed=1)
    path = write_gpt_oss_gguf(tmp_path / "m.gguf", hf)
    kept = load_checkpoint(path, quantization="auto").tensors
    stored = stored_weights(path)
    assert stored.nbytes == sum(w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * 4 for w in kept.values())
    assert stored.types == "F32 + MXFP4 (as Q5_0)"
    as_stored = stored_weights(path, as_kept=False)  # (the benchmarks' roofline: the least any server reads)
    assert as_stored.nbytes == sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors) < stored.nbytes
    assert as_stored.types == "F32 + MXFP4"
