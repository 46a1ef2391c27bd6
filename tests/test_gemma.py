"""Gemma 2 and Gemma 3 against transformers on tiny random-weight models made here: windowed layers
between global ones (Gemma 3's each kind with its RoPE base), norms around attention and MLP, GeGLU,
the embedding scaled by sqrt(hidden), query_pre_attn_scalar, Gemma 3's q/k norms and Gemma 2's soft
caps (small here, so that they bite). Exact greedy tokens in float32 from the Hugging Face
directory, from Gemma 3's image-and-text layout, and from GGUFs written by llama.cpp's own
converter; the Q8_0 file through the native decode step, bit for bit the per-op path, and its
greedy tokens as the quantized tests define agreement."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import sentencepiece
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.config import CacheConfig
from kvserve.kernels import decode_step
from kvserve.model.loader import read_model_config
from family_checks import agreement, float32_tokens, greedy, native_and_per_op, prompts, reference

from tiny_models import convert_with_llama_cpp, make_tiny_hf_model

WINDOW = 8  # the prompts (4-40 tokens) and 24 generated pass it: the windowed layers drop keys
FAMILIES = {
    # windowed 0-4, global 5 (every sixth), windowed 6; global RoPE base 1e6 with linear scaling 8,
    # windowed base 1e4 unscaled
    "gemma3": dict(num_layers=7, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # windowed and global in turn; caps far below the default 50 and 30
    "gemma2": dict(num_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}
WINDOWS = {"gemma3": (WINDOW,) * 5 + (0, WINDOW), "gemma2": (WINDOW, 0, WINDOW, 0)}


class _Files(dict):
    """GGUF files by type, each written when a test first asks for it (make test-isa runs only the
    Q8_0 file's test, and llama.cpp's converter takes seconds a file)."""

    def __init__(self, write) -> None:
        super().__init__()
        self._write = write

    def __missing__(self, kind: str):
        self[kind] = path = self._write(kind)
        return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def gemma(request, tmp_path_factory):
    """(family, transformers' model, its directory, GGUF files {"f32", "q8_0"} from llama.cpp's converter):
    GQA 4:2, head_dim 32 (not 64 / 4, and the query_pre_attn_scalar), tied head, random norms. The converter
    reads Gemma 2's vocabulary from a SentencePiece model only, so Gemma 2's directory gets one trained here
    (the tests compare token ids: its pieces need not be the model's)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model, directory = make_tiny_hf_model(root / "hf", arch=family, head_dim=32, seed=3, sliding_window=WINDOW,
                                          query_pre_attn_scalar=32, **FAMILIES[family])
    if family == "gemma2":
        _write_sentencepiece(Path(directory) / "tokenizer.model")
    files = _Files(lambda kind: convert_with_llama_cpp(directory, root / f"{kind}.gguf", kind))
    return family, model, directory, files


def _write_sentencepiece(path: Path) -> None:
    """A small byte-fallback BPE SentencePiece model, trained on a few sentences (Gemma's ids: pad 0, eos 1,
    bos 2, unk 3)."""
    text = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris.",
            "Numbers: 0 1 2 3 4 5 6 7 8 9", "kvserve serves language models on the CPU."] * 16
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model, vocab_size=400,
                                             model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2,
                                             unk_id=3, minloglevel=2)
    path.write_bytes(model.getvalue())


def test_the_config_says_gemma_from_both_sources(gemma) -> None:
    family, _, directory, files = gemma
    for source in (directory, files["f32"]):
        c = read_model_config(source)
        assert (c.architecture, c.qk_norm, c.sandwich_norms, c.hidden_act, c.head_dim, c.tie_word_embeddings,
                c.sliding_window, c.layer_windows) == (family, family == "gemma3", True, "gelu_tanh", 32, True, None,
                                                       WINDOWS[family]), source
        assert (c.embedding_multiplier, c.attention_scale) == (8.0, 32**-0.5), source
        if family == "gemma3":
            assert (c.rope_theta, c.sliding_rope_theta, c.rope_scaling.kind, c.rope_scaling.factor) == (
                1e6, 1e4, "linear", 8.0), source
        else:
            assert (c.sliding_rope_theta, c.attn_logit_softcapping, c.final_logit_softcapping) == (None, 2.0, 3.0), source


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_float32_greedy_tokens_equal_transformers(gemma, source) -> None:
    _, hf, directory, files = gemma
    got, want = float32_tokens(directory if source == "hf" else files["f32"], hf)
    assert got == want


@pytest.mark.parametrize("gemma", ["gemma3"], indirect=True)
def test_gemma3s_image_and_text_checkpoint_serves_its_language_model(gemma, tmp_path) -> None:
    """google/gemma-3-4b-it's layout: model_type gemma3, the text config nested, the language model's
    tensors under model.language_model. and a vision tower beside them (skipped)."""
    _, hf, directory, _ = gemma
    text = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]}))
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(directory / "model.safetensors").items()}
    state["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    save_file(state, tmp_path / "model.safetensors")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((directory / f).read_bytes())
    assert read_model_config(tmp_path).eos_token_ids == (1, 106)
    llm = LLM(str(tmp_path), dtype="float32", cache=CacheConfig(num_blocks=64))
    batch = prompts(2, seed=7)
    assert greedy(llm, batch) == [reference(hf, p) for p in batch]


@pytest.mark.skipif(decode_step.library() is None, reason="no C compiler: the native step cannot build")
def test_the_converters_q8_0_runs_the_native_step_as_the_per_op_path_does_and_agrees_with_transformers(gemma) -> None:
    family, hf, _, files = gemma
    llm = LLM(str(files["q8_0"]), cache=CacheConfig(num_blocks=128, enable_prefix_caching=False))
    step = llm.runner.native
    assert [step._layers[i].window for i in range(len(WINDOWS[family]))] == list(WINDOWS[family])
    assert step._layers[0].attn_out_norm and step._layers[0].mlp_out_norm
    assert bool(step._layers[0].sliding_rope) == (family == "gemma3")
    assert not step._layers[WINDOWS[family].index(0)].sliding_rope  # a global layer
    assert step._model.attn_softcap == (2.0 if family == "gemma2" else 0.0)
    batch = prompts(4, seed=5)
    native, per_op = native_and_per_op(llm, batch)
    assert native == per_op
    # int8 activations are a slightly different model: greedy tokens fed transformers' own agree at
    # nearly every step (tests/test_quant.py's measure of agreement).
    agree, steps = agreement(llm, hf, batch)
    assert agree >= 0.9 * steps, f"{agree}/{steps}"


@pytest.mark.parametrize("gemma", ["gemma2"], indirect=True)
@pytest.mark.parametrize("source", ["hf", "q8_0"])
def test_gemma2s_logprobs_are_of_its_soft_capped_logits(gemma, source) -> None:
    """A cap never moves an argmax: the greedy tokens cannot show it, the logprobs do (cap 3: each
    logit within +-3), on the per-op path and the native step's alike."""
    _, hf, directory, files = gemma
    llm = LLM(str(directory if source == "hf" else files["q8_0"]), dtype="float32", cache=CacheConfig(num_blocks=64))
    prompt = prompts(1, seed=9)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    assert torch.allclose(got, want[torch.arange(8), out.token_ids], atol=1e-4 if source == "hf" else 0.05)
    spread = want.max(-1).values - want.min(-1).values
    assert (spread < 6).all() and (spread > 3).all()  # the cap's mark: logits within +-3, and pressed against it
