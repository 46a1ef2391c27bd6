"""Models users already have (kvserve/stores.py): a Hugging Face cache and an Ollama store,
each built in a temporary directory as huggingface_hub and Ollama lay them out, read by real
`kvserve` processes (the environment variables those tools read point at them) — names resolve,
`kvserve models` lists them, a missing one is a clear error, and a server serves an Ollama model
with its params as the default sampling."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from gguf import GGMLQuantizationType as Q

from server_harness import REPO, free_port
from tiny_models import make_tiny_hf_model, write_tiny_gguf

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PARAMS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repeat_penalty": 1.1, "stop": ["<|im_end|>"]}


def _hf_repo(hub: Path, repo: str, files: dict[str, Path]) -> Path:
    """A repository in a Hugging Face cache: blobs by hash, a snapshot of links, refs/main."""
    root = hub / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    for name, source in files.items():
        blob = root / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def _ollama_model(store: Path, manifest: str, gguf: Path, params: dict | None) -> Path:
    """A pulled model in an Ollama store: its manifest and blobs named by their sha256."""
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)

    def blob(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(data)
        return f"sha256:{digest}"

    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": blob(gguf.read_bytes()), "size": gguf.stat().st_size}]
    if params is not None:
        data = json.dumps(params).encode()
        layers.append({"mediaType": "application/vnd.ollama.image.params", "digest": blob(data), "size": len(data)})
    path = store / "manifests" / manifest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blobs / layers[0]["digest"].replace(":", "-")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stores")
    model, directory = make_tiny_hf_model(tmp / "qwen3", arch="qwen3", head_dim=32, seed=3)
    hub = tmp / "hf" / "hub"
    _hf_repo(hub, "kvtest/tiny-qwen3", {p.name: p for p in directory.iterdir() if p.is_file()})
    q8 = write_tiny_gguf(tmp / "tiny-Q8_0.gguf", model, Q.Q8_0, with_vocab=True)
    f32 = write_tiny_gguf(tmp / "tiny-F32.gguf", model, Q.F32, with_vocab=True)
    _hf_repo(hub, "kvtest/tiny-GGUF", {q8.name: q8, f32.name: f32})
    ollama = tmp / "ollama"
    blob = _ollama_model(ollama, "registry.ollama.ai/library/tinyq/latest", q8, PARAMS)
    _ollama_model(ollama, "hf.co/kvtest/tiny-GGUF/F32", f32, None)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "OLLAMA_MODELS": str(ollama),
           "OMP_NUM_THREADS": "1"}
    return env, hub, blob


def _kvserve(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_models_lists_the_cache_and_the_store_with_their_architectures(stores) -> None:
    env, hub, blob = stores
    out = _kvserve(env, "models", "--json")
    assert out.returncode == 0, out.stderr
    found = {r["model"]: r for r in json.loads(out.stdout)}
    snapshot = hub / "models--kvtest--tiny-qwen3" / "snapshots" / COMMIT
    expected = {
        "kvtest/tiny-qwen3": ("hf-cache", str(snapshot)),
        "kvtest/tiny-GGUF:Q8_0": ("hf-cache", str(snapshot.parents[2] / "models--kvtest--tiny-GGUF" / "snapshots" / COMMIT / "tiny-Q8_0.gguf")),
        "kvtest/tiny-GGUF:F32": ("hf-cache", str(snapshot.parents[2] / "models--kvtest--tiny-GGUF" / "snapshots" / COMMIT / "tiny-F32.gguf")),
        "ollama:tinyq:latest": ("ollama", str(blob)),
        "ollama:hf.co/kvtest/tiny-GGUF:F32": ("ollama", None),
    }
    for name, (source, path) in expected.items():
        assert name in found, (name, sorted(found))
        row = found[name]
        assert (row["source"], row["architecture"], row["loads"]) == (source, "qwen3", True), row
        assert path is None or row["path"] == path, row
    # Each listed name is what --model takes: kv-size reads the same architecture through it.
    for name in expected:
        out = _kvserve(env, "kv-size", name, "--json", "--memory", "1GiB")
        assert out.returncode == 0, (name, out.stderr)
        assert json.loads(out.stdout)["num_layers"] == 2, name


def test_names_that_are_not_there_are_one_clear_line(stores) -> None:
    env, hub, _ = stores
    cases = {
        "kvtest/absent": ["'kvtest/absent'", "not in the Hugging Face cache", str(hub), "hf download kvtest/absent"],
        "kvtest/tiny-GGUF": ["holds 2 GGUF files", "tiny-F32.gguf", "tiny-Q8_0.gguf", "kvtest/tiny-GGUF:Q4_K_M"],
        "kvtest/tiny-GGUF:Q4_K_M": ["no GGUF file with 'Q4_K_M' in its name"],
        "ollama:qwen3:4b": ["Ollama's store at", "ollama pull qwen3:4b", "OLLAMA_MODELS"],
        "missing/dir/model.gguf": ["is neither a preset", "ollama:name:tag"],
    }
    for name, parts in cases.items():
        out = _kvserve(env, "kv-size", name)
        assert out.returncode == 2, (name, out.stdout, out.stderr)
        line = out.stderr.strip()
        assert line.startswith("kvserve: error: ") and "\n" not in line, (name, out.stderr)
        for part in parts:
            assert part in line, (name, part, line)


@pytest.mark.slow
def test_a_server_serves_an_ollama_model_with_its_params_as_the_default_sampling(stores, tmp_path) -> None:
    env, _, _ = stores
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", "ollama:tinyq", "--port", str(port),
                                 "--kv-cache-gib", "0.05", "--no-access-log"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, log.read_text()
            import time
            time.sleep(0.1)
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["ollama:tinyq"]
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "ollama:tinyq", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "sampling defaults from Ollama's params: temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1" in text, text
