"""Sampling defaults: what a request that leaves a sampling field out gets.

OpenAI's own defaults (temperature 1, no token limit for chat) suit large models; a 135 M model
sampled at temperature 1 answers junk most of the time. So, as vLLM does, a checkpoint's own
recommendation wins when it carries one: a Hugging Face `generation_config.json`
(temperature, top_p, top_k, min_p, repetition_penalty), GGUF's `general.sampling.*` keys, or the
params of a model Ollama pulled (kvserve/stores.py).
Without one, SERVER_DEFAULTS below apply — measured on the default model (README's "capital of
France" question; see docs/server.md). `--generation-config none` ignores the checkpoint,
`--default-sampling JSON` overrides field by field; the result is logged at start-up.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve import stores

# Fields a request may leave out and a default may fill.
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty")
# generation_config.json / GGUF key → SamplingParams field.
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
# A chat request without max_tokens stops here (OpenAI: no limit but the context).
MAX_TOKENS_DEFAULT = 1024


@dataclass(frozen=True)
class SamplingDefaults:
    """Values used for the fields a request leaves out (None: SamplingParams' own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    source: str = "none"  # where they came from, for the start-up log

    def given(self) -> dict[str, Any]:
        """The fields that are set, as SamplingParams keyword arguments."""
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}

    def override(self, values: dict[str, Any], source: str) -> SamplingDefaults:
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise ValueError(f"--default-sampling: unknown field(s) {', '.join(unknown)}; "
                             f"allowed: {', '.join(FIELDS)}")
        return dataclasses.replace(self, **values, source=f"{self.source} + {source}")

    def describe(self) -> str:
        given = self.given()
        values = ", ".join(f"{k}={v}" for k, v in given.items()) or "none (OpenAI's: temperature 1)"
        return f"sampling defaults from {self.source}: {values}"


# Measured on SmolLM2-135M-Instruct: temperature 1 answers the README's question wrong most of the
# time; 0.2 with top_p 0.9 keeps small models on the likely path and still varies the output.
SERVER_DEFAULTS = SamplingDefaults(temperature=0.2, top_p=0.9, source="server defaults")


def from_checkpoint(model_path: Path, model: str | None = None) -> SamplingDefaults | None:
    """The checkpoint's recommended sampling, or None when it carries none. `model`: the name it
    was loaded by (an Ollama model's sampling is in its params layer, beside the GGUF)."""
    found: dict[str, Any]  # SamplingDefaults' fields: numbers as the checkpoint gives them
    if model is not None and model.startswith(stores.OLLAMA_PREFIX):
        found = stores.ollama_sampling(model)
        source = "Ollama's params"
    elif model_path.is_dir():
        path = model_path / "generation_config.json"
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None
        found = {field: config[key] for key, field in _HF_KEYS.items() if isinstance(config.get(key), (int, float))}
        # do_sample false means greedy, whatever temperature says.
        if config.get("do_sample") is False:
            found = {"temperature": 0.0}
        source = f"{path.name}"
    else:
        from kvserve.tokenizer.gguf_vocab import read_gguf_metadata

        meta = read_gguf_metadata(model_path)
        found = {field: meta[key] for key, field in _GGUF_KEYS.items() if isinstance(meta.get(key), (int, float))}
        source = "GGUF general.sampling.*"
    if not found:
        return None
    if "top_k" in found:
        found["top_k"] = int(found["top_k"]) if found["top_k"] > 0 else -1
    return SamplingDefaults(**found, source=source)


def resolve(model_path: Path, generation_config: str = "auto", override: str | None = None,
            model: str | None = None) -> SamplingDefaults:
    """`generation_config`: "auto" (the checkpoint's, else the server's) or "none" (server's only).
    `override`: a JSON object of fields, applied last. `model`: the name it was loaded by."""
    if generation_config not in ("auto", "none"):
        raise ValueError(f"--generation-config must be auto or none, got {generation_config!r}")
    defaults = (from_checkpoint(model_path, model) if generation_config == "auto" else None) or SERVER_DEFAULTS
    if override:
        try:
            values = json.loads(override)
        except json.JSONDecodeError as e:
            raise ValueError(f"--default-sampling must be a JSON object: {e}") from None
        if not isinstance(values, dict):
            raise ValueError("--default-sampling must be a JSON object, e.g. '{\"temperature\": 0.7}'")
        defaults = defaults.override(values, "--default-sampling")
    from kvserve.sampling_params import SamplingParams

    SamplingParams(**defaults.given())  # out-of-range values fail at start-up, not per request
    return defaults
