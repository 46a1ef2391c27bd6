"""Models users already have: the Hugging Face cache and Ollama's store.

loader.resolve_model_path asks here for a name that is neither an alias nor an existing path:
  owner/name[:TAG]     a Hugging Face repository, its snapshot in the local cache as huggingface_hub
                       resolves it (HF_HUB_CACHE, HF_HOME), downloaded when absent and online. A
                       repository of safetensors loads as its directory; one of GGUF files loads the
                       one file whose name holds TAG (Q4_K_M, …), or its only one.
  ollama:name[:tag]    a model Ollama has pulled, from its store (OLLAMA_MODELS, else
                       ~/.ollama/models): the manifest's model layer is a GGUF blob, and its
                       params layer (temperature, top_k, …) the model's default sampling.
`kvserve models` lists what the two hold (`listing`) beside the aliases. A library below the
model: names to paths and sampling values, nothing loaded.

huggingface_hub comes with transformers, which xgrammar requires; any version since 0.23 has
what is used here.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.errors import ModelNotFoundError

OLLAMA_PREFIX = "ollama:"
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
# What a repository of safetensors needs: weights, configs, tokenizer files, a chat template.
_HF_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]
_OLLAMA_MODEL = "application/vnd.ollama.image.model"
_OLLAMA_PARAMS = "application/vnd.ollama.image.params"
# Ollama's parameter names → kvserve's sampling fields (generation_defaults.FIELDS).
OLLAMA_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty"}


def is_hf_repo(name: str) -> bool:
    """owner/name[:TAG], not a file's name (a mistyped relative path is not looked up online)."""
    return bool(_HF_REPO.match(name)) and not name.endswith((".gguf", ".safetensors", ".json"))


# --- Hugging Face ---------------------------------------------------------------------------------

def hf_model(name: str) -> Path:
    """The directory (safetensors) or .gguf file of Hugging Face repository `name` (owner/repo[:TAG])."""
    from huggingface_hub import constants, snapshot_download

    repo, _, tag = name.partition(":")
    patterns = [f"*{tag}*.gguf", f"*{tag.upper()}*.gguf", f"*{tag.lower()}*.gguf"] if tag else _HF_FILES
    try:
        snapshot = Path(snapshot_download(repo, local_files_only=True, allow_patterns=patterns))
    except Exception:  # noqa: BLE001 - not in the cache (huggingface_hub's error types differ between its versions)
        try:
            snapshot = Path(snapshot_download(repo, allow_patterns=patterns))
        except Exception as e:  # noqa: BLE001 - offline, unknown, gated: the reason, in one line
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ModelNotFoundError(
                f"model {name!r}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and not downloaded "
                f"({type(e).__name__}: {reason}); download it where there is a network "
                f"(`hf download {repo}`), or point HF_HUB_CACHE / HF_HOME at a cache that holds it") from None
    return _in_snapshot(snapshot, name, tag)


def _in_snapshot(snapshot: Path, name: str, tag: str) -> Path:
    ggufs = sorted(p for p in snapshot.rglob("*.gguf") if not tag or tag.lower() in p.name.lower())
    if not tag and (snapshot / "config.json").is_file():
        return snapshot
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelNotFoundError(f"model {name!r} holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs[:6])}); "
                                 f"name one by its quantization: {name.partition(':')[0]}:Q4_K_M")
    what = f"no GGUF file with {tag!r} in its name" if tag else "neither config.json nor a GGUF file"
    raise ModelNotFoundError(f"model {name!r}: its snapshot at {snapshot} has {what}")


# --- Ollama ---------------------------------------------------------------------------------------

def ollama_models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


@dataclass(frozen=True)
class OllamaModel:
    name: str  # as Ollama names it: qwen3:4b, hf.co/owner/repo:Q4_K_M
    gguf: Path  # the model layer's blob
    params: dict[str, Any]  # the params layer (temperature, top_k, stop, …), {} without one


def _manifest_path(name: str) -> Path:
    """Ollama's manifest for `name` ([host/][namespace/]model[:tag]; tag latest, host
    registry.ollama.ai, namespace library by default), as Ollama lays out its store."""
    base, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
    parts = base.split("/")
    if len(parts) == 1:
        parts = ["registry.ollama.ai", "library", *parts]
    elif len(parts) == 2:
        parts = ["registry.ollama.ai", *parts]
    if not all(parts) or any(p in (".", "..") for p in parts + [tag]):
        raise ModelNotFoundError(f"{OLLAMA_PREFIX}{name}: not an Ollama model name (e.g. ollama:qwen3:4b)")
    return ollama_models_dir() / "manifests" / Path(*parts) / tag


def _blob(digest: str) -> Path:
    return ollama_models_dir() / "blobs" / digest.replace(":", "-")


def ollama_model(name: str) -> OllamaModel:
    """The model Ollama pulled as `name` (with or without the ollama: prefix)."""
    name = name.removeprefix(OLLAMA_PREFIX)
    path = _manifest_path(name)
    if not path.is_file():
        raise ModelNotFoundError(f"model {OLLAMA_PREFIX}{name}: Ollama's store at {ollama_models_dir()} has no manifest "
                                 f"{path.relative_to(ollama_models_dir())}: `ollama pull {name}`, or set OLLAMA_MODELS "
                                 "to the store that holds it")
    try:
        layers = json.loads(path.read_text(encoding="utf-8"))["layers"]
        by_type = {layer["mediaType"]: layer["digest"] for layer in layers}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelNotFoundError(f"model {OLLAMA_PREFIX}{name}: unreadable manifest {path} ({e})") from None
    if _OLLAMA_MODEL not in by_type:
        raise ModelNotFoundError(f"model {OLLAMA_PREFIX}{name}: its manifest has no model layer")
    gguf = _blob(by_type[_OLLAMA_MODEL])
    if not gguf.is_file():
        raise ModelNotFoundError(f"model {OLLAMA_PREFIX}{name}: its model blob {gguf} is missing: `ollama pull {name}` again")
    params: dict[str, Any] = {}
    if _OLLAMA_PARAMS in by_type:
        try:
            params = json.loads(_blob(by_type[_OLLAMA_PARAMS]).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            params = {}  # sampling defaults are a nicety: the model still loads
    return OllamaModel(name, gguf, params if isinstance(params, dict) else {})


def ollama_sampling(name: str) -> dict[str, float]:
    """The params layer's sampling values as kvserve's fields (the rest, as `stop`, is not used)."""
    params = ollama_model(name).params
    return {field: params[key] for key, field in OLLAMA_SAMPLING.items()
            if isinstance(params.get(key), (int, float)) and not isinstance(params.get(key), bool)}


# --- the listing ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Found:
    name: str  # what to pass to --model
    source: str  # hf-cache, ollama (alias: `kvserve models` adds the aliases)
    path: Path


def listing() -> list[Found]:
    """Every model the Hugging Face cache and Ollama's store hold (not checked for loading: see
    `kvserve models`)."""
    found = _hf_cached()
    manifests = ollama_models_dir() / "manifests"
    for path in sorted(p for p in manifests.rglob("*") if p.is_file()) if manifests.is_dir() else []:
        host, *rest, model, tag = path.relative_to(manifests).parts
        name = "/".join(([] if host == "registry.ollama.ai" and rest == ["library"] else
                         rest if host == "registry.ollama.ai" else [host, *rest]) + [model]) + f":{tag}"
        try:
            found.append(Found(OLLAMA_PREFIX + name, "ollama", ollama_model(name).gguf))
        except ModelNotFoundError:
            pass
    return found


def _hf_cached() -> list[Found]:
    try:
        from huggingface_hub import scan_cache_dir

        repos = scan_cache_dir().repos
    except Exception:  # noqa: BLE001 - no cache yet (huggingface_hub raises its own CacheNotFound), or no huggingface_hub
        return []
    out = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        snapshot = max(repo.revisions, key=lambda r: r.last_modified).snapshot_path
        if (snapshot / "config.json").is_file():
            out.append(Found(repo.repo_id, "hf-cache", snapshot))
        for gguf in sorted(snapshot.rglob("*.gguf")):
            out.append(Found(f"{repo.repo_id}:{_quant_tag(gguf.name)}", "hf-cache", gguf))
    return out


def _quant_tag(filename: str) -> str:
    """The quantization a GGUF's name ends with (Qwen3-4B-Q4_K_M.gguf → Q4_K_M), else the stem."""
    stem = filename.removesuffix(".gguf")
    m = re.search(r"(I?Q\d[\w]*|F16|BF16|F32|MXFP4)$", stem, re.IGNORECASE)
    return m.group(1) if m else stem
