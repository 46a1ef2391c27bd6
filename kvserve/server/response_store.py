"""The Responses API's stored responses: a bounded, in-memory, least-recently-used store.

A response created with `store` true (the default) is kept here once it has finished, for
`GET /v1/responses/{id}` and for a later request's `previous_response_id`, which continues its
conversation. Two bounds, whichever is met first: at most `capacity` responses
(`kvserve serve --responses-store-size`) and at most `max_bytes` of them
(`--responses-store-mib`); past either the least recently used ones are dropped. Each is kept as
its JSON bytes, so what the byte bound counts is what it costs (the same JSON parsed into Python
objects may take ten times more). Nothing is written to disk: a restart forgets them all, and
behind a router each replica has its own store.

So that a client whose `previous_response_id` is refused can tell why, the ids of responses that
were never stored (`store: false`, or larger than the whole store), were evicted or were deleted
are remembered (as many again, at least 1,024; ids only) and the refusal says which.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

UNKNOWN = ("no response with this id was made by this server (or the server restarted since, or another replica "
           "behind a router made it)")


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class StoredResponse:
    body: bytes  # the response object as JSON, as GET /v1/responses/{id} answers it
    # What a request with previous_response_id = this one continues, as JSON of plain Responses
    # items (kvserve/server/openai/responses.py): the earlier responses' input and output, this request's
    # input, then its output. Instructions are not carried over (OpenAI's rule).
    conversation: bytes

    @classmethod
    def of(cls, body: dict[str, Any], conversation: Sequence[dict[str, Any]]) -> StoredResponse:
        return cls(_json(body), _json(list(conversation)))

    @property
    def size(self) -> int:
        return len(self.body) + len(self.conversation)

    def response(self) -> dict[str, Any]:
        return json.loads(self.body)

    def items(self) -> list[dict[str, Any]]:
        return json.loads(self.conversation)


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0  # of the responses kept
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> why it is not here
        self._lock = threading.Lock()  # the event loop is the only user today; cheap insurance

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def keeps(self) -> bool:
        return self.capacity > 0 and self.max_bytes > 0

    def put(self, rid: str, stored: StoredResponse) -> bool:
        """Keep a finished response; False when the store keeps none (capacity 0) or it alone
        is larger than the store."""
        if not self.keeps:
            self._forget(rid, "the server keeps no responses (kvserve serve --responses-store-size 0 or "
                              "--responses-store-mib 0)")
            return False
        if stored.size > self.max_bytes:
            self._forget(rid, f"it was {stored.size:,} bytes of JSON, more than the whole store keeps "
                              f"({self.max_bytes:,} bytes: kvserve serve --responses-store-mib)")
            return False
        with self._lock:
            self._drop_locked(rid)
            self._kept[rid] = stored
            self.bytes += stored.size
            self._gone.pop(rid, None)
            while len(self._kept) > self.capacity or self.bytes > self.max_bytes:
                old = next(iter(self._kept))
                self._drop_locked(old)
                self._forget_locked(old, f"it was evicted: the server keeps the most recently used responses, at "
                                         f"most {self.capacity} (kvserve serve --responses-store-size) and "
                                         f"{self.max_bytes:,} bytes (--responses-store-mib)")
        return True

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            stored = self._kept.get(rid)
            if stored is not None:
                self._kept.move_to_end(rid)
            return stored

    def delete(self, rid: str) -> bool:
        with self._lock:
            if not self._drop_locked(rid):
                return False
            self._forget_locked(rid, "it was deleted")
            return True

    def not_stored(self, rid: str) -> None:
        """A response created with store false: remembered only to say so later."""
        self._forget(rid, "it was created with store: false")

    def why_missing(self, rid: str) -> str:
        with self._lock:
            return self._gone.get(rid, UNKNOWN)

    def _drop_locked(self, rid: str) -> bool:
        stored = self._kept.pop(rid, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None

    def _forget(self, rid: str, why: str) -> None:
        with self._lock:
            self._forget_locked(rid, why)

    def _forget_locked(self, rid: str, why: str) -> None:
        self._gone[rid] = why
        self._gone.move_to_end(rid)
        while len(self._gone) > max(self.capacity, 1024):
            self._gone.popitem(last=False)
