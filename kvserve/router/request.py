"""What the router reads from a request body to route it: the prompt and the tokens it may cost.

The body itself is forwarded untouched, so a replica answers a bad request with its own exact
error; here nothing is validated, and a body that cannot be read is routed by load alone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
EMBEDDINGS_PATH = "/v1/embeddings"  # a prefill only: its input is read like a completion's prompt


@dataclass
class RoutedRequest:
    path: str
    text: str = ""  # the prompt as text, for the approximate prefix tree
    prompt: str | list[int] | None = None  # a completion's single prompt
    messages: list[dict] | None = None  # a chat's messages, as the chat template wants them
    add_generation_prompt: bool = True
    max_tokens: int | None = None
    n: int = 1
    token_ids: dict[str, list[int]] = field(default_factory=dict)  # per model file (precise source)
    hashes: dict[tuple[str, int], list[bytes]] = field(default_factory=dict)  # per (model, block size)

    @property
    def routable(self) -> bool:
        return bool(self.text) or bool(self.prompt)

    def estimated_prompt_tokens(self) -> int:
        """Without a tokenizer: ~4 characters per token (English BPE)."""
        if isinstance(self.prompt, list):
            return len(self.prompt)
        return len(self.text) // 4 + 1


def _message_for_template(m: Any) -> dict | None:
    """The server's own rule: content parts joined, developer is system."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return None
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if content is not None and not isinstance(content, str):
        return None
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": content or ""}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def parse_request(path: str, body: bytes) -> RoutedRequest:
    req = RoutedRequest(path)
    if (path not in GENERATION_PATHS and path != EMBEDDINGS_PATH) or not body:
        return req
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return req
    if not isinstance(data, dict):
        return req
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    if isinstance(max_tokens, int) and max_tokens >= 0:
        req.max_tokens = max_tokens
    if isinstance(data.get("n"), int) and data["n"] >= 1:
        req.n = data["n"]
    if path == EMBEDDINGS_PATH:
        req.max_tokens = 0  # nothing is generated; its prompt's blocks land in that replica's prefix cache
    if path in ("/v1/completions", EMBEDDINGS_PATH):
        prompt = data.get("prompt" if path != EMBEDDINGS_PATH else "input")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            req.prompt = req.text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            req.prompt = prompt
    else:
        messages = data.get("messages")
        if isinstance(messages, list) and messages:
            plain = [_message_for_template(m) for m in messages]
            if all(p is not None for p in plain):
                req.messages = plain
                req.add_generation_prompt = data.get("add_generation_prompt", True) is not False
                # Role markers keep "system: X" and "user: X" apart in the tree.
                req.text = "".join(f"<{p['role']}>{p['content']}" for p in plain)
    return req
