"""Phi-3 / Phi-4-mini (fused qkv and gate_up weights, RoPE over part of each head, a sliding
window) against transformers on tiny random-weight models made here: exact greedy tokens in float32
from the Hugging Face directory and from a GGUF named as llama.cpp names it (its fused ffn_up);
the quantized GGUF through the native decode step, bit for bit the per-op path. LongRoPE
(Phi-3-*-128k, Phi-4-mini) is refused at load, by name."""
from __future__ import annotations

import random

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve import LLM, SamplingParams
from kvserve.config import CacheConfig
from kvserve.errors import ModelFormatError
from kvserve.kernels import decode_step
from kvserve.model.loader import read_model_config
from tiny_models import make_tiny_hf_model, write_tiny_gguf

TOKENS = 24
# Phi-4-mini's shape in small: 3/4 of each head turned (partial_rotary_factor 0.75), GQA, tied head
CASES = {"phi4-mini-like": dict(rope_scaling={"partial_rotary_factor": 0.75}, tie=True),
         "phi3-mini-like": dict(num_kv_heads=4, tie=False, sliding_window=16)}


@pytest.fixture(scope="module", params=list(CASES))
def phi3(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("phi3") / request.param
    model, directory = make_tiny_hf_model(directory, arch="phi3", head_dim=32, seed=4, **CASES[request.param])
    return request.param, model, directory


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def _reference(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


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
    prompts = _prompts(3)
    assert _greedy(llm, prompts) == [_reference(hf, p) for p in prompts]


@pytest.mark.skipif(decode_step.library() is None, reason="no C compiler: the native step cannot build")
def test_a_quantized_gguf_runs_the_native_step_as_the_per_op_path_does(phi3, tmp_path) -> None:
    _, hf, _ = phi3
    llm = LLM(str(write_tiny_gguf(tmp_path / "q8.gguf", hf, Q.Q8_0, with_vocab=True)),
              cache=CacheConfig(num_blocks=128, enable_prefix_caching=False))
    assert llm.runner.native is not None
    prompts = _prompts(4)
    llm.model.set_batch_invariant(True)
    try:
        native = _greedy(llm, prompts)
        llm.runner.native, step = None, llm.runner.native
        try:
            per_op = _greedy(llm, prompts)
        finally:
            llm.runner.native = step
    finally:
        llm.model.set_batch_invariant(llm.batch_invariant)
    assert native == per_op


def test_longrope_is_refused_by_name(tmp_path) -> None:
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
                "original_max_position_embeddings": 1024, "partial_rotary_factor": 0.75}
    model, directory = make_tiny_hf_model(tmp_path / "hf", arch="phi3", rope_scaling=longrope,
                                          with_tokenizer=False, vocab_size=512, pad_token_id=0)
    with pytest.raises(ModelFormatError, match="RoPE scaling 'longrope' is not supported"):
        read_model_config(directory)
