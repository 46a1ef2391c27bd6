"""The kvserve command: one module per subcommand, each with `add_parser(subparsers)` (its
arguments, with `func` set to its `run(args)`), so this module only assembles them.

  serve     serve.py     the OpenAI-compatible HTTP server
  route     route.py     the router in front of running servers
  up        up.py        N servers and a router, in one command
  chat      chat.py      a conversation in the terminal
  generate  generate.py  one prompt, or a JSONL batch
  explain   explain.py   one prompt, each stage shown with measured numbers
  kv-size   kv_size.py   KV cache bytes per token, without loading weights
  models    models.py    the models found here: aliases, the Hugging Face cache, Ollama's store
  export    export.py    a .gguf model as a Hugging Face directory
  bench     bench.py     `kvserve bench serve`, the load generator
"""
from __future__ import annotations

import argparse
import logging
import sys

from kvserve import __version__
from kvserve.errors import KVServeError


def build_parser() -> argparse.ArgumentParser:
    from kvserve.commands import bench, chat, explain, export, generate, kv_size, models

    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: an LLM inference server you can read")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (chat, generate, kv_size, models, explain, export, bench):
        command.add_parser(sub)
    try:
        from kvserve.commands import route, serve, up
    except ImportError:  # the server extra is not installed
        pass
    else:
        for command in (serve, route, up):
            command.add_parser(sub)
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
        return args.func(args)
    except (KVServeError, ValueError, OSError) as e:
        # Errors the user can fix get one line, not a traceback.
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

