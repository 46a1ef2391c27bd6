"""`kvserve bench serve`: streamed load against any OpenAI-compatible server, with `vllm bench
serve`'s metrics (serve.py runs it, client.py sends one request, datasets.py makes the prompts,
metrics.py sums up). kvserve's own developer benchmarks are the repository's benchmarks/."""
