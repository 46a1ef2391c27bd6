"""Grammar-constrained decoding: compile a Constraint once, a matcher per sequence, a token
mask per step.

The engine is xgrammar. Measured against llguidance on this project's CPU with the default
model's 49,152-token vocabulary (a nested schema, docs/server.md has the figures): xgrammar
compiles a schema in ~60 ms and fills a batch-32 mask in ~1.4 ms per step, llguidance compiles
lazily (~1 ms) but fills in ~14 ms per step at batch 32 and needs 1.5 s to load the tokenizer;
xgrammar also ships a CPU kernel that applies the masks to the logits in place.

One step: `apply_masks(logits, seqs)` fills one packed bitmask row per constrained sequence
(C++, no Python loop over the vocabulary) and sets every token the grammar forbids to -inf;
after sampling, `advance(seq, token)` moves the sequence's matcher on. A token the matcher
refuses (the grammar cannot continue, e.g. min_tokens banned the only allowed stop token) ends
the sequence with finish_reason "grammar" instead of generating text the grammar forbids.
"""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvserve.errors import InvalidParam
from kvserve.structured import bounds, limits
from kvserve.structured.grammar_cache import GrammarCache
from kvserve.structured.spec import Constraint

if TYPE_CHECKING:
    from kvserve.tokenizer import Tokenizer

FINISH_REASON = "grammar"  # a sequence whose grammar cannot continue


class Guided(Protocol):
    """What the step functions below read and write of a sequence (the engine's `Sequence`,
    which this layer does not import)."""

    matcher: Any  # xgrammar's GrammarMatcher, or None for a sequence without a grammar
    grammar_refused: bool


def vocab_type(backend_json: str) -> Any:
    """How the vocabulary spells bytes: GPT-2 byte-level, SentencePiece byte fallback, or raw."""
    import xgrammar as xgr

    decoder = json.loads(backend_json).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _choice_grammar(choices: list[str]) -> str:
    """EBNF: exactly one of the strings (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_constraint(compiler: Any, c: Constraint) -> Any:
    """c compiled by an xgrammar GrammarCompiler (the size limits are the caller's), or an
    InvalidParam that names the request field and what is wrong (MemoryError: out of memory)."""
    try:
        if c.kind == "json":
            # No free whitespace: small models otherwise fill the output with blank lines; and
            # no unbounded numbers, which a sampled model may extend until max_tokens (bounds.py).
            return compiler.compile_json_schema(bounds.bounded(c.value), any_whitespace=False, strict_mode=True)
        if c.kind == "json_object":
            # Any object, its values' numbers bounded as a schema's are (bounds.py).
            return compiler.compile_json_schema(bounds.bounded(bounds.JSON_OBJECT), any_whitespace=False)
        if c.kind == "regex":
            return compiler.compile_regex(c.value)
        if c.kind == "choice":
            return compiler.compile_grammar(_choice_grammar(json.loads(c.value)))
        return compiler.compile_grammar(c.value)
    except (RuntimeError, ValueError, TypeError) as e:
        if "bad_alloc" in str(e):  # xgrammar's form of an allocation that failed: not the constraint's fault
            raise MemoryError(str(e)) from None
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}.get(c.kind, "constraint")
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", reason)  # xgrammar's "[time] file.cc:line: " prefix
        raise InvalidParam(c.param, f"{c.param} is not a valid {what} that kvserve can enforce: {reason}") from None


class GrammarCompiler:
    """Constraint → compiled grammar, for one tokenizer. Built on first use (loading the
    vocabulary into xgrammar takes ~0.5 s); a server builds it once its model is loaded, to give
    the vocabulary to its compile processes (kvserve/server/grammar_pool.py).

    A constraint over the size limits (kvserve/structured/limits.py) is refused before any work.
    Compiled grammars are kept in a cache bounded by bytes (kvserve/structured/grammar_cache.py;
    xgrammar's own cache, which never evicts, is off) and on the request's Constraint.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._info: Any = None  # xgrammar's TokenizerInfo, with the compiler
        self._lock = threading.Lock()
        self.cache = GrammarCache()
        self.limits = limits.LIMITS

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise ValueError("structured output needs the xgrammar package: pip install xgrammar") from None
                backend = self._tokenizer.backend
                vocab = [backend.id_to_token(i) or "" for i in range(self._tokenizer.vocab_size)]
                self._info = xgr.TokenizerInfo(vocab, vocab_type(backend.to_str()), vocab_size=self._vocab_size,
                                               stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            return self._compiler

    def cached(self, c: Constraint) -> bool:
        """Whether c is compiled already: for its request, or in the cache (then pinned on c)."""
        if c.compiled:
            return True
        hit = self.cache.get(c.key)
        if hit is not None:
            c.compiled[:] = [hit]
        return hit is not None

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar, or a ValueError that names the request field and what is wrong."""
        return c.compiled[0] if self.cached(c) else self.build(c)

    def check(self, c: Constraint) -> None:
        """InvalidParam if c is over the size limits (no compile work is done for it)."""
        limits.check(c, self.limits)

    def tokenizer_info(self) -> Any:
        """xgrammar's TokenizerInfo: the vocabulary as the compiles see it (kvserve/structured/compile_worker.py
        loads it into its processes)."""
        self._xgr_compiler()
        return self._info

    def build(self, c: Constraint) -> Any:
        """Compile c (no cache lookup), keep it in the cache and on c."""
        self.check(c)
        grammar = compile_constraint(self._xgr_compiler(), c)
        self.cache.put(c.key, grammar, grammar.memory_size_bytes)
        c.compiled[:] = [grammar]
        return grammar

    def matcher(self, c: Constraint) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(c))


def apply_masks(logits: torch.Tensor, seqs: Seq[Guided]) -> torch.Tensor:
    """Set to -inf every logit the sequences' grammars forbid, in place; rows without a grammar
    are untouched. logits: [len(seqs), >= vocab]; returned as float32 if a mask was applied."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    if logits.dtype != torch.float32:
        logits = logits.float()
    bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[1])  # [B, ceil(V / 32)] int32
    for i in rows:
        seqs[i].matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    return logits


def advance(seq: Guided, token: int) -> bool:
    """Feed the sampled token to seq's matcher; False when the grammar cannot accept it."""
    if seq.matcher is None:
        return True
    seq.grammar_refused = not seq.matcher.accept_token(token)
    return not seq.grammar_refused


def stuck(seq: Guided) -> bool:
    """The grammar refused the last token, or ended (its stop token) while the sequence goes on
    (min_tokens, ignore_eos): nothing more can be generated that it allows."""
    return seq.matcher is not None and (seq.grammar_refused or seq.matcher.is_terminated())
