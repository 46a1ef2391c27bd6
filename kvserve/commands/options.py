"""Arguments that several commands share: which model, how its weights load, how it samples."""
from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or Hugging Face directory (default: smollm2-135m)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (auto: bfloat16 where the CPU computes it natively)")
    add_quantize_arg(p)


def add_quantize_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default="auto", choices=("auto", "none", "q8_0", "q4_0"),
                   help="weights: auto keeps a GGUF's quantized blocks (default), none decodes them to --dtype, "
                        "q8_0/q4_0 quantize a float checkpoint on load")
    p.add_argument("--activations", default="auto", choices=("auto", "int8x2", "int8"),  # model/quant.py's
                   help="quantized weights: how the integer kernels quantize activations. int8x2: int8, then what int8 "
                        "left: the exact float path's answers (KL ~2e-6); int8: one level as llama.cpp's, ~1.7-2x "
                        "faster in large batches and prompts, answers that can leave the exact path's where two tokens "
                        "are near a tie; auto (default): int8x2 under a billion parameters, int8 above "
                        "(docs/quality.md)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
