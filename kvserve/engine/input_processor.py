"""A request's input, checked: prompt (text or token ids) + SamplingParams → token ids the engine
can run, or an InvalidParam naming the field that is wrong and what to do. Every check of a
request before it reaches the engine is here; `LLMEngine.add_request` takes ids only and runs
`check` on them itself, so nothing unchecked reaches the scheduler whoever calls it.

Safe on any thread: it reads the tokenizer, fixed sizes and the grammar cache (which locks), so
the server runs it on a worker thread, off the event loop and the engine thread. `check` never
compiles a constraint (seconds of C++ for some schemas): the server compiles on its grammar pool
first (kvserve/server/grammar_pool.py), the library in `process`, on the caller's thread.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvserve.errors import InvalidParam
from kvserve.kv.manager import KVCacheManager
from kvserve.sampling_params import SamplingParams
from kvserve.structured.grammar import GrammarCompiler
from kvserve.tokenizer import PromptTooLong, Tokenizer


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, manager: KVCacheManager,
                 grammars: GrammarCompiler) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.manager = manager
        self.grammars = grammars
        # Said in context-length errors when the pool, not the model, sets the limit.
        self.context_note = ""
        if max_model_len == manager.pool.num_blocks * manager.block_size:
            self.context_note = " (all the KV pool can hold)"

    def process(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, checked with params, its constraint compiled here (the library's
        way in; the server compiles on its grammar pool and calls `encode` and `check`)."""
        if params.constraint is not None:
            self.grammars.compile(params.constraint)  # a bad schema fails here; kept on it for the matcher
        return self.check(self.encode(prompt), params)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Text tokenized (at most a context's worth), token ids as a list; not yet checked."""
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt:
            raise InvalidParam("prompt", "prompt must not be empty")
        try:
            return self.tokenizer.encode(prompt, max_tokens=self.max_model_len)
        except PromptTooLong:
            raise InvalidParam(
                "prompt", f"prompt is more than {self.max_model_len} tokens but the context holds "
                f"{self.max_model_len}{self.context_note}: shorten the prompt") from None

    def check(self, ids: list[int], params: SamplingParams) -> list[int]:
        """ids and params as one request: ids in the vocabulary, prompt and output within the
        context and the pool, logit_bias ids in the vocabulary, the constraint compiled already
        (read, never compiled, here). Allocates nothing; returns ids."""
        params.validate()  # again: a caller may have changed the fields since they were made
        limit, note = self.max_model_len, self.context_note
        if ids and not (all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < self.vocab_size):
            bad = next(t for t in ids if type(t) is not int or not 0 <= t < self.vocab_size)
            raise InvalidParam("prompt", f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise InvalidParam("prompt", "prompt must not be empty")
        outside = next((t for t in (params.logit_bias or ()) if t >= self.vocab_size), None)
        if outside is not None:
            raise InvalidParam("logit_bias", f"logit_bias: token id {outside} is outside the vocabulary "
                               f"[0, {self.vocab_size}): use ids from POST /tokenize")
        n = len(ids)
        if n > limit or (n == limit and params.max_tokens != 0):  # room for one token
            raise InvalidParam("prompt", f"prompt is {n} tokens but the context holds {limit}{note}: shorten the prompt")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise InvalidParam(
                "max_tokens", f"max_tokens is {params.max_tokens} but the context holds {limit} tokens{note} "
                f"and the prompt takes {n}: max_tokens must be at most {limit - n}")
        if n + params.min_tokens > limit:  # bounded like max_tokens
            raise InvalidParam(
                "min_tokens", f"min_tokens is {params.min_tokens} but the context holds {limit} tokens{note} "
                f"and the prompt takes {n}: min_tokens must be at most {limit - n}")
        total = n + (params.max_tokens if params.max_tokens is not None else limit - n)
        blocks = self.manager.blocks_held_at_most(total)
        if blocks > self.manager.pool.num_blocks:
            raise InvalidParam(
                "max_tokens", f"the request needs {blocks} KV blocks ({total} tokens) but the pool holds "
                f"{self.manager.pool.num_blocks}: lower max_tokens or shorten the prompt")
        c = params.constraint
        if c is not None and not self.grammars.cached(c):  # a caller's bug, not the client's: no 400
            raise RuntimeError(f"{c.param} was not compiled before the check: compile it first "
                               "(InputProcessor.process, or the server's grammar pool)")
        return ids
