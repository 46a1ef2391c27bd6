"""Qwen3 (a norm over each query and key head before RoPE; head_dim apart from hidden / heads)
against transformers on a tiny random-weight model made here: exact greedy tokens in float32 from
its Hugging Face directory (sharded safetensors) and from a GGUF named as llama.cpp names it; the
quantized GGUF through the native decode step, bit for bit the per-op path, and its greedy tokens
as the quantized tests define agreement."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from kvserve import LLM
from kvserve.config import CacheConfig
from kvserve.kernels import decode_step
from kvserve.model.loader import read_model_config
from family_checks import agreement, decode_both, greedy, native_and_per_op, prompts, reference
from tiny_models import make_tiny_hf_model, write_tiny_gguf

@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """GQA 4:2, head_dim 32 (not 64 / 4), untied head, random norms (q_norm, k_norm too)."""
    directory = tmp_path_factory.mktemp("qwen3") / "hf"
    model, directory = make_tiny_hf_model(directory, arch="qwen3", tie=False, head_dim=32, seed=3)
    model.save_pretrained(directory, max_shard_size="2MB")  # sharded: an index and several files
    assert (directory / "model.safetensors.index.json").is_file()
    return model, directory


def test_the_config_says_qwen3_from_both_sources(qwen3, tmp_path) -> None:
    hf, directory = qwen3
    gguf_path = write_tiny_gguf(tmp_path / "q.gguf", hf)
    for source in (directory, gguf_path):
        c = read_model_config(source)
        assert (c.architecture, c.qk_norm, c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                c.attention_bias, c.tie_word_embeddings) == ("qwen3", True, 32, 4, 2, False, False), source


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_float32_greedy_tokens_equal_transformers(qwen3, tmp_path, source) -> None:
    hf, directory = qwen3
    path = directory if source == "hf" else write_tiny_gguf(tmp_path / "q.gguf", hf, Q.F32, with_vocab=True)
    llm = LLM(str(path), dtype="float32", cache=CacheConfig(num_blocks=64))
    batch = prompts(3, seed=5)
    assert greedy(llm, batch) == [reference(hf, p) for p in batch]


@pytest.mark.skipif(decode_step.library() is None, reason="no C compiler: the native step cannot build")
def test_a_quantized_gguf_runs_the_native_step_as_the_per_op_path_does_and_agrees_with_transformers(qwen3, tmp_path) -> None:
    hf, _ = qwen3
    llm = LLM(str(write_tiny_gguf(tmp_path / "q8.gguf", hf, Q.Q8_0, with_vocab=True)), cache=CacheConfig(num_blocks=128,
                                                                                       enable_prefix_caching=False))
    assert llm.runner.native is not None and llm.runner.native._layers[0].q_norm is not None
    batch = prompts(4, seed=5)
    native, per_op = native_and_per_op(llm, batch)
    assert native == per_op
    decode_both(llm.runner, prompts(3, seed=6), steps=4)  # logits too: the head norms are the step's arithmetic
    # int8 activations are a slightly different model: greedy tokens fed transformers' own agree at
    # nearly every step (tests/test_quant.py's measure of agreement).
    agree, steps = agreement(llm, hf, batch)
    assert agree >= 0.9 * steps, f"{agree}/{steps}"
