"""Weights on transparent huge pages (kvserve/hugepages.py): an Arena's tensors are whole, apart
and aligned; where the OS gives huge pages they are backed by them, and a model's repacked
weights come from one; KVSERVE_HUGEPAGES=0 gives plain tensors."""
from __future__ import annotations

import pytest
import torch

from kvserve import hugepages
from kvserve.hugepages import Arena

THP_ON = hugepages.thp_mode() in ("always", "madvise")


def huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arena_tensors_are_aligned_apart_and_hold_their_bytes():
    arena = Arena(huge=True, chunk=8 << 20)
    shapes = [((1000,), torch.uint8), ((3, 7), torch.float32), ((5 << 20,), torch.uint8), ((0,), torch.uint8),
              ((64, 64), torch.float16), ((9 << 20,), torch.uint8)]  # the last one larger than a chunk
    made = []
    for shape, dtype in shapes:
        t = arena.empty(shape, dtype)
        assert t.shape == torch.Size(shape) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % hugepages.ALIGN == 0
        t.copy_(torch.arange(t.numel()).reshape(shape).to(dtype))
        made.append(t)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in made if t.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "two arena tensors overlap"
    for (shape, dtype), t in zip(shapes, made):  # each still holds what was written: nothing wrote over it
        assert torch.equal(t, torch.arange(t.numel()).reshape(shape).to(dtype))


def test_plain_arena_hands_out_ordinary_tensors(monkeypatch):
    monkeypatch.setenv("KVSERVE_HUGEPAGES", "0")
    assert not hugepages.enabled()
    arena = Arena()
    assert not arena.huge
    t = arena.empty((4, 4), torch.float32)
    assert t.shape == (4, 4) and t.untyped_storage().nbytes() == 64  # its own storage, not a chunk's view


@pytest.mark.skipif(not THP_ON, reason="this kernel gives no transparent huge pages (THP never or absent)")
def test_arena_memory_is_backed_by_huge_pages(monkeypatch):
    monkeypatch.delenv("KVSERVE_HUGEPAGES", raising=False)
    assert hugepages.enabled()
    arena = Arena()
    t = arena.empty((16 << 20,))
    t.fill_(1)  # touched: the kernel backs the advised range now
    assert huge_kib_at(t.data_ptr() + (8 << 20)) >= 2048


HEAP_REUSE = """
import ctypes, torch
from kvserve.hugepages import Arena
libc = ctypes.CDLL(None)
# large blocks from the heap, kept there when freed (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), as a long run's malloc may
assert libc.mallopt(-3, 1 << 30) == 1 and libc.mallopt(-1, 1 << 30) == 1
t = torch.ones(80 << 20, dtype=torch.uint8)  # heap faulted in on 4 KiB pages, then freed for reuse
del t
a = Arena().empty((16 << 20,))
a.fill_(1)
address, inside = a.data_ptr() + (8 << 20), False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= address < hi
    elif inside and head == "AnonHugePages:":
        print(int(line.split()[1]))
        break
"""


@pytest.mark.skipif(not THP_ON, reason="this kernel gives no transparent huge pages (THP never or absent)")
def test_arena_chunks_are_fresh_mappings_not_reused_heap():
    """Advice does not turn pages already faulted in on 4 KiB into huge ones: a chunk from malloc's heap,
    freed by earlier tensors, stayed on small pages (as once happened late in a test run)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", HEAP_REUSE], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "KVSERVE_HUGEPAGES": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) >= 2048


@pytest.mark.skipif(not THP_ON, reason="this kernel gives no transparent huge pages (THP never or absent)")
def test_a_models_repacked_weights_lie_on_huge_pages(monkeypatch, default_gguf):
    from kvserve import LLM
    from kvserve.kernels import quant_matmul

    if not quant_matmul.x8_available(8):  # the tied head's Q8_0
        pytest.skip("this build keeps the head's stored layout (no repacked copy to place)")
    monkeypatch.delenv("KVSERVE_HUGEPAGES", raising=False)
    llm = LLM(str(default_gguf))
    model = llm.model
    head = model.lm_head.weight.blocks  # the tied embedding / LM head: the largest weight, in the arena
    assert model.lm_head.weight.x8
    assert huge_kib_at(head.data_ptr() + head.numel() // 2) >= 2048
    down = model.layers[5].down.weight.blocks
    assert huge_kib_at(down.data_ptr()) >= 2048
