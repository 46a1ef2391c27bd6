"""Ollama's answer shapes: a whole answer (`whole`), NDJSON lines as the answer comes (`lines`),
Ollama's counts and durations, tool calls gathered whole. The routes are
server/ollama/generation.py.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kvserve.outputs import RequestOutput
from kvserve.server.canonical import ChoiceDeltas, chat_message
from kvserve.server.generation import Job
from kvserve.server.logprobs import chat_logprobs

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.ollama.protocol import _Generation


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _stats(out: RequestOutput, arrival: float) -> dict[str, Any]:
    """Ollama's counts and durations (nanoseconds) of a finished request."""
    m, now = out.metrics, time.monotonic()
    first = (m.first_token_time if m and m.first_token_time else now)
    scheduled = (m.first_scheduled_time if m and m.first_scheduled_time else arrival)
    last = (m.last_token_time if m and m.last_token_time else now)
    ns = lambda seconds: max(1, int(seconds * 1e9))  # noqa: E731 - a rate is tokens / duration: never 0
    return {"total_duration": ns(now - arrival), "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids), "prompt_eval_duration": ns(first - scheduled),
            "eval_count": len(out.outputs[0].token_ids), "eval_duration": ns(last - first)}


def _calls(delta_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls as Ollama's: arguments as an object."""
    return [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}}
            for c in delta_calls]


class WholeCalls:
    """Tool calls streamed in pieces (OpenAI's deltas: the first with id and name, then arguments
    as the model writes them) gathered whole: Ollama sends each call once, complete."""

    def __init__(self) -> None:
        self.by_index: dict[int, dict[str, Any]] = {}

    def feed(self, delta_calls: list[dict[str, Any]]) -> None:
        for call in delta_calls:
            whole = self.by_index.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})
            fn = call.get("function") or {}
            whole["function"]["name"] += fn.get("name") or ""
            whole["function"]["arguments"] += fn.get("arguments") or ""

    def whole(self) -> list[dict[str, Any]]:
        return _calls([self.by_index[i] for i in sorted(self.by_index)])


def _inside(ctx: ServerContext, job: Job, req: _Generation) -> bool | None:
    """As EngineClient.reasoning; None too for raw /api/generate (the client wrote the prompt)."""
    return None if getattr(req, "raw", False) else ctx.client.reasoning(job)


def whole(ctx: ServerContext, job: Job, req: _Generation, final: RequestOutput, key: str, mode: str | None) -> dict:
    c = final.outputs[0]
    body: dict[str, Any] = {"model": req._name, "created_at": now()}
    message, _ = chat_message(c.text, c.finish_reason, mode if key == "message" else None, _inside(ctx, job, req),
                              ctx.client.tool_formats)
    thinking = message.get("reasoning_content") if req.think is not False else None
    if key == "message":
        body["message"] = {"role": "assistant", "content": message["content"] or ""}
        if thinking is not None:
            body["message"]["thinking"] = thinking
        if message.get("tool_calls"):
            body["message"]["tool_calls"] = _calls(message["tool_calls"])
    else:
        body["response"] = message["content"]
        if thinking is not None:
            body["thinking"] = thinking
    if c.logprobs is not None:
        body["logprobs"] = chat_logprobs(c.logprobs, ctx.texts)["content"]
    return {**body, "done": True, "done_reason": c.finish_reason, **_tail(final, job, key)}


def _tail(final: RequestOutput, job: Job, key: str) -> dict[str, Any]:
    context = {"context": final.prompt_token_ids + final.outputs[0].token_ids} if key == "response" else {}
    return {**_stats(final, job.arrival), **context}


async def lines(ctx: ServerContext, job: Job, req: _Generation, key: str, mode: str | None) -> AsyncIterator[dict]:
    deltas = ChoiceDeltas(mode if key == "message" else None, _inside(ctx, job, req), ctx.client.tool_formats)

    def line(piece: dict[str, Any], done: bool = False, **extra: Any) -> dict[str, Any]:
        thinking = {"thinking": piece["thinking"]} if "thinking" in piece else {}
        value = {"role": "assistant", "content": piece["content"], **piece} if key == "message" else piece["content"]
        return {"model": req._name, "created_at": now(), key: value, **(thinking if key == "response" else {}),
                "done": done, **extra}

    calls = WholeCalls()

    def pieces(delta: dict[str, Any]) -> dict[str, Any] | None:
        """Ollama's piece of one chat delta: content, or thinking (None for reasoning think false drops)."""
        if "reasoning_content" in delta:
            return None if req.think is False else {"content": "", "thinking": delta["reasoning_content"]}
        if key == "message":
            calls.feed(delta.get("tool_calls") or [])
        return {"content": delta.get("content", "")}

    def gathered() -> dict[str, Any]:
        return {"content": "", "tool_calls": calls.whole()}

    async with aclosing(ctx.client.outputs(job)) as outputs:
        async for _, out in outputs:
            c = out.outputs[0]
            out_deltas = deltas.feed(c.delta_text)
            lp = chat_logprobs(c.delta_logprobs, ctx.texts)["content"] if c.delta_logprobs else None
            if lp and not out_deltas:
                out_deltas = [{"content": ""}]
            for j, delta in enumerate(out_deltas):
                if (piece := pieces(delta)) is not None:
                    yield line(piece, **({"logprobs": lp} if lp and j == 0 else {}))
            if c.finished:
                rest, _ = deltas.finish(c.finish_reason)
                for delta in rest:
                    if (piece := pieces(delta)) is not None:
                        yield line(piece)
                if calls.by_index:
                    yield line(gathered())
                if (piece := pieces({})) is not None:  # (always: an empty delta)
                    yield line(piece, True, done_reason=c.finish_reason, **_tail(out, job, key))
