"""`--allowed-hosts`: the Host header names the server (or router) answers to.

A web page can make a browser send requests to a server on its user's machine or network by
pointing its own domain name at the server's address ("DNS rebinding"); the browser then treats
the server as the page's own origin and lets the page read the answers. Those requests carry the
page's domain in their Host header, so a server that knows its own names refuses them. An empty
list (the default) accepts any Host. Entries: a name or an address (`localhost`, `10.0.0.2`,
`[::1]`), `*.example.com` for a domain's subdomains, `*` for any; ports are ignored.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.web.errors import APIError


def parse_allowed_hosts(value: str | None) -> tuple[str, ...]:
    """`--allowed-hosts a,b,*.c` as a tuple of lowercase entries; ValueError for an empty entry."""
    if not value:
        return ()
    hosts = tuple(h.strip().lower() for h in value.split(","))
    for h in hosts:
        if not h or "/" in h or (h.startswith("*") and h != "*" and not h.startswith("*.")):
            raise ValueError(f"--allowed-hosts: {h!r} is not a host name, an address, '*.DOMAIN' or '*' "
                             "(give them comma-separated, e.g. localhost,127.0.0.1,*.internal)")
    return hosts


def host_name(header: str) -> str:
    """The name in a Host header, without its port: 'Example.com:8000' → 'example.com', '[::1]:80' → '[::1]'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    for entry in allowed:
        if entry == "*" or entry == name or (entry.startswith("*.") and name.endswith(entry[1:])):
            return True
        if ":" in entry and not entry.startswith("[") and name == f"[{entry}]":  # ::1 written bare
            return True
    return False


def host_error(scope: Scope, allowed: tuple[str, ...]) -> APIError | None:
    """The 400 for a request whose Host is not allowed; None when it is (or the list is empty)."""
    if not allowed or scope["type"] != "http":
        return None
    header = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
    if host_allowed(host_name(header), allowed):
        return None
    return APIError(400, f"the Host header {header[:200]!r} is not a name this service answers to "
                    "(its --allowed-hosts): use one of those", code="invalid_host")


class HostAllowList:
    """ASGI middleware: a request whose Host is not allowed gets 400 in the OpenAI error body."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = host_error(scope, self.allowed)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
