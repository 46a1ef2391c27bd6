"""`kvserve export`: a .gguf model written as a Hugging Face directory (kvserve/model/export.py)."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write a .gguf model as a Hugging Face directory (dequantized safetensors)")
    p.add_argument("gguf", help="a .gguf file or an alias (smollm2-135m)")
    p.add_argument("outdir", type=Path, help="the directory to write")
    p.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.llm import parse_dtype
    from kvserve.model.export import export_hf

    print(export_hf(args.gguf, args.outdir, parse_dtype(args.dtype)))
    return 0
