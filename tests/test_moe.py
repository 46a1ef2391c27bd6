"""Mixtures of experts (Mixtral: top 2 of 4 here, renormalized; Qwen3-MoE: top 2 of 8, q/k norms)
against transformers on tiny random-weight models made here: exact greedy tokens in float32 from
the Hugging Face directory and from GGUFs written by llama.cpp's own converter (its 3-D expert
tensors split per expert); Qwen3-MoE's dense layers (mlp_only_layers) and unrenormalized weights
from its directory; the converter's Q8_0 file's greedy tokens as the quantized tests define
agreement, and a request's tokens the same alone and in a batch (experts multiply their rows with
the batch-invariant integer kernel); the native decode step's routed, grouped experts bit for bit
the per-op path's."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.config import CacheConfig
from kvserve.explain import explain, format_explanation
from kvserve.kernels import decode_step, layer_ops
from kvserve.model.loader import read_model_config
from kvserve.model.native_decode import NativeDecode
from family_checks import agreement, decode_both, float32_tokens, greedy, native_and_per_op, prompts, reference
from tiny_models import convert_with_llama_cpp, make_tiny_hf_model

FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
}
EXPERTS = {"mixtral": (4, 2, 128), "qwen3_moe": (8, 2, 64)}  # experts, chosen per token, expert FFN width
native_step = pytest.mark.skipif(decode_step.library() is None, reason="no C compiler: the native step cannot build")


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
    family, hf, _, files = moe
    llm = LLM(str(files["q8_0"]), cache=CacheConfig(num_blocks=128, enable_prefix_caching=False))
    assert llm.runner.native is not None and llm.runner.native._layers[0].experts.n == EXPERTS[family][0]
    batch = prompts(4, seed=5)
    alone = [greedy(llm, [p])[0] for p in batch]
    native, per_op = native_and_per_op(llm, batch)  # prompts and decode steps through the native step, and not
    assert native == per_op == alone
    agree, steps = agreement(llm, hf, batch)
    assert agree >= 0.9 * steps, f"{agree}/{steps}"


@native_step
@pytest.mark.parametrize("levels", [2, 1])
def test_the_native_step_routes_and_adds_the_experts_bit_for_bit_as_the_per_op_path(moe, levels) -> None:
    """Logits identical at every decode step of a batch whose rows share some experts and not others
    (5 rows x 2 chosen over 4 or 8 experts), activations at two int8 levels and at one."""
    _, _, _, files = moe
    llm = LLM(str(files["q8_0"]), cache=CacheConfig(num_blocks=128, enable_prefix_caching=False))
    llm.model.set_activation_levels(levels)
    llm.runner.native = NativeDecode(llm.model, llm.runner.kv_caches, llm.runner.block_size, llm.runner.kv_scales)
    decode_both(llm.runner, prompts(5, seed=7), steps=6)


@native_step
def test_a_quantized_qwen3_moe_with_a_dense_layer_and_unrenormalized_weights_takes_the_native_step(tmp_path) -> None:
    _, directory = make_tiny_hf_model(tmp_path / "hf", arch="qwen3_moe", seed=4, num_layers=3, num_experts=8,
                                      num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=False,
                                      mlp_only_layers=[1])
    llm = LLM(str(directory), quantization="q8_0", cache=CacheConfig(num_blocks=128, enable_prefix_caching=False))
    layers = llm.runner.native._layers
    assert (layers[0].experts.n, layers[0].experts.top_k, layers[0].experts.how) == (8, 3, layer_ops.ROUTE_SOFTMAX)
    assert layers[1].experts.n == 0 and layers[1].gate_up.nparts == 1 and layers[2].experts.n == 8
    decode_both(llm.runner, prompts(4, seed=8), steps=5)
    native, per_op = native_and_per_op(llm, prompts(3, seed=9))
    assert native == per_op


def test_the_router_kernel_picks_the_experts_and_weights_torch_does() -> None:
    """layer_ops.route (both paths' router on quantized models) against torch's softmax and top k: Mixtral's
    and Qwen3-MoE's (softmax over all, renormalized or not) and gpt-oss's (biased logits, softmax of the top k)."""
    torch.manual_seed(0)
    h, router, bias = torch.randn(37, 64), torch.randn(16, 64) * 0.2, torch.randn(16) * 0.5
    for renorm in (True, False):
        chosen, w = layer_ops.route(h, router, 4, layer_ops.ROUTE_RENORM if renorm else layer_ops.ROUTE_SOFTMAX)
        want_w, want = torch.softmax(h @ router.T, dim=-1).topk(4, dim=-1)
        want_w = want_w / want_w.sum(-1, keepdim=True) if renorm else want_w
        assert torch.equal(chosen, want)
        assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-6)
    chosen, w = layer_ops.route(h, router, 4, layer_ops.ROUTE_TOP_LOGITS, bias)
    top, want = torch.nn.functional.linear(h, router, bias).topk(4, dim=-1)
    assert torch.equal(chosen, want)
    assert torch.allclose(w, torch.softmax(top, dim=-1), rtol=1e-5, atol=1e-6)
    nan = torch.full((1, 64), float("nan"))
    for how in (layer_ops.ROUTE_RENORM, layer_ops.ROUTE_TOP_LOGITS):  # a NaN row still names two experts
        assert layer_ops.route(nan, router, 2, how)[0].tolist() == [[0, 1]]


def test_the_startup_log_says_the_bytes_a_token_reads(moe, caplog) -> None:
    family, _, _, files = moe
    with caplog.at_level("INFO", logger="kvserve"):
        llm = LLM(str(files["q8_0"]), cache=CacheConfig(num_blocks=16))
    experts, chosen, _ = EXPERTS[family]
    idle = sum(lin.nbytes for lw in llm.model.layers for lin in lw.experts.linears()) * (experts - chosen) // experts
    assert llm.model.active_nbytes == llm.model.nbytes - idle > 0
    assert f"MB read per token: {chosen} of {experts} experts" in caplog.text


@native_step
def test_explain_shows_the_experts_each_token_went_through(moe) -> None:
    """The native step's trace of the chosen experts equals the per-op path's routing, step by step; the
    report names them and counts a token's bytes as its chosen experts' (active_nbytes)."""
    family, _, _, files = moe
    experts, chosen, _ = EXPERTS[family]
    llm = LLM(str(files["q8_0"]), cache=CacheConfig(num_blocks=64, enable_prefix_caching=False))
    ids = prompts(1, seed=11)[0]
    native = explain(llm, ids, max_tokens=6, measure=False)
    assert llm.runner.native is not None and not llm.runner.native.trace and llm.runner.native._work.moe_trace is None
    step, llm.runner.native = llm.runner.native, None
    try:
        per_op = explain(llm, ids, max_tokens=6, measure=False)
    finally:
        llm.runner.native = step
    assert [s.token_id for s in native.steps] == [s.token_id for s in per_op.steps]
    assert [s.experts for s in native.steps] == [s.experts for s in per_op.steps]
    for s in native.steps:
        assert len(s.experts) == 3 and all(len(set(c)) == chosen and set(c) <= set(range(experts)) for c in s.experts)
    assert len({c for s in native.steps for c in s.experts}) > 1  # tokens go through different experts
    text = format_explanation(native)
    assert f"Experts: each token went through {chosen} of {experts} in each of 3 sparse layers" in text
    first = " | ".join(" ".join(map(str, c)) for c in native.steps[1].experts)
    assert f"{native.steps[1].piece!r:<16.16} {first}" in text
    assert native.weight_bytes_read == llm.model.active_nbytes - (0 if llm.model.tied else llm.model.embed.nbytes)
