"""kvserve's developer benchmarks: run from the repository root as `python -m benchmarks.NAME`
(or a `make bench*` / `make soak` target); not part of the installed package. They use kvserve's
public names; the load generator users get, `kvserve bench serve`, is kvserve/bench/.

  offline           `make bench`: offline throughput against transformers, same run
  step              where one decode step's milliseconds go
  quant             the quantized matmul kernel per layer shape and batch
  batch_invariance  what --batch-invariant costs a prefill
  speculative       speculation off vs on (n-gram or a draft model)
  tensor_parallel   2 ranks against one process; gloo's all-reduce
  grammar           xgrammar vs llguidance mask costs
  kv_disk           time to first token from the KV disk tier after a restart
  router            `make bench-router`: routing policies and the router's own latency
  compare           `make bench-peers`: llama.cpp, vLLM CPU, transformers beside kvserve
                    (peers.py sets them up, hf_server.py is the transformers server,
                    limits.py measures this machine, report.py writes docs/benchmarks.md)
  formats           `make bench-formats`: kvserve beside llama-server per weight format
  soak              `make soak`: replicas dying under mixed load (soak_load.py: the load)
  kernel_ab         the quantized matmul kernel built twice (a -D define, a git revision), alternated
  hugepages         a model's weights on plain and on huge pages, alternated in one process
  serving_path      what the serving path adds to a token at one user: served vs in-process
  draft_ceiling     what prompt-lookup drafting could win, replayed on the copy corpus
  speculative_peers `make bench-speculative`: speculation off and on, kvserve beside llama-server's
                    n-gram drafters, served
"""
from __future__ import annotations

import argparse


def one_model_ab_parser(name: str, doc: str, tokens_help: str) -> argparse.ArgumentParser:
    """The options of the benchmarks that alternate two ways of running one model's greedy decode."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128, help=tokens_help)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    return ap
