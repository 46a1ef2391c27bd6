"""`kvserve bench serve` arguments (named as `vllm bench serve` names them) → BenchConfig."""
from __future__ import annotations

import argparse
import math
import os


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("serve", help="streamed load against a server: TTFT, TPOT, ITL, E2EL, throughput, goodput",
                       description="Metric names and definitions follow `vllm bench serve`.")
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the model name to send (default: the server's first model)")
    p.add_argument("--endpoint", default="completions", choices=("completions", "chat"))
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--tokenizer", default=None,
                   help="a model kvserve can load, whose tokenizer sizes the prompts (default: smollm2-135m)")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=("random", "prefix", "copy", "jsonl"),
                   help="random words; shared prefixes; copy: rewrite a passage of kvserve's source with one word "
                        "changed (copy-heavy answers); jsonl: your own prompts (default: random)")
    d.add_argument("--dataset-path", default=None, help="jsonl: one {\"prompt\": ...} per line (optional \"output_len\")")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--input-len", type=int, default=128, help="prompt tokens (prefix: tokens after the shared prefix; copy: "
                   "the passage's)")
    d.add_argument("--output-len", type=int, default=128, help="output tokens asked for each request")
    d.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens of each shared prefix")
    d.add_argument("--num-prefixes", type=int, default=4, help="prefix: distinct prefixes the prompts share")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop at end-of-sequence (output lengths then vary)")
    lo = p.add_argument_group("load")
    lo.add_argument("--max-concurrency", type=int, default=None, help="closed loop: most requests in flight")
    lo.add_argument("--request-rate", type=float, default=math.inf, help="open loop: requests per second (default: inf)")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    lo.add_argument("--max-duration", type=float, default=None, help="stop after this many seconds")
    lo.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    lo.add_argument("--num-warmups", type=int, default=1, help="short untimed requests sent first")
    o = p.add_argument_group("results")
    o.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:10000")
    o.add_argument("--percentiles", default="50,90,99", help="comma-separated (default: 50,90,99)")
    o.add_argument("--save-result", default=None, metavar="FILE", help="write the result as JSON")
    o.add_argument("--save-detailed", action="store_true", help="with --save-result: every request's timings too")
    o.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_serve)


def config_from_args(args: argparse.Namespace):
    from kvserve.bench.datasets import DatasetConfig
    from kvserve.bench.metrics import parse_goodput
    from kvserve.bench.serve import BenchConfig

    try:
        percentiles = tuple(float(p) for p in args.percentiles.split(","))
    except ValueError:
        raise ValueError(f"--percentiles takes numbers separated by commas, not {args.percentiles!r}") from None
    dataset = DatasetConfig(name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                            output_len=args.output_len, prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                            path=args.dataset_path, seed=args.seed)
    return BenchConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint, dataset=dataset,
                       tokenizer=args.tokenizer, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                       burstiness=args.burstiness, max_duration=args.max_duration, timeout=args.timeout,
                       goodput=parse_goodput(args.goodput), ignore_eos=args.ignore_eos, num_warmups=args.num_warmups,
                       api_key=args.api_key, seed=args.seed, percentiles=percentiles, progress=not args.disable_tqdm)


def run_serve(args: argparse.Namespace) -> int:
    from kvserve.bench.metrics import summary
    from kvserve.bench.serve import run, save

    result = run(config_from_args(args))
    print(summary(result.metrics))
    if result.unfinished or result.not_sent:
        print(f"--max-duration ended the run: {result.unfinished} unfinished, {result.not_sent} not sent")
    if args.save_result:
        save(result, args.save_result, args.save_detailed)
    return 0 if result.metrics.completed else 1
