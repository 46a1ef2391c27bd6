"""`python -m benchmarks.speculative_peers`: speculation off and on, kvserve beside llama-server, served.

`benchmarks.speculative` measures kvserve's speculation in one process; this puts it behind HTTP
beside llama.cpp's server and its own speculative settings, on the same file, workloads and client:
`kvserve serve` with and without `--speculative ngram`, and llama-server with `--spec-type none`
and each of `--llama-spec` (its n-gram drafters: ngram-simple with its defaults, lookup 12 and
draft 48, and with a short lookup, as prompt lookup drafts). Workloads are `kvserve bench serve`'s
`copy` (rewrite a passage of kvserve's source with one word changed) and `random`, on the chat
endpoint, greedy, a fixed number of output tokens (EOS ignored), at each number of users (a
closed loop of that many clients; two prompts a client, four at least). Every server gets 2 threads (llama-server
`-np` = clients). `--rounds N` measures each cell N times, the servers' order turned round each
round, and the table gives medians; a speculating engine's greedy text must equal its own text
without speculation ("same output").
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks import formats
from benchmarks.compare import THREADS, Server, bench_tokenizer
from kvserve.bench.datasets import DatasetConfig, load_samples
from kvserve.bench.serve import BenchConfig, run

# llama-server's n-gram drafters tried: its defaults, and a short lookup as prompt lookup takes
LLAMA_SPEC = {"ngram-simple": ["--spec-type", "ngram-simple"],
              "ngram-simple n=3 m=8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                       "--spec-ngram-simple-size-m", "8"]}


def argv_for(setting: str, model: Path, slots: int):
    """The server command for a setting: "kvserve", "kvserve ngram", "llama-server" or "llama-server <LLAMA_SPEC key>":
    benchmarks.formats' command for the engine, with the setting's speculative flags."""
    engine, _, spec = setting.partition(" ")
    base = formats.argv_for("kvserve" if engine == "kvserve" else "llama", model, slots)
    flags = (["--speculative", "ngram"] if engine == "kvserve" else LLAMA_SPEC[spec]) if spec else []
    return lambda port: base(port) + flags


def measure(setting: str, model: Path, dataset: DatasetConfig, users: int, log: Path) -> tuple[float, list[str]]:
    """(output tokens/s, the greedy texts) of one workload on one fresh server."""
    server = Server(argv_for(setting, model, users), {"OMP_NUM_THREADS": str(THREADS)}, log)
    try:
        name = server.wait_ready()
        cfg = BenchConfig(base_url=server.url, model=name, endpoint="chat", dataset=dataset, max_concurrency=users,
                          max_duration=600, timeout=600, num_warmups=1, progress=False)
        result = run(cfg, load_samples(dataset, bench_tokenizer()))
    finally:
        server.stop()
    if result.unfinished or result.not_sent or any(o.output_tokens != dataset.output_len for o in result.outputs):
        raise RuntimeError(f"{setting}: not every request ran to {dataset.output_len} tokens; log {log}")
    return result.metrics.output_throughput, [o.generated_text for o in result.outputs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative_peers", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the shipped default model)")
    p.add_argument("--datasets", default="copy,random")
    p.add_argument("--users", default="1,4")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama-spec", default=",".join(LLAMA_SPEC), help=f"of {', '.join(LLAMA_SPEC)}")
    p.add_argument("--logs", default="/tmp/kvserve-speculative-peers", help="the servers' logs")
    args = p.parse_args(argv)
    from kvserve.model.loader import resolve_model_path

    model = Path(args.model) if args.model else resolve_model_path("smollm2-135m")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    llama = [f"llama-server {s}" for s in args.llama_spec.split(",") if s]
    settings = ["kvserve", "kvserve ngram", "llama-server", *llama]
    print(f"{model.name}, {THREADS} threads each, chat, greedy, {args.output_len} tokens out (EOS ignored); "
          f"tok/s, medians of {args.rounds} rounds\n")
    print("| workload | users | kvserve off | kvserve ngram | ratio | same output | llama-server off | "
          + " | ".join(f"{s} | ratio" for s in llama) + " | kvserve ngram / llama-server's best |")
    print("|---|---:|" + "---:|" * 3 + "---|---:|" + "---:|---:|" * len(llama) + "---:|")
    for ds in args.datasets.split(","):
        for users in (int(u) for u in args.users.split(",")):
            dataset = DatasetConfig(ds, max(4, 2 * users), args.input_len, args.output_len, seed=users)
            tok_s: dict[str, list[float]] = {s: [] for s in settings}
            texts: dict[str, list[str]] = {}
            for r in range(args.rounds):
                for s in settings if r % 2 == 0 else settings[::-1]:
                    log = logs / f"{ds}-c{users}-r{r}-{s.replace(' ', '_').replace('=', '')}.log"
                    rate, out = measure(s, model, dataset, users, log)
                    tok_s[s].append(rate)
                    texts.setdefault(s, out)
            med = {s: statistics.median(v) for s, v in tok_s.items()}
            same = sorted(texts["kvserve"]) == sorted(texts["kvserve ngram"])
            best_llama = max(med[s] for s in ["llama-server", *llama])
            cells = [f"{med['kvserve']:.1f}", f"{med['kvserve ngram']:.1f}",
                     f"**{med['kvserve ngram'] / med['kvserve']:.2f}**", "yes" if same else "**no**",
                     f"{med['llama-server']:.1f}"]
            cells += [c for s in llama for c in (f"{med[s]:.1f}", f"{med[s] / med['llama-server']:.2f}")]
            cells.append(f"**{med['kvserve ngram'] / best_llama:.2f}x**")
            print(f"| {ds} | {users} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
