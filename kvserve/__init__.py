"""kvserve: an LLM inference server you can read, run and trust.

The public names load on first use, so `kvserve` the command starts (and handles Ctrl-C) before
torch is imported.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "KVCache", "SamplingParams", "RequestOutput", "CompletionOutput", "CacheConfig",
           "ModelConfig", "SchedulerConfig", "SpeculativeConfig"]
__version__ = "0.1.0"

_WHERE = {"LLM": "kvserve.llm", "KVCache": "kvserve.llm", "SamplingParams": "kvserve.sampling_params",
          "RequestOutput": "kvserve.outputs", "CompletionOutput": "kvserve.outputs", "CacheConfig": "kvserve.config",
          "ModelConfig": "kvserve.config", "SchedulerConfig": "kvserve.config", "SpeculativeConfig": "kvserve.config"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
