"""The ZMQ source of the precise cache_aware index: a replica's KV events as vLLM sends them.

A replica started with `--kv-events-endpoint` names its PUB (and replay) endpoint in its
`GET /kv/events` answer (kvserve/server/kv_events.py), with `kv_events_seq`: the last batch sent
before that answer's events were read. The router (kvserve/router/kv_index.py) takes the answer as
its starting state, then follows the stream from the next batch: a batch it missed (the gap
between the answer and its subscription, a dropped message) it asks the replay socket for; what
replay no longer keeps, or a publisher that started over (its numbers go back), sends it back to
a full `GET /kv/events`. Events arrive as the replica's engine records them, not at the next poll.

Believed only so far, as the HTTP answer is (kvserve/router/kv_page.py): a message larger than
the HTTP answer's limit is dropped by ZMQ itself (MAXMSGSIZE), a payload that is not a
KVEventBatch of 32-byte hashes in the replica's block size, or a set past the held-blocks limit,
is a broken rule. The router connects only to the replica's own host (a `*` endpoint means it):
a replica cannot point the router's sockets elsewhere.
"""
from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from kvserve.kv import event_wire
from kvserve.router.kv_page import BrokenRule

log = logging.getLogger("kvserve.router")

END_SEQ = -1
_WILDCARDS = {"*", "0.0.0.0", "::", "[::]"}
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
REPLAY_TIMEOUT = 2.0  # seconds for the replay socket's whole answer
_THREAD_BYTES = 64 << 10  # payloads larger than this are decoded on a worker thread


def replica_endpoint(advertised: str, replica_url: str) -> str:
    """The advertised endpoint as the router reaches it: `*` becomes the replica's host; another
    host than the replica's is refused (BrokenRule); ipc:// only for a replica on loopback."""
    host = urlsplit(replica_url).hostname or ""
    if advertised.startswith("ipc://"):
        if host not in _LOOPBACK:
            raise BrokenRule(f"it names the ipc endpoint {advertised[:200]!r} but is not on this host")
        return advertised
    if not advertised.startswith("tcp://") or ":" not in advertised[6:]:
        raise BrokenRule(f"its KV events endpoint {advertised[:200]!r} is not tcp://HOST:PORT")
    where, _, port = advertised[6:].rpartition(":")
    if not port.isdigit():
        raise BrokenRule(f"its KV events endpoint {advertised[:200]!r} has no port")
    if where not in _WILDCARDS and where.strip("[]") != host:
        raise BrokenRule(f"its KV events endpoint {advertised[:200]!r} is not on its own host {host}")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Resync(Exception):
    """The stream cannot continue from here: take a full GET /kv/events first."""


class ZmqFollower:
    """One replica's stream: a SUB socket kept across resyncs (so nothing is lost while the
    router reads a full answer) and a DEALER on its replay socket."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, max_bytes: int) -> None:
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        ctx = zmq.asyncio.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self._max_bytes = max_bytes
        self.next = 0  # the batch number wanted next
        self._last_sub = -1  # the last number seen on SUB (they only grow while the publisher lives)

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def restart_at(self, last_seq: int) -> None:
        """A full answer was taken whose events reach batch last_seq: continue after it."""
        self.next = last_seq + 1
        self._last_sub = -1

    async def batches(self, alive, tick: float):
        """Yield decoded batches in order, catching up from replay first; raise Resync when the
        stream cannot go on. Yields None every `tick` seconds without a message (so the caller
        can check on the replica)."""
        for batch in await self._catch_up():
            yield batch
        while alive():
            if not await self._sub.poll(int(tick * 1000)):
                yield None
                continue
            frames = await self._sub.recv_multipart()
            seq, payload = _frames(frames, 3)
            if seq <= self._last_sub:
                raise Resync("its publisher started over")
            self._last_sub = seq
            if seq < self.next:  # had it from a replay already
                continue
            if seq > self.next:  # missed some: ask the replay socket, which may no longer keep them
                for batch in await self._catch_up():
                    yield batch
                if seq < self.next:
                    continue
                if seq > self.next:
                    raise Resync(f"batches {self.next}..{seq - 1} are lost")
            self.next = seq + 1
            yield await _decode(payload)

    async def _catch_up(self) -> list[event_wire.KVEventBatch]:
        """Everything the replay socket keeps from self.next on, in order (none without one)."""
        out: list[event_wire.KVEventBatch] = []
        if self.replay_endpoint is None:
            return out
        if self._replay is None:
            self._replay = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
            self._replay.connect(self.replay_endpoint)
        await self._replay.send_multipart((b"", self.next.to_bytes(8, "big")))
        deadline = time.monotonic() + REPLAY_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await self._replay.poll(int(left * 1000)):
                self._replay.close(linger=0)  # a late answer must not be read as the next one's
                self._replay = None
                raise Resync("its replay socket did not answer")
            seq, payload = _frames(await self._replay.recv_multipart(), 3, replay=True)
            if seq == END_SEQ:
                return out
            if seq < self.next:
                continue
            if seq > self.next:
                raise Resync(f"its replay no longer keeps batch {self.next}")
            self.next = seq + 1
            out.append(await _decode(payload))


def _frames(frames: list[bytes], n: int, replay: bool = False) -> tuple[int, bytes]:
    """(sequence number, payload) of [topic, seq, payload], or of replay's ["", seq, payload]."""
    if len(frames) != n or len(frames[1]) != 8 or (replay and frames[0] != b""):
        raise BrokenRule(f"a KV events message of {len(frames)} frames is not [topic, 8-byte seq, payload]")
    return int.from_bytes(frames[1], "big", signed=replay), frames[2]


async def _decode(payload: bytes) -> event_wire.KVEventBatch:
    try:
        if len(payload) > _THREAD_BYTES:
            return await asyncio.to_thread(event_wire.decode, payload)
        return event_wire.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BrokenRule(f"a KV events payload is not a KVEventBatch: {str(e)[:200]}") from None


def apply_batch(held: set[bytes], batch: event_wire.KVEventBatch, block_size: int, max_held: int) -> None:
    """One batch's events on the replica's set; a wrong hash or block size, or a set past
    max_held, is a broken rule."""
    for e in batch.events:
        if isinstance(e, event_wire.AllBlocksCleared):
            held.clear()
            continue
        if any(len(h) != 32 for h in e.block_hashes):
            raise BrokenRule("a KV event's block hash is not 32 bytes (a chained SHA-256)")
        if isinstance(e, event_wire.BlockStored):
            if e.block_size != block_size:
                raise BrokenRule(f"a KV event's block size {e.block_size} is not its /kv/events' {block_size}")
            held.update(e.block_hashes)
        else:
            held.difference_update(e.block_hashes)
    if len(held) > max_held:
        raise BrokenRule(f"it says it holds {len(held)} blocks, more than the router's limit of {max_held}")
