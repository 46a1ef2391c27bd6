"""Mixtures of experts (Mixtral: top 2 of 4 here, renormalized; Qwen3-MoE: top 2 of 8, q/k norms)
against transformers on tiny random-weight models made here: exact greedy tokens in float32 from
the Hugging Face directory and from GGUFs written by llama.cpp's own converter (its 3-D expert
tensors split per expert); Qwen3-MoE's dense layers (mlp_only_layers) and unrenormalized weights
from its directory; the converter's Q8_0 file's greedy tokens as the quantized tests define
agreement, and a request's tokens the same alone and in a batch (experts multiply their rows with
the batch-invariant integer kernel)."""
from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.config import CacheConfig
from kvserve.model.loader import read_model_config
from family_checks import agreement, float32_tokens, greedy, prompts, reference
from tiny_models import convert_with_llama_cpp, make_tiny_hf_model

FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
}
EXPERTS = {"mixtral": (4, 2, 128), "qwen3_moe": (8, 2, 64)}  # experts, chosen per token, expert FFN width


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(request, tmp_path_factory):
    """(family, transformers' model, its directory, llama.cpp's converter's files {"f32", "q8_0"})."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model, directory = make_tiny_hf_model(root / "hf", arch=family, seed=3, num_layers=3, **FAMILIES[family])
    return family, model, directory, {t: convert_with_llama_cpp(directory, root / f"{t}.gguf", t) for t in ("f32", "q8_0")}


def test_the_config_says_experts_from_both_sources(moe) -> None:
    family, _, directory, files = moe
    for source in (directory, files["f32"]):
        c = read_model_config(source)
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == EXPERTS[family], source
        assert c.norm_topk_prob and c.dense_layers == () and c.qk_norm == (family == "qwen3_moe"), source


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_float32_greedy_tokens_equal_transformers(moe, source) -> None:
    _, hf, directory, files = moe
    got, want = float32_tokens(directory if source == "hf" else files["f32"], hf)
    assert got == want


def test_qwen3_moes_dense_layers_and_unrenormalized_weights(tmp_path) -> None:
    """mlp_only_layers keeps layer 1 dense; norm_topk_prob false weighs the chosen experts by their
    softmax over all eight (llama.cpp's converter writes neither: its files are all-sparse, renormalized)."""
    hf, directory = make_tiny_hf_model(tmp_path / "hf", arch="qwen3_moe", seed=4, num_layers=3, num_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
                                       mlp_only_layers=[1])
    c = read_model_config(directory)
    assert (c.dense_layers, c.norm_topk_prob) == ((1,), False)
    llm = LLM(str(directory), dtype="float32", cache=CacheConfig(num_blocks=64))
    assert llm.model.layers[1].experts is None and llm.model.layers[0].experts is not None
    batch = prompts(3, seed=6)
    assert greedy(llm, batch) == [reference(hf, p) for p in batch]


def test_the_converters_q8_0_agrees_with_transformers_and_a_request_is_the_same_alone_and_batched(moe) -> None:
    _, hf, _, files = moe
    llm = LLM(str(files["q8_0"]), cache=CacheConfig(num_blocks=128))
    assert llm.runner.native is None  # the experts run in the per-op path
    batch = prompts(4, seed=5)
    alone = [greedy(llm, [p])[0] for p in batch]
    assert greedy(llm, batch) == alone
    agree, steps = agreement(llm, hf, batch)
    assert agree >= 0.9 * steps, f"{agree}/{steps}"


def test_the_startup_log_says_the_bytes_a_token_reads(moe, caplog) -> None:
    family, _, _, files = moe
    with caplog.at_level("INFO", logger="kvserve"):
        llm = LLM(str(files["q8_0"]), cache=CacheConfig(num_blocks=16))
    experts, chosen, _ = EXPERTS[family]
    idle = sum(lin.nbytes for lw in llm.model.layers for lin in lw.experts.linears()) * (experts - chosen) // experts
    assert llm.model.active_nbytes == llm.model.nbytes - idle > 0
    assert f"MB read per token: {chosen} of {experts} experts" in caplog.text
