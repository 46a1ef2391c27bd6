"""`kvserve kv-size`: KV cache bytes per token, at a context, and in a memory budget, from a
model's architecture alone (the figures are kvserve/kv/kv_size.py's)."""
from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("kv-size", help="KV cache bytes per token, at a context, and in a memory budget (no weights loaded)")
    p.add_argument("model", help="a preset (llama-2-7b, llama-3-8b, ...), a config.json or its directory, or a .gguf file")
    p.add_argument("--context", type=int, default=None, help="tokens of context (default: the model's)")
    p.add_argument("--dtype", "--kv-cache-dtype", dest="dtype", default="float16",
                   help="KV cache element type: float32, bfloat16, float16, fp8, int8 (kvserve's: 1 byte per value and "
                        "a 2-byte scale per K/V row) (default: float16)")
    p.add_argument("--weight-dtype", default=None, help="weights' element type, int8 and int4 included (default: --dtype)")
    p.add_argument("--memory", default=None, help="memory for weights + cache, e.g. 16GiB (default: this machine's available RAM)")
    p.add_argument("--kv-disk-gib", type=float, default=None,
                   help="also show how many tokens a disk tier of this size holds (kvserve serve --kv-disk-gib)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block, for the disk tier (default: 16)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="memory read GB/s for the bytes roofline (default: measured now, a 256 MiB read)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.kv.kv_size import format_report, kv_size, read_bandwidth

    disk = int(args.kv_disk_gib * (1 << 30)) if args.kv_disk_gib is not None else None
    bandwidth = args.bandwidth * 1e9 if args.bandwidth is not None else read_bandwidth()
    s = kv_size(args.model, context=args.context, dtype=args.dtype, memory=args.memory, weight_dtype=args.weight_dtype,
                disk=disk, block_size=args.block_size, bandwidth=bandwidth)
    print(json.dumps(s.to_json(), indent=2) if args.json else format_report(s))
    return 0
