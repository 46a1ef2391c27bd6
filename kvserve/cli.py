"""The kvserve command: chat, generate, serve, route, up, kv-size, explain, export, bench serve."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvserve import __version__
from kvserve.errors import KVServeError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or Hugging Face directory (default: smollm2-135m)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (auto: bfloat16 where the CPU computes it natively)")
    add_quantize_arg(p)


def add_quantize_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default="auto", choices=("auto", "none", "q8_0", "q4_0"),
                   help="weights: auto keeps a GGUF's quantized blocks (default), none decodes them to --dtype, "
                        "q8_0/q4_0 quantize a float checkpoint on load")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: an LLM inference server you can read")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="chat in the terminal, streaming tokens as they are decoded")
    _add_model_args(chat)
    chat.set_defaults(model=None)  # with --url: the server's model unless one is named
    _add_sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="a system message")
    chat.add_argument("--url", default=None, help="chat with a running kvserve server instead of loading the model")
    chat.add_argument("--api-key", default=None, help="the server's API key (with --url)")

    gen = sub.add_parser("generate", help="complete one prompt, or a JSONL file of prompts")
    _add_model_args(gen)
    _add_sampling_args(gen, max_tokens=128)
    gen.add_argument("prompt", nargs="?", help="the prompt (omit with --input)")
    gen.add_argument("--input", type=Path, help='JSONL: one {"prompt": ...} or {"messages": [...]} per line, optional sampling fields')
    gen.add_argument("--output", type=Path, help="JSONL results (default: standard output)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")

    kv = sub.add_parser("kv-size", help="KV cache bytes per token, at a context, and in a memory budget (no weights loaded)")
    kv.add_argument("model", help="a preset (llama-2-7b, llama-3-8b, ...), a config.json or its directory, or a .gguf file")
    kv.add_argument("--context", type=int, default=None, help="tokens of context (default: the model's)")
    kv.add_argument("--dtype", "--kv-cache-dtype", dest="dtype", default="float16",
                    help="KV cache element type: float32, bfloat16, float16, fp8, int8 (kvserve's: 1 byte per value and "
                         "a 2-byte scale per K/V row) (default: float16)")
    kv.add_argument("--weight-dtype", default=None, help="weights' element type, int8 and int4 included (default: --dtype)")
    kv.add_argument("--memory", default=None, help="memory for weights + cache, e.g. 16GiB (default: this machine's available RAM)")
    kv.add_argument("--kv-disk-gib", type=float, default=None,
                    help="also show how many tokens a disk tier of this size holds (kvserve serve --kv-disk-gib)")
    kv.add_argument("--block-size", type=int, default=16, help="tokens per KV block, for the disk tier (default: 16)")
    kv.add_argument("--json", action="store_true", help="print the figures as JSON")

    ex = sub.add_parser("explain", help="run one prompt and show each stage (tokens, prefill, decode, KV cache) with measured numbers")
    _add_model_args(ex)
    ex.add_argument("prompt")
    ex.add_argument("--max-tokens", type=int, default=16)
    ex.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ex.add_argument("--kv-disk-path", default=None, metavar="DIR",
                    help="a KV disk tier: the prompt's blocks are saved there at the end and read back by the next run")
    ex.add_argument("--kv-disk-gib", type=float, default=4.0, help="the disk tier's bound (default: 4)")


    exp = sub.add_parser("export", help="write a .gguf model as a Hugging Face directory (dequantized safetensors)")
    exp.add_argument("gguf", help="a .gguf file or an alias (smollm2-135m)")
    exp.add_argument("outdir", type=Path, help="the directory to write")
    exp.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")

    from kvserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    try:
        from kvserve.server.cli import add_serve_parser
    except ImportError:  # the server extra is not installed
        pass
    else:
        add_serve_parser(sub)
        from kvserve.router.cli import add_route_parser
        from kvserve.router.up import add_up_parser

        add_route_parser(sub)
        add_up_parser(sub)
    return parser


def _exit_quietly_on_signals() -> None:
    """Ctrl-C or SIGTERM before a command takes over its signals (imports, loading) exits 0 at once,
    with one line instead of a traceback or a C++ abort from threads torn down mid-load."""
    import os
    import signal

    def handler(sig: int, frame: object) -> None:
        print(f"kvserve: {signal.Signals(sig).name}: exiting", file=sys.stderr, flush=True)
        os._exit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        _exit_quietly_on_signals()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        if args.command == "chat":
            from kvserve.chat import run_chat

            return run_chat(args)
        if args.command == "generate":
            from kvserve.generate import run_generate

            return run_generate(args)
        if args.command == "explain":
            from kvserve.explain import run_explain

            return run_explain(args)
        if args.command == "kv-size":
            from kvserve.kv.kv_size import run_kv_size

            return run_kv_size(args)
        if args.command == "export":
            from kvserve.llm import parse_dtype
            from kvserve.model.export import export_hf

            print(export_hf(args.gguf, args.outdir, parse_dtype(args.dtype)))
            return 0
        return args.func(args)
    except (KVServeError, ValueError, OSError) as e:
        # Errors the user can fix get one line, not a traceback.
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
