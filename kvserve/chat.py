"""`kvserve chat`: a conversation in the terminal, streamed token by token.

In-process it drives the seed's loop itself (prefill, then decode until end-of-sequence);
with --url it streams the same conversation from a running kvserve server.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

from kvserve.sampling_params import SamplingParams


def _read_user() -> str | None:
    try:
        line = input("\n>>> ") if sys.stdin.isatty() else sys.stdin.readline()
    except EOFError:
        return None
    if not line:
        return None
    line = line.strip()
    return None if line in ("/exit", "/quit") else line


def stream_local(llm, messages: list[dict], params: SamplingParams) -> Iterator[str]:
    """The seed's loop: prefill the conversation, decode until an end token or max_tokens."""
    from kvserve.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(llm.tokenizer, skip_special_tokens=True)
    cache, token = llm.prefill(llm.encode_chat(messages), params)
    try:
        for _ in range(params.max_tokens if params.max_tokens is not None else llm.max_model_len):
            if token in llm.eos_token_ids or cache.num_tokens + 1 >= llm.max_model_len:
                break
            yield detok.add([token])
            cache, token = llm.decode(cache, token, params)
    finally:
        cache.close()


def chat_url(url: str) -> str:
    """The chat endpoint of a server given as http://host:port or as the http://host:port/v1 the
    server prints at start-up."""
    base = url.rstrip("/")
    base = base.removesuffix("/chat/completions").removesuffix("/v1")
    return base + "/v1/chat/completions"


def stream_remote(url: str, api_key: str | None, messages: list[dict], args: argparse.Namespace) -> Iterator[str]:
    """Server-Sent Events from POST /v1/chat/completions."""
    import httpx

    try:
        yield from _stream_remote(url, api_key, messages, args)
    except httpx.TransportError as e:  # one line, not a traceback
        raise ConnectionError(f"cannot reach the server at {url}: {e or type(e).__name__}; "
                              "is `kvserve serve` running there?") from None


def _stream_remote(url: str, api_key: str | None, messages: list[dict], args: argparse.Namespace) -> Iterator[str]:
    import httpx

    body = {"messages": messages, "stream": True, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "top_p": args.top_p}
    if args.model is not None:  # else whatever model the server serves
        body["model"] = args.model
    if args.seed is not None:
        body["seed"] = args.seed
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.stream("POST", chat_url(url), json=body, headers=headers, timeout=None) as r:
        if r.status_code != 200:
            r.read()
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text
            raise ValueError(f"the server answered {r.status_code}: {msg}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                yield choice.get("delta", {}).get("content") or ""


def run_chat(args: argparse.Namespace) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    llm = None
    if args.url is None:
        from kvserve.llm import LLM
        from kvserve.model.loader import DEFAULT_MODEL

        llm = LLM(args.model or DEFAULT_MODEL, dtype=args.dtype, quantization=args.quantize)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat: type a message, /exit to leave.", file=sys.stderr)
    while (user := _read_user()) is not None:
        if not user:
            continue
        messages.append({"role": "user", "content": user})
        if llm is not None:
            pieces = stream_local(llm, messages, params)
        else:
            pieces = stream_remote(args.url, args.api_key, messages, args)
        reply = []
        for piece in pieces:
            print(piece, end="", flush=True)
            reply.append(piece)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0
