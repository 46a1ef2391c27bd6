"""Time to first token of a shared ~4,000-token document after a server restart: its KV blocks
read from the disk tier against a cold prefill, and the same tokens out.

Three `kvserve serve` processes of the same model on loopback, one after another:
  1. with --kv-disk-path: the document and a first question, then the second question (a RAM
     prefix hit); the blocks RAM caches are saved at shutdown;
  2. restarted on the same path: the document and the second question, timed (disk hit);
  3. without a disk tier: the same request, timed (the cold prefill).
Each fresh server first answers a short unrelated request, so one-time costs are not counted.
The disk hit reads back the very bits the RAM hit used, so their tokens must be equal; against
the cold prefill they are equal only where chunking does not change the numerics
(--batch-invariant makes quantized layers use one kernel at every batch size).

    python -m benchmarks.kv_disk [--model smollm2-135m] [--tokens 4000]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

QUESTIONS = ("Which box holds the most marbles?", "How many boxes are green?")


def document(items: int) -> str:
    colours = ["red", "green", "blue", "grey", "white", "black"]
    return "\n".join(f"Item {i}: the {colours[i % 6]} box on shelf {i % 17} holds {i * 7 % 13} marbles and "
                     f"{i * 3 % 11} buttons." for i in range(items))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, log: Path, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "w")
        cmd = [sys.executable, "-m", "kvserve", "serve", "--model", model, "--port", str(self.port), "--no-access-log",
               "--max-num-batched-tokens", "512", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready in 600 s: see {log}")
            time.sleep(0.2)

    def ask(self, prompt: str, max_tokens: int) -> tuple[float, str, int, int]:
        """(time to first token, text, prompt tokens, cached prompt tokens) of a greedy streamed completion."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        text, first, cached, prompt_tokens = [], None, 0, 0
        t0 = time.perf_counter()
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices"):
                    if first is None:
                        first = time.perf_counter() - t0
                    text.append(event["choices"][0].get("text", ""))
                if event.get("usage"):
                    prompt_tokens = event["usage"]["prompt_tokens"]
                    cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert first is not None, "no token came back"
        return first, "".join(text), prompt_tokens, cached

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == name:
                return float(value)
        return 0.0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4000, help="about this many tokens of shared document")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-invariant", action="store_true", help="pass --batch-invariant to every server")
    args = ap.parse_args(argv)
    extra = ("--batch-invariant",) if args.batch_invariant else ()
    doc = document(max(1, args.tokens // 24))  # ~24 tokens per line with this model's tokenizer
    ask = lambda q: f"{doc}\n\nQuestion: {q}\nAnswer:"  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="kvserve-kv-disk-") as tmp:
        disk = ("--kv-disk-path", os.path.join(tmp, "kv"), "--kv-disk-gib", "2", *extra)
        first = Server(args.model, Path(tmp, "1.log"), *disk)
        try:
            first.ask("Hello", 4)
            first.ask(ask(QUESTIONS[0]), args.max_tokens)
            t_ram, out_ram, _, _ = first.ask(ask(QUESTIONS[1]), args.max_tokens)
        finally:
            first.stop()
        warm = Server(args.model, Path(tmp, "2.log"), *disk)
        try:
            warm.ask("Hello", 4)
            t_disk, out_disk, n_prompt, cached = warm.ask(ask(QUESTIONS[1]), args.max_tokens)
            disk_tokens = warm.metric("kvserve_kv_disk_hit_tokens_total")
        finally:
            warm.stop()
        cold = Server(args.model, Path(tmp, "3.log"), *extra)
        try:
            cold.ask("Hello", 4)
            t_cold, out_cold, _, _ = cold.ask(ask(QUESTIONS[1]), args.max_tokens)
        finally:
            cold.stop()
    print(f"document + question: {n_prompt} prompt tokens; after the restart {int(disk_tokens)} read from the "
          f"disk tier ({cached} cached tokens reported)")
    print(f"time to first token: disk tier after a restart {t_disk * 1e3:.0f} ms, cold prefill {t_cold * 1e3:.0f} ms, "
          f"ratio {t_disk / t_cold:.2f} (a RAM prefix hit before the restart: {t_ram * 1e3:.0f} ms)")
    print(f"same tokens out: disk hit vs RAM hit {out_disk == out_ram}; disk hit vs cold prefill {out_disk == out_cold}")
    return 0 if out_disk == out_ram else 1


if __name__ == "__main__":
    sys.exit(main())
