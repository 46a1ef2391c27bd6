"""The soak's mixed load (`make soak`, benchmarks/soak.py): clients that loop until a deadline,
each request one of chat, completions or Responses (stored, with legal metadata), streamed or not,
with structured output or tools, a share of the streams dropped by their client after the first
event; beside them one hostile client that sends, every few seconds, a slow schema (4,000 empty
optional properties: compiles for minutes) and a Responses request with metadata over OpenAI's
limits, both of which must be refused; and each outcome classified by cause.

Why a cause per outcome and not a status: the soak's targets are about *why* a request failed. A
stream cut by a replica that was SIGKILLed while it held the stream (`replica_failed`) is the one
failure a router cannot hide; a request that never reached a replica (`no_replica`, a refused
connection to the router, `router_busy`) or any other 5xx is a loss the router should have
prevented.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

import httpx

SCHEMAS = [  # a few structured-output schemas, so the grammar cache holds several and reuses them
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
     "required": ["city"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 3}}, "required": ["tags"]},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}]
# The red team's schema (issue 45): 4,000 empty optional properties, ~45 KB and 4,001 nodes, inside
# the size limits, but its compile takes minutes. The same schema every time, as a client retrying
# would send it: a replica compiles it at most once per grammar thread, so the soak's two cores are
# not spent on compiles alone.
SLOW_SCHEMA = {"type": "object", "properties": {f"p{i}": {} for i in range(4000)}}
# OpenAI's metadata limits are 16 keys, keys of 64 and values of 512 characters: one form over each.
BIG_METADATA = [{f"k{i}": "v" for i in range(17)}, {"note": "x" * 4000}, {"k" * 65: "v"}]
# What a hostile request may get: a refusal (status, as the docs say; the slow schema's compile is
# killed at its timeout, never finished and cached: docs/server.md).
REFUSALS = {"slow_schema": ("400", "429"), "big_metadata": ("400",)}
TOPICS = "rivers lanterns harbors glaciers orchards falcons copper meadows".split()


@dataclass
class Outcome:
    kind: str  # chat, completion, structured, tools, responses; hostile: slow_schema, big_metadata
    stream: bool
    start: float  # seconds since the soak began
    end: float
    result: str  # ok, disconnected (by the client, on purpose), refused (a hostile request, as expected), failed
    cause: str = ""  # refused, failed: "<status>:<code or param>", "midstream:<code>", "transport:<exception>"
    replica: str = ""  # x-kvserve-replica of the answer, if one came

    def as_dict(self) -> dict:
        return asdict(self)


def make_body(kind: str, stream: bool, rng: random.Random, model: str, max_tokens: int) -> tuple[str, dict]:
    """(path, body) of one request of this kind."""
    topic = rng.choice(TOPICS)
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": stream, "temperature": rng.choice([0, 0.8]),
                  "seed": rng.randrange(1 << 30)}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "completion":
        return "/v1/completions", body | {"prompt": f"A short note about {topic}:"}
    if kind in ("responses", "big_metadata"):  # stored, so the store's bound is exercised too
        metadata = rng.choice(BIG_METADATA) if kind == "big_metadata" else {"topic": topic, "client": "soak"}
        return "/v1/responses", {"model": model, "input": f"Tell me about {topic}.", "max_output_tokens": max_tokens,
                                 "temperature": body["temperature"], "seed": body["seed"], "store": True,
                                 "metadata": metadata}
    body["messages"] = [{"role": "system", "content": "You are brief."},
                        {"role": "user", "content": f"Tell me about {topic}."}]
    if kind in ("structured", "slow_schema"):
        schema = SLOW_SCHEMA if kind == "slow_schema" else rng.choice(SCHEMAS)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    elif kind == "tools":
        body["messages"][1]["content"] = f"What is the weather where {topic} are?"
        body["tools"] = TOOLS
        body["tool_choice"] = rng.choice(["required", {"type": "function", "function": {"name": "get_weather"}}])
    return "/v1/chat/completions", body


async def one_request(client: httpx.AsyncClient, path: str, body: dict, disconnect: bool) -> tuple[str, str, str]:
    """(result, cause, replica). A client that disconnects leaves after the first event with text."""
    try:
        if not body.get("stream"):
            r = await client.post(path, json=body)
            replica = r.headers.get("x-kvserve-replica", "")
            if r.status_code == 200:
                return "ok", "", replica
            return "failed", f"{r.status_code}:{_code(r.content)}", replica
        async with client.stream("POST", path, json=body) as r:
            replica = r.headers.get("x-kvserve-replica", "")
            if r.status_code != 200:
                return "failed", f"{r.status_code}:{_code(await r.aread())}", replica
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return "failed", f"midstream:{event['error'].get('code')}", replica
                if disconnect and event.get("choices"):
                    return "disconnected", "", replica  # leaving the block closes the connection
            return ("ok", "", replica) if done else ("failed", "midstream:no_done", replica)
    except httpx.HTTPError as e:
        return "failed", f"transport:{type(e).__name__}", ""


def _code(raw: bytes) -> str:
    try:
        error = json.loads(raw)["error"]
        return str(error.get("code") or error.get("param"))  # a 400's param says which limit refused it
    except (ValueError, KeyError, TypeError, AttributeError):
        return "not_openai_error"


async def run_load(url: str, model: str, seconds: float, clients: int, max_tokens: int, disconnect_share: float,
                   t0: float, seed: int = 0, hostile_every: float = 30, refuse_within: float = 15) -> list[Outcome]:
    """Run `clients` loops and the hostile client until `seconds` pass; every outcome, in the order
    they ended. A hostile request's refusal counts as `refused` only within `refuse_within` s (the
    replicas' compile timeout and some slack): a later one is a hang, a failure."""
    outcomes: list[Outcome] = []
    deadline = t0 + seconds
    limits = httpx.Limits(max_connections=clients + 3, max_keepalive_connections=clients + 1)
    timeout = httpx.Timeout(120, connect=10)  # no request of the soak's size takes minutes: a hang fails it
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        async def send(kind: str, stream: bool, disconnect: bool, rng: random.Random) -> None:
            path, body = make_body(kind, stream, rng, model, max_tokens)
            start = time.monotonic() - t0
            result, cause, replica = await one_request(client, path, body, disconnect)
            end = time.monotonic() - t0
            if kind in REFUSALS:
                if result == "failed" and cause.split(":")[0] in REFUSALS[kind]:
                    result, cause = ("refused", cause) if end - start <= refuse_within else ("failed", "late:" + cause)
                elif result == "ok" and kind == "big_metadata":
                    result, cause = "failed", "200:accepted_over_limit"
            outcomes.append(Outcome(kind, stream, round(start, 3), round(end, 3), result, cause, replica))
            if result == "failed" and cause.split(":")[0] in ("503", "429", "transport"):
                await asyncio.sleep(0.2)  # as a real client backs off; keeps a failure from spinning

        async def loop(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                kind = rng.choice(["chat", "chat", "completion", "structured", "tools", "responses"])
                stream = kind != "responses" and rng.random() < 0.6  # Responses' typed events are not parsed here
                await send(kind, stream, stream and rng.random() < disconnect_share, rng)

        async def hostile() -> None:
            rng = random.Random(seed * 1000 + clients)
            while (at := time.monotonic()) < deadline:
                for kind in REFUSALS:
                    await send(kind, False, False, rng)
                await asyncio.sleep(max(0.0, min(at + hostile_every, deadline) - time.monotonic()))

        await asyncio.gather(hostile(), *(loop(i) for i in range(clients)))
    return outcomes


def classify(outcomes: list[Outcome], kills: list[float], slack: float = 5.0) -> dict:
    """Counts by result and cause, and which failures the targets allow.

    Allowed: `replica_failed` (mid-stream event, or a 503 with that code) of a request that was in
    flight when a replica was SIGKILLed (started before the kill, ended within `slack` s after it):
    the replica died holding it, after bytes of it may have reached the client, so no retry is safe.
    Lost: the request never reached a replica (`no_replica`, `router_busy`, a transport error to the
    router). Every other failure is unexpected. Refusals of hostile requests are counted apart, by
    kind and cause; so is every result by kind."""
    by_cause: dict[str, int] = {}
    refusals: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    allowed = lost = unexpected = 0
    for o in outcomes:
        by_kind.setdefault(o.kind, {}).setdefault(o.result, 0)
        by_kind[o.kind][o.result] += 1
        if o.result == "refused":
            refusals[f"{o.kind} {o.cause}"] = refusals.get(f"{o.kind} {o.cause}", 0) + 1
        if o.result != "failed":
            continue
        by_cause[o.cause] = by_cause.get(o.cause, 0) + 1
        code = o.cause.split(":", 1)[1] if ":" in o.cause else ""
        if code == "replica_failed" and any(o.start <= k <= o.end <= k + slack for k in kills):
            allowed += 1
        elif code in ("no_replica", "router_busy") or o.cause.startswith("transport:"):
            lost += 1
        else:
            unexpected += 1
    count = lambda r: sum(o.result == r for o in outcomes)  # noqa: E731
    return {"requests": len(outcomes), "ok": count("ok"), "disconnected": count("disconnected"),
            "refused": count("refused"), "refusals_by_cause": dict(sorted(refusals.items())),
            "results_by_kind": dict(sorted(by_kind.items())), "failed": count("failed"), "failures_by_cause": dict(sorted(by_cause.items())),
            "failed_allowed_killed_in_flight": allowed, "lost_never_reached_replica": lost,
            "failed_unexpected": unexpected}
