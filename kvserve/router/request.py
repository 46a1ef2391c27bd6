"""What the router reads from a request body to route it: the prompt and the tokens it may cost.

The body itself is forwarded untouched, so a replica answers a bad request with its own exact
error; here nothing is validated, and a body that cannot be read is routed by load alone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.router.response_homes import named_id
from kvserve.server import routes
from kvserve.server.anthropic import protocol as anthropic_protocol
from kvserve.server.canonical import ChatTurn
from kvserve.server.ollama import protocol as ollama_protocol
from kvserve.server.openai import responses_protocol
from kvserve.tokenizer.chat_template import ChatPrompt
from kvserve.web.errors import APIError

# From the server's route table: what costs a replica a prompt and an answer, or its input only
# (/v1/embeddings: read like a completion's prompt).
GENERATION_PATHS, PREFILL_PATHS = routes.paths("generate"), routes.paths("prefill")


@dataclass
class RoutedRequest:
    path: str
    text: str = ""  # the prompt as text, for the approximate prefix tree
    prompt: str | list[int] | None = None  # a completion's single prompt
    suffix: str | None = None  # a completion's suffix: fill in the middle (kvserve/fim.py)
    messages: list[dict] | None = None  # a chat's messages, roughly: for the approximate text only
    add_generation_prompt: bool = True
    turn: ChatTurn | None = None  # a chat's body as its route reads it (any API): the precise source renders it
    max_tokens: int | None = None
    n: int = 1
    token_ids: dict[str, list[int]] = field(default_factory=dict)  # per replica renderer (precise source)
    hashes: dict[tuple[str, int], list[bytes]] = field(default_factory=dict)  # per (renderer, block size)
    response_id: str | None = None  # the stored response it needs (router/response_homes.py)

    def chat_prompt(self) -> ChatPrompt | None:
        """The prompt the replica's route will render from the body, tools and template switches included."""
        return self.turn.prompt if self.turn is not None else None

    @property
    def routable(self) -> bool:
        return bool(self.text) or bool(self.prompt)

    def estimated_prompt_tokens(self) -> int:
        """Without a tokenizer: ~4 characters per token (English BPE)."""
        if isinstance(self.prompt, list):
            return len(self.prompt)
        return (len(self.text) + len(self.suffix or "")) // 4 + 1


def _message_for_template(m: Any) -> dict | None:
    """Roles and content as text, for the approximate source's tree (the precise source renders
    the whole body with the server's own ChatPrompt instead)."""
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


def parse_request(path: str, body: bytes, method: str = "POST") -> RoutedRequest:
    req = RoutedRequest(path, response_id=named_id(method, path))
    if (path not in GENERATION_PATHS and path not in PREFILL_PATHS) or not body:
        return req
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return req
    if not isinstance(data, dict):
        return req
    options = given if isinstance(given := data.get("options"), dict) else {}
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens", options.get("num_predict")))
    if isinstance(max_tokens, int) and max_tokens >= 0:
        req.max_tokens = max_tokens
    if isinstance(data.get("n"), int) and data["n"] >= 1:
        req.n = data["n"]
    if path in PREFILL_PATHS:
        req.max_tokens = 0  # nothing is generated; its prompt's blocks land in that replica's prefix cache
    if (read := routes.CHAT_READERS.get(path)) is not None and (turn := read(data)) is not None:
        req.turn = turn  # the route's own reading: its prompt, its limit and n
        req.max_tokens = None if turn.sampling.defaulted else turn.sampling.max_tokens
        req.n = turn.sampling.n
    if path in ("/v1/responses", "/v1/messages", "/api/chat", "/api/generate"):
        _other_api(req, data)
    elif path == "/v1/completions" or path in PREFILL_PATHS:
        prompt = data.get("input" if path in PREFILL_PATHS else "prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            req.prompt = req.text = prompt
            if isinstance(data.get("suffix"), str) and data["suffix"]:
                req.suffix = data["suffix"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            req.prompt = prompt
    else:
        messages = data.get("messages")
        if isinstance(messages, list) and messages:
            plain = [p for m in messages if (p := _message_for_template(m)) is not None]
            if len(plain) == len(messages):
                req.messages = plain
                req.add_generation_prompt = data.get("add_generation_prompt", True) is not False
                # Role markers keep "system: X" and "user: X" apart in the tree.
                req.text = "".join(f"<{p['role']}>{p['content']}" for p in plain)
    return req


def _other_api(req: RoutedRequest, data: dict) -> None:
    """Responses, Anthropic's messages and Ollama's chat and generate: the body kept for the precise
    source, their messages' text for the approximate one (a prompt Ollama sends raw is a plain prompt)."""
    try:
        if req.path == "/v1/responses":
            if data.get("previous_response_id") is not None:  # the start of the conversation is stored on one replica
                req.response_id = named_id("POST", req.path, data["previous_response_id"])
                return
            given = data["input"]
            items = responses_protocol.plain_items(given) if isinstance(given, list) else [
                {"type": "message", "role": "user", "content": given}]
            instructions = [{"role": "system", "content": data["instructions"]}] if data.get("instructions") else []
            messages = instructions + responses_protocol.chat_messages(items)
        elif req.path == "/v1/messages":
            messages = anthropic_protocol.template_messages(data)
        elif req.path == "/api/chat":
            messages = ollama_protocol.chat_messages(data["messages"])
        elif data.get("raw") is True:
            if isinstance(data.get("prompt"), str) and data["prompt"]:
                req.prompt = req.text = data["prompt"]
            return
        else:
            messages = ollama_protocol.generate_messages(data["prompt"], data.get("system"))
    except (KeyError, TypeError, ValueError, AttributeError, APIError):
        return  # the replica will say what is wrong with it; routed by load meanwhile
    plain = [p for m in messages if (p := _message_for_template(m)) is not None]
    if messages and len(plain) == len(messages):
        req.messages = messages
        req.text = "".join(f"<{p['role']}>{p['content']}" for p in plain)
