"""The ranks of a tensor-parallel model: who they are, how they meet, what passes between them.

Rank 0 runs everything a single process runs (scheduler, sampler, HTTP); ranks 1.. run
`kvserve.parallel.worker`'s loop. They meet through a TCP store on MASTER_ADDR:MASTER_PORT and
talk over a gloo process group of their own (not torch.distributed's global default group, so an
LLM can be built, closed and built again in one process). Per step rank 0 broadcasts a header
(op, token count, sequence count, block-table length) and one int64 payload with the step's
inputs; each layer then meets twice, in the all-reduces after o_proj and down_proj.

Ranks come from the environment (`torchrun` sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or
are spawned here on loopback (`spawn_workers`). A spawned worker exits when its parent does;
every worker exits when rank 0 sends OP_STOP or its connection to rank 0 breaks.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import kvserve

OP_STOP, OP_STEP, OP_BATCH_INVARIANT = 0, 1, 2
# A worker waits for the next step as long as the server idles: the group's timeout must not end
# that wait (a dead rank 0 ends it instead, by closing the connection).
IDLE_TIMEOUT = timedelta(days=365)
STORE_TIMEOUT = timedelta(seconds=120)  # to meet at start-up
PARENT_ENV = "KVSERVE_TP_PARENT"  # a spawned worker's parent pid


@dataclass(frozen=True)
class LoadSpec:
    """What rank 0 tells each worker once: what to load and how big the KV pool is."""

    model: str
    dtype: str  # torch dtype name, e.g. "float32"
    quantization: str
    kv_dtype: str
    num_blocks: int
    block_size: int
    batch_invariant: bool
    threads: int
    act_levels: int  # int8 levels per activation row in quantized layers (LlamaModel.set_activation_levels)


@dataclass
class Step:
    """A step's inputs as the workers receive them (the attention metadata is rebuilt from these)."""

    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_world() -> tuple[int, int] | None:
    """(rank, world size) set by torchrun, or None outside a multi-process launch."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), size) if size > 1 else None


class TPGroup:
    """One rank's end of the group. Rank 0's collectives run under one lock, so a shutdown from
    another thread never interleaves with a step."""

    def __init__(self, rank: int, size: int, addr: str, port: int, children: list[subprocess.Popen] | None = None) -> None:
        self.rank, self.size = rank, size
        # Under torchrun the agent already serves the store on MASTER_PORT: every rank is a client.
        master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = dist.TCPStore(addr, port, size, is_master=master, timeout=STORE_TIMEOUT, wait_for_workers=False)
        self._store = dist.PrefixStore("kvserve-tp", store)
        self.pg = dist.ProcessGroupGloo(self._store, rank, size, IDLE_TIMEOUT)
        self.lock = threading.Lock()
        self.children = children or []
        self.closed = False

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place."""
        # torch's stubs declare the collectives on ProcessGroup only; Gloo's Backend has them at runtime
        self.pg.allreduce([t]).wait()  # type: ignore[attr-defined]
        return t

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()  # type: ignore[attr-defined]  # (as in all_reduce)
        return t

    def broadcast_json(self, obj: object | None = None) -> Any:
        """Rank 0's `obj` on every rank (small things, once: the load spec, a status)."""
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8) if self.rank == 0 else None
        n = self._broadcast(torch.tensor([0 if data is None else data.numel()], dtype=torch.int64))
        buf = data if data is not None else torch.empty(int(n.item()), dtype=torch.uint8)
        return json.loads(bytes(self._broadcast(buf).numpy()).decode())

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank reports ok (after loading)."""
        return bool(self.all_reduce(torch.tensor([0 if ok else 1], dtype=torch.int64)).item() == 0)

    # -- rank 0 ---------------------------------------------------------------------------------
    def send_spec(self, spec: LoadSpec | None) -> None:
        self.broadcast_json(None if spec is None else asdict(spec))

    def send_op(self, op: int, arg: int = 0) -> None:
        self._broadcast(torch.tensor([op, arg, 0, 0], dtype=torch.int64))

    def send_step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, query_lens: list[int],
                  seq_lens: list[int], block_tables: list[list[int]]) -> None:
        T, B = ids.shape[0], len(query_lens)
        flat = [b for t in block_tables for b in t]
        self._broadcast(torch.tensor([OP_STEP, T, B, len(flat)], dtype=torch.int64))
        tail = torch.tensor([*query_lens, *seq_lens, *(len(t) for t in block_tables), *flat], dtype=torch.int64)
        self._broadcast(torch.cat([ids, positions, slots, tail]))

    def close(self) -> None:
        """Stop the workers (OP_STOP, unless a step holds the lock past a moment) and reap the
        spawned ones; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0 and self.lock.acquire(timeout=5):
            try:
                self.send_op(OP_STOP)
            except RuntimeError:  # a worker already gone
                pass
            finally:
                self.lock.release()
        self.reap()

    def abort(self) -> None:
        """Rank 0 before any spec: tell the workers there is nothing to load; they exit."""
        self.send_spec(None)
        self.closed = True
        self.reap()

    def reap(self) -> None:
        """Wait for the spawned workers (killed after 10 s)."""
        for child in self.children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    # -- workers --------------------------------------------------------------------------------
    def receive_spec(self) -> LoadSpec | None:
        obj = self.broadcast_json()
        return None if obj is None else LoadSpec(**obj)

    def receive(self) -> tuple[int, int, Step | None]:
        """The next message: (op, its argument, the step's inputs for OP_STEP)."""
        op, T, B, n = self._broadcast(torch.empty(4, dtype=torch.int64)).tolist()
        if op != OP_STEP:
            return op, T, None
        payload = self._broadcast(torch.empty(3 * T + 3 * B + n, dtype=torch.int64))
        ids, positions, slots = payload[:T], payload[T : 2 * T], payload[2 * T : 3 * T]
        rest = payload[3 * T :].tolist()
        query_lens, seq_lens, lens, flat = rest[:B], rest[B : 2 * B], rest[2 * B : 3 * B], rest[3 * B :]
        tables, at = [], 0
        for k in lens:
            tables.append(flat[at : at + k])
            at += k
        return op, 0, Step(ids, positions, slots, query_lens, seq_lens, tables)


def spawn_workers(size: int, port: int) -> list[subprocess.Popen]:
    """Ranks 1..size-1 as `python -m kvserve.parallel.worker` on loopback; they learn what to load
    from rank 0. Their output goes to this process's stderr."""
    children = []
    # The workers import the same kvserve as this process, whatever their working directory holds.
    root = str(Path(kvserve.__file__).resolve().parent.parent)
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    for rank in range(1, size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), PARENT_ENV: str(os.getpid()), "PYTHONPATH": path}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        children.append(subprocess.Popen([sys.executable, "-m", "kvserve.parallel.worker"], env=env,
                                         stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno()))
    return children


def connect(size: int) -> TPGroup:
    """Rank 0's group of `size` ranks: the torchrun launch's, or workers spawned on loopback."""
    world = env_world()
    if world is not None:
        rank, world_size = world
        if size != world_size:
            raise ValueError(f"tensor parallel size {size} differs from the launch's WORLD_SIZE {world_size}: "
                             "give the same number (or leave --tensor-parallel-size out under torchrun)")
        return TPGroup(rank, size, os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]))
    port = free_port()
    children = spawn_workers(size, port)
    try:
        return TPGroup(0, size, "127.0.0.1", port, children)
    except BaseException:
        for c in children:
            c.kill()
        raise
