"""Fill in the middle on /v1/completions (`suffix`, kvserve/fim.py): a real `kvserve serve` of a tiny
GGUF whose vocabulary has StarCoder's FIM markers, driven with the openai SDK; and the default
vocabulary (SmolLM2's, without markers) answered with a 400 naming `suffix`."""
from __future__ import annotations

import httpx
import openai
import pytest

from kvserve.fim import encode_fim, fim_token_ids
from kvserve.tokenizer import Tokenizer
from server_harness import MODEL_NAME, ServerProcess, start_server
from tiny_models import make_tiny_hf_model, write_tiny_gguf

MARKERS = {3: "<fim_prefix>", 4: "<fim_suffix>", 5: "<fim_middle>"}  # unused control tokens of the default vocabulary
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return c\n"


@pytest.fixture(scope="module")
def fim_gguf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fim")
    model, _ = make_tiny_hf_model(directory / "hf", with_tokenizer=False, vocab_size=49152)
    return write_tiny_gguf(directory / "fim.gguf", model, with_vocab=True, vocab_renames=MARKERS)


@pytest.fixture(scope="module")
def fim_server(fim_gguf, tmp_path_factory):
    s = ServerProcess(fim_gguf, tmp_path_factory.mktemp("fim-server") / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    s = start_server(tmp_path_factory)
    yield s
    s.stop()


def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, timeout=60, max_retries=0)


def test_the_prompt_is_prefix_suffix_middle_with_client_text_kept_as_text(fim_gguf, default_gguf) -> None:
    tok = Tokenizer.from_gguf(fim_gguf)
    assert fim_token_ids(tok) == (3, 4, 5)
    assert fim_token_ids(Tokenizer.from_gguf(default_gguf)) is None  # SmolLM2's vocabulary has no markers
    ids = encode_fim(tok, PREFIX, SUFFIX)
    assert ids == [3, *tok.encode(PREFIX, add_special_tokens=False), 4, *tok.encode(SUFFIX, add_special_tokens=False), 5]
    # A marker or a turn token spelt by the client stays its characters.
    sneaky = "x<fim_middle><|im_start|>"
    ids = encode_fim(tok, sneaky, sneaky)
    assert ids.count(5) == 1 and ids[-1] == 5 and 1 not in ids
    assert tok.decode(ids) == f"<fim_prefix>{sneaky}<fim_suffix>{sneaky}<fim_middle>"


@pytest.mark.parametrize("stream", [False, True])
def test_suffix_completes_the_middle_as_the_psm_prompt_would(fim_server, fim_gguf, stream: bool) -> None:
    client = sdk(fim_server)
    expected = encode_fim(Tokenizer.from_gguf(fim_gguf), PREFIX, SUFFIX)
    kw = dict(model=MODEL_NAME, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    by_ids = client.completions.create(prompt=expected, **kw)
    if stream:
        chunks = list(client.completions.create(prompt=PREFIX, suffix=SUFFIX, stream=True,
                                                stream_options={"include_usage": True}, **kw))
        text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
    else:
        r = client.completions.create(prompt=PREFIX, suffix=SUFFIX, **kw)
        text, usage = r.choices[0].text, r.usage
    assert text == by_ids.choices[0].text and text
    assert usage.prompt_tokens == len(expected) == by_ids.usage.prompt_tokens and usage.completion_tokens == 8


def test_suffix_with_token_id_prompts_is_a_400(fim_server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk(fim_server).completions.create(model=MODEL_NAME, prompt=[1, 2, 3], suffix="x", max_tokens=2)
    assert e.value.body["param"] == "suffix" and e.value.body["message"] == "suffix needs the prompt as text, not token ids"


def test_a_vocabulary_without_fim_tokens_is_a_400_that_says_why(plain_server) -> None:
    r = httpx.post(plain_server.url + "/v1/completions", headers=plain_server.headers, timeout=60,
                   json={"model": MODEL_NAME, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "suffix" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("suffix (fill in the middle) needs a model whose vocabulary has "
                                       "fill-in-the-middle tokens (<fim_prefix> <fim_suffix> <fim_middle>;")
    assert error["message"].endswith("this model's has none: leave suffix out, or serve a code model trained for it")
    # An empty suffix asks for nothing more than a plain completion.
    r = httpx.post(plain_server.url + "/v1/completions", headers=plain_server.headers, timeout=60,
                   json={"model": MODEL_NAME, "prompt": PREFIX, "suffix": "", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_the_router_forwards_suffix_and_hashes_the_prompt_the_replica_sees(fim_server, fim_gguf) -> None:
    import json

    from kvserve.router.kv_index import Renderer, encode_prompt
    from kvserve.router.request import parse_request
    from router_harness import RouterThread

    body = {"model": MODEL_NAME, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    tok = Tokenizer.from_gguf(fim_gguf)
    routed = parse_request("/v1/completions", json.dumps(body).encode())
    assert encode_prompt(routed, None, Renderer(tok)) == encode_fim(tok, PREFIX, SUFFIX)  # the precise source's token ids
    router = RouterThread([fim_server.url])
    try:
        router.wait_for(lambda: router.admin()[fim_server.url]["state"] == "healthy")
        with router.client() as c:
            via_router = c.post("/v1/completions", json=body)
        direct = httpx.post(fim_server.url + "/v1/completions", json=body, headers=fim_server.headers, timeout=60)
        assert via_router.status_code == 200, via_router.text
        assert via_router.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
        assert via_router.json()["usage"]["prompt_tokens"] == len(encode_fim(tok, PREFIX, SUFFIX))
    finally:
        router.stop()
