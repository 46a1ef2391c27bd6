"""Embeddings: the mean of the prompt's final hidden states, L2-normalised, computed by the engine.

The engine's pooling against transformers (a tiny random model in this process, and the default
model served by a real `kvserve serve`), through chunked prefill, batching with generation and
preemption, every KV block back in the pool afterwards; then /v1/embeddings through the `openai`
SDK (float and base64), LangChain's OpenAIEmbeddings, bad input, the API key, the input cap and
the router.
"""
from __future__ import annotations

import base64
import json
import threading

import httpx
import numpy as np
import pytest
import torch

from kvserve import SamplingParams
from kvserve.outputs import OutputKind
from kvserve.router.request import parse_request
from router_harness import RouterThread
from server_harness import API_KEY, DEFAULT_MODEL, start_default_server

NAME = DEFAULT_MODEL
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.",
         "A much longer input, " + "with many repeated clauses, " * 12 + "to be read in several chunks."]


def mean_pool(hidden: torch.Tensor) -> torch.Tensor:
    """The reference pooling: [T, hidden] → the mean over tokens, L2-normalised."""
    return torch.nn.functional.normalize(hidden.float().mean(dim=0), dim=0)


# -- the engine, on a tiny random model in this process ------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()




def reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return mean_pool(hf(torch.tensor([ids])).last_hidden_state[0])


def test_embedding_equals_transformers_mean_pool_in_chunks(make_llm, tiny_hf) -> None:
    llm = make_llm(max_num_batched_tokens=32)  # the long input's prompt is read in 32-token chunks
    ids = llm.tokenizer.encode(TEXTS[2])
    assert len(ids) > 64
    outs = llm.embed([*TEXTS, ids[:40]], use_tqdm=False)
    for out in outs:
        vec = torch.tensor(out.embedding)
        assert vec.shape == (llm.config.hidden_size,) and abs(vec.norm().item() - 1) < 1e-5
        torch.testing.assert_close(vec, reference(tiny_hf, out.prompt_token_ids), atol=2e-6, rtol=0)
    assert outs[3].prompt_token_ids == ids[:40] and outs[0].outputs[0].token_ids == []
    assert outs[0].finish_reason == "length"


def test_embeddings_run_beside_generation_and_give_every_block_back(make_llm) -> None:
    llm = make_llm(num_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].token_ids
    vectors = [o.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    free = llm.manager.pool.num_free_blocks
    engine = llm.engine
    engine.add_request("g", engine.inputs.process("Once upon a time", greedy), greedy, output_kind=OutputKind.FINAL_ONLY)
    for _ in range(3):  # the generation is under way when the embeddings arrive
        engine.step()
    for i, text in enumerate(TEXTS):
        engine.add_request(f"e{i}", llm.tokenizer.encode(text), SamplingParams(max_tokens=0), pooling=True)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["g"].token_ids == alone  # its KV blocks were not touched
    for i in range(len(TEXTS)):
        np.testing.assert_allclose(finals[f"e{i}"].embedding, vectors[i], atol=1e-6)
    assert llm.manager.pool.num_free_blocks == free  # every block back (full ones cached, as after any request)


def test_a_preempted_embedding_starts_its_pooling_over(make_llm, tiny_hf) -> None:
    # 8 blocks of 16 tokens: the embedding's prompt (100 tokens, 16 a step) fills the pool while
    # the generation decodes, the generation's next block preempts it, and it is read again later.
    llm = make_llm(num_blocks=8, max_num_batched_tokens=16)
    ids = (llm.tokenizer.encode(TEXTS[2]) * 2)[:100]
    engine = llm.engine
    engine.add_request("g", list(range(100, 115)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("e", ids, SamplingParams(max_tokens=0), pooling=True, output_kind=OutputKind.FINAL_ONLY)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == "e"), final)
    assert engine.scheduler.num_preemptions >= 1
    torch.testing.assert_close(torch.tensor(final.embedding), reference(tiny_hf, ids), atol=2e-6, rtol=0)


def test_pooling_requires_max_tokens_zero(make_llm) -> None:
    llm = make_llm()
    with pytest.raises(ValueError, match="max_tokens must be 0"):
        llm.engine.add_request("e", llm.tokenizer.encode("hi"), SamplingParams(max_tokens=1), pooling=True)


def test_the_router_reads_an_embeddings_input() -> None:
    req = parse_request("/v1/embeddings", json.dumps({"model": NAME, "input": ["one text"]}).encode())
    assert (req.prompt, req.text, req.max_tokens, req.routable) == ("one text", "one text", 0, True)
    req = parse_request("/v1/embeddings", json.dumps({"input": [1, 2, 3]}).encode())
    assert req.prompt == [1, 2, 3] and req.max_tokens == 0
    assert not parse_request("/v1/embeddings", json.dumps({"input": ["a", "b"]}).encode()).routable  # by load


# -- /v1/embeddings on a real server of the default model (float path: it equals transformers') --

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_default_server(tmp_path_factory, "--quantize", "none", "--max-prompts", "8", "--max-model-len", "256")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120)


def token_ids(server, text: str) -> list[int]:
    with server.client() as c:
        return c.post("/tokenize", json={"prompt": text}).json()["tokens"]


@pytest.mark.slow
def test_openai_float_and_base64_equal_transformers(server, client, hf_model) -> None:
    as_float = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in as_float.data] == [0, 1, 2] and as_float.model == NAME
    ids = [token_ids(server, t) for t in TEXTS]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(map(len, ids))
    for d, tokens in zip(as_float.data, ids):
        vec = torch.tensor(d.embedding)
        assert vec.shape == (576,)
        with torch.no_grad():
            ref = mean_pool(hf_model.model(torch.tensor([tokens])).last_hidden_state[0])
        torch.testing.assert_close(vec, ref, atol=2e-5, rtol=0)
    # base64 as OpenAI sends it: little-endian float32 bytes, the float answer's values exactly (of
    # one input alone: a batch's composition moves the last bits). The SDK asks for base64 by default.
    one = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float").data[0].embedding
    raw = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)
    assert np.frombuffer(base64.b64decode(raw), dtype="<f4").tolist() == one
    assert client.embeddings.create(model=NAME, input=TEXTS[0]).data[0].embedding == one
    np.testing.assert_allclose(one, as_float.data[0].embedding, atol=1e-6)


@pytest.mark.slow
def test_token_id_inputs_are_the_texts_they_encode(server, client) -> None:
    ids = [token_ids(server, t) for t in TEXTS[:2]]
    by_text = client.embeddings.create(model=NAME, input=TEXTS[:2], encoding_format="float").data
    by_ids = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    one = client.embeddings.create(model=NAME, input=ids[1], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in by_ids.data], [d.embedding for d in by_text], atol=1e-6)
    np.testing.assert_allclose(one.data[0].embedding, by_text[1].embedding, atol=1e-6)
    assert one.usage.prompt_tokens == len(ids[1])


@pytest.mark.slow
def test_langchain_openai_embeddings(server, client) -> None:
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(base_url=server.url + "/v1", api_key=API_KEY, model=NAME, check_embedding_ctx_length=False)
    docs = emb.embed_documents(TEXTS)
    query = emb.embed_query(TEXTS[1])
    ref = [d.embedding for d in client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float").data]
    np.testing.assert_allclose(docs, ref, atol=1e-6)
    np.testing.assert_allclose(query, ref[1], atol=1e-6)


@pytest.mark.slow
def test_embeddings_during_a_stream_leave_it_and_the_pool_intact(server, client) -> None:
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with server.client() as c:
        alone = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    texts: list[str] = []

    def stream() -> None:
        with server.client() as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    texts.append(json.loads(line[6:])["choices"][0]["text"])

    t = threading.Thread(target=stream)
    t.start()
    for _ in range(4):
        assert len(client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float").data) == 3
    t.join(120)
    assert "".join(texts) == alone
    assert server.metric("kvserve_kv_cache_blocks_used") == 0
    assert server.metric("kvserve_num_requests_running") == 0


@pytest.mark.slow
@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "dimensions": 64}, 400, "dimensions"),
    ({"input": ["x"] * 9}, 400, "input"),  # --max-prompts 8
    ({"input": "word " * 300}, 400, "input"),  # --max-model-len 256
    ({"input": [7] * 257}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ["a", ""]}, 400, "input"),
    ({"input": ["a", [1, 2]]}, 400, "input"),
    ({"input": [10**9]}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "x", "max_tokens": 4}, 400, "max_tokens"),
    ({}, 400, "input"),
    ({"input": "x", "model": "nope"}, 404, "model"),
], ids=["dimensions", "too-many-inputs", "too-long", "ids-too-long", "empty", "empty-list", "empty-in-batch",
        "mixed-batch", "out-of-vocab", "int", "encoding-format", "unknown-field", "missing", "unknown-model"])
def test_bad_input_is_a_4xx_naming_the_field(server, body, status, param) -> None:
    with server.client() as c:
        r = c.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.mark.slow
def test_a_prompt_filling_the_context_is_embedded(server) -> None:
    with server.client() as c:  # no token is generated, so the whole context is the input's
        r = c.post("/v1/embeddings", json={"input": [7] * 256})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256


@pytest.mark.slow
def test_the_api_key_is_required(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.slow
def test_through_the_router(server, client) -> None:
    router = RouterThread([server.url], "cache_aware")
    try:
        with router.client() as c:
            r = c.post("/v1/embeddings", json={"model": NAME, "input": TEXTS[0]})
            assert r.status_code == 200, r.text
            assert r.headers["x-kvserve-replica"] == server.url
            bad = c.post("/v1/embeddings", json={"model": NAME, "input": "x", "dimensions": 3})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
        direct = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float").data[0].embedding
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], direct, atol=1e-6)
        assert router.admin()[server.url]["in_flight"] == 0
    finally:
        router.stop()
