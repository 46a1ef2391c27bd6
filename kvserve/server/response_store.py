"""The Responses API's stored responses: a bounded, in-memory, least-recently-used store.

A response created with `store` true (the default) is kept here once it has finished, for
`GET /v1/responses/{id}` and for a later request's `previous_response_id`, which continues its
conversation. At most `capacity` responses are kept (`kvserve serve --responses-store-size`); past
that the least recently used one is dropped. Nothing is written to disk: a restart forgets them
all, and behind a router each replica has its own store.

So that a client whose `previous_response_id` is refused can tell why, the ids of responses that
were never stored (`store: false`), were evicted or were deleted are remembered (as many again,
ids only) and the refusal says which.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

UNKNOWN = ("no response with this id was made by this server (or the server restarted since, or another replica "
           "behind a router made it)")


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET /v1/responses/{id} answers it
    # What a request with previous_response_id = this one continues, as plain Responses items
    # (kvserve/server/responses.py): the earlier responses' input and output, this request's
    # input, then its output. Instructions are not carried over (OpenAI's rule).
    conversation: tuple[dict[str, Any], ...]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> why it is not here
        self._lock = threading.Lock()  # the event loop is the only user today; cheap insurance

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, stored: StoredResponse) -> bool:
        """Keep a finished response; False when the store keeps none (capacity 0)."""
        rid = stored.body["id"]
        if self.capacity <= 0:
            self._forget(rid, "the server keeps no responses (kvserve serve --responses-store-size 0)")
            return False
        with self._lock:
            self._kept[rid] = stored
            self._kept.move_to_end(rid)
            self._gone.pop(rid, None)
            while len(self._kept) > self.capacity:
                old, _ = self._kept.popitem(last=False)
                self._forget_locked(old, f"it was evicted: the server keeps the {self.capacity} most recently used "
                                         "responses (kvserve serve --responses-store-size)")
        return True

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            stored = self._kept.get(rid)
            if stored is not None:
                self._kept.move_to_end(rid)
            return stored

    def delete(self, rid: str) -> bool:
        with self._lock:
            if self._kept.pop(rid, None) is None:
                return False
            self._forget_locked(rid, "it was deleted")
            return True

    def not_stored(self, rid: str) -> None:
        """A response created with store false: remembered only to say so later."""
        self._forget(rid, "it was created with store: false")

    def why_missing(self, rid: str) -> str:
        with self._lock:
            return self._gone.get(rid, UNKNOWN)

    def _forget(self, rid: str, why: str) -> None:
        with self._lock:
            self._forget_locked(rid, why)

    def _forget_locked(self, rid: str, why: str) -> None:
        self._gone[rid] = why
        self._gone.move_to_end(rid)
        while len(self._gone) > max(self.capacity, 1024):
            self._gone.popitem(last=False)
