"""The disk tier under the RAM pool: prefix blocks evicted from RAM are saved, and read back on a miss.

Saving never holds up an engine step. When the pool reuses a cached block (its K/V still valid),
save() copies the block out of the pool tensors on the engine thread — one contiguous copy,
[layers, 2, kv_heads, block_size, head_dim] — and hands it to a writer thread through a queue
bounded in bytes; when the queue is full the block is dropped (counted), not waited for. Reading
is on the engine thread, inside a prefix lookup: read_run() reads the chain's next blocks while
the disk has them, and copy_in() writes them into freshly allocated pool blocks in one indexed
copy per layer, so the scheduler counts them as computed, as a RAM hit.

A store is only ever read under the fingerprint it was written with (namespace()): the
checkpoint's identity, the activation and KV dtypes, quantization, block size, layer and head
shapes and the tokenizer's fingerprint. Anything else reads as a separate, empty store.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.kv.disk_store import DiskStore

log = logging.getLogger("kvserve")

QUEUE_BYTES = 64 << 20  # blocks copied out and waiting for the writer, at most
_SAMPLE = 1 << 20  # bytes read from each end of a large weight file for its identity


@dataclass(frozen=True)
class DiskStats:
    """The tier's counters (blocks, tokens and bytes), for /metrics, the live page and explain."""

    capacity_bytes: int
    bytes_used: int
    blocks: int  # block files on disk (all namespaces under the path)
    blocks_written: int
    writes_dropped: int  # the writer's queue was full
    hit_blocks: int  # prefix hits served from disk (counted once per admission, as RAM hits)
    hit_tokens: int
    load_errors: int  # files that failed their checks: deleted, read as misses


def checkpoint_identity(path: str | Path) -> str:
    """A checkpoint's identity without hashing gigabytes: each file's name and size, small files
    whole, and the first and last MiB of large ones (GGUF metadata leads its file)."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                fh.seek(size - _SAMPLE)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def namespace(fields: dict[str, object]) -> bytes:
    """16 bytes that change whenever anything the stored K/V depend on does."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()[:16]


class DiskTier:
    def __init__(self, path: str | Path, capacity_bytes: int, fields: dict[str, object],
                 kv_caches: list[torch.Tensor], block_size: int, queue_bytes: int = QUEUE_BYTES,
                 kv_scales: list[torch.Tensor] | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the KV disk tier's capacity must be > 0 bytes, got {capacity_bytes}")
        self.kv_caches = kv_caches  # per layer [2, Hkv, num_blocks, block_size, D]
        self.kv_scales = kv_scales  # an int8 pool's: per layer [2, Hkv, num_blocks, block_size]
        self.block_size = block_size
        _, hkv, _, bs, d = kv_caches[0].shape
        self.block_shape = (len(kv_caches), 2, hkv, bs, d)  # one block, all layers: what a file holds
        self.dtype = kv_caches[0].dtype
        self.kv_bytes = kv_caches[0].element_size() * len(kv_caches) * 2 * hkv * bs * d
        # An int8 block's row scales follow its K/V in the same file: one file, one checksum.
        self.scale_shape = (len(kv_caches), 2, hkv, bs)
        self.scale_bytes = 0 if kv_scales is None else kv_scales[0].element_size() * len(kv_caches) * 2 * hkv * bs
        self.block_bytes = self.kv_bytes + self.scale_bytes
        self.fields = fields
        self.store = DiskStore(path, namespace(fields), capacity_bytes)
        info = self.store.dir / "namespace.json"  # for a person looking at the directory
        if not info.exists():
            info.write_text(json.dumps(fields, indent=1, sort_keys=True))
        self.writes_dropped = 0
        self.hit_blocks = 0
        self.hit_tokens = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_bytes // self.block_bytes))
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-kv-disk-writer", daemon=True)
        self._writer.start()
        log.info("KV disk tier: %s, %.2f GiB (%d blocks of %d tokens), %.2f GiB used", self.store.dir,
                 capacity_bytes / (1 << 30), capacity_bytes // self.block_bytes, block_size,
                 self.store.bytes_used / (1 << 30))

    # -- saving (engine thread, then the writer) ------------------------------------------
    def save(self, block_id: int, block_hash: bytes, token_ids: Sequence[int], wait: bool = False) -> None:
        """A cached block is about to be reused: copy it out and queue it, or drop it when the
        queue is full (`wait`: wait for room instead; never inside an engine step)."""
        if block_hash in self.store:
            return
        if not wait and self._queue.full():  # (only this thread puts: the check holds until the put)
            self.writes_dropped += 1
            return
        data = torch.stack([kv[:, :, block_id] for kv in self.kv_caches]).view(torch.uint8).flatten()  # [L, 2, Hkv, BS, D]
        if self.kv_scales is not None:
            scales = torch.stack([sc[:, :, block_id] for sc in self.kv_scales])  # [L, 2, Hkv, BS]
            data = torch.cat([data, scales.view(torch.uint8).flatten()])
        self._queue.put((block_hash, tuple(token_ids), data))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, ids, data = item
                self.store.put(key, ids, memoryview(data.numpy()).cast("B"))
            except Exception:  # a write must never kill the writer
                log.exception("KV disk tier: writing a block failed")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join()

    # -- loading (engine thread) ----------------------------------------------------------
    def read_run(self, chain: Iterable[tuple[bytes, Sequence[int]]], limit: int) -> list[tuple[bytes, Sequence[int], memoryview]]:
        """(hash, tokens, payload) of the chain's blocks from its start while the disk has them
        whole, at most `limit`."""
        out: list[tuple[bytes, Sequence[int], memoryview]] = []
        for h, ids in chain:
            if len(out) >= limit or h not in self.store:
                break
            payload = self.store.get(h, ids)
            if payload is None or len(payload) != self.block_bytes:
                break
            out.append((h, ids, payload))
        return out

    def copy_in(self, block_ids: list[int], payloads: list[memoryview]) -> None:
        """Write blocks read from disk into pool blocks: one indexed copy per layer."""
        kv = [torch.frombuffer(p[:self.kv_bytes], dtype=self.dtype).view(self.block_shape) for p in payloads]
        data = torch.stack(kv, dim=3)  # [L, 2, Hkv, n, BS, D]
        index = torch.tensor(block_ids, dtype=torch.long)
        for layer, pool in enumerate(self.kv_caches):
            pool.index_copy_(2, index, data[layer])
        if self.kv_scales is not None:
            dtype = self.kv_scales[0].dtype
            scales = torch.stack([torch.frombuffer(p[self.kv_bytes:], dtype=dtype).view(self.scale_shape)
                                  for p in payloads], dim=3)  # [L, 2, Hkv, n, BS]
            for layer, pool in enumerate(self.kv_scales):
                pool.index_copy_(2, index, scales[layer])

    def stats(self) -> DiskStats:
        s = self.store
        return DiskStats(capacity_bytes=s.capacity_bytes, bytes_used=s.bytes_used, blocks=s.num_files,
                         blocks_written=s.counters.files_written, writes_dropped=self.writes_dropped,
                         hit_blocks=self.hit_blocks, hit_tokens=self.hit_tokens, load_errors=s.counters.load_errors)


def tier_fields(model_path: str | Path, model_dtype: torch.dtype, quantization: str, batch_invariant: bool,
                activations: str, kv_dtype: torch.dtype, block_size: int, num_layers: int, num_kv_heads: int,
                head_dim: int, tokenizer_fingerprint: str, context: int | None = None) -> dict[str, object]:
    """What a stored block's bytes depend on: a different value is a different namespace. `context`:
    the context served, for a model whose RoPE depends on it (LongRoPE); None for others."""
    return {**({"context": context} if context is not None else {}),
        "format": 1, "checkpoint": checkpoint_identity(model_path), "model_file": os.path.basename(str(model_path)),
        "dtype": str(model_dtype), "quantization": quantization, "batch_invariant": batch_invariant,
        "activations": activations, "kv_dtype": str(kv_dtype), "block_size": block_size, "num_layers": num_layers,
        "num_kv_heads": num_kv_heads, "head_dim": head_dim, "tokenizer": tokenizer_fingerprint,
    }
