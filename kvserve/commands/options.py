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


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
