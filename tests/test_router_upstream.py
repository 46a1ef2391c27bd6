"""The router's HTTP/1.1 client to replicas (kvserve/router/upstream.py), against real servers on
127.0.0.1: small asyncio servers that answer exactly as each test scripts (framing, keep-alive,
answers cut short or never sent), and uvicorn for a real replica's keep-alive."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvserve.router.upstream import ConnectError, ConnectionLost, ConnectTimeout, ReadTimeout, Upstream
from server_harness import free_port

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class Scripted:
    """An HTTP server on loopback whose every connection runs `script(reader, writer, n)` (n: the
    connection's number, from 0); it records each request head it reads, and the connections."""

    def __init__(self, script) -> None:
        self.script = script
        self.connections = 0
        self.heads: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                return await reader.readexactly(int(line.split(b":")[1]))
        return b""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n, self.connections = self.connections, self.connections + 1
        try:
            await self.script(self, reader, writer, n)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()


def run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


async def get(upstream: Upstream, url: str, body: bytes = b"") -> tuple[int, bytes]:
    response = await upstream.request(url, b"POST", b"/v1/x?a=%20b", b"x-note: n\r\n", body)
    return response.status, await response.body()


def test_requests_go_out_as_given_and_a_kept_alive_connection_is_reused() -> None:
    async def answer_each(server, reader, writer, n):
        while True:
            body = await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nX-Up: %d\r\n\r\n%s" % (len(body), n, body))

    async def test():
        server = Scripted(answer_each)
        url = await server.start()
        upstream = Upstream(connections=4, connect_timeout=2, read_timeout=5)
        response = await upstream.request(url, b"POST", b"/v1/x?a=%20b", b"x-note: n\r\n", b'{"a": 1}')
        assert (response.status, response.header(b"x-up"), await response.body()) == (200, b"0", b'{"a": 1}')
        assert await get(upstream, url, b"second") == (200, b"second")
        assert server.connections == 1  # the second request reused the first's connection
        host = url.removeprefix("http://").encode()
        assert server.heads[0] == (b"POST /v1/x?a=%20b HTTP/1.1\r\nhost: " + host + b"\r\nx-note: n\r\n"
                                   b"content-length: 8\r\n\r\n")
        await upstream.close()
        await server.stop()

    run(test)


def test_a_connection_the_replica_closed_while_idle_is_not_reused() -> None:
    async def answer_then_close(server, reader, writer, n):
        await server.read_request(reader)
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.05)  # then it closes: as uvicorn does past its keep-alive

    async def test():
        server = Scripted(answer_then_close)
        url = await server.start()
        upstream = Upstream(connections=4, connect_timeout=2, read_timeout=5)
        assert await get(upstream, url) == (200, b"ok")
        await asyncio.sleep(0.3)
        assert await get(upstream, url) == (200, b"ok")  # not sent on the closed connection
        assert server.connections == 2
        await upstream.close()
        await server.stop()

    run(test)


def test_an_idle_connection_past_the_idle_timeout_is_replaced_before_the_replica_drops_it() -> None:
    """A real uvicorn replica keeps connections 5 s; the router's pool gives them up earlier (its
    idle_timeout, 4 s by default, here 0.2 s), so a request never races the replica's close."""
    clients = []

    async def where(request: Request) -> JSONResponse:
        clients.append(request.scope["client"][1])
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/x", where, methods=["POST"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    async def test():
        upstream = Upstream(connections=4, connect_timeout=2, read_timeout=5, idle_timeout=0.2)
        url = f"http://127.0.0.1:{port}"
        for _ in range(3):
            assert await get(upstream, url) == (200, b'{"ok":true}')
        await asyncio.sleep(0.4)
        assert await get(upstream, url) == (200, b'{"ok":true}')
        await upstream.close()

    try:
        run(test)
    finally:
        server.should_exit = True
        thread.join(5)
    assert clients[0] == clients[1] == clients[2] != clients[3]  # kept alive, then a new connection


@pytest.mark.parametrize("first, then", [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello", b" world"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", b"6\r\n world\r\n0\r\n\r\n"),
    (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello", b" world"),  # until the connection closes
])
def test_bodies_framed_by_length_by_chunks_or_by_the_close_arrive_whole(first, then) -> None:
    async def send_in_two_parts(server, reader, writer, n):
        await server.read_request(reader)
        writer.write(first)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(then)
        await writer.drain()
        if b"connection: close" not in first:
            await asyncio.sleep(5)

    async def test():
        server = Scripted(send_in_two_parts)
        url = await server.start()
        upstream = Upstream(connections=4, connect_timeout=2, read_timeout=5)
        response = await upstream.request(url, b"GET", b"/", b"", b"")
        parts = [part async for part in _parts(response)]
        assert parts == [b"hello", b" world"]  # as they arrived, not held until the end
        # A framed answer leaves its connection ready for the next request; one ended by the close does not.
        assert len(upstream.pools[url].idle) == (0 if b"connection: close" in first else 1)
        await upstream.close()
        await server.stop()

    run(test)


async def _parts(response):
    while part := await response.read():
        yield part


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\na\r\nonly ten b\r\n",
])
def test_an_answer_cut_mid_body_raises_connection_lost_after_what_arrived(answer) -> None:
    async def cut(server, reader, writer, n):
        await server.read_request(reader)
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(0.05)  # then the connection closes: a replica that died

    async def test():
        server = Scripted(cut)
        url = await server.start()
        upstream = Upstream(connections=4, connect_timeout=2, read_timeout=5)
        response = await upstream.request(url, b"GET", b"/", b"", b"")
        assert await response.read() == b"only ten b"
        with pytest.raises(ConnectionLost, match="closed the connection during its answer"):
            await response.read()
        assert not upstream.pools[url].idle and not upstream.pools[url].open  # nothing broken kept
        await upstream.close()
        await server.stop()

    run(test)


def test_a_replica_closing_before_its_answer_is_connection_lost_and_a_closed_port_a_connect_error() -> None:
    async def close_at_once(server, reader, writer, n):
        await server.read_request(reader)

    async def test():
        server = Scripted(close_at_once)
        url = await server.start()
        upstream = Upstream(connections=4, connect_timeout=2, read_timeout=5)
        with pytest.raises(ConnectionLost, match="before its answer"):
            await get(upstream, url)
        with pytest.raises(ConnectError, match="cannot connect"):
            await get(upstream, f"http://127.0.0.1:{free_port()}")
        await upstream.close()
        await server.stop()

    run(test)


def test_silence_past_the_read_timeout_raises_read_timeout_before_and_during_the_answer() -> None:
    async def head_then_silence(server, reader, writer, n):
        await server.read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nfive ")
            await writer.drain()
        await asyncio.sleep(5)

    async def test():
        server = Scripted(head_then_silence)
        url = await server.start()
        upstream = Upstream(connections=4, connect_timeout=2, read_timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(ReadTimeout, match="sent nothing for 0.3 s"):
            await get(upstream, url)  # no head
        response = await upstream.request(url, b"GET", b"/", b"", b"")
        assert await response.read() == b"five "
        with pytest.raises(ReadTimeout):
            await response.read()  # half a body, then nothing
        assert 0.5 < time.monotonic() - t0 < 3
        assert server.connections == 2  # the timed-out connection was not reused
        await upstream.close()
        await server.stop()

    run(test)


def test_closing_an_unfinished_answer_closes_its_connection_so_the_replica_sees_the_client_leave() -> None:
    async def stream_until_closed(server, reader, writer, n):
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"6\r\ntoken \r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
                if reader.at_eof() or writer.is_closing():
                    break
                try:
                    await asyncio.wait_for(reader.read(1), 0.001)
                except TimeoutError:
                    continue
                break  # EOF: the client left
        finally:
            server.closed_by_client.set()

    async def test():
        server = Scripted(stream_until_closed)
        url = await server.start()
        upstream = Upstream(connections=4, connect_timeout=2, read_timeout=5)
        response = await upstream.request(url, b"GET", b"/", b"", b"")
        assert (await response.read()).startswith(b"token ")
        response.close()
        await asyncio.wait_for(server.closed_by_client.wait(), 5)
        await upstream.close()
        await server.stop()

    run(test)


def test_a_slow_reader_stops_the_connection_reading_and_a_full_pool_times_out_waiting() -> None:
    big = b"x" * (1 << 20)

    async def send_big(server, reader, writer, n):
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(big), big))
        await writer.drain()
        await asyncio.sleep(5)

    async def test():
        server = Scripted(send_big)
        url = await server.start()
        upstream = Upstream(connections=1, connect_timeout=0.3, read_timeout=5)
        response = await upstream.request(url, b"GET", b"/", b"", b"")
        await asyncio.sleep(0.3)  # the replica sends 1 MiB; nobody reads it yet
        conn = next(iter(upstream.pools[url].open))
        assert not conn.transport.is_reading() and response._queued < len(big)  # the rest waits in the socket
        with pytest.raises(ConnectTimeout, match="no connection"):
            await upstream.request(url, b"GET", b"/", b"", b"")  # the one connection allowed is busy
        assert await response.body() == big
        await upstream.close()
        await server.stop()

    run(test)
