"""MXFP4 blocks (gpt-oss's experts) carried as Q5_0 blocks, value for value.

An MXFP4 block ("OCP Microscaling Formats (MX) v1.0", as ggml's block_mxfp4 stores it) is one e8m0
scale 2^(e - 127) and 32 e2m1 codes; doubled, the codes' values are the integers 0, ±1, ±2, ±3, ±4,
±6, ±8, ±12 at half the scale, 2^(e - 128). A Q5_0 block is d (q - 16) with q in 0..31 and d a
float16: q = 16 + value and d = 2^(e - 128) hold the same 32 numbers exactly wherever float16 holds
the power of two (2^-24 .. 2^15, e in 104..143). So the integer kernels multiply MXFP4 weights with
their Q5_0 code on every ISA level, at 22 bytes a block instead of 17 (not dequantized to float,
which is 128 bytes a block in float32). Smaller scales (values under 2^-21, far below a trained
weight's) round to multiples of 2^-24; larger ones, beyond float16, are refused.
"""
from __future__ import annotations

import numpy as np
import torch

# MXFP4's e2m1 values by 4-bit code, doubled (ggml's kvalues_mxfp4): halving the scale makes up for it
E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)
SMALLEST, LARGEST = -24, 15  # the powers of two float16 holds exactly (subnormals included)


def kept_nbytes(stored: int) -> int:
    """The bytes MXFP4 blocks of `stored` bytes take as Q5_0 blocks."""
    return stored // 17 * 22


class ScaleOutOfRange(ValueError):
    """An MXFP4 scale beyond what a float16 holds (or e8m0's NaN, 255)."""


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """Byte tables: an MXFP4 byte (codes lo, hi) → the Q5_0 byte of their q's low four bits; a scale byte
    e → d's two float16 bytes (those in range)."""
    q = (E2M1_DOUBLED.numpy() + 16).astype(np.uint8)  # by code; -0 is 0, so q 16
    byte = np.arange(256)
    nibbles = ((q[byte & 0xF] & 0xF) | ((q[byte >> 4] & 0xF) << 4)).astype(np.uint8)
    d = np.ldexp(np.float16(1), np.clip(np.arange(256) - 128, SMALLEST, LARGEST)).astype(np.float16)
    return nibbles, d.view(np.uint8).reshape(256, 2)


_NIBBLES, _D = _tables()


def as_q5_0(e: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks as e8m0 scale bytes [n] and their codes [n, 16] (value i in the low nibble of byte i,
    16 + i in the high one) → ggml's block_q5_0 bytes [n, 22]: d (float16), qh (bit i: the fifth bit
    of q_i), qs (q_i's low four bits in the low nibble of byte i, q_{16+i}'s in the high). Byte tables,
    so a gpt-oss-20b expert tensor takes a fraction of a second."""
    e_np, qs_np = e.numpy(), qs.numpy()
    if (e_np.astype(np.int32) - 128 > LARGEST).any():
        worst = int(e_np.max())
        raise ScaleOutOfRange(f"an MXFP4 scale byte {worst} (2^{worst - 127}) is beyond float16's range"
                              + (" (e8m0's NaN)" if worst == 255 else ""))
    out = np.empty((len(e_np), 22), np.uint8)
    out[:, :2] = _D[e_np]
    # q = 16 + value has its fifth bit where the value is >= 0: codes 0..8 (8 is -0)
    out[:, 2:4] = np.packbits((qs_np & 0xF) <= 8, axis=1, bitorder="little")  # values 0..15
    out[:, 4:6] = np.packbits(qs_np <= 0x8F, axis=1, bitorder="little")  # values 16..31: the high nibbles
    out[:, 6:] = _NIBBLES[qs_np]
    small = np.flatnonzero(e_np.astype(np.int32) - 128 < SMALLEST)
    if len(small):  # values under float16's smallest step: rounded to it
        out[small] = _rounded(e_np[small].astype(np.int32) - 128, qs_np[small])
    return torch.from_numpy(out)


def _rounded(power: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Blocks whose scale 2^power is under float16's smallest: values rounded to multiples of 2^SMALLEST."""
    codes = np.concatenate([qs & 0xF, qs >> 4], 1)
    values = E2M1_DOUBLED.numpy()[codes] * np.ldexp(1.0, power - SMALLEST)[:, None]
    q = (np.sign(values) * np.floor(np.abs(values) + 0.5) + 16).astype(np.uint8)  # (C's roundf: ggml's rounding)
    out = np.empty((len(power), 22), np.uint8)
    out[:, :2] = np.array([2.0 ** SMALLEST], np.float16).view(np.uint8)
    out[:, 2:6] = np.packbits(q >> 4, axis=1, bitorder="little")
    out[:, 6:] = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    return out


def gguf_as_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """ggml's block_mxfp4 bytes [n, 17] (e, then value i in the low nibble of byte i, 16 + i in the
    high one) → block_q5_0 bytes [n, 22]."""
    return as_q5_0(blocks[:, 0].contiguous(), blocks[:, 1:].contiguous())


def hf_as_q5_0(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's published MXFP4 [..., n, 16] bytes (value 2j in the low nibble of byte j, 2j + 1 in the
    high one) and e8m0 scales [..., n] → block_q5_0 bytes [..., 22 n]."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(-1, 32)  # value order
    qs = codes[:, :16] | (codes[:, 16:] << 4)  # as ggml stores them
    return as_q5_0(scales.reshape(-1).contiguous(), qs).reshape(*blocks.shape[:-2], -1)
