"""`kvserve serve --join ROUTER_URL`: register with a router once ready, deregister on drain.

A server on another host (or a Kubernetes pod) announces itself to `kvserve route` through the
router's admin API, so the router needs no list of replicas up front. Registration waits for
this server's own /health to answer 200 and retries until the router answers; the first
SIGTERM/SIGINT deregisters (one request, at most 2 s) before the server drains.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import uvicorn

log = logging.getLogger("kvserve.server")


def advertised_url(host: str, port: int, explicit: str | None) -> str:
    """The URL the router should use: --advertise-url, else this host's name when bound to all."""
    if explicit:
        return explicit.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Joiner:
    def __init__(self, router_url: str, own_url: str, local_url: str, admin_key: str | None) -> None:
        self.router_url = router_url.rstrip("/")
        self.own_url = own_url
        self.local_url = local_url  # where this process checks its own /health
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._left = threading.Event()

    def attach(self, server: uvicorn.Server) -> None:
        """Register once ready (a daemon thread); deregister on the server's first exit signal."""
        threading.Thread(target=self._register, name="kvserve-join", daemon=True).start()
        handle_exit = server.handle_exit

        def on_exit(sig, frame) -> None:  # uvicorn installs this as the signal handler
            if not self._left.is_set():
                self._left.set()
                # Here, not on a thread: an idle server's drain ends at once, and the process
                # would exit before the router heard. One request, at most 2 s if the router is gone.
                self.leave()
            handle_exit(sig, frame)

        server.handle_exit = on_exit  # type: ignore[method-assign]

    def _register(self) -> None:
        delay = 0.2
        while not self._left.is_set():
            try:
                if httpx.get(self.local_url + "/health", timeout=5).status_code == 200:
                    r = httpx.post(self.router_url + "/admin/replicas", json={"url": self.own_url},
                                   headers=self.headers, timeout=5)
                    if r.status_code < 300:
                        log.info("joined the router at %s as %s", self.router_url, self.own_url)
                        return
                    log.warning("the router at %s refused to add this server: %s %s", self.router_url,
                                r.status_code, r.text[:200])
                    if r.status_code in (401, 403):
                        return  # a wrong admin key does not fix itself
            except httpx.HTTPError:
                pass  # not ready yet, or the router is not up yet
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def leave(self) -> None:
        try:
            httpx.request("DELETE", self.router_url + "/admin/replicas", json={"url": self.own_url},
                          headers=self.headers, timeout=2)
            log.info("left the router at %s", self.router_url)
        except httpx.HTTPError as e:
            log.warning("could not deregister from the router at %s: %s", self.router_url, e)
