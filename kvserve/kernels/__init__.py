"""Native CPU kernels, compiled on first use and called through ctypes.

paged_attention.c (decode attention over the KV pool), layer_ops.c (residual add + RMSNorm,
RoPE + KV store) and quant_matmul.c (matmuls over GGML quantized blocks and bfloat16 weights,
integer dot products per ISA level: AVX2, AVX-512 VNNI where compiled for it, plain C).

The C sources and the headers they include (numerics.h, which they share; quant_matmul.c's quant_*.h) ship
with the package. On first use each is compiled with the system C compiler (`$CC`, else `cc`) for this CPU's
ISA level (`kvserve.cpu.isa()`) into a cache directory keyed by the sources (every .c and .h of the folder),
the compiler and the CPU, and loaded after torch so that it shares torch's OpenMP runtime. Where no compiler is
found or the build fails, `load()` returns None once, logs why, and callers keep their plain-torch path.
`KVSERVE_NATIVE=0` turns native kernels off.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch  # loaded first: its libgomp is the one the kernels link against

from kvserve import cpu
from kvserve.config import env_switch

log = logging.getLogger("kvserve.kernels")

SOURCES = Path(__file__).parent
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


def arch_flags() -> list[str]:
    """Code generation for the ISA level in use (kvserve.cpu.isa(), which KVSERVE_ISA can lower),
    so a machine with AVX-512 can build and test what an AVX2-only or older CPU runs."""
    level = cpu.isa()
    if level in ("avx512", "neon"):
        return ["-mcpu=native"] if level == "neon" else ["-march=native"]
    if level == "avx2":
        return ["-march=x86-64-v3"]  # AVX2, FMA, F16C, BMI2
    return ["-march=armv8-a"] if platform.machine().lower() in ("aarch64", "arm64") else ["-march=x86-64"]


def enabled() -> bool:
    return env_switch("KVSERVE_NATIVE")


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve"
    )
    return Path(root) / "kernels"


def _compile(name: str, defines: tuple[str, ...] = ()) -> Path:
    """kvserve/kernels/<name>.c built for this CPU (with `-D` defines: a variant, e.g. a profiling build) into the cache."""
    src = SOURCES / f"{name}.c"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    # every source of the folder: a kernel may include another's .c (decode_step.c includes all three)
    others = [f.read_text() for f in sorted([*SOURCES.glob("*.h"), *SOURCES.glob("*.c")]) if f != src]
    flags = [*FLAGS, *arch_flags(), *(f"-D{d}" for d in defines)]
    cpu_signature = " ".join(sorted(cpu.cpu_flags())) or platform.machine()
    key = hashlib.sha256("\0".join([src.read_text(), *others, cc, version, " ".join(flags), cpu_signature]).encode())
    out = cache_dir() / f"{'-'.join((name, *defines))}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.warning("compiling kvserve's %s kernel for this CPU (%s; once, then cached in %s)", name,
                " ".join(arch_flags()), out.parent)
    # Build under a temporary name, then rename: concurrent processes never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, str(src), "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed on {src.name}: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# Tensor dtypes the kernels take, as the integer flag they are passed: activations and weights
# in DTYPES; a KV pool in any of KV_DTYPES (its format need not be the activations'; an int8
# pool comes with its row scales, model/kv_int8.py).
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
KV_DTYPES = {**DTYPES, torch.float16: 2, torch.int8: 3}


def scales_ptr(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> int | None:
    """The scales' address for the kernels: an int8 pool's own [2, Hkv, num_blocks, block_size]
    float16 contiguous tensor, else None (a float pool has none)."""
    if kv_cache.dtype != torch.int8:
        return None
    if kv_scale is None or kv_scale.dtype != torch.float16 or tuple(kv_scale.shape) != tuple(kv_cache.shape[:-1]) \
            or not kv_scale.is_contiguous():
        raise ValueError(f"an int8 KV pool {tuple(kv_cache.shape)} needs its float16 row scales "
                         f"{tuple(kv_cache.shape[:-1])}, got {None if kv_scale is None else tuple(kv_scale.shape)}")
    return kv_scale.data_ptr()


def build_all() -> dict[str, str | None]:
    """Compile every kernel of the folder for this ISA level, one compiler per core, into the cache:
    name -> None, or why it failed. For a test run's set-up, before several workers would each
    compile the same kernel on a cold cache (decode_step.c, which includes the others, takes ~45 s)."""
    from concurrent.futures import ThreadPoolExecutor

    def build(name: str) -> str | None:
        try:
            _compile(name)
            return None
        except Exception as e:  # noqa: BLE001 - reported, not raised: load() falls back the same way
            return str(e)

    names = sorted(f.stem for f in SOURCES.glob("*.c"))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(build, names)))


@cache
def load(name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled kernel library `name` (kvserve/kernels/<name>.c), or None where unavailable."""
    if not enabled():
        return None
    try:
        lib = ctypes.CDLL(str(_compile(name, defines)))
        log.info("native kernel %s loaded", name)
        return lib
    except Exception as e:  # noqa: BLE001 - any failure means: use the torch path
        log.warning("native kernel %s unavailable, using the torch path: %s", name, e)
        return None


_TYPED: set[ctypes.CDLL] = set()  # the libraries bind() set the argument types of (load() keeps each)


def bind(name: str, signatures: dict[str, list[Any]], defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """load(name, defines) with each exported function's argument types set (all return int)."""
    lib = load(name, defines)
    if lib is not None and lib not in _TYPED:
        for fn, args in signatures.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = ctypes.c_int
        _TYPED.add(lib)
    return lib


def loaded(lib: ctypes.CDLL | None, name: str) -> ctypes.CDLL:
    """lib, for a caller that checked its kernels are available (an error naming them otherwise)."""
    if lib is None:
        raise RuntimeError(f"the native {name} kernels are unavailable: check available() first")
    return lib
