"""One streamed request to an OpenAI-compatible server, timed on the client: what users feel.

Timing follows `vllm bench serve`: TTFT is from sending the request to the first chunk that
carries text; each later text chunk adds one inter-token latency (ITL) gap, so a chunk that
bundles several tokens counts as one gap; E2EL runs to the end of the stream. Output tokens are
the server's `usage.completion_tokens` where it honours `stream_options.include_usage`, else the
number of text chunks (`tokens_counted_by` says which). A request fails with a cause: an HTTP
status (429, 503…), an error event inside the stream, a dropped connection, a stream that ends
without `[DONE]`, a timeout, or cancellation at the benchmark's time bound.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class RequestSpec:
    api_url: str  # …/v1/completions or …/v1/chat/completions
    model: str
    prompt: str
    prompt_len: int
    output_len: int
    chat: bool = False
    ignore_eos: bool = True
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""  # the failure's cause, one short line (its kind before the first ':')
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between consecutive text chunks
    latency: float = 0.0  # E2EL, seconds
    chunks: int = 0  # text chunks received
    output_tokens: int = 0
    tokens_counted_by: str = "chunks"  # "usage" when the server reported completion_tokens
    prompt_tokens: int = -1  # from usage; -1 where the server did not say
    prompt_len: int = 0  # as sent (local tokenizer)
    generated_text: str = ""


def request_body(spec: RequestSpec) -> dict:
    body: dict = {
        "model": spec.model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.ignore_eos:
        # Fixed output length: vLLM and kvserve know ignore_eos, llama.cpp's server too; min_tokens
        # is the other common name for it.
        body |= {"ignore_eos": True, "min_tokens": spec.output_len}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def _chunk_text(data: dict) -> str:
    text = ""
    for choice in data.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:
            text += delta.get("content") or delta.get("reasoning_content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def send(client: httpx.AsyncClient, spec: RequestSpec, timeout: float | None) -> RequestOutput:
    """Stream one request and time it; never raises for what the server does (the output says)."""
    out = RequestOutput(prompt_len=spec.prompt_len)
    out.start_time = last = time.perf_counter()
    done = False
    parts: list[str] = []
    try:
        async with client.stream("POST", spec.api_url, json=request_body(spec), headers=spec.headers,
                                 timeout=httpx.Timeout(timeout)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # SSE comments, event names, blank separators
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    data = json.loads(payload)
                except ValueError:
                    out.error = f"bad chunk: {payload[:80]!r}"
                    return out
                if "error" in data:
                    out.error = f"error event: {_error_message(json.dumps(data))}"
                    return out
                now = time.perf_counter()
                text = _chunk_text(data)
                if text:
                    if out.chunks == 0:
                        out.ttft = now - out.start_time
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.chunks += 1
                    parts.append(text)
                usage = data.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_tokens = int(usage["completion_tokens"])
                    out.tokens_counted_by = "usage"
                    out.prompt_tokens = int(usage.get("prompt_tokens", -1))
    except httpx.TimeoutException:
        out.error = f"timeout: no answer within {timeout} s"
        return out
    except (httpx.TransportError, httpx.StreamError) as e:
        out.error = f"stream dropped: {type(e).__name__}"
        return out
    out.latency = time.perf_counter() - out.start_time
    out.generated_text = "".join(parts)
    if not done:
        out.error = "stream dropped: ended without [DONE]"
        return out
    if out.tokens_counted_by == "chunks":
        out.output_tokens = out.chunks
    out.success = True
    return out


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error", body)
        msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        msg = body
    return " ".join(msg.split())[:160]


def failure_kind(error: str) -> str:
    """'HTTP 429: the server is at capacity…' → 'HTTP 429'; 'stream dropped: …' → 'stream dropped'."""
    return error.split(":", 1)[0] if error else ""
