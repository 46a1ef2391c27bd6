"""Reading one `GET /kv/events` answer from a replica, within bounds the replica cannot move.

A replica's answer is believed only so far: the router reads at most `max_bytes` of it (as it
arrives, never the whole body into memory first), parses it on a worker thread one element at a
time (json.loads of a whole 20 MiB body would hold the interpreter lock, and so the router's
event loop, for tens of milliseconds), checks every field and every hash, and refuses a replica
that says it holds more than `max_held` blocks. Any broken rule raises `BrokenRule`; the caller
takes the replica out (kvserve/router/kv_index.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import httpx

HASH_HEX = 64  # a chained SHA-256 (kvserve/kv/block_pool.py), as hex
_SPACE = re.compile(r"[ \t\n\r]*")
_HEX = re.compile(f"[0-9a-f]{{{HASH_HEX}}}")
_SCALARS = {"model": str, "block_size": int, "caching": bool, "instance": str, "seq": int, "renderer": str,
            "kv_events_endpoint": str, "kv_events_replay_endpoint": str, "kv_events_topic": str, "kv_events_seq": int}
_SCALAR_CHARS = 4096  # the longest a scalar field (a model path) may be


class BrokenRule(ValueError):
    """The replica's /kv/events answer broke a rule: too large, malformed, or too many blocks."""


@dataclass
class KVPage:
    fields: dict  # model, block_size, caching, instance, seq (those present)
    held: set[bytes] | None  # a snapshot: every hash held now
    events: list[tuple[bool, bytes]] | None  # (stored?, hash) in order, after the router's `since`


async def read_body(response: httpx.Response, max_bytes: int) -> bytes:
    """The answer's body as it arrives; more than max_bytes is a broken rule (the rest unread)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BrokenRule(f"its answer is {declared} bytes, more than the router's limit of {max_bytes}")
    chunks, size = [], 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > max_bytes:
            raise BrokenRule(f"its answer is more than the router's limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_page(body: bytes, max_held: int, head: bool = False) -> KVPage:
    """Check and parse one answer (on a worker thread: asyncio.to_thread); `head`: one asked for
    with ?head=true, the fields without events or held hashes."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BrokenRule(f"its answer is not UTF-8 ({e.reason} at byte {e.start})") from None
    decoder = json.JSONDecoder()
    page = KVPage({}, None, None)
    pos = _skip(text, _expect(text, _skip(text, 0), "{"))
    while not text.startswith("}", pos):
        key, pos = _decode(decoder, text, pos, _SCALAR_CHARS, "a key")
        if not isinstance(key, str):
            raise BrokenRule(f"a key at character {pos} is not a string")
        pos = _skip(text, _expect(text, _skip(text, pos), ":"))
        if key == "held":
            page.held, pos = _held(decoder, text, pos, max_held)
        elif key == "events":
            page.events, pos = _events(decoder, text, pos, max_held)
        elif key in _SCALARS:
            value, pos = _decode(decoder, text, pos, _SCALAR_CHARS, f'"{key}"')
            kind = _SCALARS[key]
            if type(value) is not kind:
                raise BrokenRule(f'"{key}" is {type(value).__name__}, not {kind.__name__}')
            page.fields[key] = value
        else:  # a field a newer kvserve may add: skipped, if it is small
            _, pos = _decode(decoder, text, pos, _SCALAR_CHARS, f'"{key}"')
        pos = _skip(text, pos)
        if not text.startswith(",", pos):
            break
        pos = _skip(text, pos + 1)
    pos = _expect(text, pos, "}")
    if _skip(text, pos) != len(text):
        raise BrokenRule(f"text after the answer's end at character {pos}")
    if page.fields.get("caching", True):
        for key in ("model", "block_size", "instance", "seq"):
            if key not in page.fields:
                raise BrokenRule(f'no "{key}" field')
        if head and (page.held is not None or page.events is not None):
            raise BrokenRule('a ?head=true answer has "held" or "events"')
        if not head and (page.held is None) == (page.events is None):
            raise BrokenRule('exactly one of "held" and "events" must be there')
        if not 1 <= page.fields["block_size"] <= 1 << 16 or page.fields["seq"] < 0:
            raise BrokenRule(f"block_size {page.fields['block_size']} or seq {page.fields['seq']} out of range")
    return page


def apply_events(held: set[bytes], events: list[tuple[bool, bytes]], max_held: int) -> None:
    """The replica's set after its events (on a worker thread); past max_held is a broken rule."""
    for stored, h in events:
        (held.add if stored else held.discard)(h)
    if len(held) > max_held:
        raise BrokenRule(f"it says it holds {len(held)} blocks, more than the router's limit of {max_held}")


def _skip(text: str, pos: int) -> int:
    m = _SPACE.match(text, pos)
    return m.end() if m else pos  # (it always matches: zero or more spaces)


def _expect(text: str, pos: int, char: str) -> int:
    if not text.startswith(char, pos):
        raise BrokenRule(f"expected {char!r} at character {pos}, found {text[pos:pos + 10]!r}")
    return pos + 1


def _decode(decoder: json.JSONDecoder, text: str, pos: int, limit: int, what: str):
    """One small JSON value at pos: at most `limit` characters, so no value costs more than that."""
    piece = text[pos:pos + limit]
    try:
        value, end = decoder.raw_decode(piece)
    except json.JSONDecodeError as e:
        raise BrokenRule(f"{what} at character {pos} is not JSON of at most {limit} characters ({e.msg})") from None
    return value, pos + end


def _hash(value: object, where: str) -> bytes:
    if not isinstance(value, str) or len(value) != HASH_HEX or not _HEX.fullmatch(value):
        raise BrokenRule(f"{where} is not a block hash ({HASH_HEX} lowercase hex digits): {str(value)[:80]!r}")
    return bytes.fromhex(value)


def _items(decoder: json.JSONDecoder, text: str, pos: int, max_items: int, what: str):
    """The elements of a JSON array at pos, one small value at a time (a Python loop: the
    interpreter lock goes back to the event loop between elements)."""
    pos = _skip(text, _expect(text, pos, "["))
    if text.startswith("]", pos):
        return pos + 1
    n = 0
    while True:
        value, pos = _decode(decoder, text, _skip(text, pos), 256, what)
        n += 1
        if n > max_items:
            raise BrokenRule(f"{what} has more than the router's limit of {max_items} entries")
        yield value
        pos = _skip(text, pos)
        if text.startswith(",", pos):
            pos += 1
            continue
        return _expect(text, pos, "]")


def _held(decoder: json.JSONDecoder, text: str, pos: int, max_held: int) -> tuple[set[bytes], int]:
    held: set[bytes] = set()
    items = _items(decoder, text, pos, max_held, '"held"')
    try:
        while True:
            held.add(_hash(next(items), 'an entry of "held"'))
    except StopIteration as stop:
        return held, stop.value


def _events(decoder: json.JSONDecoder, text: str, pos: int, max_items: int) -> tuple[list[tuple[bool, bytes]], int]:
    events: list[tuple[bool, bytes]] = []
    items = _items(decoder, text, pos, max_items, '"events"')
    try:
        while True:
            event = next(items)
            if not (isinstance(event, list) and len(event) == 3 and type(event[0]) is int and event[1] in ("+", "-")):
                raise BrokenRule(f'an entry of "events" is not [seq, "+" or "-", hash]: {str(event)[:120]!r}')
            events.append((event[1] == "+", _hash(event[2], 'an entry of "events"')))
    except StopIteration as stop:
        return events, stop.value
