"""gpt-oss against transformers' GptOssForCausalLM on a tiny random-weight model made here (4 layers,
windowed and full alternating with a window of 8, 4 experts, top 2, YaRN as gpt-oss configures it).
Exact greedy tokens in float32 from Hugging Face directories (float experts, and MXFP4 ones as
gpt-oss publishes them) and from GGUFs written as llama.cpp names gpt-oss (MXFP4 experts and F32);
the experts' weights are MXFP4 values, so every file is the same model. Loaded as it comes, an MXFP4
file keeps its experts as MXFP4 blocks (model/mxfp4.py) for the integer kernels:
equal values, and the quantized path's agreement with transformers; with quantized attention too,
the native decode step, equal to the per-op path. Each piece shown to matter (the tokens differ
without the sinks, the clamp, the windows or YaRN; the log-probabilities without the sinks); tensor
parallel refused; a request's tokens the same alone and batched."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from family_checks import agreement, decode_both, greedy, native_and_per_op, prompts, reference
from gguf import GGMLQuantizationType as Q
from gpt_oss_models import make_gpt_oss, save_mxfp4_directory, write_gpt_oss_gguf

from kvserve import LLM, SamplingParams
from kvserve.config import CacheConfig, RopeScaling, SchedulerConfig
from kvserve.kernels import decode_step, layer_ops
from kvserve.model import attention
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_checkpoint, read_model_config
from kvserve.model.quant import QuantizedLinear, QuantizedWeight
from kvserve.parallel.shard import TensorParallelError, plan

PROMPTS = prompts(3, seed=7)
native_step = pytest.mark.skipif(decode_step.library() is None, reason="no C compiler: the native step cannot build")  # 4 to 39 tokens, then 24 generated: past the window of 8 everywhere


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(transformers' model, its directory, other files of it {"mxfp4", "f32" GGUFs, "hf-mxfp4" directory},
    transformers' greedy tokens for PROMPTS)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    hf, directory = make_gpt_oss(root / "hf", seed=1)
    files = {"mxfp4": write_gpt_oss_gguf(root / "mxfp4.gguf", hf),
             "mxfp4-q8_0": write_gpt_oss_gguf(root / "mxfp4-q8_0.gguf", hf, attention=Q.Q8_0),
             "f32": write_gpt_oss_gguf(root / "f32.gguf", hf, experts=Q.F32),
             "hf-mxfp4": save_mxfp4_directory(directory, root / "hf-mxfp4")}
    return hf, directory, files, [reference(hf, p) for p in PROMPTS]


def _llm(path, quantization: str = "none") -> LLM:
    return LLM(str(path), dtype="float32", quantization=quantization, cache=CacheConfig(num_blocks=64))


def test_the_config_from_both_sources(gpt_oss) -> None:
    _, directory, files, _ = gpt_oss
    configs = [read_model_config(src) for src in (directory, files["mxfp4"])]
    for c in configs:
        assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("gpt-oss", 4, 2, 64)
        assert c.layer_windows == (8, 0, 8, 0) and c.sliding_window is None and c.sliding_rope_theta is None
        assert c.attention_sinks and c.attention_bias and (c.swiglu_limit, c.swiglu_alpha) == (7.0, 1.702)
        assert c.rope_theta == 150000.0
        assert c.rope_scaling == RopeScaling("yarn", 32.0, original_max_position_embeddings=4096,
                                             attention_factor=pytest.approx(1.3465736), truncate=False)
    assert dataclasses.replace(configs[0], name="") == dataclasses.replace(configs[1], name="")


@pytest.mark.parametrize("source", ["hf", "hf-mxfp4", "mxfp4", "f32"])
def test_float32_greedy_tokens_equal_transformers(gpt_oss, source) -> None:
    _, directory, files, want = gpt_oss
    llm = _llm(directory if source == "hf" else files[source])
    assert llm.runner.native is None  # float weights: the per-op path (its decode steps' sinks in the fused kernel)
    assert greedy(llm, PROMPTS) == want


def _without(model: LlamaModel, piece: str) -> None:
    """`model` with one of gpt-oss's pieces taken out, in place."""
    if piece == "sinks":
        for lw in model.layers:
            lw.sinks = None
    elif piece == "windows":
        for lw in model.layers:
            lw.window = 0
    elif piece == "clamp":
        model.config = dataclasses.replace(model.config, swiglu_limit=float("inf"))
    else:
        raise ValueError(piece)


@pytest.mark.parametrize("piece", ["sinks", "windows", "clamp"])
def test_each_piece_matters(gpt_oss, piece) -> None:
    """Taken out, each changes the greedy tokens: the test above would catch kvserve without it."""
    _, directory, _, want = gpt_oss
    llm = _llm(directory)
    _without(llm.model, piece)
    assert greedy(llm, PROMPTS) != want


def test_yarn_matters(gpt_oss, tmp_path) -> None:
    """The same weights under plain RoPE (the config's rope_parameters rewritten) give other tokens."""
    _, directory, _, want = gpt_oss
    plain = shutil.copytree(directory, tmp_path / "plain")
    cfg = json.loads((plain / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(cfg))
    assert greedy(_llm(plain), PROMPTS) != want


@pytest.mark.parametrize("source", ["mxfp4", "hf-mxfp4"])
def test_mxfp4_experts_stay_quantized_with_the_same_values_and_agree_with_transformers(gpt_oss, source) -> None:
    """As it comes, an MXFP4 GGUF or directory keeps every expert as MXFP4 blocks (17 bytes a block where
    float32 takes 128) holding the float path's very weights; through the integer kernels the greedy
    choice, fed transformers' tokens, is transformers' at nearly every step, as for the other quantized
    families."""
    hf, _, files, _ = gpt_oss
    kept, exact = (load_checkpoint(files[source], quantization=q).tensors for q in ("auto", "none"))
    experts = [n for n in exact if ".mlp.experts." in n and n.endswith("_proj.weight")]
    assert len(experts) == 4 * 4 * 3  # layers x experts x (gate, up, down)
    for name in experts:
        assert isinstance(kept[name], QuantizedWeight) and kept[name].qtype == Q.MXFP4, name
        assert torch.equal(kept[name].dequantize(), exact[name]), name
    llm = _llm(files[source], "auto")
    assert all(isinstance(lin, QuantizedLinear) for lw in llm.model.layers for lin in lw.experts.down)
    agree, steps = agreement(llm, hf, PROMPTS)
    assert agree >= 0.9 * steps, f"{agree}/{steps}"


@native_step
def test_the_native_step_gives_the_per_op_paths_logits_and_tokens(gpt_oss) -> None:
    """With quantized attention (as llama.cpp's MXFP4_MOE files have it) gpt-oss runs the native decode step:
    sinks in the fused attention, the biased router's softmax of the top k, biased experts and the clamped
    SwiGLU in C, and the per-op path computes the same bits (its decode through the same kernels); windowed
    layers are past their window of 8 in 12 steps. Greedy tokens equal, each request's the same alone as in the
    batch, and they agree with transformers."""
    hf, _, files, _ = gpt_oss
    llm = _llm(files["mxfp4-q8_0"], "auto")
    native = llm.runner.native
    assert native is not None
    layers = native._layers
    assert [bool(layers[i].sinks) for i in range(4)] == [True] * 4 and layers[0].experts.router_bias
    assert layers[0].experts.how == layer_ops.ROUTE_TOP_LOGITS and native._model.swiglu_limit == 7.0
    decode_both(llm.runner, prompts(4, seed=8), steps=12)
    ours, per_op = native_and_per_op(llm, PROMPTS)
    assert ours == per_op
    assert [greedy(llm, [p])[0] for p in PROMPTS] == greedy(llm, PROMPTS)  # alone as in a batch
    agree, steps = agreement(llm, hf, PROMPTS)
    assert agree >= 0.9 * steps, f"{agree}/{steps}"


def test_a_request_is_the_same_alone_and_batched(gpt_oss) -> None:
    _, _, files, _ = gpt_oss
    llm = _llm(files["mxfp4"], "auto")  # experts on the integer kernels
    batch = prompts(4, seed=8)
    alone = [greedy(llm, [p])[0] for p in batch]
    assert greedy(llm, batch) == alone


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Each prompt token's log-probability given those before it."""
    out = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])


def test_prompt_logprobs_through_chunked_prefill_equal_transformers_and_the_sinks_move_them(gpt_oss) -> None:
    """A 48-token prompt in chunks of 16: each chunk's windowed layers read the pool, sinks applied;
    without the sinks the log-probabilities move far past the tolerance."""
    hf, directory, _, _ = gpt_oss
    prompt = [100 + 7919 * i % 40000 for i in range(48)]
    with torch.no_grad():
        logits = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    want = logits.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    llm = LLM(str(directory), dtype="float32", cache=CacheConfig(num_blocks=64, enable_prefix_caching=False),
              scheduler=SchedulerConfig(max_num_batched_tokens=16))
    torch.testing.assert_close(_prompt_logprobs(llm, prompt), want, atol=1e-4, rtol=0)
    _without(llm.model, "sinks")
    assert (_prompt_logprobs(llm, prompt) - want).abs().max() > 1e-2


def test_a_long_prompts_scores_are_made_a_slice_of_queries_at_a_time(gpt_oss, monkeypatch) -> None:
    """The reference attention's scores are bounded (attention.SINK_SCORES_BYTES): sliced down to one query at a
    time, a 48-token prompt's log-probabilities are the whole chunk's, within float rounding."""
    _, directory, _, _ = gpt_oss
    prompt = [100 + 7919 * i % 40000 for i in range(48)]
    whole = _prompt_logprobs(_llm(directory), prompt)
    monkeypatch.setattr(attention, "SINK_SCORES_BYTES", 1)
    torch.testing.assert_close(_prompt_logprobs(_llm(directory), prompt), whole, atol=1e-5, rtol=0)


def test_tensor_parallel_refuses_it(gpt_oss) -> None:
    _, directory, _, _ = gpt_oss
    with pytest.raises(TensorParallelError, match="does not run gpt-oss models yet"):
        plan(read_model_config(directory), {}, 2)
