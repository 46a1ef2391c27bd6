"""Memory on transparent huge pages for what a decode step streams through: the weights.

A decode step reads every weight once, front to back, from memory. On 4 KiB pages every page is
a TLB miss and the CPU's stream prefetcher stops at each page's edge; on 2 MiB pages neither
happens: on a Zen 4 at 2 threads the same kernels read a model's layers in 0.86-0.95 of the time,
and a token takes 0.89-0.97 of it (docs/benchmarks.md, "Weights on huge pages"). Linux backs anonymous memory with huge pages
where madvise(MADV_HUGEPAGE) asks for them when /sys/kernel/mm/transparent_hugepage/enabled is
`always` or `madvise` (the default of most distributions). Elsewhere, or with
KVSERVE_HUGEPAGES=0, an `Arena` hands out plain torch tensors.

Weights are cut from an `Arena`'s chunks one after another, so a small model's many small
matrices share huge pages instead of each rounding up to one of its own (a huge page is
resident as a whole once touched). Each chunk is a private anonymous mapping of its own, never
touched before the advice: memory from malloc may be heap that earlier tensors already faulted
in on 4 KiB pages, which the advice does not turn into huge ones.
"""
from __future__ import annotations

import mmap

import torch

from kvserve.config import env_switch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # an arena's chunk; a larger tensor gets a chunk of its own size
ALIGN = 64  # tensors start on cache lines
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The kernel's THP setting: `always`, `madvise`, `never`, or `unavailable` (not Linux, no THP)."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


def enabled() -> bool:
    """Whether arenas ask for huge pages: Linux with THP on `always` or `madvise`, and
    KVSERVE_HUGEPAGES not 0."""
    return env_switch("KVSERVE_HUGEPAGES") and thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def _advised_bytes(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] starting on a huge page's boundary, in a fresh private anonymous mapping whose
    pages are advised MADV_HUGEPAGE before anything touches them (the tensor keeps the mapping alive)."""
    span = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # whole huge pages
    mem = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # room to start on a boundary
    raw = torch.frombuffer(mem, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    try:
        mem.madvise(mmap.MADV_HUGEPAGE, offset, span)
    except OSError:  # (refused, by an old kernel: plain pages, same bytes)
        pass
    return raw[offset : offset + nbytes]


class Arena:
    """Hands out tensors cut one after another from chunks of huge-page memory (`enabled()`), or
    plain `torch.empty` tensors. A chunk lives while any tensor cut from it does."""

    def __init__(self, huge: bool | None = None, chunk: int = CHUNK) -> None:
        self.huge = enabled() if huge is None else huge
        self.chunk = chunk
        self._free: torch.Tensor | None = None  # the current chunk's unused bytes

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` and `dtype`."""
        if not self.huge:
            return torch.empty(shape, dtype=dtype)
        n = torch.Size(shape).numel() * dtype.itemsize
        need = (n + ALIGN - 1) // ALIGN * ALIGN
        if self._free is None or self._free.numel() < need:
            self._free = _advised_bytes(max(self.chunk, need))
        out, self._free = self._free[:n], self._free[need:]
        return out.view(dtype).view(shape)
