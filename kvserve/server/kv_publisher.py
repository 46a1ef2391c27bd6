"""`kvserve serve --kv-events-endpoint tcp://*:5557`: the block pool's events on a ZMQ PUB socket
in vLLM's wire format (kvserve/kv/event_wire.py), with vLLM's replay socket, so gateways built for
vLLM (llm-d's precise prefix-cache scorer) and kvserve's own router follow a replica's KV cache.

Events go out in the form asked for (`--kv-events-format`, kvserve/kv/event_wire.py): array
(positional, llm-d's) or map (vLLM's newer tagged maps, vllm-router's); framing and replay are
the same for both. As vLLM's ZmqEventPublisher sends them: each message is [topic, sequence
number (8 bytes, big-endian, from 0), msgpack KVEventBatch]. The replay socket (ROUTER) answers a request
[identity, "", start sequence (8 bytes big-endian)] with every kept batch numbered from start,
as [identity, "", seq, payload] each, then [identity, "", -1 (8 bytes, signed), ""]; it keeps the
last `buffer_steps` batches (10,000), at most `buffer_bytes` (64 MiB) of them. As in vLLM, an
endpoint with `*` (or ipc://) is bound and any other tcp:// endpoint connected to (a subscriber
that binds, as llm-d's central one does).

The engine thread only records into the pool's event log (kvserve/kv/events.py); this module's
own thread waits on that log, encodes and sends, so the engine never waits on the network. A
subscriber that reads slowly or not at all has at most `hwm` batches queued for it (ZMQ's
default, not vLLM's 100,000: a batch may be hundreds of KiB); past that ZMQ drops that
subscriber's batches alone, and it sees the gap in sequence numbers and asks the replay socket. The
sockets are created (and a bad or busy address refused) when the server starts, before the
model loads; events flow once it has.
"""
from __future__ import annotations

import logging
import re
import threading
from collections import deque
from collections.abc import Callable

import zmq

from kvserve.kv import event_wire
from kvserve.kv.events import BlockEventLog

log = logging.getLogger("kvserve.server")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
HWM = 1000  # batches queued per subscriber
REPLAY_BYTES = 64 << 20  # of the batches kept for replay
_ENDPOINT = re.compile(r"^(tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})|ipc://.+)$")


def check_endpoint(value: str, flag: str) -> str:
    """The endpoint if it is one ZMQ takes, else a ValueError that says what to give."""
    m = _ENDPOINT.match(value)
    if m is None or (m.group(3) is not None and not 0 < int(m.group(3)) < 65536):
        raise ValueError(f"{flag} must be tcp://*:PORT (bind every interface), tcp://HOST:PORT (connect to a "
                         f"subscriber that binds there) or ipc://PATH; got {value!r}")
    return value


def binds(endpoint: str) -> bool:
    """vLLM's rule: `*`, `::` and ipc:// endpoints are bound, other tcp:// ones connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = HWM, form: event_wire.Format = "array",
                 buffer_bytes: int = REPLAY_BYTES) -> None:
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.form = form  # event_wire's array or map form of each event
        self.bound = binds(endpoint)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            (self._pub.bind if self.bound else self._pub.connect)(endpoint)
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot open the KV events socket ({endpoint if self._replay is None else replay_endpoint}): "
                             f"{e}; give a free port and an address of this host") from None
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque()  # for replay: (seq, payload), oldest first
        self._buffer_steps, self._buffer_bytes, self._buffered = buffer_steps, buffer_bytes, 0
        self._lock = threading.Lock()
        self._last_seq = -1  # the last batch's sequence number
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, source: Callable[[], tuple[BlockEventLog, int] | None]) -> None:
        """Publish from source()'s log (and block size) once it gives one (the model has loaded)."""
        self._thread = threading.Thread(target=self._run, args=(source,), name="kv-events-publisher", daemon=True)
        self._thread.start()

    def last_seq(self) -> int:
        """The last batch's sequence number (-1 before any). Read before a snapshot of the log, it
        splits the stream: batches up to it hold only events in the snapshot, and every event
        after the snapshot comes in a later batch (kvserve/router/kv_zmq.py resumes there)."""
        with self._lock:
            return self._last_seq

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # -- the publisher's thread ---------------------------------------------------------------
    def _run(self, source: Callable[[], tuple[BlockEventLog, int] | None]) -> None:
        events_log: BlockEventLog | None = None
        block_size, read = 0, 0
        while not self._stop.is_set():
            try:
                if events_log is None:
                    got = source()
                    if got is None:
                        self._serve_replay()
                        self._stop.wait(0.05)
                        continue
                    events_log, block_size = got
                events_log.wait_beyond(read, 0.05)
                self._serve_replay()
                page = events_log.blocks_since(read)
                if page.events is None:  # fell behind the log (or first read after it wrapped)
                    vllm_events = event_wire.to_vllm(page.held or [], block_size, snapshot=True)
                else:
                    vllm_events = event_wire.to_vllm(page.events, block_size)
                for batch in event_wire.batches(vllm_events):
                    self._send(batch)
                read = page.seq
            except Exception:  # the publisher must outlive one bad step
                log.exception("KV events publisher")
                self._stop.wait(0.1)

    def _send(self, batch: event_wire.KVEventBatch) -> None:
        payload = event_wire.encode(batch, self.form)
        seq = self._last_seq + 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._buffered += len(payload)
        while len(self._buffer) > self._buffer_steps or self._buffered > self._buffer_bytes:
            self._buffered -= len(self._buffer.popleft()[1])
        with self._lock:
            self._last_seq = seq

    def _serve_replay(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events replay: a request of %d frames ignored (want [\"\", start seq])", len(frames))
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", END_SEQ, b""))
