"""The router's HTTP clients to replicas: aiohttp for proxied requests (make_session), and for
its own calls (health checks, /kv/events) httpx over asyncio streams instead of anyio sockets.

httpx's default network layer (httpcore on anyio) registers the socket with the event loop
before every read and unregisters it after: two extra system calls per chunk, which is per
token for a streamed answer, and measurable where system calls are dear (a sandboxed VM).
asyncio's streams keep the socket registered for the connection's life, as uvicorn does on
the other side of the router. Everything above the socket (pooling, HTTP/1.1, timeouts,
errors) is still httpx/httpcore's.
"""
from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
import typing

import httpcore
import httpx

if sys.version_info >= (3, 11):
    _timeout = asyncio.timeout
else:  # pragma: no cover - Python 3.10
    @contextlib.asynccontextmanager
    async def _timeout(delay: float | None):
        # 3.10 has no asyncio.timeout: cancel the task from a timer, report a TimeoutError.
        task = asyncio.current_task()
        handle = asyncio.get_running_loop().call_later(delay, task.cancel) if delay is not None else None
        try:
            yield
        except asyncio.CancelledError:
            if handle is not None and handle.when() <= asyncio.get_running_loop().time():
                raise TimeoutError from None
            raise
        finally:
            if handle is not None:
                handle.cancel()


@contextlib.contextmanager
def _mapped(timeout_error: type[Exception], os_error: type[Exception]):
    try:
        yield
    except TimeoutError as e:
        raise timeout_error(str(e) or "timed out") from e
    except (OSError, EOFError) as e:
        raise os_error(str(e) or type(e).__name__) from e


class _Stream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        with _mapped(httpcore.ReadTimeout, httpcore.ReadError):
            if timeout is None:
                return await self._reader.read(max_bytes)
            async with _timeout(timeout):
                return await self._reader.read(max_bytes)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        with _mapped(httpcore.WriteTimeout, httpcore.WriteError):
            self._writer.write(buffer)
            async with _timeout(timeout):
                await self._writer.drain()

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await self._writer.wait_closed()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
            async with _timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        return self

    def get_extra_info(self, info: str) -> typing.Any:
        transport = self._writer.transport
        if info == "is_readable":  # an idle pooled connection the replica closed
            return self._reader.at_eof() or transport.is_closing()
        if info == "ssl_object":
            return transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return transport.get_extra_info("sockname")
        if info == "server_addr":
            return transport.get_extra_info("peername")
        if info == "socket":
            return transport.get_extra_info("socket")
        return None


class _Backend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: typing.Iterable | None = None) -> httpcore.AsyncNetworkStream:
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
            async with _timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, local_addr=(local_address, 0) if local_address else None)
        for option in socket_options or ():
            writer.transport.get_extra_info("socket").setsockopt(*option)
        return _Stream(reader, writer)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: typing.Iterable | None = None) -> httpcore.AsyncNetworkStream:
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
            async with _timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path)
        return _Stream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _Transport(httpx.AsyncHTTPTransport):
    def __init__(self, limits: httpx.Limits) -> None:
        super().__init__(limits=limits)
        # The same pool httpx builds, on the asyncio-stream backend.
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=_Backend())


def make_client(limits: httpx.Limits, timeout: httpx.Timeout) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=_Transport(limits), timeout=timeout, trust_env=False)


def make_session(connections: int, connect_timeout: float, read_timeout: float):
    """The client for proxied requests: aiohttp's, whose HTTP parser is C (llhttp), where
    httpcore's h11 parses each streamed chunk in Python — most of the router's cost per token.

    Bodies pass untouched (no decompression, no Content-Type or User-Agent added); idle
    connections are kept 4 s, under uvicorn's 5 s keep-alive on the replicas' side, so that a
    request never goes out on a connection the replica is closing.
    """
    import aiohttp

    connector = aiohttp.TCPConnector(limit=connections, keepalive_timeout=4.0)
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_connect=connect_timeout,
                                    sock_read=read_timeout)
    # No cookie jar: a replica's Set-Cookie is for the client it answered, never to be replayed
    # on other clients' requests (and a jar costs a parse per answer).
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 cookie_jar=aiohttp.DummyCookieJar(),
                                 skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
                                 trust_env=False)
