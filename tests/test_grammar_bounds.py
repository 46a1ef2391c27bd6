"""Structured-output grammars are bounded and owned by their request: a size limit checked before
compiling (a 400 naming it), compiles on a pool of their own with a time limit and a queue
bound, taken off the queue when their request ends, and a compiled-grammar cache bounded by
bytes with hit/miss metrics. Real xgrammar compiles with the default model's vocabulary, and a
real server process."""
from __future__ import annotations

import asyncio
import json
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
from server_harness import MODEL_NAME, start_server


def chain(n: int, tag: str = "x") -> str:
    """An EBNF chain of n + 2 rules; its compile time grows steeply with n (1400: ~1 s here)."""
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


# -- the pool: own threads, a time limit, a queue bound, cancellation ---------------------------
def test_slow_compiles_time_out_fill_only_their_own_pool_and_leave_when_their_request_does(compiler):
    compiler.limits = GrammarLimits(max_chars=1 << 30, max_rules=1 << 30)  # slow shapes the limits would stop
    compiler.compile(Constraint("json_object"))  # xgrammar's vocabulary, loaded once
    pool = GrammarPool(threads=2, max_pending=3, timeout=0.3)

    async def scenario():
        slow = [asyncio.ensure_future(pool.compile(compiler, Constraint("grammar", chain(1400, tag), "guided_grammar")))
                for tag in ("a", "b")]
        await asyncio.sleep(0.05)
        queued_constraint = Constraint("grammar", 'root ::= "queued"', "guided_grammar")
        queued = asyncio.ensure_future(pool.compile(compiler, queued_constraint))
        await asyncio.sleep(0.05)
        assert pool.pending == 3
        with pytest.raises(APIError) as full:  # one more: refused at once
            await pool.compile(compiler, Constraint("regex", "x+", "guided_regex"))
        assert (full.value.status, full.value.code) == (429, "grammar_pool_full")
        t0 = time.monotonic()
        assert await asyncio.to_thread(lambda: "free") == "free"  # the default pool is not theirs
        free_after = time.monotonic() - t0
        queued.cancel()  # its request ended while it waited: it never compiles
        errors = await asyncio.gather(*slow, return_exceptions=True)
        await asyncio.gather(queued, return_exceptions=True)
        return errors, free_after, queued_constraint

    errors, free_after, queued_constraint = asyncio.run(scenario())
    assert [str(e) for e in errors] == ["guided_grammar took longer than 0.3 s to compile, this server's limit "
                                        "(--grammar-compile-timeout): make it simpler"] * 2
    assert free_after < 0.2 and pool.timeouts == 2
    deadline = time.monotonic() + 30
    while pool.pending:  # the two started compiles run to their end (xgrammar cannot be stopped)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not queued_constraint.compiled and not compiler.cached(Constraint("grammar", 'root ::= "queued"'))
    assert len(compiler.cache) == 3  # json_object and the two slow ones, kept for a retry
    pool.shutdown()


def test_a_client_that_leaves_takes_its_queued_compile_with_it(compiler):
    compiler.limits = GrammarLimits(max_chars=1 << 30, max_rules=1 << 30)
    compiler.compile(Constraint("json_object"))
    pool = GrammarPool(threads=1, max_pending=4, timeout=30)

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
    pool.shutdown()


def test_a_schema_sent_again_while_it_compiles_waits_for_that_compile_and_leaves_the_other_thread_free(compiler):
    compiler.limits = GrammarLimits(max_chars=1 << 30, max_rules=1 << 30)
    compiler.compile(Constraint("json_object"))
    pool = GrammarPool(threads=2, max_pending=8, timeout=30)
    slow_value = chain(1400, "r")

    async def scenario():
        slow = [asyncio.ensure_future(pool.compile(compiler, Constraint("grammar", slow_value, "guided_grammar")))
                for _ in range(4)]  # a client retrying the same slow schema
        await asyncio.sleep(0.05)
        assert pool.pending == 1  # one compile for the four requests
        t0 = time.monotonic()
        other = Constraint("grammar", 'root ::= "other"', "guided_grammar")
        await pool.compile(compiler, other)  # on the second thread, not behind the slow one
        other_after = time.monotonic() - t0
        slow[0].cancel()  # one waiter leaving does not stop the others' compile
        await asyncio.gather(*slow[1:])
        return other_after, other, slow

    t0 = time.monotonic()
    other_after, other, slow = asyncio.run(scenario())
    slow_after = time.monotonic() - t0
    assert other.compiled and other_after < 0.5 < slow_after, (other_after, slow_after)
    assert pool.pending == 0 and pool._compiling == {}
    assert compiler.cached(Constraint("grammar", slow_value)) and len(compiler.cache) == 3
    pool.shutdown()


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
