"""KV blocks on disk: one file per block, checked on read, bounded in bytes, least recently used out.

Layout: ROOT/NAMESPACE/KK/KEY.kvb, where NAMESPACE fingerprints everything the bytes depend on
(model, KV dtype, block size, shapes: kv/disk_tier.py) and KEY is the block's chained hash. A
file holds its own key, its namespace, its token ids and the block's K/V, with a CRC-32 over all of
it:

    magic "KVB1" | crc32 u32 | key 32 B | namespace 16 B | n_tokens u32 | payload_len u64
    | token ids (n_tokens x int64) | payload

It is written to a temporary name in the same directory and renamed, so a reader sees a whole
file or none; a file that is torn anyway (a disk that lied, a bit flip, a hand edit) fails its
checks on read, is deleted and reads as a miss. Nothing read is trusted beyond what it proves:
the key, namespace and token ids must equal what the lookup asked for.

The capacity bounds every block file under ROOT (all namespaces) by the bytes the disk allocated
to it (st_blocks x 512: a sparse file costs what it holds, not its length): the oldest by last use
(mtime, which a hit refreshes, so the order survives restarts) go first. Only files in the layout
above are the store's: anything else under ROOT (another name, a symlink, a directory of its own)
is never counted, evicted or deleted. One process owns a ROOT's accounting; files other processes
add later are not counted until the next start.
"""
from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvserve")

MAGIC = b"KVB1"
_HEAD = struct.Struct("<4sI32s16sIQ")  # magic, crc32, key, namespace, n_tokens, payload_len
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 60.0  # a temporary file this old belongs to a writer that died
_NAMESPACE_DIR = re.compile(r"[0-9a-f]{32}")
_KK_DIR = re.compile(r"[0-9a-f]{2}")
_BLOCK_NAME = re.compile(r"([0-9a-f]{2})[0-9a-f]{62}")  # a key's hex, its first two digits the directory's


@dataclass
class StoreCounters:
    files_written: int = 0
    load_errors: int = 0  # files that failed their checks (deleted) or could not be read
    evicted_files: int = 0


def block_file_bytes(payload_bytes: int, num_tokens: int) -> int:
    """The size of one block's file."""
    return _HEAD.size + 8 * num_tokens + payload_bytes


def encode_block(key: bytes, namespace: bytes, token_ids: Sequence[int], payload: memoryview | bytes) -> list:
    """The file's bytes as buffers to write in order (the payload is not copied)."""
    tokens = array("q", token_ids).tobytes()
    rest = struct.pack("<32s16sIQ", key, namespace, len(token_ids), len(payload))
    crc = zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(rest)))
    return [MAGIC + struct.pack("<I", crc) + rest, tokens, payload]


def decode_block(data: bytearray, key: bytes, namespace: bytes, token_ids: Sequence[int]) -> memoryview | None:
    """The payload of a file's bytes if it is whole and is the block asked for, else None."""
    if len(data) < _HEAD.size:
        return None
    magic, crc, k, ns, n, plen = _HEAD.unpack_from(data)
    end = _HEAD.size + 8 * n
    if magic != MAGIC or len(data) != end + plen:
        return None
    view = memoryview(data)
    if zlib.crc32(view[end:], zlib.crc32(view[_HEAD.size:end], zlib.crc32(view[8:_HEAD.size]))) != crc:
        return None
    if k != key or ns != namespace or array("q", bytes(view[_HEAD.size:end])).tolist() != list(token_ids):
        return None
    return view[end:]


class DiskStore:
    """Blocks of one namespace under `root`, the whole root bounded by `capacity_bytes`."""

    def __init__(self, root: str | Path, namespace: bytes, capacity_bytes: int) -> None:
        if len(namespace) != 16:
            raise ValueError("the namespace is a 16-byte fingerprint")
        self.root = Path(root)
        self.namespace = namespace
        self.dir = self.root / namespace.hex()
        self.capacity_bytes = capacity_bytes
        self.counters = StoreCounters()
        self._lock = threading.Lock()  # the index: the writer thread adds, the engine thread reads
        self._files: OrderedDict[str, int] = OrderedDict()  # path → size, least recently used first
        self._bytes = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._scan()
        with self._lock:
            self._evict_to(self.capacity_bytes)

    # -- the index ------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index every block file under root, oldest use first; drop dead writers' temporaries."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for ns in _subdirs(self.root, _NAMESPACE_DIR):
            for kk in _subdirs(ns, _KK_DIR):
                for entry in _entries(kk):
                    key, _, suffix = entry.name.partition(".")  # KEY.kvb, or KEY.kvb.PID.TID.tmp
                    name = _BLOCK_NAME.fullmatch(key)
                    if name is None or name[1] != kk.name or not entry.is_file(follow_symlinks=False):
                        continue  # not ours
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if suffix == SUFFIX[1:]:
                        found.append((st.st_mtime, entry.path, _allocated(st)))
                    elif suffix.startswith(SUFFIX[1:] + ".") and suffix.endswith(TMP_SUFFIX) \
                            and now - st.st_mtime > STALE_TMP_SECONDS:
                        _unlink(entry.path)
        for _, path, size in sorted(found):
            self._files[path] = size
            self._bytes += size

    def path_of(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.dir, h[:2], h + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return self.path_of(key) in self._files

    @property
    def bytes_used(self) -> int:
        return self._bytes

    @property
    def num_files(self) -> int:
        return len(self._files)

    def _forget(self, path: str) -> None:
        size = self._files.pop(path, None)
        if size is not None:
            self._bytes -= size

    def _evict_to(self, limit: int) -> None:
        while self._files and self._bytes > limit:
            path, size = self._files.popitem(last=False)
            self._bytes -= size
            self.counters.evicted_files += 1
            _unlink(path)

    # -- reads and writes -----------------------------------------------------------------
    def get(self, key: bytes, token_ids: Sequence[int]) -> memoryview | None:
        """The block's payload, or None: absent, or failing a check (then deleted)."""
        path = self.path_of(key)
        with self._lock:
            if path not in self._files:
                return None
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(data)
        except OSError:  # removed behind our back
            with self._lock:
                self._forget(path)
            return None
        payload = decode_block(data, key, self.namespace, token_ids) if n == len(data) else None
        with self._lock:
            if payload is None:
                self.counters.load_errors += 1
                self._forget(path)
                _unlink(path)
                log.warning("KV disk tier: %s failed its checks (torn or corrupt): deleted", path)
                return None
            if path in self._files:
                self._files.move_to_end(path)
        try:
            os.utime(path)  # the LRU order as a restart will read it
        except OSError:
            pass
        return payload

    def put(self, key: bytes, token_ids: Sequence[int], payload: memoryview | bytes) -> bool:
        """Write a block (temporary file, then rename) and evict to capacity. False if it was
        there already, larger than the whole capacity, or the write failed."""
        path = self.path_of(key)
        parts = encode_block(key, self.namespace, token_ids, payload)
        length = sum(len(p) for p in parts)
        size = -(-length // _UNIT) * _UNIT  # what the disk will allocate, at least
        with self._lock:
            if path in self._files or size > self.capacity_bytes:
                return False
            self._evict_to(self.capacity_bytes - size)  # room first: the bound holds at every moment
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)
                f.flush()
                size = max(size, _allocated(os.fstat(f.fileno())))
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            log.warning("KV disk tier: could not write %s: %s", path, e)
            return False
        with self._lock:
            self._forget(path)
            self._files[path] = size
            self._bytes += size
            self.counters.files_written += 1
            self._evict_to(self.capacity_bytes)
        return True

    def files(self) -> list[str]:
        """Indexed block files, least recently used first."""
        with self._lock:
            return list(self._files)


_UNIT = 4096  # the allocation unit a file's length is rounded up to before it is written (ext4's, XFS's)


def _allocated(st: os.stat_result) -> int:
    """The bytes the disk holds for a file: a sparse file's holes cost nothing."""
    return st.st_blocks * 512


def _entries(path: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError:  # removed meanwhile, or not ours to read
        return []


def _subdirs(path: str | os.PathLike, pattern: re.Pattern[str]) -> list[os.DirEntry]:
    """The directories (not symlinks) in `path` whose names are the store's."""
    return [e for e in _entries(path) if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
