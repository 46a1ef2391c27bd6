"""`python -m benchmarks.serving_path --model FILE`: what the serving path adds to a token at one
user: one greedy stream served by `kvserve serve` (its own process, loopback HTTP, read by a
raw-socket client so that no HTTP library shares the cores) against the same decode run in-process
with no server around it (`LLM.generate`), alternated round by round so that the VM's memory speed
moves both alike.

Per token, medians over each run's decode steps, the best run of each kind:
- alone: the engine's step period in-process (one decode step's end to the next's);
- served: the gap between SSE events at the client, and from the request's own timeline
  (`"kvserve": {"timeline": true}`) the server's step period and its forward pass.
served ITL - alone period is what the serving path adds: a slower forward pass (the event loop and
the client share the cores), more time between steps, and the hand-over to the socket."""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks import one_model_ab_parser
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

PROMPT = "Round {i}: write a long story about a lighthouse keeper who collects lost letters from the sea. " * 4


@dataclass
class Run:
    itl: float | None  # the client's gap between SSE events (served only)
    period: float  # a decode step's end to the next's, engine side
    forward: float  # a decode step's forward pass


def decode_steps(timeline: dict) -> tuple[float, float]:
    """(step period, forward pass) medians, seconds, of a request's decode events."""
    prompt = timeline["prompts"][0] if "prompts" in timeline else timeline
    dec = [e for e in prompt["events"] if e["event"] == "decode"]
    return (statistics.median(b["end"] - a["end"] for a, b in zip(dec, dec[1:])),
            statistics.median(e["end"] - e["t"] for e in dec))


def served(port: int, prompt: str, tokens: int) -> Run:
    """One streamed completion, each SSE event timed as its bytes arrive at the socket."""
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                       "kvserve": {"timeline": True}}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        times, buf = [], b""
        while b"data: [DONE]" not in buf:
            data = s.recv(1 << 16)
            if not data:
                raise RuntimeError(f"the server closed the stream early: {buf[-400:]!r}")
            now = time.monotonic()
            times += [now] * data.count(b"\ndata: {" if buf else b"data: {")
            buf += data
    events = [json.loads(line[6:]) for line in buf.decode().splitlines() if line.startswith("data: {")]
    timeline = next(e["kvserve"]["timeline"] for e in reversed(events) if "kvserve" in e)
    itl = statistics.median(b - a for a, b in zip(times, times[1:]) if b > a)
    return Run(itl, *decode_steps(timeline))


def alone(llm: LLM, prompt: str, tokens: int) -> Run:
    out = llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0), use_tqdm=False)
    return Run(None, *decode_steps(llm.engine.timeline.get(out[0].request_id)))


def main(argv: list[str] | None = None) -> None:
    args = one_model_ab_parser("serving_path", __doc__, "tokens per stream (EOS ignored)").parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvserve-serving-path-{port}.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", "--model", args.model, "--port", str(port),
                                   "--threads", str(args.threads), "--no-access-log"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up; its log: {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        import torch

        torch.set_num_threads(args.threads)
        llm = LLM(args.model)
        served(port, PROMPT.format(i="warm"), 16), alone(llm, PROMPT.format(i="warm"), 16)
        runs: dict[str, list[Run]] = {"served": [], "alone": []}
        for r in range(args.rounds):  # distinct prompts: no prefix-cache hit, the same length
            for kind in ("served", "alone")[:: 1 if r % 2 == 0 else -1]:
                time.sleep(0.2)  # the other side's OpenMP threads back asleep
                prompt = PROMPT.format(i=f"{r:03d}")
                runs[kind].append(served(port, prompt, args.tokens) if kind == "served" else alone(llm, prompt, args.tokens))
            sv, al = runs["served"][-1], runs["alone"][-1]
            print(f"round {r + 1}: served ITL {sv.itl * 1e3:.2f} ms (server step period {sv.period * 1e3:.2f}, forward "
                  f"{sv.forward * 1e3:.2f}) | alone step period {al.period * 1e3:.2f} ms (forward {al.forward * 1e3:.2f})"
                  f" | adds {(sv.itl - al.period) * 1e3:+.2f} ms", flush=True)
    finally:
        server.terminate()
        server.wait()
    sv = min(runs["served"], key=lambda x: x.itl)
    al = min(runs["alone"], key=lambda x: x.period)
    adds = [(a.itl - b.period) * 1e3 for a, b in zip(runs["served"], runs["alone"])]
    print(f"\nbest of {args.rounds}, ms per token: served ITL {sv.itl * 1e3:.2f} (step period {sv.period * 1e3:.2f}, "
          f"forward {sv.forward * 1e3:.2f}); alone step period {al.period * 1e3:.2f} (forward {al.forward * 1e3:.2f})")
    print(f"the serving path adds {(sv.itl - al.period) * 1e3:.2f} ms per token (best against best); "
          f"round by round median {statistics.median(adds):+.2f} ms, range {min(adds):+.2f} to {max(adds):+.2f}")


if __name__ == "__main__":
    main()
