"""KV events in vLLM's wire format over ZMQ: what `kvserve serve --kv-events-endpoint` sends, read
as a vLLM consumer reads it, and kvserve's router following it.

The payloads are decoded here by a msgpack reader written in this file from vLLM's documented
schema (vllm/distributed/kv_events.py: msgspec structs with array_like=True, tag=True), not by
kvserve's own decoder; a second check decodes them with msgspec structs laid out as vLLM's newest
ones are (trailing fields with defaults), and a third with vLLM's own classes where vllm is
importable. The hashes are recomputed here from the prompt's token ids.
"""
from __future__ import annotations

import hashlib
import logging
import struct
import subprocess
import sys
import time
from array import array

import httpx
import msgspec
import pytest
import zmq

from kvserve.kv import event_wire
from kvserve.kv.events import REMOVED, STORED, BlockEventLog
from kvserve.router.kv_zmq import Resync, ZmqFollower, apply_batch, replica_endpoint
from kvserve.router.kv_page import BrokenRule
from kvserve.server.kv_publisher import HWM, KVEventPublisher
from router_harness import RouterThread
from server_harness import MODEL_NAME, REPO, ServerProcess, free_port, tiny_model_dir

BLOCK = 16


# -- an independent reader: msgpack as the spec defines it, vLLM's layout by position -----------
class Msgpack:
    """Just the msgpack types a KVEventBatch uses."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        assert len(out) == n, "truncated"
        self.pos += n
        return out

    def value(self):
        b = self.take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x90 <= b <= 0x9F:
            return [self.value() for _ in range(b & 0x0F)]
        if 0x80 <= b <= 0x8F:
            return self.pairs(b & 0x0F)
        if 0xA0 <= b <= 0xBF:
            return self.take(b & 0x1F).decode()
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        sized = {0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin"), 0xD9: (">B", "str"),
                 0xDA: (">H", "str"), 0xDB: (">I", "str"), 0xDC: (">H", "arr"), 0xDD: (">I", "arr"),
                 0xDE: (">H", "map"), 0xDF: (">I", "map")}
        if b in sized:
            fmt, kind = sized[b]
            n = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
            if kind == "arr":
                return [self.value() for _ in range(n)]
            if kind == "map":
                return self.pairs(n)
            raw = self.take(n)
            return raw if kind == "bin" else raw.decode()
        numbers = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h",
                   0xD2: ">i", 0xD3: ">q"}
        fmt = numbers[b]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def pairs(self, n: int) -> dict:
        out = {}
        for _ in range(n):
            key = self.value()
            assert isinstance(key, str) and key not in out, key
            out[key] = self.value()
        return out


def read_batch(payload: bytes) -> dict:
    """vLLM's KVEventBatch: [ts, events, data_parallel_rank]; each event [tag, fields...]."""
    r = Msgpack(payload)
    ts, events, rank = r.value()
    assert r.pos == len(payload)
    fields = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                              "lora_name"),
              "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}
    out = []
    for e in events:
        names = fields[e[0]]
        assert len(e) == 1 + len(names), e
        out.append({"type": e[0], **dict(zip(names, e[1:]))})
    return {"ts": ts, "events": out, "data_parallel_rank": rank}


def read_map_batch(payload: bytes) -> dict:
    """vLLM's newer form: the same [ts, events, data_parallel_rank], each event a map whose first
    key is the tag, "type", then the fields in declaration order."""
    r = Msgpack(payload)
    ts, events, rank = r.value()
    assert r.pos == len(payload)
    for e in events:
        assert list(e)[0] == "type", e
    return {"ts": ts, "events": events, "data_parallel_rank": rank}


def chain(token_ids: list[int]) -> list[bytes]:
    """kvserve's block hashes, recomputed: SHA-256 over the parent's hash (or b"kvserve-root") and
    the block's token ids as int64; never the block holding the last token."""
    out, parent = [], b"kvserve-root"
    for i in range((len(token_ids) - 1) // BLOCK):
        parent = hashlib.sha256(parent + array("q", token_ids[i * BLOCK:(i + 1) * BLOCK]).tobytes()).digest()
        out.append(parent)
    return out


# -- vLLM's newest layout, as msgspec structs (fields with defaults after the seven) -----------
class _VEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_VEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_VEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_VEvent):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# vLLM's newer layout, the map form: the same tags and fields, events without array_like.
class _VMapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(_VMapEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MapBlockRemoved(_VMapEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(_VMapEvent, tag="AllBlocksCleared"):
    pass


class VllmMapBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]
    data_parallel_rank: int | None = None


H = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]


def test_a_chain_of_stores_is_one_block_stored_and_evictions_one_block_removed():
    log = BlockEventLog()
    log.record(STORED, H[0], None, tuple(range(16)))
    log.record(STORED, H[1], H[0], tuple(range(16, 32)))
    log.record(STORED, H[2], None, tuple(range(100, 116)))  # another chain
    log.record(REMOVED, H[1])
    log.record(REMOVED, H[0])
    events = event_wire.to_vllm(log.blocks_since(0).events, 16)
    [batch] = event_wire.batches(events)
    got = read_batch(event_wire.encode(batch))
    assert got["data_parallel_rank"] == 0 and abs(got["ts"] - time.time()) < 5
    assert got["events"] == [
        {"type": "BlockStored", "block_hashes": [H[0], H[1]], "parent_block_hash": None, "token_ids": list(range(32)),
         "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [H[2]], "parent_block_hash": None,
         "token_ids": list(range(100, 116)), "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [H[1], H[0]], "medium": "CPU"}]
    vllm = msgspec.msgpack.decode(event_wire.encode(batch), type=VllmBatch)
    assert [type(e).__name__ for e in vllm.events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert vllm.events[0].block_hashes == [H[0], H[1]] and vllm.events[0].group_idx is None


def test_the_map_form_is_the_same_events_as_tagged_maps_in_a_positional_batch():
    log = BlockEventLog()
    log.record(STORED, H[0], None, tuple(range(16)))
    log.record(STORED, H[1], H[0], tuple(range(16, 32)))
    log.record(REMOVED, H[1])
    log.record(STORED, H[2], None, tuple(range(100, 116)))
    events = event_wire.to_vllm(log.blocks_since(0).events, 16, snapshot=True)
    [batch] = event_wire.batches(events)
    payload = event_wire.encode(batch, "map")
    got = read_map_batch(payload)
    assert got["data_parallel_rank"] == 0 and got["ts"] == batch.ts
    assert got["events"] == [
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [H[0], H[1]], "parent_block_hash": None, "token_ids": list(range(32)),
         "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [H[1]], "medium": "CPU"},
        {"type": "BlockStored", "block_hashes": [H[2]], "parent_block_hash": None,
         "token_ids": list(range(100, 116)), "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None}]
    # The seven required fields in declaration order, nil ones too; the defaulted ones left out.
    assert [list(e) for e in got["events"]] == [["type"], STORED_KEYS, ["type", "block_hashes", "medium"], STORED_KEYS]
    vllm = msgspec.msgpack.decode(payload, type=VllmMapBatch)
    assert [type(e).__name__ for e in vllm.events] == ["MapAllBlocksCleared", "MapBlockStored", "MapBlockRemoved",
                                                       "MapBlockStored"]
    assert vllm.events[1].token_ids == list(range(32)) and vllm.events[1].group_idx is None
    # One decoder for both forms: kvserve's router follows a replica in either.
    assert event_wire.decode(payload) == event_wire.decode(event_wire.encode(batch)) == batch
    with pytest.raises(msgspec.DecodeError):  # an array-form reader cannot read maps (llm-d keeps the default)
        msgspec.msgpack.decode(payload, type=VllmBatch)


def test_a_snapshot_clears_first_and_lists_parents_before_children():
    log = BlockEventLog(capacity=2)
    log.record(STORED, H[0], None, (1,) * 16)
    log.record(STORED, H[1], H[0], (2,) * 16)
    log.record(REMOVED, H[0])
    log.record(STORED, H[0], None, (1,) * 16)  # the parent again, newer than its child
    page = log.blocks_since(0)  # fell behind a log of 2
    assert page.events is None
    got = read_batch(event_wire.encode(next(event_wire.batches(event_wire.to_vllm(page.held, 16, snapshot=True)))))
    assert [e["type"] for e in got["events"]] == ["AllBlocksCleared", "BlockStored"]
    assert got["events"][1]["block_hashes"] == [H[0], H[1]] and got["events"][1]["token_ids"] == [1] * 16 + [2] * 16


# -- a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def publishing(tmp_path_factory):
    pub, replay = free_port(), free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = ServerProcess(tiny_model_dir(tmp_path_factory), log, "--kv-events-endpoint", f"tcp://*:{pub}",
                           "--kv-events-replay-endpoint", f"tcp://*:{replay}", "--kv-events-topic", "kv@pod-a@tiny")
    server.wait_ready()
    yield server, pub, replay
    server.stop()


def test_a_served_prompts_blocks_arrive_as_vllm_sends_them_and_replay_repeats_them(publishing):
    server, pub, replay = publishing
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@pod-a")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    prompt = " ".join(f"word{i}" for i in range(40))
    with server.client() as c:
        time.sleep(0.5)  # a SUB socket joins a moment after connect (ZMQ's slow joiner)
        ids = c.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert len(ids) > 3 * BLOCK
        assert c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 1}).status_code == 200
        messages = []
        while sub.poll(1000):
            messages.append(sub.recv_multipart())
        # Read once the stream is quiet: the publisher sends on its own thread, a moment after the engine records.
        start = c.get("/kv/events").json()
    sub.close(0)
    assert start["kv_events_endpoint"] == f"tcp://*:{pub}" and start["kv_events_topic"] == "kv@pod-a@tiny"
    # The engine records block by block; the publisher sends what it finds each time it wakes.
    assert [m[1] for m in messages] == [i.to_bytes(8, "big") for i in range(len(messages))]
    assert start["kv_events_seq"] == len(messages) - 1 and {m[0] for m in messages} == {b"kv@pod-a@tiny"}
    stored = [e for m in messages for e in read_batch(m[2])["events"]]
    assert {e["type"] for e in stored} == {"BlockStored"}
    hashes = chain(ids)
    assert [h for e in stored for h in e["block_hashes"]] == hashes
    assert [t for e in stored for t in e["token_ids"]] == ids[:len(hashes) * BLOCK]
    assert [e["parent_block_hash"] for e in stored] == [None] + [e["block_hashes"][-1] for e in stored[:-1]]
    assert {(e["block_size"], e["medium"], e["lora_id"], e["lora_name"]) for e in stored} == {(BLOCK, "CPU", None, None)}

    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    answer = []
    while dealer.poll(3000):
        answer.append(dealer.recv_multipart())
        if answer[-1][1] == (-1).to_bytes(8, "big", signed=True):
            break
    dealer.close(0)
    assert answer == [[b"", seq, payload] for _, seq, payload in messages] + [[b"", (-1).to_bytes(8, "big", signed=True), b""]]


@pytest.mark.parametrize("given, says", [
    (["--kv-events-endpoint", "localhost:5557"], "--kv-events-endpoint must be tcp://*:PORT"),
    (["--kv-events-endpoint", "tcp://*:99999"], "--kv-events-endpoint must be tcp://*:PORT"),
    (["--kv-events-replay-endpoint", "tcp://*:5558"], "--kv-events-replay-endpoint needs --kv-events-endpoint"),
    (["--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://10.0.0.1:5558"],
     "--kv-events-replay-endpoint is bound, so give tcp://*:PORT"),
])
def test_a_bad_endpoint_is_refused_at_start_saying_what_to_give(tmp_path_factory, given, says):
    r = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--model", str(tiny_model_dir(tmp_path_factory)),
                        "--port", str(free_port()), *given], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and says in r.stderr, r.stderr


@pytest.mark.parametrize("given, says", [
    (["--kv-events-format", "map"], "--kv-events-format needs --kv-events-endpoint (the PUB socket whose events it "
                                    "shapes)"),
    (["--kv-events-endpoint", "tcp://*:5557", "--kv-events-format", "json"],
     "--kv-events-format must be array (what llm-d reads) or map (what vllm-router's kv_aware reads); got 'json'"),
])
def test_a_bad_events_format_is_refused_by_the_checks_serve_runs_before_loading(given, says):
    from kvserve.commands import build_parser
    from kvserve.commands.serve import _check_kv_events

    args = build_parser().parse_args(["serve", "--model", "unused", *given])
    with pytest.raises(ValueError) as refused:
        _check_kv_events(args)
    assert str(refused.value) == says


def test_a_busy_port_is_refused_at_start(tmp_path_factory):
    port = free_port()
    holder = zmq.Context.instance().socket(zmq.PUB)
    holder.bind(f"tcp://*:{port}")
    try:
        r = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--model", str(tiny_model_dir(tmp_path_factory)),
                            "--port", str(free_port()), "--kv-events-endpoint", f"tcp://*:{port}"],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    finally:
        holder.close(0)
    assert r.returncode != 0 and "cannot open the KV events socket" in r.stderr, r.stderr


# -- the router's follower against a real publisher, in process ----------------------------------
def test_a_late_follower_catches_up_from_replay_and_a_lost_batch_sends_it_back_to_a_full_read():
    import asyncio

    pub_port, replay_port = free_port(), free_port()
    log = BlockEventLog()
    publisher = KVEventPublisher(f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", buffer_steps=2)
    publisher.start(lambda: (log, BLOCK))
    try:
        log.record(STORED, H[0], None, (1,) * BLOCK)
        deadline = time.monotonic() + 5
        while publisher.last_seq() < 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        async def follow(first_seq: int, want: int) -> set[bytes]:
            f = ZmqFollower(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", "", 1 << 20)
            held: set[bytes] = set()
            f.restart_at(first_seq)
            try:
                async for batch in f.batches(lambda: len(held) < want, 0.05):
                    if batch is not None:
                        apply_batch(held, batch, BLOCK, 100)
            finally:
                f.close()
            return held

        # Joined after batch 0 was sent: replay gives it.
        assert asyncio.run(asyncio.wait_for(follow(-1, 1), 10)) == {H[0]}
        for i in (1, 2, 3):  # three more batches: replay keeps the last two
            log.record(STORED, H[i], None, (i,) * BLOCK)
            while publisher.last_seq() < i:
                time.sleep(0.01)
        with pytest.raises(Resync, match="no longer keeps batch 0"):
            asyncio.run(asyncio.wait_for(follow(-1, 4), 10))
    finally:
        publisher.close()


def test_a_stalled_subscriber_queues_at_most_the_high_water_mark_and_replay_is_bounded_by_bytes():
    """A subscriber that reads nothing costs at most HWM batches in the publisher (vLLM's 100,000
    queued all 1,500 batches of 90 KB here: 135 MB); ZMQ drops its later ones, and it sees the gap.
    The replay buffer keeps the newest batches within its byte bound."""
    pub_port, replay_port = free_port(), free_port()
    batch = event_wire.KVEventBatch(0.0, [event_wire.BlockStored([bytes(32)], None, [70_000] * 30_000, 30_000,
                                                                 None, "CPU", None)], 0)
    size = len(event_wire.encode(batch, "array"))
    assert size > 80_000  # big enough that the kernel's socket buffers hold few of them
    publisher = KVEventPublisher(f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", buffer_bytes=10 * size)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        time.sleep(0.3)  # ZMQ's slow joiner
        sent = HWM + 500
        for _ in range(sent):
            publisher._send(batch)  # as the publisher's thread sends each batch it encodes
        time.sleep(0.5)
        seqs = []
        while sub.poll(500):
            seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert seqs == list(range(len(seqs))) and len(seqs) <= HWM + 100 < sent, len(seqs)
        publisher.start(lambda: None)  # no pool's log: the thread only answers replay
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(3000) and (frames := dealer.recv_multipart())[2]:
            replayed.append(int.from_bytes(frames[1], "big"))
        dealer.close(0)
        assert replayed == list(range(sent - 10, sent))
    finally:
        sub.close(0)
        publisher.close()


@pytest.mark.parametrize("form", event_wire.FORMATS)
def test_the_router_follows_a_publisher_in_either_form(form):
    import asyncio

    pub_port = free_port()
    log = BlockEventLog()
    publisher = KVEventPublisher(f"tcp://*:{pub_port}", form=form)
    assert publisher.form == form

    async def follow() -> set[bytes]:
        f = ZmqFollower(f"tcp://127.0.0.1:{pub_port}", None, "", 1 << 20)
        held: set[bytes] = set()
        f.restart_at(-1)
        try:
            await asyncio.sleep(0.3)  # a SUB socket joins a moment after connect (ZMQ's slow joiner)
            publisher.start(lambda: (log, BLOCK))
            log.record(STORED, H[0], None, (1,) * BLOCK)
            log.record(STORED, H[1], H[0], (2,) * BLOCK)
            log.record(REMOVED, H[0])
            async for batch in f.batches(lambda: held != {H[1]}, 0.05):
                if batch is not None:
                    apply_batch(held, batch, BLOCK, 100)
        finally:
            f.close()
        return held

    try:
        assert asyncio.run(asyncio.wait_for(follow(), 10)) == {H[1]}
    finally:
        publisher.close()


def test_an_endpoint_on_another_host_is_a_broken_rule():
    assert replica_endpoint("tcp://*:5557", "http://127.0.0.1:8000") == "tcp://127.0.0.1:5557"
    assert replica_endpoint("tcp://10.1.2.3:5557", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5557"
    with pytest.raises(BrokenRule, match="not on its own host"):
        replica_endpoint("tcp://10.9.9.9:5557", "http://10.1.2.3:8000")
    with pytest.raises(BrokenRule, match="not on this host"):
        replica_endpoint("ipc:///tmp/x", "http://10.1.2.3:8000")


# -- kvserve's router following two replicas over ZMQ -------------------------------------------
@pytest.mark.slow
def test_router_follows_two_replicas_over_zmq_and_routes_a_shared_prefix_to_its_holder(tmp_path_factory):
    replicas = []
    for _ in range(2):
        log = tmp_path_factory.mktemp("server") / "server.log"
        replicas.append(ServerProcess(tiny_model_dir(tmp_path_factory), log, "--kv-cache-gib", "0.0003",
                                      "--kv-events-endpoint", f"tcp://*:{free_port()}",
                                      "--kv-events-replay-endpoint", f"tcp://*:{free_port()}"))
    router = None
    try:
        for s in replicas:
            s.wait_ready()
        router = RouterThread([s.url for s in replicas], "cache_aware", cache_source="precise")
        router.wait_for(lambda: all(a.get("kv_events", "").startswith("followed over ZMQ (tcp://127.0.0.1:")
                                    for a in router.admin().values()), timeout=20)
        system = " ".join(f"Rule {i}: answer in the manner of a careful librarian." for i in range(12))

        def chat(q: str) -> dict:
            return {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}

        def synced(url: str) -> None:
            replica = next(r for r in router.state.replicas if r.url == url)
            server = next(s for s in replicas if s.url == url)

            def same() -> bool:
                held = httpx.get(url + "/kv/events", params={"since": 10**9}, headers=server.headers).json()["held"]
                b = router.state.index.blocks.get(replica)
                return (b is not None and b.held == {bytes.fromhex(h) for h in held}
                        and not any(p[0] > 0 or p[1] > time.monotonic() for p in b.pending.values()))
            router.wait_for(same)

        with router.client() as c:
            first = c.post("/v1/chat/completions", json=chat("Where are the atlases?"))
            home = first.headers["x-kvserve-replica"]
            assert first.json()["usage"]["prompt_tokens"] > 100
            for q in ["Is the map room open?", "Who wrote this book?", "May I borrow two?"]:
                synced(home)
                r = c.post("/v1/chat/completions", json=chat(q))
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert r.headers["x-kvserve-replica"] == home and r.headers["x-kvserve-route"] == "prefix_hit"
                assert int(r.headers["x-kvserve-prefix-match"]) == cached >= 96
            # Long prompts sent straight to that replica evict the shared prefix; the stream says so.
            home_server = next(s for s in replicas if s.url == home)
            with home_server.client() as direct:
                for i in range(5):
                    filler = " ".join(f"item{i}-{j}" for j in range(90))
                    body = {"model": MODEL_NAME, "prompt": filler, "max_tokens": 1}
                    assert direct.post("/v1/completions", json=body).status_code == 200
            synced(home)
            r = c.post("/v1/chat/completions", json=chat("And now?"))
            assert r.headers["x-kvserve-route"] == "no_match" and r.headers["x-kvserve-prefix-match"] == "0"
        # Still followed over ZMQ, not polled.
        assert all(a["kv_events"].startswith("followed over ZMQ") for a in router.admin().values())
    finally:
        if router is not None:
            router.stop()
        for s in replicas:
            s.stop()


def test_a_stream_that_does_not_reach_the_router_sends_it_back_to_full_reads(caplog):
    """A stand-in replica advertises a ZMQ endpoint nobody listens on, and says at each check that
    it has sent one more batch: none arrives, so the router reads /kv/events in full again."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from router_harness import AppThread

    dead = free_port()
    full_reads, heads = [], []
    fields = {"model": "/nowhere/model.gguf", "block_size": 16, "caching": True, "instance": "i1", "seq": 3,
              "kv_events_endpoint": f"tcp://*:{dead}", "kv_events_topic": ""}

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ready"})

    async def events(request: Request) -> JSONResponse:
        if request.query_params.get("head") == "true":
            heads.append(time.monotonic())
            return JSONResponse({**fields, "kv_events_seq": len(heads)})
        full_reads.append(time.monotonic())
        return JSONResponse({**fields, "kv_events_seq": 0, "held": [H[0].hex()]})

    stand_in = AppThread(Starlette(routes=[Route("/health", health), Route("/kv/events", events)]))
    router = None
    try:
        with caplog.at_level(logging.WARNING, logger="kvserve.router"):
            router = RouterThread([stand_in.url], "cache_aware", cache_source="precise", health_interval=60,
                                  kv_stream_check=0.3)
            router.wait_for(lambda: len(full_reads) >= 3, timeout=15)
        assert router.admin()[stand_in.url]["kv_events"] == f"followed over ZMQ (tcp://127.0.0.1:{dead})"
        assert router.admin()[stand_in.url]["blocks_held"] == 1
        warned = [r.getMessage() for r in caplog.records if "do not reach the router" in r.getMessage()]
        assert warned == [f"{stand_in.url}: its ZMQ KV events (tcp://127.0.0.1:{dead}) do not reach the router; "
                          f"reading /kv/events every 0.3 s instead"]
    finally:
        if router is not None:
            router.stop()
        stand_in.stop()
