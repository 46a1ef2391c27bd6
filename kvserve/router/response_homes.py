"""Where each stored Responses-API response lives: the replica that made it.

A replica keeps the responses it made (server/response_store.py); `previous_response_id`,
`GET /v1/responses/{id}` and `DELETE` work only there. Each replica names the engine id of a
generation in its `x-kvserve-request-id` header (for /v1/responses, the response's `id`), so the
router records id → replica as answers pass and sends later requests naming that id to the same
replica. What it does not know (a router restarted, an id evicted from this bounded map, the
replica re-added) it finds by asking: the replica that does not hold the id says so with
`response_not_found` / `previous_response_not_found`, and the router tries the next one
(proxy.py), so a conversation is never answered "not found" while some replica holds it.
"""
from __future__ import annotations

from collections import OrderedDict

RESPONSES = "/v1/responses"
ID_HEADER = b"x-kvserve-request-id"
NOT_HERE = frozenset({"response_not_found", "previous_response_not_found"})


def named_id(method: str, path: str, previous_response_id: object = None) -> str | None:
    """The stored response a request needs: the `{id}` of /v1/responses/{id}[/...], or a create's
    previous_response_id."""
    if path.startswith(RESPONSES + "/"):
        rid = path[len(RESPONSES) + 1:].split("/", 1)[0]
        return rid or None
    if method == "POST" and path == RESPONSES and isinstance(previous_response_id, str) and previous_response_id:
        return previous_response_id
    return None


class ResponseHomes:
    """A bounded map of response id → replica URL, the most recently used kept."""

    def __init__(self, capacity: int = 65_536) -> None:
        self.capacity = capacity
        self._home: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._home)

    def get(self, rid: str) -> str | None:
        url = self._home.get(rid)
        if url is not None:
            self._home.move_to_end(rid)
        return url

    def record(self, rid: str, url: str) -> None:
        self._home[rid] = url
        self._home.move_to_end(rid)
        while len(self._home) > self.capacity:
            self._home.popitem(last=False)

    def forget(self, rid: str) -> None:
        self._home.pop(rid, None)

    def forget_replica(self, url: str) -> None:
        """A replica left: what it stored is gone with it."""
        for rid in [r for r, u in self._home.items() if u == url]:
            del self._home[rid]
