"""The router's HTTP clients to replicas: `Upstream`, a lean HTTP/1.1 client of its own, for
proxied requests, and httpx (make_client) for the router's own calls (health checks, /kv/events).

Why a client of its own: every proxied request pays the client's cost before its first byte,
and the proxy needs little of a general client — its requests are already HTTP (headers
filtered, body read), it must not follow redirects, keep cookies, decompress or add headers, and
it relays the answer as it arrives. aiohttp's request() (URL objects, cookie and tracing hooks,
its stream reader's buffers and wake-ups) cost about a quarter of the router's latency to the
first byte. What is left here:

- one asyncio.Protocol (`Connection`) per connection, kept per replica while idle (the most
  recently used first), at most `idle_timeout` = 4 s: under uvicorn's 5 s keep-alive on the
  replica's side, so a request never goes out on a connection the replica is closing;
- the request written with one transport.write (its bytes built once);
- the answer parsed by httptools (llhttp, in C) as it arrives; body bytes queue on the
  `Response`, whose read() hands over all that is queued without waiting when there is any (no
  task or future per chunk); past 64 KiB queued the connection stops reading, so a slow client
  slows the replica's socket instead of growing the router's memory;
- errors that tell the proxy what it may do: `ConnectError` / `ConnectTimeout` (nothing was
  sent: another replica may have the request; `ConnectRefused`: nothing listens there, the
  replica is down), `ReadTimeout` (no byte for `read_timeout`: the
  replica may be working on it), `ConnectionLost` (closed before or during the answer).
"""
from __future__ import annotations

import asyncio
import errno
import ssl
from collections import deque
from urllib.parse import urlsplit

import httpx

try:
    import httptools
except ImportError:  # pragma: no cover - a dependency; a clear error if an install lost it
    httptools = None  # type: ignore[assignment]  # Upstream() says what is missing

MAX_HEAD_BYTES = 64 << 10  # an answer's status line and headers
HIGH_WATER = 64 << 10  # body bytes queued before the connection stops reading


def make_client(limits: httpx.Limits, timeout: httpx.Timeout) -> httpx.AsyncClient:
    """The client for the router's own calls: a few small requests per replica per second."""
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


class UpstreamError(Exception):
    """A replica could not be reached, or its answer was cut."""


class ConnectError(UpstreamError):
    """No connection could be made: nothing was sent."""


class ConnectRefused(ConnectError):
    """The replica's host refused the connection: nothing listens on its port (it died or stopped)."""


def is_refusal(exc: BaseException | None) -> bool:
    """Whether a connect error (ours, asyncio's or httpx's) was a refused connection: the first
    OS error along its causes decides; asyncio's "Multiple exceptions" (one per address of a host
    name) counts when every address refused."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, ConnectRefused):
            return True
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno == errno.ECONNREFUSED
        text = str(exc)
        if isinstance(exc, OSError) and text.startswith("Multiple exceptions: "):
            parts = text[len("Multiple exceptions: "):].split(", [")
            return all(f"Errno {errno.ECONNREFUSED}]" in part for part in parts if part.strip())
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class ConnectTimeout(ConnectError, TimeoutError):
    """Connecting (or waiting for a free connection) took longer than connect_timeout: nothing was sent."""


class ReadTimeout(UpstreamError, TimeoutError):
    """The replica sent no byte for read_timeout after the request was sent."""


class ConnectionLost(UpstreamError):
    """The connection closed (or the answer was not HTTP) before the answer's end."""


class Response:
    """One answer: status and headers once the head arrived, then read() the body as it comes.

    read() and body() raise ConnectionLost or ReadTimeout; close() before the end closes the
    connection (the replica sees its client leave); at the end the connection goes back to the
    pool by itself.
    """

    def __init__(self, conn: Connection) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # as the replica sent them
        self._conn: Connection | None = conn
        self._chunks: list[bytes] = []
        self._queued = 0
        self._head = False
        self._done = False  # the whole body was received
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None  # read() waiting for bytes
        self._since = 0.0  # when that wait began
        self._timer: asyncio.TimerHandle | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (name in lower case)."""
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    async def read(self) -> bytes:
        """The body bytes received since the last read (waiting for some); b"" at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._queued > HIGH_WATER and self._conn is not None:
            self._conn.transport.resume_reading()
        self._queued = 0
        return data

    async def started(self) -> None:
        """Wait until the body's first bytes (or its end) arrived, without taking them; raises
        as read() does. A replica writes a whole answer's head and body apart, and may die between."""
        while not self._chunks and not self._done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def body(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Done with the answer: before its end, the connection is closed (never reused)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    # -- called by the Connection ---------------------------------------------------------
    async def _wait(self) -> None:
        conn = self._conn
        assert conn is not None
        loop = conn.loop
        self._since = loop.time()
        if self._timer is None:  # one timer per answer, not one per wait (see _check_timeout)
            self._timer = loop.call_at(self._since + conn.read_timeout, self._check_timeout)
        self._waiter = waiter = loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _check_timeout(self) -> None:
        """Time out a wait that has gone on for read_timeout, else look again when one could have."""
        self._timer = None
        conn = self._conn
        if conn is None:
            return
        now = conn.loop.time()
        if self._waiter is not None and now - self._since >= conn.read_timeout - 0.001:
            self._fail(ReadTimeout(f"{conn.origin} sent nothing for {conn.read_timeout:g} s"))
            self.close()
            return
        start = self._since if self._waiter is not None else now
        self._timer = conn.loop.call_at(start + conn.read_timeout, self._check_timeout)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued > HIGH_WATER and self._queued - len(data) <= HIGH_WATER and self._conn is not None:
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._conn = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if not self._done and self._error is None:
            self._error = error
            if self._timer is not None:  # no wait comes after an error
                self._timer.cancel()
                self._timer = None
            self._wake()


class Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; it serves one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.origin = pool.origin
        self.read_timeout = pool.read_timeout
        self.transport: asyncio.Transport  # set by connection_made, before create_connection returns it
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.lost = False
        self.in_use = False  # serving a request (it holds one of Upstream.slots)
        self.idle_since = 0.0
        self._head_bytes = 0
        self._until_eof = False  # the answer has neither Content-Length nor chunks: it ends at EOF

    def send(self, data: bytes) -> Response:
        self.response = response = Response(self)
        self._head_bytes = 0
        self.transport.write(data)
        return response

    def close(self) -> None:
        self.lost = True
        self.response = None
        self.transport.close()
        self.pool.gone(self)

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream connection's is an asyncio.Transport

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:  # the router asks for no upgrade
            response._fail(ConnectionLost(f"{self.origin} answered something that is not HTTP/1.1: {e!r}"))
            self.close()
            return
        if not response._head:  # counted while one head goes on across reads: the bound is the limit + one read
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                response._fail(ConnectionLost(f"{self.origin} answered a head larger than {MAX_HEAD_BYTES} bytes"))
                self.close()

    def eof_received(self) -> bool:
        response = self.response
        if response is not None and self._until_eof and response._head:
            self._message_done(keep_alive=False)
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        response, self.response = self.response, None
        if response is not None:
            why = f": {exc}" if exc else ""
            where = "during" if response._head else "before"
            response._fail(ConnectionLost(f"{self.origin} closed the connection {where} its answer{why}"))
        self.pool.gone(self)

    # -- httptools callbacks ------------------------------------------------------------------
    def _answer(self) -> Response:
        """The answer being parsed (bytes after one's end are not an answer: the parser's error)."""
        if self.response is None:
            raise ConnectionLost(f"{self.origin} sent bytes after its answer")
        return self.response

    def on_header(self, name: bytes, value: bytes) -> None:
        self._answer().headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._answer()
        response.status = status = self.parser.get_status_code()
        response._head = True
        framed = status < 200 or status in (204, 304) or any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in response.headers)
        self._until_eof = not framed
        response._wake()

    def on_body(self, body: bytes) -> None:
        self._answer()._feed(body)

    def on_message_complete(self) -> None:
        self._message_done(self.parser.should_keep_alive())

    def _message_done(self, keep_alive: bool) -> None:
        response, self.response = self.response, None
        if response is None:
            return
        response._finish()
        if keep_alive and not self._until_eof:
            self.pool.release(self)
        else:
            self.close()


class Pool:
    """The connections to one replica: the idle ones, most recently used last."""

    def __init__(self, upstream: Upstream, url: str) -> None:
        parts = urlsplit(url)
        self.upstream = upstream
        self.loop = asyncio.get_running_loop()
        self.origin = url
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.read_timeout = upstream.read_timeout
        self.host_header = b"host: " + parts.netloc.encode("idna") + b"\r\n"
        self.idle: deque[Connection] = deque()
        self.open: set[Connection] = set()

    def take(self) -> Connection | None:
        """An idle connection still good for a request, if any (those past their idle time are closed)."""
        deadline = self.loop.time() - self.upstream.idle_timeout
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost and conn.idle_since > deadline and not conn.transport.is_closing():
                conn.in_use = True
                return conn
            conn.close()
        return None

    async def connect(self) -> Connection:
        try:
            _, conn = await self.loop.create_connection(lambda: Connection(self), self.host, self.port, ssl=self.ssl)
        except OSError as e:
            kind = ConnectRefused if is_refusal(e) else ConnectError
            raise kind(f"cannot connect to {self.origin}: {e}") from None
        conn.in_use = True
        self.open.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        """Its answer ended and the connection may serve another."""
        conn.in_use = False
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        self.upstream.slots.release()

    def gone(self, conn: Connection) -> None:
        """It closed (either side): never to be used again."""
        self.open.discard(conn)
        if conn.in_use:
            conn.in_use = False
            self.upstream.slots.release()
        elif conn in self.idle:
            self.idle.remove(conn)


class Upstream:
    """Proxied requests to replicas over kept-alive HTTP/1.1 connections (see the module doc).

        upstream = Upstream(connections=512, connect_timeout=2.0, read_timeout=600.0)
        response = await upstream.request("http://10.0.0.1:8000", b"POST", b"/v1/completions", headers, body)
        while chunk := await response.read(): ...

    `connections` bounds the connections in use at once (a request waits up to connect_timeout
    for one); `headers` is the header block as bytes, each line ending in CRLF, without Host and
    Content-Length (added here).
    """

    def __init__(self, connections: int, connect_timeout: float, read_timeout: float, idle_timeout: float = 4.0) -> None:
        if httptools is None:
            raise RuntimeError("the router needs httptools (pip install 'httptools>=0.6'): it parses the replicas' answers")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        self.slots = asyncio.Semaphore(connections)  # connections in use
        self.pools: dict[str, Pool] = {}

    async def request(self, url: str, method: bytes, target: bytes, headers: bytes, body: bytes) -> Response:
        """Send a request to the replica at url (scheme://host:port); its answer once its head arrived."""
        pool = self.pools.get(url)
        if pool is None:
            pool = self.pools[url] = Pool(self, url)
        data = b"%s %s HTTP/1.1\r\n%s%s" % (method, target, pool.host_header, headers)
        if body or method not in (b"GET", b"HEAD", b"DELETE"):
            data += b"content-length: %d\r\n\r\n%s" % (len(body), body)
        else:
            data += b"\r\n"
        acquired, conn = False, None
        try:
            if self.slots.locked():  # every connection is in use: wait for one, as for connecting
                async with asyncio.timeout(self.connect_timeout):
                    await self.slots.acquire()
            else:
                await self.slots.acquire()  # at once: no timer to set on the common path
            acquired = True
            conn = pool.take()
            if conn is None:
                async with asyncio.timeout(self.connect_timeout):
                    conn = await pool.connect()
        except BaseException as e:
            if conn is not None:
                conn.close()  # gives its slot back
            elif acquired:
                self.slots.release()
            if isinstance(e, TimeoutError):
                raise ConnectTimeout(f"no connection to {url} within {self.connect_timeout:g} s") from None
            raise
        response = conn.send(data)
        try:
            while not response._head:
                if response._error is not None:
                    raise response._error
                await response._wait()
        except BaseException:
            response.close()  # cancelled (the client left) or failed: the replica must not keep working
            raise
        return response

    async def close(self) -> None:
        for pool in self.pools.values():
            for conn in list(pool.open):
                conn.transport.close()
        self.pools.clear()
