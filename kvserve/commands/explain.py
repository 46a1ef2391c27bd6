"""`kvserve explain`: one prompt through the real pipeline, each stage shown with measured
numbers (the measuring and the text are kvserve/explain.py's)."""
from __future__ import annotations

import argparse

from kvserve.commands.options import add_model_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("explain", help="run one prompt and show each stage (tokens, prefill, decode, KV cache) with measured numbers")
    add_model_args(p)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--kv-disk-path", default=None, metavar="DIR",
                   help="a KV disk tier: the prompt's blocks are saved there at the end and read back by the next run")
    p.add_argument("--kv-disk-gib", type=float, default=4.0, help="the disk tier's bound (default: 4)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.config import CacheConfig
    from kvserve.explain import explain, format_explanation
    from kvserve.llm import LLM

    if args.max_tokens < 1:  # said before the model loads
        raise ValueError(f"max_tokens must be at least 1, got {args.max_tokens}")
    cache = CacheConfig()
    if args.kv_disk_path is not None:
        cache = CacheConfig(disk_path=args.kv_disk_path, disk_bytes=int(args.kv_disk_gib * (1 << 30)))
    llm = LLM(args.model, args.dtype, quantization=args.quantize, activations=args.activations, cache=cache)
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.encode_chat([{"role": "user", "content": args.prompt}])
    print(format_explanation(explain(llm, prompt, args.max_tokens)))
    if args.kv_disk_path is not None:  # the prompt's blocks stay for the next run
        llm.offload_prefix_cache()
    return 0
