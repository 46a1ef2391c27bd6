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
"""
