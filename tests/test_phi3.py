"""Phi-3 / Phi-4-mini (fused qkv and gate_up weights, RoPE over part of each head, a sliding
window) against transformers on tiny random-weight models made here: exact greedy tokens in float32
from the Hugging Face directory and from a GGUF named as llama.cpp names it (its fused ffn_up);
the quantized GGUF through the native decode step, bit for bit the per-op path; LongRoPE
(Phi-3-*-128k, Phi-4-mini) within the original context exactly, and its long factors past it."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve import LLM
from kvserve.config import CacheConfig
from kvserve.kernels import decode_step
from kvserve.model.loader import read_model_config
from family_checks import greedy, native_and_per_op, prompts, reference
from tiny_models import make_tiny_hf_model, write_tiny_gguf

# Phi-4-mini's shape in small: 3/4 of each head turned (partial_rotary_factor 0.75), GQA, tied head
CASES = {"phi4-mini-like": dict(rope_scaling={"partial_rotary_factor": 0.75}, tie=True),
         "phi3-mini-like": dict(num_kv_heads=4, tie=False, sliding_window=16)}


@pytest.fixture(scope="module", params=list(CASES))
def phi3(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("phi3") / request.param
    model, directory = make_tiny_hf_model(directory, arch="phi3", head_dim=32, seed=4, **CASES[request.param])
    return request.param, model, directory


def test_the_config_from_both_sources(phi3, tmp_path) -> None:
    case, hf, directory = phi3
    rotary = 24 if case == "phi4-mini-like" else 0
    window = 16 if case == "phi3-mini-like" else None
    for source in (directory, write_tiny_gguf(tmp_path / "p.gguf", hf)):
        c = read_model_config(source)
        assert (c.architecture, c.head_dim, c.rotary_dim, c.sliding_window) == ("phi3", 32, rotary, window), source


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_float32_greedy_tokens_equal_transformers(phi3, tmp_path, source) -> None:
    _, hf, directory = phi3
    path = directory if source == "hf" else write_tiny_gguf(tmp_path / "p.gguf", hf, Q.F32, with_vocab=True)
    llm = LLM(str(path), dtype="float32", cache=CacheConfig(num_blocks=64))
    batch = prompts(3, seed=7)
    assert greedy(llm, batch) == [reference(hf, p) for p in batch]


@pytest.mark.skipif(decode_step.library() is None, reason="no C compiler: the native step cannot build")
def test_a_quantized_gguf_runs_the_native_step_as_the_per_op_path_does(phi3, tmp_path) -> None:
    _, hf, _ = phi3
    llm = LLM(str(write_tiny_gguf(tmp_path / "q8.gguf", hf, Q.Q8_0, with_vocab=True)),
              cache=CacheConfig(num_blocks=128, enable_prefix_caching=False))
    native, per_op = native_and_per_op(llm, prompts(4, seed=7))
    assert native == per_op


LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 128, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    """Phi-4-mini's RoPE in small: 12 of 16 dims turned, LongRoPE (2048 / 128: attention factor 1.25)."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("longrope") / "hf", arch="phi3", rope_scaling=LONGROPE, seed=5,
                              original_max_position_embeddings=128)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_longrope_within_the_original_context_equals_transformers(longrope, tmp_path, source) -> None:
    # Served at 128 tokens (the original context): the short factors, as transformers uses below it.
    hf, directory = longrope
    path = directory if source == "hf" else write_tiny_gguf(tmp_path / "p.gguf", hf, Q.F32, with_vocab=True)
    c = read_model_config(path).rope_scaling
    assert (c.kind, c.original_max_position_embeddings) == ("longrope", 128)
    assert c.short_factor == pytest.approx(LONGROPE["short_factor"]) and c.long_factor == pytest.approx(LONGROPE["long_factor"])
    assert c.attention_factor == pytest.approx(1.25, abs=0.01)
    llm = LLM(str(path), dtype="float32", max_model_len=128, cache=CacheConfig(num_blocks=64))
    batch = prompts(3, seed=7)
    assert greedy(llm, batch) == [reference(hf, p) for p in batch]


def test_longrope_past_the_original_context_takes_the_long_factors(longrope) -> None:
    # As llama.cpp chooses: by the context served, for every position alike (the K/V kept stay valid).
    _, directory = longrope
    exponents = torch.arange(0, 12, 2).float() / 12
    for context, factors in ((128, LONGROPE["short_factor"]), (1024, LONGROPE["long_factor"])):
        llm = LLM(str(directory), dtype="float32", max_model_len=context, cache=CacheConfig(num_blocks=64))
        expected = 1.0 / (torch.tensor(factors) * 10000.0 ** exponents)
        assert llm.max_model_len == context
        assert torch.allclose(llm.model.inv_freq, torch.cat([expected, torch.zeros(2)]))
