"""kvserve: an LLM inference server you can read, run and trust."""
from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.llm import LLM, KVCache
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "KVCache", "SamplingParams", "RequestOutput", "CompletionOutput", "CacheConfig",
           "ModelConfig", "SchedulerConfig"]
__version__ = "0.1.0"
