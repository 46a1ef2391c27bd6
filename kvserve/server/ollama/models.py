"""Ollama's API about the model: /api/tags, /api/show, /api/ps and /api/version, the served model
as Ollama's clients expect to find it (a NAME:latest tag, its size, family and parameter count,
its context length). Generation is kvserve/server/ollama/generation.py's.
"""
from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvserve import __version__
from kvserve.server.errors import APIError
from kvserve.server.ollama.protocol import ShowRequest

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext

# The Ollama release whose API this follows (tools, structured output, done_reason, /api/ps'
# context_length); Ollama's clients read /api/version to decide what a server can do.
OLLAMA_API_VERSION = "0.12.0"


def _tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return path.stat().st_size if path.exists() else 0


def _parameter_count(cfg) -> int:
    """Parameters of a Llama-family decoder from its shapes (no bias terms but Qwen2's, ignored)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = h * q * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size + 2 * h
    return cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + cfg.num_hidden_layers * layer + h


def _human(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _card(ctx: ServerContext) -> dict[str, Any]:
    c = ctx.client
    path = Path(c.model_path)
    modified = datetime.fromtimestamp(os.path.getmtime(path) if path.exists() else ctx.state.started, UTC)
    details = {"parent_model": "", "format": "gguf" if path.is_file() else "safetensors",
               "family": c.model_config.architecture, "families": [c.model_config.architecture],
               "parameter_size": _human(_parameter_count(c.model_config)), "quantization_level": c.quantization}
    name = _tagged(ctx.settings.model_name)
    return {"name": name, "model": name, "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "size": _size(path), "digest": ctx.system_fingerprint.removeprefix("fp_").ljust(64, "0"), "details": details}


async def version(request: Request, ctx: ServerContext) -> dict:
    return {"version": OLLAMA_API_VERSION, "kvserve": __version__}


async def tags(request: Request, ctx: ServerContext) -> dict:
    ctx.state.require_ready()
    return {"models": [_card(ctx)]}


async def running(request: Request, ctx: ServerContext) -> dict:
    """/api/ps."""
    ctx.state.require_ready()
    card = _card(ctx)
    return {"models": [{**{k: card[k] for k in ("name", "model", "size", "digest", "details")},
                        "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                        "context_length": ctx.client.max_model_len}]}


async def show(request: Request, ctx: ServerContext) -> dict:
    ctx.state.require_ready()
    req = await ctx.parse(request, ShowRequest)
    given = req.model or req.name
    if given is None:
        raise APIError(400, "model is required", param="model")
    if given.removesuffix(":latest") != ctx.settings.model_name:
        raise APIError(404, f"model {given!r} not found: GET /api/tags lists the one served here", param="model")
    c, card = ctx.client, _card(ctx)
    cfg, arch = c.model_config, c.model_config.architecture
    parameters = "\n".join(f"{k} {json.dumps(v)}" for k, v in ctx.settings.defaults.items())
    return {"modelfile": f"# served by kvserve {__version__}\nFROM {c.model_path}\n",
            "parameters": parameters, "template": c.tokenizer.chat_template.source,
            "details": card["details"], "modified_at": card["modified_at"],
            "model_info": {"general.architecture": arch, "general.parameter_count": _parameter_count(cfg),
                           f"{arch}.context_length": c.max_model_len,
                           f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.block_count": cfg.num_hidden_layers,
                           f"{arch}.attention.head_count": cfg.num_attention_heads,
                           f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
                           f"{arch}.vocab_size": cfg.vocab_size},
            "capabilities": ["completion", "tools"]}
