"""Structured-output grammars are bounded and owned by their request: a size limit checked before
compiling (a 400 naming it), compiles on a pool of their own with a time limit and a queue
bound, taken off the queue when their request ends and killed in their process when it has
started, and a compiled-grammar cache bounded by bytes with hit/miss metrics. Real xgrammar
compiles with the default model's vocabulary, real processes, and a real server process."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from kvserve.errors import InvalidParam
from kvserve.server.errors import APIError
from kvserve.server.grammar_pool import GrammarPool
from kvserve.structured.grammar import GrammarCompiler
from kvserve.structured.limits import GrammarLimits
from kvserve.structured.spec import Constraint
from kvserve.tokenizer import Tokenizer
from server_harness import MODEL_NAME, gone, grammar_processes, slow_schema, start_server, wait_for


def chain(n: int, tag: str = "x") -> str:
    """An EBNF chain of n + 2 rules; its compile time grows steeply with n (1400: 0.35-1 s in a worker, by CPU;
    2100: about five times that)."""
    return "root ::= r0\n" + "\n".join(f'r{i} ::= "{tag}{i}" | r{i + 1}' for i in range(n)) + f'\nr{n} ::= "end"'


def enum_schema(n: int, width: int = 12) -> str:
    return json.dumps({"enum": [f"v{i:0{width}d}" for i in range(n)]})


@pytest.fixture
def compiler(default_gguf: Path) -> GrammarCompiler:
    tok = Tokenizer.from_gguf(default_gguf)
    return GrammarCompiler(tok, tok.vocab_size, frozenset(tok.eos_token_ids))


# -- limits, before any work ----------------------------------------------------------------------
@pytest.mark.parametrize("constraint, message", [
    (Constraint("json", enum_schema(100_000), "response_format.json_schema.schema"),
     "response_format.json_schema.schema has 1700010 characters; this server compiles at most 65536 characters "
     "per constraint: make it smaller (fewer values or rules)"),
    (Constraint("json", json.dumps({"enum": list(range(1025))})),
     "response_format has 1025 enum and const values; this server compiles at most 1024 enum and const values "
     "per constraint: make it smaller (fewer values or rules)"),
    (Constraint("json", json.dumps({"anyOf": [{"type": "string"}] * 2100})),
     "response_format has more than 4096 nodes (objects, arrays and values); this server compiles at most 4096 "
     "nodes per constraint: make it smaller (fewer values or rules)"),
    (Constraint("choice", json.dumps([str(i) for i in range(1025)]), "guided_choice"),
     "guided_choice has 1025 choices; this server compiles at most 1024 choices per constraint: make it smaller "
     "(fewer values or rules)"),
    (Constraint("grammar", chain(300), "structured_outputs.grammar"),
     "structured_outputs.grammar has 302 rules; this server compiles at most 256 rules per constraint: make it "
     "smaller (fewer values or rules)"),
])
def test_a_constraint_over_a_limit_is_refused_before_compiling(compiler, constraint, message):
    t0 = time.monotonic()
    with pytest.raises(InvalidParam) as e:
        compiler.compile(constraint)
    assert str(e.value) == message and e.value.param == constraint.param
    assert time.monotonic() - t0 < 1.0
    assert compiler._compiler is None  # xgrammar was never even loaded
    assert not constraint.compiled


def test_what_fits_the_limits_compiles(compiler):
    for c in (Constraint("json", json.dumps({"enum": list(range(1024))})), Constraint("grammar", chain(254)),
              Constraint("choice", json.dumps([str(i) for i in range(1024)]))):
        assert compiler.compile(c) is c.compiled[0]


# -- the cache: LRU by bytes ------------------------------------------------------------------------
def test_the_cache_keeps_the_most_recent_grammars_within_its_bytes(compiler):
    a, b, c = (Constraint("json", enum_schema(200, width=w)) for w in (10, 11, 12))
    size_a = compiler.compile(a).memory_size_bytes
    compiler.cache.resize(2 * size_a + size_a // 2)  # room for two of these
    compiler.compile(b)
    assert compiler.compile(Constraint("json", a.value)) is a.compiled[0]  # a hit: a is now the most recent
    compiler.compile(c)  # b, the least recently used, goes
    cache = compiler.cache
    assert (cache.hits, cache.misses, cache.evictions, len(cache)) == (1, 3, 1, 2)
    assert cache.bytes == a.compiled[0].memory_size_bytes + c.compiled[0].memory_size_bytes <= cache.max_bytes
    again = Constraint("json", b.value)
    assert not compiler.cached(again) and cache.misses == 4
    # A request keeps its own grammar whatever the cache drops: b's matcher still works.
    misses = cache.misses
    matcher = compiler.matcher(b)
    assert matcher.accept_string('"v00000000199"') and not matcher.accept_string("x")
    assert cache.misses == misses  # not looked up, not compiled again
    compiler.cache.resize(0)  # nothing is kept, and nothing breaks
    assert len(cache) == 0 and cache.bytes == 0 and compiler.compile(again) is again.compiled[0]


# -- the pool: own processes, a time limit, a queue bound, cancellation -------------------------
@pytest.fixture
def make_pool(compiler):
    """A pool with its compile processes started: the fork server loaded and a worker on each
    thread (the server starts them as its model loads: kvserve/server/grammar_pool.py)."""
    compiler.limits = GrammarLimits(max_chars=1 << 30, max_rules=1 << 30)  # slow shapes the limits would stop
    compiler.compile(Constraint("json_object"))  # xgrammar's vocabulary, loaded once here
    made: list[GrammarPool] = []

    def make(workers: int = 2, max_pending: int = 8, timeout: float = 60, memory_mib: float = 1024) -> GrammarPool:
        pool = GrammarPool(workers, max_pending, timeout=60, memory_mib=memory_mib)
        made.append(pool)

        async def warm():
            await asyncio.gather(*(pool.compile(compiler, Constraint("regex", f"warm{i}")) for i in range(workers)))

        asyncio.run(warm())
        pool.timeout = timeout
        return pool

    yield make
    for pool in made:
        pool.shutdown()


def live_workers() -> set[int]:
    """The pids of this process's grammar workers (a test's pool is the only one running)."""
    return grammar_processes(os.getpid())[1]


async def compiling(pool: GrammarPool, n: int, timeout: float = 10.0) -> set[int]:
    """Once n compiles are pending (and a moment more: they reach their workers), the workers' pids."""
    t0 = time.monotonic()
    while pool.pending < n:
        assert time.monotonic() - t0 < timeout, f"{pool.pending} of {n} compiles pending"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    return live_workers()


def test_slow_compiles_time_out_fill_only_their_own_pool_and_are_killed_when_their_request_leaves(compiler, make_pool):
    pool = make_pool(max_pending=3, timeout=0.5)
    cached = len(compiler.cache)

    async def scenario():
        slow = [asyncio.ensure_future(pool.compile(compiler, Constraint("grammar", chain(2100, tag), "guided_grammar")))
                for tag in ("a", "b")]  # past the 0.5 s timeout on every CPU here
        await asyncio.sleep(0.1)
        queued_constraint = Constraint("grammar", 'root ::= "queued"', "guided_grammar")
        queued = asyncio.ensure_future(pool.compile(compiler, queued_constraint))
        await asyncio.sleep(0.05)
        assert pool.pending == 3
        busy = live_workers()
        with pytest.raises(APIError) as full:  # one more: refused at once
            await pool.compile(compiler, Constraint("regex", "x+", "guided_regex"))
        assert (full.value.status, full.value.code) == (429, "grammar_pool_full")
        t0 = time.monotonic()
        assert await asyncio.to_thread(lambda: "free") == "free"  # the default pool is not theirs
        free_after = time.monotonic() - t0
        queued.cancel()  # its request ended while it waited: it never compiles
        errors = await asyncio.gather(*slow, return_exceptions=True)
        await asyncio.gather(queued, return_exceptions=True)
        t0 = time.monotonic()
        while pool.pending:  # the two started compiles are killed, not run to their end
            assert time.monotonic() - t0 < 0.5, pool.pending
            await asyncio.sleep(0.01)
        killed = wait_for(lambda: gone(busy), timeout=2.0)
        t0 = time.monotonic()
        small = Constraint("json", json.dumps({"type": "array", "items": {"type": "integer"}}))
        await pool.compile(compiler, small)  # on a fresh worker, at once
        return errors, free_after, queued_constraint, busy, killed, time.monotonic() - t0, small

    errors, free_after, queued_constraint, busy, killed, small_after, small = asyncio.run(scenario())
    assert [str(e) for e in errors] == ["guided_grammar took longer than 0.5 s to compile, this server's limit "
                                        "(--grammar-compile-timeout): make it simpler"] * 2
    assert free_after < 0.2 and pool.timeouts == 2
    assert len(busy) == 2 and killed < 0.5, (busy, killed)
    assert small.compiled and small_after < 0.5, small_after
    assert not queued_constraint.compiled and not compiler.cached(Constraint("grammar", 'root ::= "queued"'))
    assert len(compiler.cache) == cached + 1  # the small one: the slow ones were never finished


def test_a_client_that_leaves_takes_its_queued_compile_with_it(compiler, make_pool):
    pool = make_pool(workers=1, max_pending=4, timeout=30)

    async def scenario():
        gone = asyncio.Event()

        async def receive() -> dict:  # the request's ASGI receive once its body was read
            await gone.wait()
            return {"type": "http.disconnect"}

        slow = asyncio.ensure_future(pool.compile(compiler, Constraint("grammar", chain(1400, "s"), "guided_grammar")))
        await asyncio.sleep(0.05)
        behind = Constraint("grammar", 'root ::= "behind"', "guided_grammar")
        leaving = asyncio.ensure_future(pool.compile(compiler, behind, receive))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        gone.set()
        with pytest.raises(APIError) as left:
            await leaving
        answered = time.monotonic() - t0
        await slow
        return left.value, answered, behind

    error, answered, behind = asyncio.run(scenario())
    assert (error.status, error.code, error.message) == (400, "client_disconnected",
                                                         "the client disconnected while its grammar compiled")
    assert answered < 0.2  # at once, not after the compile ahead of it
    assert pool.pending == 0 and not behind.compiled and not compiler.cached(Constraint("grammar", behind.value))


def test_a_compile_whose_every_client_left_is_killed_and_its_worker_serves_the_next_at_once(compiler, make_pool):
    pool = make_pool()
    async def scenario():
        gone = asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        slow = [Constraint("json", json.dumps(slow_schema(tag))) for tag in ("a", "b")]
        waiting = [asyncio.ensure_future(pool.compile(compiler, c, receive)) for c in slow]
        busy = await compiling(pool, 2)
        assert pool.pending == 2 and len(busy) == 2
        gone.set()  # both clients leave
        await asyncio.gather(*waiting, return_exceptions=True)
        t0 = time.monotonic()
        small = Constraint("json", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
        await pool.compile(compiler, small)  # the slow compiles would hold both workers for minutes
        return time.monotonic() - t0, busy

    small_after, busy = asyncio.run(scenario())
    assert small_after < 0.5, small_after
    assert wait_for(lambda: gone(busy), timeout=2.0) < 0.5
    assert pool.pending == 0 and pool._compiling == {}


def test_a_compile_that_ends_in_its_worker_too_late_to_run_again_here_in_time_gets_its_400_and_runs_nowhere(
        compiler, make_pool):
    seconds = []
    for tag in ("m", "n"):  # what this compile costs here
        t0 = time.monotonic()
        compiler.build(Constraint("grammar", chain(1400, tag)))
        seconds.append(time.monotonic() - t0)
    pool = make_pool(timeout=1.5 * min(seconds))  # room for one compile, not for two
    late = Constraint("grammar", chain(1400, "late"), "guided_grammar")
    t0 = time.monotonic()
    with pytest.raises(InvalidParam) as error:
        asyncio.run(pool.compile(compiler, late))
    answered = time.monotonic() - t0
    assert str(error.value) == (f"guided_grammar took longer than {pool.timeout:g} s to compile, this server's limit "
                                "(--grammar-compile-timeout): make it simpler")
    assert answered < pool.timeout + 0.2 and pool.timeouts == 1
    time.sleep(2 * min(seconds))  # a compile here after the worker's would have ended by now
    assert not compiler.cached(Constraint("grammar", late.value)) and pool.pending == 0


def test_a_schema_sent_again_while_it_compiles_waits_for_that_compile_and_leaves_the_other_worker_free(compiler, make_pool):
    pool = make_pool()
    slow_value = chain(1400, "r")
    cached = len(compiler.cache)

    async def scenario():
        slow = [asyncio.ensure_future(pool.compile(compiler, Constraint("grammar", slow_value, "guided_grammar")))
                for _ in range(4)]  # a client retrying the same slow schema
        await asyncio.sleep(0.05)
        assert pool.pending == 1  # one compile for the four requests
        t0 = time.monotonic()
        other = Constraint("grammar", 'root ::= "other"', "guided_grammar")
        await pool.compile(compiler, other)  # on the second worker, not behind the slow one
        other_after = time.monotonic() - t0
        slow[0].cancel()  # one waiter leaving does not stop the others' compile
        await asyncio.gather(*slow[1:])
        return other_after, other, slow

    t0 = time.monotonic()
    other_after, other, slow = asyncio.run(scenario())
    slow_after = time.monotonic() - t0
    assert other.compiled and other_after < 0.5 < slow_after, (other_after, slow_after)
    assert pool.pending == 0 and pool._compiling == {}
    assert compiler.cached(Constraint("grammar", slow_value)) and len(compiler.cache) == cached + 2


def test_a_schema_that_compiled_past_its_timeout_is_refused_at_once_when_sent_again(compiler, make_pool):
    pool = make_pool(timeout=0.5)
    too_slow = ("guided_grammar took longer than 0.5 s to compile, this server's limit "
                "(--grammar-compile-timeout): make it simpler")

    async def scenario():
        gone = asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        # past the 0.5 s timeout on every CPU here (chain(1400) compiled in 0.35 s in a worker on a Zen 4)
        slow = Constraint("grammar", chain(2100, "t"), "guided_grammar")
        answers = []
        for _ in range(2):  # its client sends it again after the 400
            t0 = time.monotonic()
            with pytest.raises(InvalidParam) as error:
                await pool.compile(compiler, Constraint(slow.kind, slow.value, slow.param))
            answers.append((str(error.value), time.monotonic() - t0, slow.key in pool._compiling))
        # One whose client left early ran for a fraction of the timeout: sent again, it compiles again.
        left = Constraint("grammar", chain(2100, "u"), "guided_grammar")
        leaving = asyncio.ensure_future(pool.compile(compiler, left, receive))
        await asyncio.sleep(0.1)
        gone.set()
        with pytest.raises(APIError):
            await leaving
        again = asyncio.ensure_future(pool.compile(compiler, Constraint(left.kind, left.value, left.param)))
        await asyncio.sleep(0.05)
        compiling_again = pool.pending
        with pytest.raises(InvalidParam):
            await again
        return answers, compiling_again

    answers, compiling_again = asyncio.run(scenario())
    (first, first_took, _), (second, second_took, second_compiling) = answers
    assert first == second == too_slow
    assert first_took >= 0.5 and second_took < 0.05 and not second_compiling, answers
    assert compiling_again == 1 and pool.timeouts == 3


def test_a_compile_past_its_memory_cap_gets_a_400_naming_it_and_the_next_compiles_on_a_fresh_worker(
        compiler, make_pool):
    pool = make_pool(workers=1, memory_mib=48)  # the 4,000-property schema takes ~100 MiB
    big = Constraint("json", json.dumps(slow_schema("m")), "response_format.json_schema.schema")

    async def scenario():
        before = live_workers()
        with pytest.raises(InvalidParam) as error:
            await pool.compile(compiler, big)
        small = Constraint("json", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
        await pool.compile(compiler, small)
        return error.value, before, small

    error, before, small = asyncio.run(scenario())
    assert error.param == big.param and str(error) == (
        "response_format.json_schema.schema needs more than 48 MiB to compile, this server's limit "
        "(--grammar-compile-memory-mib): make it simpler")
    assert small.compiled and pool.pending == 0
    assert len(before) == 1 and wait_for(lambda: gone(before), timeout=2.0) < 1.0  # the worker that ran out ended
    assert len(live_workers() - before) == 1


def test_the_pool_compiles_the_grammar_a_direct_compile_does(compiler, make_pool, default_gguf):
    pool = make_pool()
    tok = Tokenizer.from_gguf(default_gguf)
    direct = GrammarCompiler(tok, tok.vocab_size, frozenset(tok.eos_token_ids))
    constraints = [Constraint("json", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                  "required": ["ok"], "additionalProperties": False})),
                   Constraint("regex", r"[a-z]+@[a-z]+\.com"), Constraint("choice", json.dumps(["yes", "no"])),
                   Constraint("grammar", chain(20))]

    async def compile_all():
        for c in constraints:
            await pool.compile(compiler, c)

    asyncio.run(compile_all())
    for c in constraints:
        assert c.compiled[0].serialize_json() == direct.compile(Constraint(c.kind, c.value)).serialize_json()
    bad = Constraint("json", json.dumps({"type": "nope"}), "response_format.json_schema.schema")
    with pytest.raises(InvalidParam) as through_pool:
        asyncio.run(pool.compile(compiler, bad))
    with pytest.raises(InvalidParam) as directly:
        direct.compile(bad)
    assert str(through_pool.value) == str(directly.value) and through_pool.value.param == bad.param


def test_a_compile_process_that_dies_costs_its_request_a_400_and_the_processes_are_started_again(compiler, make_pool):
    pool = make_pool()
    # What the kernel's OOM killer would do: a worker killed from outside while it compiles, then
    # the fork server itself.
    slow = Constraint("json", json.dumps(slow_schema("o")), "response_format.json_schema.schema")

    async def scenario():
        waiting = asyncio.ensure_future(pool.compile(compiler, slow))
        busy = await compiling(pool, 1)
        assert pool.pending == 1 and len(busy) == 2  # (the other worker is idle: the busy one is its own process)
        for pid in busy:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(InvalidParam) as died:
            await waiting
        os.kill(next(iter(grammar_processes(os.getpid())[0])), signal.SIGKILL)  # the fork server
        again = Constraint("regex", "[0-9]+")
        await pool.compile(compiler, again)  # on a fork server started again
        return died.value, again

    died, again = asyncio.run(scenario())
    assert died.param == slow.param and str(died) == (
        "response_format.json_schema.schema could not be compiled: the grammar compiler's process ended on it "
        "(out of memory?): make it simpler")
    assert again.compiled and pool.pending == 0 and len(grammar_processes(os.getpid())[0]) == 1


def test_a_fork_server_that_ends_under_its_workers_compile_costs_the_request_nothing(compiler, make_pool, monkeypatch):
    """The fork server killed as it hands a worker out (the kernel's OOM killer, or a kill, a moment before the
    compile; its workers die with it): the worker's end is the fork server's, not the constraint's, so the
    compile goes once more to a worker of a fork server started again and the request gets its grammar."""
    pool = make_pool()
    processes, killed = pool._processes, []
    handed_out = processes.worker

    def worker_of_a_dying_fork_server(vocabulary):
        worker = handed_out(vocabulary)
        if not killed:
            killed.append(processes._forks.process.pid)
            os.kill(killed[0], signal.SIGKILL)
            wait_for(lambda: not worker.alive, timeout=2.0)  # it died with its fork server
        return worker

    monkeypatch.setattr(processes, "worker", worker_of_a_dying_fork_server)
    c = Constraint("regex", "[0-9]+")
    asyncio.run(pool.compile(compiler, c))
    servers, _ = grammar_processes(os.getpid())
    assert c.compiled and pool.pending == 0 and len(servers) == 1 and killed[0] not in servers


def test_shutdown_with_compiles_running_waits_for_none_and_ends_their_processes(compiler, make_pool):
    pool = make_pool()
    async def scenario():
        slow = [asyncio.ensure_future(pool.compile(compiler, Constraint("json", json.dumps(slow_schema(tag)))))
                for tag in ("a", "b")]
        await compiling(pool, 2)
        servers, workers = grammar_processes(os.getpid())
        processes = servers | workers
        t0 = time.monotonic()
        pool.shutdown()
        took = time.monotonic() - t0
        for task in slow:
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        return took, processes

    took, processes = asyncio.run(scenario())
    assert took < 0.5, took
    assert len(processes) == 3 and wait_for(lambda: gone(processes), timeout=2.0) < 1.0


# -- a real server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--max-model-len", "256", "--grammar-cache-mib", "0.05",
                     "--grammar-compile-timeout", "5")
    yield s
    s.stop()


def _chat(schema: dict | str) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def test_the_server_refuses_a_100k_value_enum_at_once_and_keeps_answering(server):
    with server.client() as c:
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json=_chat(json.loads(enum_schema(100_000))))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "response_format.json_schema.schema"
        assert "this server compiles at most 65536 characters per constraint" in error["message"]
        assert time.monotonic() - t0 < 5
        ok = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_the_servers_grammar_cache_counts_hits_and_misses_and_stays_in_its_bytes(server):
    names = ("hits", "misses", "evictions")
    before = {k: server.metric(f"kvserve_grammar_cache_{k}_total") for k in names}
    # 400-value enums compile to ~40 KB each here: --grammar-cache-mib 0.05 (51 KiB) holds one.
    a, b, c = (json.loads(enum_schema(400, width=w)) for w in (10, 11, 12))
    with server.client() as client:
        for schema in (a, a, b, c):
            r = client.post("/v1/chat/completions", json=_chat(schema))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"].startswith('"v')
    after = {k: server.metric(f"kvserve_grammar_cache_{k}_total") for k in names}
    assert {k: after[k] - before[k] for k in names} == {"hits": 1, "misses": 3, "evictions": 2}
    assert server.metric("kvserve_grammar_cache_entries") == 1
    assert 30_000 < server.metric("kvserve_grammar_cache_bytes") <= 0.05 * (1 << 20)
    assert server.metric("kvserve_grammar_compiles_pending") == 0
