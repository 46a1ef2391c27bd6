"""The kvserve command: chat, generate (one prompt or a JSONL batch), serve, bench serve, export."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvserve.errors import KVServeError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or Hugging Face directory (default: smollm2-135m)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (auto: bfloat16 where the CPU computes it natively)")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: an LLM inference server you can read")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        if args.command == "chat":
            from kvserve.chat import run_chat

            return run_chat(args)
        if args.command == "generate":
            from kvserve.batch import run_generate

            return run_generate(args)
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
