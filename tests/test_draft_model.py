"""Speculative decoding with a draft model (engine/draft_model.py): its greedy drafts verified in
the batch leave greedy output as the target alone makes it; its own KV pool is held per sequence
and given back on finish, abort and preemption."""
from __future__ import annotations

import pytest

from kvserve import LLM, CacheConfig, SamplingParams, SpeculativeConfig
from test_speculative import GREEDY, copy_heavy, random_prompts


def draft_config(model, quantization: str = "auto") -> SpeculativeConfig:
    """row_cost 0: rows are free, so whether a sequence drafts does not hang on this machine's timings."""
    return SpeculativeConfig(method="draft", draft_model=str(model), draft_quantization=quantization,
                             num_speculative_tokens=4, max_step_rows=128, row_cost=0.0)


def check_draft_pool(llm) -> None:
    """Each sequence the draft knows holds exactly the blocks of its tokens and fed drafts; the
    others (opted out, waiting, finished) hold none."""
    drafter = llm.drafter
    manager = drafter.manager
    manager.pool.check_invariant()
    running = {s.seq_id for s in llm.engine.scheduler.running}
    assert set(drafter._state) <= running
    for seq_id, st in drafter._state.items():
        assert manager.num_held_blocks(seq_id) == manager.blocks_needed(st.valid + len(st.fed))
    assert set(manager.tables) == set(drafter._state)


@pytest.mark.parametrize("quant", ["none", "q8_0"])  # the target's own float32 weights, or them quantized
def test_greedy_output_is_the_targets_alone_in_mixed_batches(make_llm, tiny_llama_dir, quant) -> None:
    off = make_llm(caching=False, max_num_batched_tokens=16, max_num_seqs=16)
    on = make_llm(caching=False, speculative=draft_config(tiny_llama_dir, quant), max_num_batched_tokens=16, max_num_seqs=16)
    # Different lengths (the 40-token prompt is prefilled, and caught up by the draft, in 16-token
    # pieces), copy-heavy ones, and two requests that opt out.
    prompts = random_prompts([3, 40, 9], seed=0) + [copy_heavy(s, segment=8) for s in range(3)]
    params = [SamplingParams(max_tokens=10 + 2 * i, speculative=i not in (2, 4), **GREEDY) for i in range(len(prompts))]
    # A sampled request drafts too (its draws differ from the run without drafts: only its length is compared).
    prompts.append(copy_heavy(9, segment=8))
    params.append(SamplingParams(max_tokens=14, temperature=0.8, seed=3, ignore_eos=True))
    ref = off.generate(prompts, params, use_tqdm=False)
    eng = on.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    got = {}
    while eng.has_unfinished_requests():
        got.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        check_draft_pool(on)
    assert [got[f"r{i}"] for i in range(len(prompts) - 1)] == [o.token_ids for o in ref[:-1]]
    assert len(got[f"r{len(prompts) - 1}"]) == 14 and eng.timeline.get(f"r{len(prompts) - 1}")["summary"]["drafted_tokens"] > 0
    for rid in ("r2", "r4"):
        assert eng.timeline.get(rid)["summary"]["drafted_tokens"] == 0
    summaries = [eng.timeline.get(f"r{i}")["summary"] for i in range(len(prompts) - 1)]  # the greedy ones
    drafted, accepted = (sum(x[key] for x in summaries) for key in ("drafted_tokens", "accepted_tokens"))
    if quant == "none":  # the same weights: every draft is the target's own token, so the draft's K/V are right
        assert drafted == accepted > 0
    else:  # some drafts rejected (the draft's K/V past them overwritten), most accepted
        assert drafted > accepted > drafted / 2
    pool = on.drafter.manager.pool
    assert (pool.num_used_blocks, pool.num_free_blocks) == (0, pool.num_blocks)


def test_sequences_whose_catch_up_does_not_pay_never_draft_and_output_stays_the_same(make_llm, tiny_llama_dir) -> None:
    from kvserve.engine.speculative import CatchUpCost

    off = make_llm(caching=False, max_num_batched_tokens=16, max_num_seqs=16)
    on = make_llm(caching=False, speculative=draft_config(tiny_llama_dir, "q8_0"), max_num_batched_tokens=16,
                  max_num_seqs=16)
    short = random_prompts([5, 7], seed=4)  # the draft reads prompts this short as decode rows: no catch-up
    long = random_prompts([40, 33], seed=5)  # behind by a prompt, at a second a token: never repaid
    params = [SamplingParams(max_tokens=60, **GREEDY)] * 2 + [SamplingParams(max_tokens=12, **GREEDY)] * 2
    ref = off.generate(short + long, params, use_tqdm=False)
    eng = on.engine
    eng.speculator.catch_up = CatchUpCost(fixed=1.0)
    for i, p in enumerate(short):
        eng.add_request(f"s{i}", p, params[i])
    got = {}
    for _ in range(6):  # decode steps are timed: the latecomers' catch-up is weighed in seconds
        eng.step()
        check_draft_pool(on)
    assert eng.speculator.step_times.measured and eng.has_unfinished_requests()
    for i, p in enumerate(long):
        eng.add_request(f"l{i}", p, params[2 + i])
    while eng.has_unfinished_requests():
        got.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        check_draft_pool(on)
    assert [got[r] for r in ("s0", "s1", "l0", "l1")] == [o.token_ids for o in ref]
    drafted = {r: eng.timeline.get(r)["summary"]["drafted_tokens"] for r in ("s0", "s1", "l0", "l1")}
    assert drafted["s0"] > 0 and drafted["s1"] > 0 and drafted["l0"] == drafted["l1"] == 0
    assert eng.speculator.num_catch_up_tokens == 0


def test_draft_blocks_go_back_on_preemption_and_abort(make_llm, tiny_llama_dir) -> None:
    from kvserve.engine.speculative import CatchUpCost

    llm = make_llm(num_blocks=10, speculative=draft_config(tiny_llama_dir, "q8_0"))
    eng, pool = llm.engine, llm.drafter.manager.pool
    eng.speculator.catch_up = CatchUpCost(fixed=0.0)  # every catch-up pays: the draft holds blocks to give back
    prompts = random_prompts([40, 40, 40], seed=2)
    for i, p in enumerate(prompts):  # each grows to 5 blocks of the target's 10: some are preempted
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, **GREEDY))
    while eng.has_unfinished_requests():
        eng.step()
        check_draft_pool(llm)  # (a preempted sequence is no longer running: it holds no draft block)
    assert eng.scheduler.num_preemptions > 0 and eng.stats().spec_draft_tokens > 0
    assert pool.num_used_blocks == 0
    for i, p in enumerate(prompts[:2]):
        eng.add_request(f"a{i}", p, SamplingParams(max_tokens=30, **GREEDY))
    for _ in range(4):
        eng.step()
    check_draft_pool(llm)
    held = [llm.drafter.manager.num_held_blocks(seq_id) for seq_id in ("a0#0", "a1#0")]
    assert min(held) >= 3  # 40 prompt tokens and more: at least 3 blocks of 16 each
    eng.abort_request("a0")
    assert llm.drafter.manager.num_held_blocks("a0#0") == 0 and pool.num_used_blocks == held[1]
    eng.abort_request("a1")
    assert (pool.num_used_blocks, pool.num_free_blocks) == (0, pool.num_blocks)


def respelt(model_dir, directory, token_id: int, text: str):
    """A copy of a model directory whose tokenizer spells one token otherwise."""
    import json
    import shutil

    shutil.copytree(model_dir, directory)
    path = directory / "tokenizer.json"
    t = json.loads(path.read_text())
    [added] = [a for a in t["added_tokens"] if a["id"] == token_id]
    t["model"]["vocab"][text] = t["model"]["vocab"].pop(added["content"])
    added["content"] = text
    path.write_text(json.dumps(t))
    return directory


def test_a_draft_model_must_have_the_targets_vocabulary(make_llm, tiny_llama_dir, tmp_path) -> None:
    from tiny_models import make_tiny_hf_model

    # Another model with the same tokens (one layer, other weights: its drafts are mostly wrong).
    _, other = make_tiny_hf_model(tmp_path / "other", num_layers=1, seed=1)
    off, on = make_llm(), make_llm(speculative=draft_config(other))
    sp = SamplingParams(max_tokens=12, **GREEDY)
    assert on.generate(copy_heavy(2), sp, use_tqdm=False)[0].token_ids == \
        off.generate(copy_heavy(2), sp, use_tqdm=False)[0].token_ids
    s = on.engine.stats()
    assert s.spec_draft_tokens > s.spec_accepted_tokens and on.drafter.manager.pool.num_used_blocks == 0
    _, wider = make_tiny_hf_model(tmp_path / "wider", vocab_size=49280, num_layers=1)
    for draft, what in ((respelt(other, tmp_path / "respelt", 3, "<other>"), "the same size, but different tokens"),
                        (wider, "49280 (tokenizer 49152) against the target's 49152 (tokenizer 49152)")):
        with pytest.raises(ValueError) as e:
            LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=16), speculative=draft_config(draft))
        assert str(e.value) == (
            f"draft model {str(draft)!r} has a vocabulary of {what}: a draft model must share the target's tokenizer; "
            "use a smaller model of the same family, or the target itself in a quantized format")
    with pytest.raises(ValueError) as e:
        SpeculativeConfig(method="draft")
    assert str(e.value) == ("speculative method 'draft' needs draft_model: a model with the target's vocabulary "
                            "(an alias, .gguf file or Hugging Face directory)")


def serve_args(*argv: str):
    from kvserve.commands import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_refuses_draft_flags_that_do_not_go_together(tiny_llama_dir) -> None:
    from kvserve.commands.serve import settings_from_args

    for argv, message in (
        (["--speculative", "draft"], "--speculative draft needs --draft-model MODEL: a model with the target's "
                                     "vocabulary (an alias, .gguf file or Hugging Face directory)"),
        (["--draft-model", str(tiny_llama_dir), "--draft-kv-cache-gib", "1"],
         "--draft-model and --draft-kv-cache-gib only work with --speculative draft: add it, or leave them out"),
        (["--speculative", "draft", "--draft-model", str(tiny_llama_dir), "--draft-kv-cache-gib", "0"],
         "--draft-kv-cache-gib must be > 0, got 0.0"),
    ):
        with pytest.raises(ValueError) as e:
            settings_from_args(serve_args("--model", str(tiny_llama_dir), *argv))
        assert str(e.value) == message


@pytest.mark.slow
def test_default_model_float32_drafted_by_its_q4_1_file() -> None:
    """The headline case: the shipped Q4_1 weights draft for the same model decoded to float32."""
    llm = LLM("smollm2-135m", dtype="float32", quantization="none", cache=CacheConfig(enable_prefix_caching=False),
              speculative=draft_config("smollm2-135m"))
    assert llm.drafter.runner.native is not None  # the draft's steps take the native decode step
    ids = llm.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    sps = [SamplingParams(max_tokens=16, speculative=s, **GREEDY) for s in (False, True)]
    plain, spec = (llm.generate(ids, sp, use_tqdm=False)[0] for sp in sps)
    assert spec.token_ids == plain.token_ids
    s = llm.engine.stats()
    assert s.spec_accepted_tokens > 0.5 * s.spec_draft_tokens
    assert llm.drafter.manager.pool.num_used_blocks == 0 and llm.manager.pool.num_used_blocks == 0


@pytest.mark.slow
def test_server_drafts_with_a_draft_model(tmp_path_factory) -> None:
    import openai
    from server_harness import MODEL_NAME, start_server, tiny_model_dir

    server = start_server(tmp_path_factory, "--speculative", "draft", "--draft-model", str(tiny_model_dir(tmp_path_factory)),
                          "--draft-quantize", "q8_0", "--draft-kv-cache-gib", "0.005")
    try:
        # float16 under quantized weights: 2 x 2 layers x 2 KV heads x 16 dims x 2 bytes = 256 bytes per token,
        # 4 KiB per block of 16; 0.005 GiB hold 1310 of them
        assert "draft KV cache: 1310 blocks x 16 tokens" in server.log()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, timeout=60, max_retries=0)
        ask = dict(model=MODEL_NAME, prompt=copy_heavy(7), max_tokens=20, temperature=0)
        plain = client.completions.create(**ask, extra_body={"ignore_eos": True, "speculative": False})
        assert server.metric("kvserve_spec_decode_num_draft_tokens_total") == 0
        spec = client.completions.create(**ask, extra_body={"ignore_eos": True})
        assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 20
        drafted = server.metric("kvserve_spec_decode_num_draft_tokens_total")
        assert drafted >= server.metric("kvserve_spec_decode_num_accepted_tokens_total") > drafted / 2
    finally:
        server.stop()
