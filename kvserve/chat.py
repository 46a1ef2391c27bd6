"""A conversation's reply, streamed piece by piece (what `kvserve chat` prints).

In-process it drives the seed's loop itself (prefill, then decode until end-of-sequence);
from a running kvserve server it streams the same conversation over /v1/chat/completions.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

from kvserve.sampling_params import SamplingParams


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


def stream_remote(url: str, api_key: str | None, messages: list[dict], params: SamplingParams,
                  model: str | None = None) -> Iterator[str]:
    """Server-Sent Events from POST /v1/chat/completions (model None: whatever model the server serves)."""
    import httpx

    try:
        yield from _stream_remote(url, api_key, messages, params, model)
    except httpx.TransportError as e:  # one line, not a traceback
        raise ConnectionError(f"cannot reach the server at {url}: {e or type(e).__name__}; "
                              "is `kvserve serve` running there?") from None


def _stream_remote(url: str, api_key: str | None, messages: list[dict], params: SamplingParams,
                   model: str | None) -> Iterator[str]:
    import httpx

    body = {"messages": messages, "stream": True, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p}
    if model is not None:
        body["model"] = model
    if params.seed is not None:
        body["seed"] = params.seed
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
