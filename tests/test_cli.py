"""The kvserve command as a user runs it: a real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys

from kvserve import LLM, SamplingParams


def kvserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_batch_jsonl_matches_the_library(tiny_llama_dir, tmp_path) -> None:
    src = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "a", "prompt": "The capital of France is", "max_tokens": 6},
        {"id": "b", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5, "stop": ["zz"]},
        {"id": "c", "prompt": "Once upon a time", "max_tokens": 4, "n": 2, "temperature": 0.9, "seed": 7},
    ]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    r = kvserve("generate", "--model", str(tiny_llama_dir), "--dtype", "float32", "--input", str(src), "--output", str(out))
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == ["a", "b", "c"]
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    ref = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert got[0]["token_ids"] == ref.token_ids and got[0]["text"] == ref.text
    assert got[0]["finish_reason"] == ref.finish_reason
    assert len(got[2]["choices"]) == 2


def test_bad_input_is_one_clear_line(tiny_llama_dir, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "temperature": 5}\n')
    r = kvserve("generate", "--model", str(tiny_llama_dir), "--input", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"kvserve: error: {bad}:1: temperature must be a finite number in [0, 2], got 5"
    )
    assert "Traceback" not in r.stderr
    r = kvserve("generate", "hi", "--model", "no-such-model")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "model 'no-such-model' is not a known alias" in r.stderr and "smollm2-135m" in r.stderr


def test_a_bad_input_file_fails_before_the_model_loads(tmp_path) -> None:
    # The model named does not exist: were it loaded first, that would be the error.
    missing = tmp_path / "nope.jsonl"
    r = kvserve("generate", "--model", "no-such-model", "--input", str(missing))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"kvserve: error: cannot read --input {missing}: No such file or directory"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"messages": "not a list"}\n')
    r = kvserve("generate", "--model", "no-such-model", "--input", str(bad))
    assert r.stderr.strip().splitlines()[-1] == (
        f'kvserve: error: {bad}:2: each line needs "prompt" (a string) or "messages" (a list)')


def test_chat_streams_from_stdin(tiny_llama_dir) -> None:
    r = kvserve("chat", "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-tokens", "5", stdin="hello\n")
    assert r.returncode == 0, r.stderr
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    ids = llm.encode_chat([{"role": "user", "content": "hello"}])
    ref = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert r.stdout.strip() == ref.text.strip()


def test_version_and_an_unreachable_chat_url_in_one_line() -> None:
    from kvserve import __version__
    from kvserve.chat import chat_url

    r = kvserve("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvserve {__version__}"
    for given in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/"):
        assert chat_url(given) == "http://127.0.0.1:8000/v1/chat/completions"
    r = kvserve("chat", "--url", "http://127.0.0.1:9/v1", stdin="hello\n")  # port 9 (discard): nothing listens
    assert r.returncode == 2, r.stderr
    error_lines = [line for line in r.stderr.splitlines() if line.startswith("kvserve: error:")]
    assert error_lines == [error_lines[0]] and "cannot reach the server at http://127.0.0.1:9/v1" in error_lines[0]
    assert "Traceback" not in r.stderr

