"""Grammar engines side by side: xgrammar and llguidance (if installed) on this CPU with the
default model's vocabulary — set-up, compile, and per-step mask cost at batch 1 and 32.

    python -m benchmarks.grammar

Why it exists: docs/server.md explains the choice of xgrammar with these figures.
"""
from __future__ import annotations

import json
import time

import torch

from kvserve.model.loader import resolve_model_path
from kvserve.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["admin", "user"]},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}}
SAMPLE = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"],
          "address": {"city": "London", "zip": "W1"}}


def _xgrammar(tok: Tokenizer, ids: list[int]) -> None:
    import xgrammar as xgr

    from kvserve.structured.grammar import vocab_type

    vocab_size = tok.vocab_size
    t0 = time.perf_counter()
    vocab = [tok.backend.id_to_token(i) or "" for i in range(vocab_size)]
    info = xgr.TokenizerInfo(vocab, vocab_type(tok.backend.to_str()), vocab_size=vocab_size, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t2 = time.perf_counter()
    print(f"xgrammar: set-up {t1 - t0:.2f} s, compile {1e3 * (t2 - t1):.0f} ms")
    for batch in (1, 32):
        matchers = [xgr.GrammarMatcher(grammar) for _ in range(batch)]
        bitmask, logits = xgr.allocate_token_bitmask(batch, vocab_size), torch.randn(batch, vocab_size)
        fill = apply = 0.0
        for token in ids:
            a = time.perf_counter()
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
            b = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            fill, apply = fill + b - a, apply + time.perf_counter() - b
            for m in matchers:
                assert m.accept_token(token)
        print(f"  batch {batch}: fill {1e3 * fill / len(ids):.2f} ms/step, apply {1e3 * apply / len(ids):.2f} ms/step")


def _llguidance(tok: Tokenizer, ids: list[int]) -> None:
    try:
        import llguidance
        import llguidance.torch as lt
    except ImportError:
        print("llguidance: not installed (pip install llguidance)")
        return
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=2)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    print(f"llguidance: set-up {time.perf_counter() - t0:.2f} s (compiles lazily while matching)")
    executor = llguidance.LLExecutor(num_threads=2)
    lt.apply_token_bitmask_inplace(torch.randn(1, tok.vocab_size), lt.allocate_token_bitmask(1, tok.vocab_size))  # warm-up
    for batch in (1, 32):
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
        bitmask, logits = lt.allocate_token_bitmask(batch, tok.vocab_size), torch.randn(batch, tok.vocab_size)
        fill = apply = 0.0
        for token in ids:
            a = time.perf_counter()
            lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
            b = time.perf_counter()
            lt.apply_token_bitmask_inplace(logits, bitmask)
            fill, apply = fill + b - a, apply + time.perf_counter() - b
            for m in matchers:
                assert m.consume_token(token), m.get_error()
        print(f"  batch {batch}: fill {1e3 * fill / len(ids):.2f} ms/step, apply {1e3 * apply / len(ids):.2f} ms/step")


def main() -> None:
    tok = Tokenizer.load(resolve_model_path("smollm2-135m"))
    ids = tok.encode(json.dumps(SAMPLE), add_special_tokens=False) + [2]
    print(f"vocabulary {tok.vocab_size}, {len(ids)} steps (a schema-valid sample, then EOS)")
    _xgrammar(tok, ids)
    _llguidance(tok, ids)


if __name__ == "__main__":
    main()
