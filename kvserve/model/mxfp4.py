"""MXFP4 blocks (gpt-oss's experts) as the kernels keep them: ggml's block_mxfp4.

An MXFP4 block ("OCP Microscaling Formats (MX) v1.0") is one e8m0 scale 2^(e - 127) and 32 e2m1 codes;
doubled, the codes' values are the integers 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12 at half the scale. ggml stores
a block as 17 bytes, e and then value i in the low nibble of byte 1 + i, 16 + i in the high one, and the
kernels multiply those bytes as they are (kernels/quant_blocks.h), a GGUF's straight from the file.
OpenAI publishes gpt-oss's experts as `*_blocks` (value 2j in the low nibble of byte j, 2j + 1 in the
high one) and `*_scales` beside them: `hf_blocks` reorders those nibbles into ggml's blocks.
"""
from __future__ import annotations

import numpy as np
import torch

# MXFP4's e2m1 values by 4-bit code, doubled (ggml's kvalues_mxfp4): halving the scale makes up for it
E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def hf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's published MXFP4 [..., n, 16] bytes and e8m0 scales [..., n] → ggml's block_mxfp4 bytes
    [..., 17 n]."""
    b = blocks.numpy()
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], 32)  # value order
    out = np.empty((*b.shape[:-1], 17), np.uint8)
    out[..., 0] = scales.numpy()
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.from_numpy(out.reshape(*b.shape[:-2], -1))
