"""`make bench`: offline throughput of kvserve against transformers, in the same run.

Workload: R requests of P random prompt tokens, each generating O tokens (ignore_eos, greedy),
on the same model and dtype for every system. kvserve gets all requests at once (continuous
batching); transformers runs them one at a time and in static batches. transformers is slow
here, so it runs on a subset of the requests (--hf-single, --hf-batches); its tokens/s is a
rate and compares directly. Results go to a markdown file with the command, machine and date.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams, SchedulerConfig
from kvserve.llm import default_dtype, parse_dtype
from benchmarks.router import write_section


@dataclass
class Row:
    system: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tps(self) -> float:
        return self.output_tokens / self.seconds


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, Python {platform.python_version()}"


def run_kvserve(llm: LLM, prompts: list[list[int]], out_len: int) -> Row:
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    llm.manager.pool.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return Row("kvserve (continuous batching)", len(prompts), sum(len(o.token_ids) for o in outs), dt)


def single_stream(llm: LLM, prompt: list[int], out_len: int) -> float:
    """Decode tokens/s of one sequence through the seed's prefill/decode loop."""
    cache, token = llm.prefill(prompt)
    t0 = time.perf_counter()
    for _ in range(out_len):
        cache, token = llm.decode(cache, token)
    dt = time.perf_counter() - t0
    cache.close()
    return out_len / dt


def run_transformers(path: Path, dtype: torch.dtype, prompts: list[list[int]], out_len: int, batch: int) -> Row:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    n_tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            x = torch.tensor(prompts[i : i + batch])  # equal lengths: no padding needed
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=out_len, min_new_tokens=out_len,
                                 do_sample=False, pad_token_id=0)
            n_tokens += (out.shape[1] - x.shape[1]) * x.shape[0]
    dt = time.perf_counter() - t0
    label = "transformers generate, one at a time" if batch == 1 else f"transformers generate, static batches of {batch}"
    return Row(label, len(prompts), n_tokens, dt)


def run_dtype(args: argparse.Namespace, dtype: str, prompts: list[list[int]]) -> tuple[list[Row], float]:
    """kvserve, then transformers one at a time and in static batches, all in one dtype."""
    # "auto" is kvserve's default (a GGUF's quantized blocks kept); a named dtype is the float path.
    llm = LLM(args.model, dtype=dtype, quantization="auto" if dtype == "auto" else "none",
              scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs))
    rows = [run_kvserve(llm, prompts, args.output_len)]
    print(f"  [{dtype}] {rows[-1].system}: {rows[-1].tps:.1f} tok/s", flush=True)
    single = single_stream(llm, prompts[0], args.output_len)
    print(f"  [{dtype}] kvserve single-stream decode: {single:.1f} tok/s", flush=True)
    path = llm.model_path
    del llm
    if path.suffix == ".gguf":  # transformers loads GGUF files directly
        for n, batch in ((args.hf_single, 1), (args.hf_batch * args.hf_batches, args.hf_batch)):
            if n > 0:
                rows.append(run_transformers(path, getattr(torch, dtype), prompts[:n], args.output_len, batch))
                print(f"  [{dtype}] {rows[-1].system}: {rows[-1].tps:.1f} tok/s", flush=True)
    return rows, single


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.offline")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="auto,float32", help="comma-separated; auto is kvserve's default")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-single", type=int, default=4, help="requests transformers runs one at a time")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-batches", type=int, default=2, help="static batches transformers runs")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--write", type=Path, default=None, help="markdown file whose `bench` section to (re)write")
    args = ap.parse_args(argv)

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    dtypes = []
    for d in args.dtypes.split(","):
        name = str(parse_dtype(d.strip())).removeprefix("torch.")
        if name not in dtypes:
            dtypes.append(name)
    print(f"model {args.model}; {args.requests} requests x {args.prompt_len} prompt + {args.output_len} output tokens; "
          f"dtypes {', '.join(dtypes)} (kvserve's default here: {str(default_dtype()).removeprefix('torch.')})", flush=True)
    results = {d: run_dtype(args, d, prompts) for d in dtypes}

    lines = [
        "## Offline throughput against transformers (`make bench`)",
        "",
        "Every system runs the same requests (random prompt token ids, greedy,",
        "`ignore_eos`) on the same model and dtype, in one run. Output tokens/s counts generated tokens",
        "over wall time, prefill included. transformers runs a subset of the requests (it is slow); its",
        "tokens/s is a rate, so the ratio compares like with like.",
        "",
        f"- command: `make bench` (`python -m benchmarks.offline {' '.join(argv if argv is not None else sys.argv[1:])}`)",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {machine()}",
        f"- model: {args.model}; {args.requests} requests x {args.prompt_len} prompt tokens x {args.output_len} "
        f"output tokens; kvserve's default dtype here is {str(default_dtype()).removeprefix('torch.')}",
        "",
        "| dtype | system | requests | output tokens | seconds | output tokens/s | kvserve is |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for d, (rows, _) in results.items():
        for r in rows:
            ratio = "—" if r is rows[0] else f"{rows[0].tps / r.tps:.2f}x"
            lines.append(f"| {d} | {r.system} | {r.requests} | {r.output_tokens} | {r.seconds:.1f} | {r.tps:.1f} | {ratio} |")
    lines += ["", f"Single-stream decode (kvserve `prefill` then {args.output_len} x `decode`, one sequence): "
              + ", ".join(f"**{single:.1f} tokens/s** in {d}" for d, (_, single) in results.items()) + ".", ""]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, text, "bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
