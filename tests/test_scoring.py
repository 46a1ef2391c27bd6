"""Scoring prompts: prompt logprobs from the engine, and echo / logprobs / max_tokens 0 on
/v1/completions, as lm-evaluation-harness's `local-completions` model uses them.

The engine's prompt logprobs against transformers (a tiny random model in this process) through
chunked prefill, a cached prefix, n > 1 and preemption; the HTTP shapes against kvserve's own
`LLM` API on the default model; and lm-eval itself (the `lm_eval` command, offline) running a
log-likelihood task and a generate_until task over local JSONL files against a real server,
its scores checked against the same items computed with `LLM`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve import LLM, CacheConfig, SamplingParams
from kvserve.model.export import write_tokenizer_files
from kvserve.outputs import OutputKind
from kvserve.tokenizer import Tokenizer
from server_harness import API_KEY, DEFAULT_MODEL, start_default_server

NAME = DEFAULT_MODEL
C = "/v1/completions"


# -- the engine, on a tiny random model in this process ------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()




def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def check_against(hf, ids: list[int], prompt_logprobs: list, k: int) -> None:
    ref = hf_logprobs(hf, ids)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for i, lp in enumerate(prompt_logprobs[1:]):
        assert lp.token_id == ids[i + 1]
        assert abs(lp.logprob - ref[i, ids[i + 1]].item()) < 1e-4
        top = ref[i].topk(k)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert all(abs(v - r) < 1e-4 for (_, v), r in zip(lp.top, top.values.tolist()))


PROMPT = list(range(300, 350))  # 50 tokens: four chunks of 16


def test_prompt_logprobs_equal_transformers_through_chunked_prefill(make_llm, tiny_hf) -> None:
    llm = make_llm(max_num_batched_tokens=16)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)[0]
    check_against(tiny_hf, PROMPT, out.prompt_logprobs, 3)
    assert out.token_ids == [] and out.finish_reason == "length"
    one = llm.generate([7], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]  # a one-token prompt has nothing to score


def test_a_cached_prefix_is_scored_all_the_same(make_llm, tiny_hf) -> None:
    llm = make_llm()
    llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # its blocks are cached now
    queries = llm.manager.prefix_stats.queries
    out = llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    check_against(tiny_hf, PROMPT, out.prompt_logprobs, 2)
    assert llm.manager.prefix_stats.queries == queries  # no lookup: every prompt token is computed


def test_scoring_beside_generation_and_with_n(make_llm, tiny_hf) -> None:
    llm = make_llm()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPT, greedy, use_tqdm=False)[0]
    both = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0, n=2),
                        use_tqdm=False)[0]
    assert [c.token_ids for c in both.outputs] == [plain.token_ids] * 2  # the prompt's scoring changes no token
    check_against(tiny_hf, PROMPT, both.prompt_logprobs, 0)


def test_a_preempted_scoring_starts_over(make_llm, tiny_hf) -> None:
    llm = make_llm(num_blocks=8, max_num_batched_tokens=16)  # as in test_embeddings: preempted mid-prompt
    ids = [(i * 37) % 4000 + 100 for i in range(100)]
    engine = llm.engine
    engine.add_request("g", list(range(100, 115)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("s", ids, SamplingParams(max_tokens=0, prompt_logprobs=1), output_kind=OutputKind.FINAL_ONLY)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == "s"), final)
    assert engine.scheduler.num_preemptions >= 1
    check_against(tiny_hf, ids, final.prompt_logprobs, 1)


def test_delta_outputs_carry_prompt_logprobs_once_then_on_the_final(make_llm) -> None:
    llm = make_llm()
    engine = llm.engine
    engine.add_request("d", PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=0),
                       output_kind=OutputKind.DELTA)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, True]


# -- /v1/completions on a real server of the default model, against LLM ---------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_default_server(tmp_path_factory, "--quantize", "none")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The server's model, as the server loads it, in this process."""
    return LLM(NAME, dtype="float32", quantization="none", cache=CacheConfig(num_blocks=256))


TEXT = "The capital of France is Paris, and the capital of Italy is Rome."


@pytest.mark.slow
def test_echo_with_logprobs_and_max_tokens_zero_scores_the_prompt(server, llm) -> None:
    with server.client() as c:
        r = c.post(C, json={"model": NAME, "prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 0}).json()
    choice = r["choices"][0]
    ids = llm.tokenizer.encode(TEXT)
    ref = llm.generate(TEXT, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0].prompt_logprobs
    lp = choice["logprobs"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert "".join(lp["tokens"]) == TEXT and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(abs(a - b.logprob) < 1e-4 for a, b in zip(lp["token_logprobs"][1:], ref[1:]))
    assert all(len(top) in (2, 3) and tok in top for top, tok in zip(lp["top_logprobs"][1:], lp["tokens"][1:]))
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                          "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.slow
def test_lm_eval_style_batch_of_token_ids(server, llm) -> None:
    """What local-completions sends for log-likelihoods: token-id prompts, max_tokens 1, echo, logprobs 1."""
    prompts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in (TEXT, "One, two, three", "Hello")]
    with server.client() as c:
        r = c.post(C, json={"model": NAME, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
                            "temperature": 0, "seed": 1234}).json()
    refs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
    for choice, ids, ref in zip(r["choices"], prompts, refs):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt's, then the one generated token's
        assert choice["text"].startswith(llm.tokenizer.decode(ids)) and lp["text_offset"][-1] == len(llm.tokenizer.decode(ids))
        assert all(abs(a - b.logprob) < 1e-4 for a, b in zip(lp["token_logprobs"][1:-1], ref.prompt_logprobs[1:]))
        assert lp["top_logprobs"][-1] and lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())  # greedy


@pytest.mark.slow
def test_echo_streams_the_prompt_first(server) -> None:
    body = {"model": NAME, "prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    with server.client() as c:
        whole = c.post(C, json=body).json()["choices"][0]
        chunks = []
        with c.stream("POST", C, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"] == TEXT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(ch["text"] for ch in chunks) == whole["text"]
    streamed = [x for ch in chunks for x in ch["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    assert [x for ch in chunks for x in ch["logprobs"]["text_offset"]] == whole["logprobs"]["text_offset"]


@pytest.mark.slow
def test_max_tokens_zero_without_echo(server) -> None:
    with server.client() as c:
        plain = c.post(C, json={"model": NAME, "prompt": TEXT, "max_tokens": 0}).json()["choices"][0]
        scored = c.post(C, json={"model": NAME, "prompt": TEXT, "max_tokens": 0, "logprobs": 1}).json()["choices"][0]
        echoed = c.post(C, json={"model": NAME, "prompt": TEXT, "max_tokens": 0, "echo": True}).json()["choices"][0]
    assert (plain["text"], plain["logprobs"], plain["finish_reason"]) == ("", None, "length")
    assert scored["text"] == "" and scored["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                           "text_offset": []}
    assert (echoed["text"], echoed["logprobs"]) == (TEXT, None)
    assert server.metric("kvserve_kv_cache_blocks_used") == 0


# -- lm-evaluation-harness against the server, checked against LLM --------------------------------

MC = [
    {"question": "What is the capital of France?", "choices": ["Paris", "London", "Berlin", "Madrid"], "label": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten", "four"], "label": 1},
    {"question": "Which planet is known as the Red Planet?", "choices": ["Venus", "Jupiter", "Mars", "Saturn"], "label": 2},
    {"question": "What colour is the sky on a clear day?", "choices": ["green", "red", "yellow", "blue"], "label": 3},
    {"question": "What do bees make?", "choices": ["honey", "milk", "silk", "glass"], "label": 0},
]
GEN = ["The opposite of hot is", "The capital of Italy is", "One, two, three, four,", "Water freezes at",
       "The largest ocean on Earth is the", "Monday, Tuesday,"]
MAX_GEN_TOKS = 12


def task_yaml(name: str, data: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


MC_TASK = """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = f"""output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def encode_pair(tok: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair (0.4): trailing spaces move to the continuation; the whole
    is encoded and split after the context's tokens; no special tokens (add_bos_token false)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def read_samples(out: Path, task: str) -> list[dict]:
    """lm-eval's logged samples, by doc; `arguments` as {"gen_args_<i>": {"arg_0": ..., "arg_1": ...}}
    and responses as strings, as its --log_samples file holds them."""
    path = next(out.rglob(f"samples_{task}_*.jsonl"))
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def arguments(sample: dict) -> list[tuple]:
    return [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]


@pytest.mark.slow
def test_lm_eval_scores_equal_llm_on_the_same_items(server, llm, default_gguf, tmp_path) -> None:
    tok = llm.tokenizer
    tokenizer_dir = tmp_path / "tokenizer"  # lm-eval's tokenizer: the GGUF's vocabulary as tokenizer.json
    tokenizer_dir.mkdir()
    write_tokenizer_files(Tokenizer.from_gguf(default_gguf), tokenizer_dir, llm.max_model_len)
    eos = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())["eos_token"]

    # generate_until: what LLM answers greedily, as lm-eval asks (token ids, stop at "\n" or its EOS
    # text). Half the golds are those answers, half are not: exact_match is 0.5 iff the server agrees.
    greedy = SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS, stop=["\n", eos])
    answers = [o.text for o in llm.generate([tok.encode(p, add_special_tokens=False) for p in GEN], greedy,
                                            use_tqdm=False)]
    golds = [a if i % 2 == 0 else "not the answer" for i, a in enumerate(answers)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": g}) + "\n" for p, g in zip(GEN, golds)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kvserve_mc.yaml").write_text(task_yaml("kvserve_mc", tmp_path / "mc.jsonl", MC_TASK))
    (tasks / "kvserve_gen.yaml").write_text(task_yaml("kvserve_gen", tmp_path / "gen.jsonl", GEN_TASK))

    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OPENAI_API_KEY": API_KEY, "TOKENIZERS_PARALLELISM": "false"}
    model_args = (f"model={NAME},base_url={server.url}{C},tokenizer={tokenizer_dir},tokenizer_backend=huggingface,"
                  "max_retries=1")
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
           "--tasks", "kvserve_mc,kvserve_gen", "--include_path", str(tasks), "--batch_size", "4",
           "--output_path", str(out), "--log_samples"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]

    # Log-likelihoods: each (context, continuation) scored by LLM on the same tokens lm-eval sends.
    mc = read_samples(out, "kvserve_mc")
    pairs = [encode_pair(tok, *args) for s in mc for args in arguments(s)]
    scored = llm.generate([ctx + cont for ctx, cont in pairs], SamplingParams(max_tokens=0, prompt_logprobs=1),
                          use_tqdm=False)
    ref = []
    for (ctx, _), o in zip(pairs, scored):
        lps = o.prompt_logprobs[len(ctx):]
        ref.append((sum(lp.logprob for lp in lps), all(lp.top[0][0] == lp.token_id for lp in lps)))
    got = [(float(resp[0][0]), resp[0][1] == "True") for s in mc for resp in s["resps"]]
    assert len(got) == len(ref) == sum(len(d["choices"]) for d in MC)
    for (ll, greedy_), (ref_ll, ref_greedy) in zip(got, ref):
        assert abs(ll - ref_ll) < 1e-3 and greedy_ == ref_greedy
    ref_acc = []
    for i, (s, d) in enumerate(zip(mc, MC)):
        lls = [ll for ll, _ in ref[i * 4:(i + 1) * 4]]
        ref_acc.append(float(max(range(4), key=lls.__getitem__) == d["label"]))
        assert s["acc"] == ref_acc[-1]
    assert results["kvserve_mc"]["acc,none"] == pytest.approx(sum(ref_acc) / len(MC))

    # Generations: the same greedy text, hence the same exact_match.
    gen = read_samples(out, "kvserve_gen")
    assert [s["filtered_resps"][0] for s in gen] == answers
    assert [s["exact_match"] for s in gen] == [float(i % 2 == 0) for i in range(len(GEN))]
    assert results["kvserve_gen"]["exact_match,none"] == pytest.approx(0.5)
    assert server.metric("kvserve_kv_cache_blocks_used") == 0
