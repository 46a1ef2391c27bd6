"""GGUF files parsed once: a memory-mapped reader, cached, whose damage is one clear error.

A model's load reads its GGUF for the config and tensors (model/gguf_file.py) and for the
vocabulary and sampling defaults (tokenizer/gguf_vocab.py); both open it here, so one load parses
the file once, and `forget()` releases it when the load is done.
"""
from __future__ import annotations

import contextlib
import functools
import mmap
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from kvserve.errors import ModelFormatError


class _Reader(GGUFReader):
    """GGUFReader whose field parsing slices a plain ndarray view of the map, not np.memmap.

    Parsing builds one small array per token and merge (~250k for a 49k-token vocabulary);
    np.memmap's per-slice bookkeeping made that 2-3 s, the plain view 0.7 s. The arrays still
    point into the same mapping; tests check the result against the stock reader.
    """

    _plain: np.ndarray | None = None

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = self._plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


def open_gguf(path: Path) -> GGUFReader:
    """Open and parse a GGUF file; any damage becomes one ModelFormatError line.

    Parsing takes most of a second for a 49k-token vocabulary, and one load reads the file for
    its config, tensors, tokenizer and sampling defaults: the last two files parsed are kept
    (keyed by path, size and modification time), so a load parses its file once."""
    st = os.stat(path)
    return _open_gguf(Path(path).resolve(), st.st_size, st.st_mtime_ns)


def forget() -> None:
    """Drop the parsed files kept by open_gguf: once a model is loaded its metadata (a 49k-token
    vocabulary parsed into numpy fields, ~45 MB) is not read again. The file's mapped pages are
    released too: tensors that were copied (fused q/k/v, gate/up) leave their source pages resident
    otherwise; those still in use (weights read in place) come back from the page cache on first
    touch. So resident memory counts each weight once."""
    for reader in list(_READERS.values()):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no madvise: pages just stay
            reader.data._mmap.madvise(mmap.MADV_DONTNEED)  # type: ignore[attr-defined]  # numpy's memmap keeps its mmap there
    _READERS.clear()
    _open_gguf.cache_clear()


# The readers open_gguf still holds (weakly: the cache above decides how long they live).
_READERS: weakref.WeakValueDictionary[Path, GGUFReader] = weakref.WeakValueDictionary()


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(
            f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
            "pass a .gguf file or a Hugging Face model directory"
        )
    try:
        # "c" (copy-on-write) maps the file writable in-process, so torch can wrap it warning-free.
        reader = _READERS[path] = _Reader(path, "c")
        return reader
    except Exception as e:  # noqa: BLE001 - gguf/numpy raise ValueError, IndexError, KeyError... on damage
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelFormatError(
            f"{path}: truncated or corrupt GGUF file ({detail}); download or convert it again"
        ) from None
