"""How a stream's events go on the wire: every API's events are plain dicts, written here.

  SSE         OpenAI's chat and text completions: `data: <json>` events, then `data: [DONE]`
  NAMED_SSE   Anthropic's Messages and OpenAI's Responses: `event: <its type>` before each data line
  NDJSON      Ollama's: one JSON object a line
The server's stream runner (kvserve/server/serving.py) and the router's error events
(kvserve/web/errors.py) both frame through these.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def dumps(event: Any) -> bytes:
    """Compact JSON, UTF-8; ASCII-escaped only where the text cannot be UTF-8 (a lone surrogate
    that an error message quoted from the client's input)."""
    text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(event, ensure_ascii=True, separators=(",", ":")).encode()


class Framing:
    media_type = "text/event-stream"
    end = b""  # what follows the last event, however the stream ended

    def frame(self, event: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def close(self, events: Iterable[dict[str, Any]]) -> bytes:
        """The last events of a stream, and its end."""
        return b"".join(map(self.frame, events)) + self.end


class _SSE(Framing):
    end = b"data: [DONE]\n\n"

    def frame(self, event: dict[str, Any]) -> bytes:
        return b"data: " + dumps(event) + b"\n\n"


class _NamedSSE(Framing):
    def frame(self, event: dict[str, Any]) -> bytes:
        return b"event: " + str(event["type"]).encode() + b"\ndata: " + dumps(event) + b"\n\n"


class _NDJSON(Framing):
    media_type = "application/x-ndjson"

    def frame(self, event: dict[str, Any]) -> bytes:
        return dumps(event) + b"\n"


SSE, NAMED_SSE, NDJSON = _SSE(), _NamedSSE(), _NDJSON()
