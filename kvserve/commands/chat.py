"""`kvserve chat`: a conversation in the terminal, streamed token by token, from the model loaded
here or from a running server (--url); the streams themselves are kvserve/chat.py's."""
from __future__ import annotations

import argparse
import sys

from kvserve.commands.options import add_model_args, add_sampling_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat in the terminal, streaming tokens as they are decoded")
    add_model_args(p)
    p.set_defaults(model=None)  # with --url: the server's model unless one is named
    add_sampling_args(p, max_tokens=512)
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--url", default=None, help="chat with a running kvserve server instead of loading the model")
    p.add_argument("--api-key", default=None, help="the server's API key (with --url)")
    p.set_defaults(func=run)


def _read_user() -> str | None:
    try:
        line = input("\n>>> ") if sys.stdin.isatty() else sys.stdin.readline()
    except EOFError:
        return None
    if not line:
        return None
    line = line.strip()
    return None if line in ("/exit", "/quit") else line


def run(args: argparse.Namespace) -> int:
    from kvserve.chat import stream_local, stream_remote
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    llm = None
    if args.url is None:
        from kvserve.llm import LLM
        from kvserve.model.loader import DEFAULT_MODEL

        llm = LLM(args.model or DEFAULT_MODEL, dtype=args.dtype, quantization=args.quantize, activations=args.activations)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat: type a message, /exit to leave.", file=sys.stderr)
    while (user := _read_user()) is not None:
        if not user:
            continue
        messages.append({"role": "user", "content": user})
        if llm is not None:
            pieces = stream_local(llm, messages, params)
        else:
            pieces = stream_remote(args.url, args.api_key, messages, params, model=args.model)
        reply = []
        for piece in pieces:
            print(piece, end="", flush=True)
            reply.append(piece)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0
