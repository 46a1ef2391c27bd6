"""kvserve kv-size: KV cache figures against ones worked out by hand."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.kv.kv_size import PRESETS, format_report, kv_size, parse_bytes
from kvserve.model.loader import read_model_config

KiB, GiB = 1024, 1024**3


def test_llama_2_7b_fp16_is_512_kib_per_token() -> None:
    s = kv_size("llama-2-7b", dtype="float16", context=4096, memory="16GiB")
    assert s.bytes_per_token == 2 * 32 * 32 * 128 * 2 == 512 * KiB
    assert s.cache_bytes == 2 * GiB  # 4096 tokens x 512 KiB
    assert s.mha_bytes_per_token == s.bytes_per_token and s.gqa_saving == 1.0  # already MHA
    # 6.74 B parameters (Meta's published count) x 2 bytes; what is left of 16 GiB holds the cache.
    assert round(s.num_parameters / 1e9, 2) == 6.74
    assert s.weight_bytes == s.num_parameters * 2
    assert s.max_tokens_in_memory == (16 * GiB - s.weight_bytes) // (512 * KiB)


def test_llama_3_8b_gqa_saves_4x() -> None:
    s = kv_size("llama-3-8b", dtype="float16", context=1_000_000, memory="80GiB")
    assert s.bytes_per_token == 128 * KiB
    assert s.mha_bytes_per_token == 512 * KiB and s.gqa_saving == 4.0
    assert s.cache_bytes == 1_000_000 * 128 * KiB
    assert round(s.num_parameters / 1e9, 2) == 8.03


@pytest.mark.parametrize(("name", "kib", "saving"), [
    ("llama-2-70b", 320, 8.0), ("llama-3-70b", 320, 8.0), ("mistral-7b", 128, 4.0),
    ("qwen2.5-7b", 56, 7.0), ("smollm2-135m", 22.5, 3.0),
])
def test_other_presets(name: str, kib: float, saving: float) -> None:
    s = kv_size(name, dtype="bfloat16", memory=GiB)
    assert s.bytes_per_token == kib * KiB and s.gqa_saving == saving


def test_weights_larger_than_memory_leave_no_room() -> None:
    s = kv_size("llama-3-70b", memory="24GiB", weight_dtype="int4")
    assert s.weight_bytes > 24 * GiB and s.max_tokens_in_memory == 0


def test_gguf_metadata_of_the_default_model(default_gguf) -> None:
    s = kv_size(default_gguf, dtype="float32", memory="1GiB")
    cfg = read_model_config(default_gguf)
    assert (s.source, s.num_layers, s.num_kv_heads, s.head_dim) == ("gguf", 30, 3, 64)
    assert s.bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 == 45 * KiB
    assert s.context == cfg.max_position_embeddings == 8192
    # The file lists its tensors, so the parameter count is exact and matches the preset's formula.
    assert s.num_parameters == PRESETS["smollm2-135m"].parameters == 134_515_008


def test_hf_config_json(tiny_llama_dir) -> None:
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    s = kv_size(tiny_llama_dir, dtype="float32", memory=GiB)  # a directory or its config.json
    assert s == kv_size(tiny_llama_dir / "config.json", dtype="float32", memory=GiB)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert s.bytes_per_token == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * 4
    assert s.source == "config.json" and s.gqa_saving == cfg["num_attention_heads"] / cfg["num_key_value_heads"]


def test_parse_bytes_and_errors() -> None:
    assert parse_bytes("16GiB") == 16 * GiB and parse_bytes("24 GB") == 24 * 10**9 and parse_bytes("512") == 512
    with pytest.raises(ValueError, match="memory must be a size like 16GiB"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="neither a preset"):
        kv_size("no-such-model")
    with pytest.raises(ValueError, match="dtype must be one of"):
        kv_size("llama-3-8b", dtype="int4")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", "kv-size", *args], capture_output=True, text=True, timeout=120)


def test_cli_spells_out_the_formula_and_json() -> None:
    r = _cli("llama-3-8b", "--context", "1000000", "--memory", "80GiB")
    assert r.returncode == 0, r.stderr
    assert "2 (K and V) x 32 layers x 8 kv-heads x 128 head-dim x 2 bytes = 131,072 bytes = 128 KiB" in r.stdout
    assert "At 1,000,000 tokens: 131,072,000,000 bytes = 122 GiB per sequence" in r.stdout
    assert "GQA saves 4x" in r.stdout
    r = _cli("llama-2-7b", "--json", "--memory", "16GiB")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["bytes_per_token"] == 524288 and got["context"] == 4096 and got["gqa_saving"] == 1.0
    r = _cli("nope")
    assert r.returncode == 2 and r.stderr.startswith("kvserve: error: 'nope' is neither a preset")


def test_a_gguf_counts_its_bytes_as_stored_and_a_token_its_chosen_experts(tmp_path) -> None:
    from gguf import GGUFReader

    from benchmarks.formats import write_random
    from kvserve.model.loader import resolve_model_path

    path = tmp_path / "moe.gguf"
    write_random(path, resolve_model_path("smollm2-135m"), arch="qwen3moe", hidden=128, layers=2, heads=2, kv_heads=1,
                 head_dim=64, ffn=64, experts=8, experts_used=2)
    tensors = GGUFReader(path).tensors
    total, experts = sum(int(t.n_bytes) for t in tensors), sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
    embedding = next(t for t in tensors if t.name == "token_embd.weight")  # beside an LM head of its own: a row read
    unread = int(embedding.n_bytes) - int(embedding.n_bytes) // int(embedding.shape[-1])
    s = kv_size(path, memory="1GiB", bandwidth=20e9)
    assert s.weight_bytes == total and s.active_bytes == total - experts * 6 // 8 - unread
    assert s.num_parameters == sum(int(t.n_elements) for t in tensors)
    report = format_report(s)
    assert "as the file stores them (F16 + F32)" in report and "2 of 8 experts per token" in report
    roofline = f"at 20 GB/s of memory read, one sequence decodes at most {20e9 / s.active_bytes:,.1f} tokens/s"
    assert roofline in report
    r = _cli(str(path), "--bandwidth", "20", "--memory", "1GiB")
    assert r.returncode == 0 and roofline in r.stdout, r.stderr
    # a weight type given counts the parameters at its size instead of the file's
    assert kv_size(path, memory="1GiB", weight_dtype="int4").weight_bytes == s.num_parameters // 2


def test_the_disk_tier_in_tokens() -> None:
    # smollm2-135m in float16: 23,040 bytes per token; a 16-token block's file is its 368,640 bytes
    # of K/V, 16 token ids (128 bytes) and a 68-byte header.
    s = kv_size("smollm2-135m", dtype="float16", memory="24GiB", disk=4 << 30)
    assert s.disk_block_file_bytes == 368_836 and s.disk_tokens == (4 << 30) // 368_836 * 16 == 186_304
    assert kv_size("smollm2-135m", memory="24GiB").disk_tokens is None
    r = _cli("smollm2-135m", "--memory", "24GiB", "--kv-disk-gib", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("Disk tier (kvserve serve --kv-disk-gib): 4 GiB holds 186,304 tokens of KV cache "
                                      "in block files of 360 KiB (11,644 blocks)")


@pytest.mark.parametrize("arch,extra", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1])),
    ("gemma3", dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=32)),
])
def test_parameters_of_each_family_equal_transformers_and_experts_count_as_read(tmp_path, arch, extra) -> None:
    """Every parameter transformers' model holds (q/k norms, Gemma's output norms, routers, experts, dense
    layers); a step reads the chosen experts only: total - (experts - chosen) x each expert's 3 matrices."""
    from tiny_models import make_tiny_hf_model

    hf, directory = make_tiny_hf_model(tmp_path, arch=arch, seed=0, num_layers=3, tie=False, with_tokenizer=False,
                                       **extra)
    s = kv_size(str(directory), dtype="float32", memory="1GiB")
    assert s.num_parameters == hf.num_parameters()
    c = hf.config
    if arch == "gemma3":
        assert s.active_parameters == s.num_parameters and "Mixture of experts" not in format_report(s)
        return
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    sparse = 3 - len(getattr(c, "mlp_only_layers", None) or [])
    assert s.active_parameters == s.num_parameters - sparse * (experts - 2) * 3 * c.hidden_size * width
    assert f"2 of {experts} experts per token" in format_report(s)
