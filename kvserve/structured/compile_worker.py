"""Grammar compiles in processes that can be killed.

xgrammar's compile is C++ that nothing interrupts: in the server's process, a schema inside the
size limits that compiles for minutes (an object of thousands of optional properties) holds its
thread and a core for minutes after its request got its 400. In a process of its own the same
compile ends when the process is killed.

A worker compiles a constraint and answers how long that took, or why the constraint is invalid;
the server then compiles again, in its own process, what compiled there in time
(kvserve/server/grammar_pool.py). The compiled grammar does not come back: xgrammar's only form
of it that crosses processes (`serialize_json`) is up to 80x its size in memory and costs more
than the compile itself (default vocabulary: a 100-property object compiles in 43 ms; writing and
reading its 12 MB of JSON take 0.9 s).

Workers are forked from a process of their own, the fork server (this module run with `-m`):
single-threaded, it imports xgrammar (~3 s: it imports torch) and loads the vocabulary once, so
that a new worker is ready in milliseconds, and the server's process, which runs many threads, is
never forked. The fork server ends when the server's end of its stdin or socket closes, however
the server ended; each worker dies with the fork server (PR_SET_PDEATHSIG).

A worker's memory is capped: it may add `memory_mib` to the address space it was forked with
(RLIMIT_AS). A compile past that fails its allocation (xgrammar's std::bad_alloc), its request
gets a 400 naming the limit, and the worker exits, so that the next compile runs in a fresh one.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvserve.errors import InvalidParam
from kvserve.structured.spec import Constraint

_PID = struct.Struct("!q")
# Thread pools off: a process that runs threads must not fork (numpy's BLAS would start one at import).
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_PR_SET_PDEATHSIG = 1
MEMORY_MIB = 1024.0  # what a compile may add to a worker's address space (the slow schemas add ~100 MiB)


class WorkerGone(Exception):
    """A compile process ended before it answered: killed, or crashed."""


class CompileWorker:
    """One process that compiles one constraint at a time; `kill` ends it whatever it is doing."""

    def __init__(self, pid: int, conn: Connection, fork_server: ForkServer) -> None:
        self.pid = pid
        self._conn = conn
        self.fork_server = fork_server  # it dies with it (PR_SET_PDEATHSIG)

    @property
    def alive(self) -> bool:
        """An idle worker never writes: its end readable means its end closed."""
        return not self._conn.closed and not self._conn.poll()

    def try_compile(self, c: Constraint) -> float:
        """Compile c there: the seconds it took, or the InvalidParam the server's own compile would
        raise (WorkerGone if the process ended first)."""
        try:
            self._conn.send((c.kind, c.value, c.param))
            ok, answer, ends = self._conn.recv()
        except (EOFError, OSError):
            raise WorkerGone(f"grammar compile process {self.pid} ended") from None
        if ends:  # it ran out of memory and exits: the next compile needs a new one
            self.close()
        if not ok:
            raise InvalidParam(c.param, answer)
        return answer

    def kill(self) -> None:
        """From any thread: the one waiting in try_compile gets WorkerGone at once."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self._conn.close()


class ForkServer:
    """The process that forks compile workers, the vocabulary already loaded. Started at once: its
    import runs while the caller does other work (the model's load); workers come once `load`ed."""

    def __init__(self, memory_mib: float = MEMORY_MIB) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno()), str(memory_mib)],
                                        stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),),
                                        env={**os.environ, **_ONE_THREAD})
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one fork request at a time
        self.loaded = False

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def ended(self, wait: float) -> bool:
        """Whether it has ended, waiting up to `wait` s for it: one killed a moment ago still polls alive,
        and a worker of it that ended was killed by its end, not by what it compiled."""
        try:
            self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return False
        return True

    def load(self, tokenizer_info: str) -> None:
        """Hand over the vocabulary (xgrammar's TokenizerInfo as JSON, ~1.6 MB for 49,152 tokens);
        returns once the fork server has read it (after its import)."""
        stdin = self.process.stdin
        assert stdin is not None  # (Popen's stdin=PIPE)
        try:
            with stdin:
                stdin.write(tokenizer_info.encode())
        except OSError:
            raise WorkerGone("the grammar compile fork server ended") from None
        self.loaded = True

    def fork(self) -> CompileWorker:
        """A new worker (waits while the fork server still starts)."""
        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                socket.send_fds(self._sock, [b"w"], [theirs.fileno()])
                answer = self._sock.recv(_PID.size, socket.MSG_WAITALL)
        except OSError:
            answer = b""
        finally:
            theirs.close()
        if len(answer) != _PID.size:
            ours.close()
            raise WorkerGone("the grammar compile fork server ended")
        return CompileWorker(_PID.unpack(answer)[0], Connection(ours.detach()), self)

    def kill(self) -> None:
        """End it and, with it, every worker it forked; waits for nothing but the kernel."""
        self.process.kill()
        try:
            self.process.wait(1.0)  # a SIGKILL is taken at once: this only reaps it
        except subprocess.TimeoutExpired:
            pass
        self._sock.close()


class CompileProcesses:
    """A fork server and one worker for each thread that asks, each started (again) when it is
    missing or has ended. `vocabulary` gives xgrammar's TokenizerInfo as JSON, when first needed;
    `memory_mib` caps each worker (the module's docstring)."""

    def __init__(self, memory_mib: float = MEMORY_MIB) -> None:
        self.memory_mib = memory_mib
        self._forks: ForkServer | None = None
        self._lock = threading.Lock()  # held while the fork server starts (seconds): never on an event loop
        self._local = threading.local()  # each thread's worker
        self.closed = False

    def start(self, vocabulary: Callable[[], str] | None = None) -> ForkServer:
        """The fork server, started if there is none alive, given the vocabulary if it lacks it
        (blocks until the fork server has read it)."""
        return self._fork_server(vocabulary)

    def worker(self, vocabulary: Callable[[], str]) -> CompileWorker:
        """This thread's worker, forked if it has none alive (WorkerGone: the fork server ended
        and could not be started again, or `kill` was called)."""
        worker: CompileWorker | None = getattr(self._local, "worker", None)
        # (an idle worker whose fork server has ended is dying with it, though its end may not show it yet)
        if worker is not None and worker.alive and worker.fork_server.alive:
            return worker
        self.discard()
        forks = self._fork_server(vocabulary)
        try:
            worker = forks.fork()
        except WorkerGone:  # the fork server ended (killed, out of memory): once more, on a new one
            worker = self._fork_server(vocabulary, ended=forks).fork()
        self._local.worker = worker
        return worker

    def discard(self) -> None:
        """Forget this thread's worker (it ended): the next `worker` forks a new one."""
        worker = getattr(self._local, "worker", None)
        if worker is not None:
            worker.close()
            self._local.worker = None

    def kill(self) -> None:
        """End every process, compiles and all, waiting for none; nothing starts again after."""
        self.closed = True
        forks = self._forks  # not under the lock: a start may hold it for seconds
        if forks is not None:
            forks.kill()  # its workers die with it

    def _fork_server(self, vocabulary: Callable[[], str] | None, ended: ForkServer | None = None) -> ForkServer:
        with self._lock:
            if self.closed:
                raise WorkerGone("the grammar compile processes were stopped")
            if self._forks is None or self._forks is ended or not self._forks.alive:
                if self._forks is not None:
                    self._forks.kill()
                self._forks = ForkServer(self.memory_mib)
            if vocabulary is not None and not self._forks.loaded:
                self._forks.load(vocabulary())
            return self._forks


# -- in the fork server and its workers ---------------------------------------------------------
def _serve_forks(sock: socket.socket, memory_mib: float) -> None:
    """Import xgrammar, read the vocabulary, then fork one worker per request until the server's end closes."""
    import xgrammar as xgr

    from kvserve.structured.grammar import compile_constraint

    info = sys.stdin.buffer.read()
    try:
        vocabulary = xgr.TokenizerInfo.deserialize_json(info.decode())
    except Exception as e:  # noqa: BLE001 - cut short: the server ended while it wrote
        if info:
            print(f"kvserve's grammar fork server could not read its vocabulary: {e}", file=sys.stderr)
        return
    compiler = xgr.GrammarCompiler(vocabulary, max_threads=1, cache_enabled=False)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers: no zombie is left
    me = os.getpid()
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        except OSError:
            return
        if not fds:
            return  # the server's end closed
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sock.close()
                _cap_memory(memory_mib)
                code = _serve_compiles(Connection(fds[0]), lambda c: compile_constraint(compiler, c), me, memory_mib)
            except BaseException:  # noqa: BLE001 - a worker never returns into the fork server's loop
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(fds[0])
        try:
            sock.sendall(_PID.pack(pid))
        except OSError:
            return


def _cap_memory(mib: float) -> None:
    """Let this process's address space grow by `mib` MiB from what it is now."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = pages * os.sysconf("SC_PAGE_SIZE") + int(mib * (1 << 20))
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _serve_compiles(conn: Connection, compile: Callable[[Constraint], object], parent: int,
                    memory_mib: float = MEMORY_MIB) -> int:
    """A worker: compile each constraint asked for and answer (True, seconds, False) or (False,
    why invalid or too big, whether it ends now: after a compile that ran out of memory)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        pass  # not Linux: a worker outlives a killed fork server until its compile ends
    if os.getppid() != parent:
        return 0  # the fork server ended before the line above
    while True:
        try:
            kind, value, param = conn.recv()
        except (EOFError, OSError):
            return 0  # the server's end closed
        t0 = time.perf_counter()
        out_of_memory = False
        try:
            compile(Constraint(kind, value, param))
            answer: tuple[bool, Any, bool] = (True, time.perf_counter() - t0, False)
        except InvalidParam as e:
            answer = (False, str(e), False)
        except MemoryError:
            out_of_memory = True
            answer = (False, f"{param} needs more than {memory_mib:g} MiB to compile, this server's limit "
                             "(--grammar-compile-memory-mib): make it simpler", True)
        try:
            conn.send(answer)
        except OSError:
            return 0
        if out_of_memory:
            return 0  # its heap may be left in pieces: the next compile gets a fresh worker


if __name__ == "__main__":
    # Ctrl-C and a process group's SIGTERM are the server's to handle: it kills these processes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _serve_forks(socket.socket(fileno=int(sys.argv[1])), float(sys.argv[2]))
