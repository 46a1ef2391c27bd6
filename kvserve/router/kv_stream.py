"""The precise index's ZMQ source: one follower per replica that advertises a stream, kept across
resyncs, applying its batches to the replica's blocks and checking that the stream reaches here.

kvserve/router/kv_index.py reads a replica's `GET /kv/events` in full and, when the answer names
a ZMQ endpoint, hands the replica to `StreamSource.follow` until the stream cannot go on (a
`Resync`: a lost batch replay no longer keeps, a publisher that started over); then it reads in
full again. Every `check_every` seconds the follower reads the replica's fields alone
(`?head=true`): another instance, or a batch the replica had sent by the last check that has
still not arrived (its ZMQ port does not reach the router), is a Resync too, with one warning.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from kvserve.router.kv_page import parse_page, read_body
from kvserve.router.kv_zmq import Resync, ZmqFollower, apply_batch, replica_endpoint
from kvserve.router.replicas import Replica

if TYPE_CHECKING:
    from kvserve.router.kv_blocks import ReplicaBlocks

log = logging.getLogger("kvserve.router")


class StreamSource:
    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str], max_bytes: int, max_held: int,
                 tick: float, check_every: float) -> None:
        self.client, self.headers = client, headers
        self.max_bytes, self.max_held = max_bytes, max_held
        self.tick, self.check_every = tick, check_every
        self._followers: dict[Replica, ZmqFollower] = {}
        self._unreached: set[Replica] = set()  # warned once each

    def forget(self, replica: Replica) -> None:
        f = self._followers.pop(replica, None)
        if f is not None:
            f.close()

    def close(self) -> None:
        for f in self._followers.values():
            f.close()
        self._followers.clear()

    async def follow(self, replica: Replica, b: ReplicaBlocks, alive: Callable[[], bool],
                     each_tick: Callable[[], None]) -> None:
        """Apply the replica's batches after the answer just read (b.stream) to b.held until a
        Resync or until alive() turns false; each_tick runs after every batch and idle tick."""
        if b.stream is None:
            raise ValueError(f"{replica.url} advertised no KV event stream to follow")
        endpoint, replay, topic, seq = b.stream
        pub = replica_endpoint(endpoint, replica.url)
        rep = replica_endpoint(replay, replica.url) if replay is not None else None
        f = self._followers.get(replica)
        if f is None or (f.endpoint, f.replay_endpoint, f.topic) != (pub, rep, topic):
            if f is not None:
                f.close()
            f = self._followers[replica] = ZmqFollower(pub, rep, topic, self.max_bytes)
        f.restart_at(seq)
        replica.extra["kv_events"] = f"followed over ZMQ ({pub})"
        check_at, sent = time.monotonic() + self.check_every, None
        try:
            async for batch in f.batches(alive, self.tick):
                if batch is not None:
                    apply_batch(b.held, batch, b.block_size, self.max_held)
                    replica.extra["blocks_held"] = len(b.held)
                each_tick()
                if time.monotonic() >= check_at:
                    sent = await self._check(replica, b, f, sent)
                    check_at = time.monotonic() + self.check_every
        except Resync as e:
            log.info("%s: its KV events stream: %s; reading /kv/events in full", replica.url, e)

    async def _check(self, replica: Replica, b: ReplicaBlocks, f: ZmqFollower, sent: int | None) -> int | None:
        """Resync if the replica is another instance or batch `sent` (the last it had sent at the
        previous check) has not arrived; else the last batch it has sent now."""
        async with asyncio.timeout(10.0):
            async with self.client.stream("GET", replica.url + "/kv/events", params={"head": "true"},
                                          headers=self.headers, timeout=5.0) as r:
                if r.status_code != 200:
                    return sent  # the health loop judges the replica
                body = await read_body(r, 64 << 10)
        data = parse_page(body, self.max_held, head=True).fields
        if data.get("instance") != b.instance:
            raise Resync("it restarted")
        if sent is not None and f.next <= sent:
            if replica not in self._unreached:
                self._unreached.add(replica)
                log.warning("%s: its ZMQ KV events (%s) do not reach the router; reading /kv/events every %g s "
                            "instead", replica.url, f.endpoint, self.check_every)
            raise Resync(f"batch {sent} was sent {self.check_every:g} s ago and has not arrived")
        return data.get("kv_events_seq", -1)
