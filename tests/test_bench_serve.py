"""`kvserve bench serve`: its statistics against what real servers streamed, its failure counting,
its bounds; and `kvserve export` (GGUF → Hugging Face directory).

Two servers: a real `kvserve serve` on a tiny model, and a small FastAPI server written here whose
timing is known (it sleeps between chunks), refuses requests (429) or drops streams on demand.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.bench import metrics
from kvserve.bench.client import RequestOutput
from kvserve.bench.datasets import DatasetConfig, Sample, WordVocabulary, default_tokenizer, load_samples
from kvserve.bench.serve import BenchConfig, arrival_offsets, run
from server_harness import API_KEY, MODEL_NAME, free_port, start_server


# ------------------------------------------------------------------ the pure parts
def test_metrics_follow_vllm_definitions():
    a = RequestOutput(success=True, ttft=0.1, itl=[0.2, 0.2, 0.2], latency=0.7, output_tokens=4, prompt_tokens=10,
                      tokens_counted_by="usage")
    b = RequestOutput(success=True, ttft=0.3, itl=[], latency=0.3, output_tokens=1, prompt_tokens=10,
                      tokens_counted_by="usage")
    bad = [RequestOutput(error="HTTP 429: at capacity"), RequestOutput(error="HTTP 429: at capacity"),
           RequestOutput(error="stream dropped: RemoteProtocolError")]
    m = metrics.compute([a, b, *bad], duration_s=2.0, goodput={"ttft": 200.0})
    assert (m.completed, m.failed) == (2, 3)
    assert m.failures == {"HTTP 429": 2, "stream dropped": 1}
    assert m.total_output_tokens == 5 and m.total_input_tokens == 20
    assert m.output_throughput == pytest.approx(2.5) and m.total_token_throughput == pytest.approx(12.5)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.request_goodput == pytest.approx(0.5)  # only `a` has TTFT <= 200 ms
    assert m.tpot.mean_ms == pytest.approx(200.0)  # (0.7 - 0.1) / 3; `b` has one token: no TPOT
    assert m.ttft.mean_ms == pytest.approx(200.0) and m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.percentiles_ms["p90"] == pytest.approx(280.0)  # linear between 100 and 300
    assert m.itl.mean_ms == pytest.approx(200.0) and m.itl.std_ms == pytest.approx(0.0, abs=1e-9)
    assert m.e2el.percentiles_ms["p99"] == pytest.approx(700.0 - 0.01 * 400.0)


def test_goodput_arguments_are_checked():
    assert metrics.parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    with pytest.raises(ValueError, match="NAME:MS with NAME ttft, tpot or e2el"):
        metrics.parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="not a number"):
        metrics.parse_goodput(["ttft:fast"])


def test_arrivals_span_num_over_rate_and_burstiness_shapes_them():
    even = arrival_offsets(50, rate=10.0, burstiness=float("inf"), seed=0)
    assert even == pytest.approx([0.1 * (i + 1) for i in range(50)])
    poisson = arrival_offsets(50, rate=10.0, burstiness=1.0, seed=0)
    bursty = arrival_offsets(50, rate=10.0, burstiness=0.2, seed=0)
    assert poisson[-1] == pytest.approx(5.0) and bursty[-1] == pytest.approx(5.0)
    gaps = lambda t: torch.tensor([b - a for a, b in zip([0.0] + t, t)])  # noqa: E731
    assert gaps(bursty).std() > gaps(poisson).std() > gaps(even).std()
    assert arrival_offsets(3, rate=float("inf"), burstiness=1.0, seed=0) == [0.0, 0.0, 0.0]


def test_random_prompts_have_the_asked_token_count():
    tok = default_tokenizer(None)
    samples = load_samples(DatasetConfig(num_prompts=5, input_len=37, output_len=3, seed=1), tok)
    assert [s.prompt_len for s in samples] == [37] * 5
    assert [len(tok.encode(s.prompt, add_special_tokens=False)) for s in samples] == [37] * 5
    assert len({s.prompt for s in samples}) == 5
    shared = load_samples(DatasetConfig("prefix", num_prompts=6, input_len=8, prefix_len=20, num_prefixes=2), tok)
    assert [s.prompt_len for s in shared] == [28] * 6
    assert all(len(tok.encode(w, add_special_tokens=False)) == 1 for w in WordVocabulary(tok).words[:500])
    prefix_of = lambda s: tok.decode(tok.encode(s.prompt, add_special_tokens=False)[:20])  # noqa: E731
    assert prefix_of(shared[0]) == prefix_of(shared[2]) != prefix_of(shared[1])


def test_copy_prompts_quote_a_source_passage_with_a_word_to_change():
    from kvserve.bench.datasets import COPY_CORPUS, COPY_INSTRUCTION

    tok = default_tokenizer(None)
    samples = load_samples(DatasetConfig("copy", num_prompts=3, input_len=60, output_len=5, seed=2), tok)
    sources = COPY_CORPUS.read_text()  # frozen: the workload does not move with kvserve's source
    head = COPY_INSTRUCTION.split("{old}")[0]
    for s in samples:
        assert s.prompt.startswith(head) and s.output_len == 5
        passage = s.prompt.split("\n\n", 1)[1]
        assert passage in sources and len(tok.encode(passage + "\n", add_special_tokens=False)) >= 30
        assert s.prompt_len == len(tok.encode(s.prompt, add_special_tokens=False))


# ------------------------------------------------------------------ against a real kvserve server
@pytest.fixture(scope="module")
def kvserve_server(tmp_path_factory):
    server = start_server(tmp_path_factory)
    yield server
    server.stop()


@pytest.mark.slow
def test_statistics_match_what_kvserve_streamed(kvserve_server):
    cfg = BenchConfig(base_url=kvserve_server.url, model=MODEL_NAME, api_key=API_KEY, max_concurrency=2,
                      dataset=DatasetConfig(num_prompts=4, input_len=16, output_len=8, seed=3), progress=False)
    result = run(cfg)
    m = result.metrics
    assert (m.completed, m.failed, result.unfinished, result.not_sent) == (4, 0, 0, 0)
    assert m.tokens_counted_by == "usage" and m.total_output_tokens == 32 and m.total_input_tokens == 64
    assert result.max_in_flight == 2
    with kvserve_server.client() as client:
        for out in result.outputs:
            assert out.prompt_tokens == out.prompt_len == 16
            assert out.output_tokens == 8
            assert 0 < out.ttft < out.latency
            assert len(out.itl) == out.chunks - 1
            assert out.ttft + sum(out.itl) <= out.latency
        # The same prompts, not streamed: the text the benchmark collected is what the model wrote.
        bodies = [client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": s.prompt, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True}).json()
                  for s in _prompts(cfg)]
    assert sorted(o.generated_text for o in result.outputs) == sorted(b["choices"][0]["text"] for b in bodies)
    assert all(b["usage"]["completion_tokens"] == 8 for b in bodies)
    tpots = sorted((o.latency - o.ttft) / 7 * 1000 for o in result.outputs)
    assert m.tpot.median_ms == pytest.approx((tpots[1] + tpots[2]) / 2)


def _prompts(cfg: BenchConfig) -> list[Sample]:
    return load_samples(cfg.dataset, default_tokenizer(None))


@pytest.mark.slow
def test_cli_writes_a_json_result(kvserve_server, tmp_path):
    from kvserve.commands import main

    path = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", kvserve_server.url, "--api-key", API_KEY, "--num-prompts", "2",
               "--input-len", "8", "--output-len", "4", "--max-concurrency", "2", "--goodput", "e2el:600000",
               "--save-result", str(path), "--disable-tqdm"])
    assert rc == 0
    saved = json.loads(path.read_text())
    assert saved["model"] == MODEL_NAME  # asked from /v1/models
    assert saved["metrics"]["completed"] == 2 and saved["metrics"]["total_output_tokens"] == 8
    assert saved["metrics"]["request_goodput"] > 0
    assert set(saved["metrics"]["ttft"]) == {"mean_ms", "median_ms", "std_ms", "percentiles_ms"}


@pytest.mark.slow
def test_kvserve_refusing_at_capacity_counts_429s(tmp_path_factory):
    server = start_server(tmp_path_factory, "--max-num-seqs", "1", "--max-queued-requests", "0")
    try:
        cfg = BenchConfig(base_url=server.url, model=MODEL_NAME, api_key=API_KEY, num_warmups=0, progress=False,
                          dataset=DatasetConfig(num_prompts=6, input_len=8, output_len=64))
        m = run(cfg).metrics
    finally:
        server.stop()
    assert m.completed >= 1 and m.failures.get("HTTP 429", 0) >= 1
    assert m.completed + m.failures["HTTP 429"] == 6


# ------------------------------------------------------------------ a server with known timing
FIRST_DELAY, GAP, CHUNKS = 0.2, 0.1, 6


class FakeServer:
    """Streams CHUNKS one-token chunks, FIRST_DELAY s before the first and GAP s between the rest.
    The model name picks a behaviour: "slow" (as above, with usage), "no-usage", "refuse-odd"
    (every other request gets 429), "drop" (the connection breaks after two chunks), "no-done"."""

    def __init__(self) -> None:
        self.received = 0
        self.in_flight = self.max_in_flight = 0
        app = FastAPI()
        app.post("/v1/completions")(self.completions)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def completions(self, request: Request):
        body = await request.json()
        self.received += 1
        mode = body["model"]
        if mode == "refuse-odd" and self.received % 2 == 1:
            return JSONResponse({"error": {"message": "busy", "type": "rate_limit_error"}}, status_code=429)

        async def events():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(FIRST_DELAY)
                for i in range(CHUNKS):
                    if i:
                        await asyncio.sleep(GAP)
                    if mode == "drop" and i == 2:
                        raise RuntimeError("the connection breaks")
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n"
                if mode != "no-usage":
                    usage = {"prompt_tokens": 5, "completion_tokens": CHUNKS, "total_tokens": CHUNKS + 5}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                if mode != "no-done":
                    yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _fake_run(server: FakeServer, mode: str, n: int, **kw) -> object:
    samples = [Sample(f"prompt {i}", 5, CHUNKS) for i in range(n)]
    cfg = BenchConfig(base_url=server.url, model=mode, num_warmups=0, progress=False, **kw)
    return run(cfg, samples)


def test_a_slowed_server_shows_its_ttft_and_itl():
    with FakeServer() as server:
        result = _fake_run(server, "slow", 4, max_concurrency=4)
    m = result.metrics
    assert m.completed == 4 and m.tokens_counted_by == "usage" and m.total_output_tokens == 4 * CHUNKS
    for out in result.outputs:
        assert len(out.itl) == CHUNKS - 1
        # The server slept GAP between chunks: a chunk read late shortens the gap after it, never the total.
        assert sum(out.itl) >= (CHUNKS - 1) * GAP * 0.95
        assert out.ttft >= FIRST_DELAY * 0.95
    # Upper bounds only loosely: a loaded machine may add delay, never remove it.
    assert GAP * 0.95 <= m.itl.median_ms / 1000 < GAP * 3
    assert FIRST_DELAY * 0.95 <= m.ttft.median_ms / 1000 < FIRST_DELAY * 3
    assert m.tpot.mean_ms == pytest.approx(sum((o.latency - o.ttft) / (CHUNKS - 1) for o in result.outputs) / 4 * 1000)


def test_without_usage_tokens_are_counted_as_chunks():
    with FakeServer() as server:
        m = _fake_run(server, "no-usage", 2).metrics
    assert m.completed == 2 and m.tokens_counted_by == "chunks" and m.total_output_tokens == 2 * CHUNKS
    assert m.total_input_tokens == 10  # the local count, 5 each, as the server said nothing


def test_refused_and_dropped_requests_are_failures_by_cause():
    with FakeServer() as server:
        refused = _fake_run(server, "refuse-odd", 6, max_concurrency=1).metrics
        dropped = _fake_run(server, "drop", 3).metrics
        unfinished = _fake_run(server, "no-done", 2).metrics
    assert (refused.completed, refused.failures) == (3, {"HTTP 429": 3})
    assert (dropped.completed, dropped.failures) == (0, {"stream dropped": 3})
    assert (unfinished.completed, unfinished.failures) == (0, {"stream dropped": 2})


def test_closed_loop_never_exceeds_its_concurrency_and_sends_exactly_num_prompts():
    with FakeServer() as server:
        result = _fake_run(server, "slow", 9, max_concurrency=3)
        assert server.received == 9 and server.max_in_flight == 3
    assert result.max_in_flight == 3 and result.metrics.completed == 9


def test_max_duration_stops_the_run_on_time():
    # Each request takes FIRST_DELAY + 5 GAP = 0.7 s; the bound comes at 0.4 s, before any finishes.
    with FakeServer() as server:
        t0 = time.perf_counter()
        result = _fake_run(server, "slow", 10, max_concurrency=2, max_duration=0.4)
        elapsed = time.perf_counter() - t0
        assert server.received == 2
    assert (result.metrics.completed, result.unfinished, result.not_sent) == (0, 2, 8)
    assert 0.4 <= result.metrics.duration_s < 0.7 and elapsed < 0.7 + 2.0


def test_open_loop_sends_at_the_asked_rate():
    with FakeServer() as server:
        result = _fake_run(server, "slow", 5, request_rate=10.0, burstiness=float("inf"))
    starts = sorted(o.start_time for o in result.outputs)
    assert [b - a for a, b in zip(starts, starts[1:])] == pytest.approx([0.1] * 4, abs=0.05)


# ------------------------------------------------------------------ kvserve export
@pytest.mark.slow
def test_export_gives_a_directory_kvserve_and_transformers_load_alike(tmp_path):
    from kvserve import LLM, SamplingParams
    from kvserve.commands import main
    from kvserve.model.loader import load_checkpoint
    from tiny_models import make_tiny_hf_model, write_tiny_gguf

    model, _ = make_tiny_hf_model(tmp_path / "hf", with_tokenizer=False, vocab_size=49152)
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", model, with_vocab=True)
    assert main(["export", str(gguf_path), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (out / name).is_file(), name
    exported, original = load_checkpoint(out), load_checkpoint(gguf_path)
    assert exported.format == "hf" and exported.config.tie_word_embeddings
    assert exported.tensors.keys() == original.tensors.keys()
    assert all(torch.equal(exported.tensors[k], original.tensors[k]) for k in original.tensors)

    prompts = ["The capital of France is", "1, 2, 3,"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    from_gguf = [o.outputs[0].token_ids for o in LLM(str(gguf_path), "float32").generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(str(out), "float32")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == from_gguf

    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for prompt, want in zip(prompts, from_gguf):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == llm.tokenizer.encode(prompt)
        got = hf.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1]:].tolist()
        assert got == want


# ------------------------------------------------------------------ the bench-peers report
def test_report_rewrites_only_its_section(tmp_path, default_gguf):
    pytest.importorskip("matplotlib")  # the `bench` extra
    from benchmarks import compare, report

    m = metrics.compute([RequestOutput(success=True, ttft=0.5, itl=[0.1] * 15, latency=2.0, output_tokens=16,
                                       prompt_tokens=32, tokens_counted_by="usage")], duration_s=2.0)
    point = {"metrics": __import__("dataclasses").asdict(m), "unfinished": 0, "not_sent": 0, "loadavg_1min": 1.5}
    records = [{"name": "kvserve", "settings": "defaults", "weights": "kvserve",
                "points": {w.key: point for w in compare.workloads(compare.QUICK)}},
               {"name": "vLLM CPU", "settings": "-", "weights": "bfloat16", "unavailable": "not runnable on this CPU"}]
    limits = {"bandwidth_gbs": 20.0, "matmul_gflops": {"float32": 100.0, "bfloat16": 1.0, "float16": 1.0}, "threads": 2}
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nhand-written\n\n{report.BEGIN}\nold figures\n{report.END}\n\nnotes after\n")
    report.write(doc, records, limits, default_gguf, 60.0, compare.QUICK)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written\n\n") and text.endswith(f"{report.END}\n\nnotes after\n")
    assert "old figures" not in text and text.count(report.BEGIN) == 1
    assert "| kvserve | random | 16 | 1 / 0 | 8.0 | 24.0 | 500 / 500 | 100.0 | 100.0 | 2,000 |" in text
    assert "| vLLM CPU | — |" in text and "not run: not runnable on this CPU" in text
    assert (tmp_path / "benchmarks" / "peers-concurrency.png").stat().st_size > 0
    assert (tmp_path / "benchmarks" / "peers-prefix.png").stat().st_size > 0
