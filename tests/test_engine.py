"""The engine: continuous batching, chunked prefill, prefix caching, preemption, sampling."""
from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.errors import EngineStalledError, InvalidParam, NonFiniteLogitsError

GREEDY = dict(temperature=0.0, ignore_eos=True)




def prompts_of(llm: LLM, lengths: list[int], seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in lengths]


def test_batch_invariance_with_chunked_prefill(make_llm) -> None:
    alone = make_llm(caching=False)
    llm = make_llm(caching=False, max_num_batched_tokens=32, max_num_seqs=16)
    lengths = [3, 70, 17, 16, 33, 5, 48, 9, 64, 1, 25, 15, 40, 2, 31, 55]
    prompts = prompts_of(llm, lengths)
    params = [SamplingParams(max_tokens=8 + i, **GREEDY) for i in range(16)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, batched):
        ref = alone.generate(p, sp, use_tqdm=False)[0]
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == "length" and len(out.token_ids) == sp.max_tokens
    # The 70-token prompt cannot fit a 32-token budget: it was prefilled in chunks.
    assert llm.engine.stats().prompt_tokens == sum(lengths)


def test_prefix_cache_reuses_a_200_token_prefix(make_llm) -> None:
    llm = make_llm()
    nocache = make_llm(caching=False)
    [prefix, a, b] = prompts_of(llm, [200, 10, 12], seed=1)
    sp = SamplingParams(max_tokens=12, **GREEDY)
    llm.generate(prefix + a, sp, use_tqdm=False)
    before = llm.engine.stats()
    out = llm.generate(prefix + b, sp, use_tqdm=False)[0]
    after = llm.engine.stats()
    # 200 shared tokens = 12 full 16-token blocks (192 tokens); block 13 mixes in the suffix.
    assert out.num_cached_tokens == 192
    assert after.prompt_tokens - before.prompt_tokens == 212 - 192
    assert after.prefix_cache_hits - before.prefix_cache_hits == 192
    assert out.token_ids == nocache.generate(prefix + b, sp, use_tqdm=False)[0].token_ids


def test_preemption_gives_identical_outputs_and_returns_blocks(make_llm) -> None:
    big = make_llm(caching=False)
    # 6 requests x (20 prompt + 44 output) = 4 blocks each; 10 blocks hold two and a half.
    small = make_llm(num_blocks=10, max_num_batched_tokens=64)
    prompts = prompts_of(small, [20] * 6, seed=2)
    sp = SamplingParams(max_tokens=44, **GREEDY)
    ref = big.generate(prompts, sp, use_tqdm=False)
    got = small.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert small.engine.stats().num_preemptions >= 3


def test_preempted_siblings_of_n_completions_finish(make_llm) -> None:
    """n > 1 under a tight pool: preempted completions come back, identical to an unconstrained run."""
    big = make_llm(caching=False)
    small = make_llm(num_blocks=10, max_num_batched_tokens=64)
    prompts = prompts_of(small, [20, 20, 20], seed=3)
    sp = SamplingParams(n=2, max_tokens=44, **GREEDY)
    ref = big.generate(prompts, sp, use_tqdm=False)
    got = small.generate(prompts, sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
    assert small.engine.stats().num_preemptions >= 2


def test_request_that_can_never_fit_is_refused_before_allocation(make_llm) -> None:
    llm = make_llm(num_blocks=4)
    msg = "max_tokens is 60 but the context holds 64 tokens \\(all the KV pool can hold\\) and the prompt takes 20"
    with pytest.raises(ValueError, match=msg):
        llm.generate(prompts_of(llm, [20])[0], SamplingParams(max_tokens=60), use_tqdm=False)
    assert llm.manager.pool.num_used_blocks == 0


def test_abort_returns_every_block(make_llm) -> None:
    llm = make_llm()
    eng = llm.engine
    for i, p in enumerate(prompts_of(llm, [40, 5, 70], seed=3)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=50, n=2 if i == 0 else 1, **GREEDY))
    for _ in range(3):
        eng.step()
    assert llm.manager.pool.num_used_blocks > 0
    out = eng.abort_request("r0")
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    eng.abort_request("r1")
    eng.abort_request("r2")
    eng.abort_request("r2")  # already gone: harmless
    eng.abort_request("nope")
    assert llm.manager.pool.num_used_blocks == 0


def test_seeded_sampling_is_the_same_in_any_batch(make_llm) -> None:
    llm = make_llm()
    [p, *others] = prompts_of(llm, [12, 30, 7, 19], seed=4)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(p, sp, use_tqdm=False)[0]
    mixed = llm.generate(others[:1] + [p] + others[1:],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), sp,
                          SamplingParams(temperature=0.7, max_tokens=5), SamplingParams(temperature=0.0, max_tokens=9)],
                         use_tqdm=False)
    assert mixed[1].token_ids == alone.token_ids
    unseeded = llm.generate(p, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert unseeded.token_ids != alone.token_ids


def test_stop_string_split_across_tokens_is_caught_and_trimmed(make_llm) -> None:
    llm = make_llm()
    p = prompts_of(llm, [10], seed=5)[0]
    full = llm.generate(p, SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)[0]
    tok = llm.tokenizer
    # Choose a stop string that straddles the boundary between output tokens k and k+1.
    for k in range(5, 30):
        left = tok.decode(full.token_ids[: k + 1], skip_special_tokens=True)
        right = tok.decode(full.token_ids[: k + 2], skip_special_tokens=True)
        if len(left) >= 2 and len(right) >= len(left) + 2 and "\ufffd" not in right:
            stop = right[len(left) - 2 : len(left) + 2]
            if full.text.find(stop) == len(left) - 2:
                break
    else:
        pytest.fail("no boundary to straddle in the sample output")
    eng = llm.engine
    eng.add_request("s", p, SamplingParams(max_tokens=40, stop=[stop], **GREEDY))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert final.finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert final.text == full.text[: len(left) - 2]
    assert "".join(deltas) == final.text  # the stream never showed the stop string


def test_n_completions_share_the_prompt_blocks(make_llm) -> None:
    llm = make_llm()
    eng = llm.engine
    p = prompts_of(llm, [40], seed=6)[0]  # 2 full blocks + 8 tokens
    eng.add_request("n3", p, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True))
    while len(eng.scheduler.running) < 3:
        eng.step()
    tables = [llm.manager.block_ids(f"n3#{i}") for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert [llm.manager.pool.blocks[b].ref_cnt for b in tables[0][:2]] == [3, 3]
    assert len({t[2] for t in tables}) == 3  # the partial block is each completion's own
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # different seeds per completion


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=2.5), "temperature must be a finite number in \\[0, 2\\]"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p must be a number in \\(0, 1\\]"),
        (dict(top_k=0), "top_k must be -1"),
        (dict(min_p=1.5), "min_p must be a number in \\[0, 1\\]"),
        (dict(presence_penalty=-2.5), "presence_penalty must be a number in \\[-2, 2\\]"),
        (dict(frequency_penalty=3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0"),
        (dict(n=0), "n must be an integer >= 1"),
        (dict(logprobs=21), "logprobs must be an integer in \\[0, 20\\]"),
        (dict(max_tokens=-1), "max_tokens must be an integer >= 0"),
        (dict(prompt_logprobs=21), "prompt_logprobs must be an integer in \\[0, 20\\]"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be <= max_tokens"),
        (dict(stop=["a"] * 17), "stop must be at most 16 non-empty strings of at most 256 characters"),
        (dict(stop="x" * 257), "stop must be at most 16"),
        (dict(stop_token_ids=list(range(257))), "stop_token_ids must be a list of at most 256"),
    ],
)
def test_bad_parameters_are_refused_by_name(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_before_any_block(make_llm) -> None:
    llm = make_llm(num_blocks=200)
    sp = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate("", sp, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.engine.add_request("e", [], sp)
    with pytest.raises(ValueError, match=r"token id 49152 is outside the vocabulary \[0, 49152\)"):
        llm.generate([5, 49152], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens is 2048 but the context holds 2048 tokens"):
        llm.generate([5, 6], SamplingParams(max_tokens=2048), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is 2048 tokens but the context holds 2048"):
        llm.generate([5] * 2048, sp, use_tqdm=False)
    assert llm.manager.pool.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_stop_token_ids_and_min_tokens(make_llm) -> None:
    llm = make_llm()
    p = prompts_of(llm, [8], seed=7)[0]
    free = llm.generate(p, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].token_ids
    stop_id = free[2]
    out = llm.generate(p, SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY), use_tqdm=False)[0]
    assert out.token_ids == free[:3] and out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    # min_tokens bans the stop id for the first 6 tokens, so the request runs past it.
    out = llm.generate(p, SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=[stop_id], **GREEDY), use_tqdm=False)[0]
    assert len(out.token_ids) >= 6 and stop_id not in out.token_ids[:6]
    out = llm.generate(p, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.token_ids == free[:3]


def test_priority_policy_runs_lower_values_first(make_llm) -> None:
    llm = make_llm(policy="priority", max_num_seqs=1)
    eng = llm.engine
    ps = prompts_of(llm, [5, 5, 5], seed=8)
    for rid, prio, p in zip("abc", [5, 0, 3], ps):
        eng.add_request(rid, p, SamplingParams(max_tokens=2, priority=prio, **GREEDY))
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["b", "c", "a"]


def test_logprobs_match_the_raw_distribution(make_llm) -> None:
    import torch

    llm = make_llm()
    p = prompts_of(llm, [9], seed=9)[0]
    out = llm.generate(p, SamplingParams(max_tokens=1, logprobs=5, **GREEDY), use_tqdm=False)[0]
    [lp] = out.outputs[0].logprobs
    cache, token = llm.prefill(p)
    assert token == lp.token_id == out.token_ids[0]
    cache.close()
    assert len(lp.top) == 5 and lp.top[0][0] == token
    assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert lp.logprob == pytest.approx(lp.top[0][1])
    assert torch.tensor([v for _, v in lp.top]).exp().sum() <= 1.0 + 1e-6


def test_errors_are_typed_with_the_parameter(make_llm) -> None:
    llm = make_llm(num_blocks=200)
    cases = [
        (lambda: SamplingParams(temperature=3.0), "temperature", "temperature must be a finite number in"),
        (lambda: SamplingParams(min_tokens=5, max_tokens=4), "min_tokens", "min_tokens must be <= max_tokens"),
        (lambda: llm.engine.inputs.process([5, 6], SamplingParams(max_tokens=2048)), "max_tokens", "max_tokens is 2048"),
        (lambda: llm.engine.inputs.process([], SamplingParams()), "prompt", "prompt must not be empty"),
        (lambda: llm.engine.inputs.process([5, 10**6], SamplingParams()), "prompt", "prompt token id 1000000"),
        # min_tokens is bounded by the context like max_tokens (it was accepted unchecked).
        (lambda: llm.engine.inputs.process([5, 6], SamplingParams(max_tokens=None, min_tokens=10**12)), "min_tokens",
         r"min_tokens is 1000000000000 but the context holds 2048 tokens and the prompt takes 2: "
         r"min_tokens must be at most 2046"),
    ]
    for call, param, message in cases:
        with pytest.raises(InvalidParam, match=message) as e:
            call()
        assert e.value.param == param and isinstance(e.value, ValueError)
    assert llm.manager.pool.num_used_blocks == 0


def test_non_finite_logits_finish_the_sequence_with_an_error(make_llm) -> None:
    llm = make_llm()
    llm.model.norm.fill_(float("nan"))  # every logit NaN from here on
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    assert out.finish_reason == "error" and out.token_ids == [] and "NaN" in out.outputs[0].stop_reason
    with pytest.raises(NonFiniteLogitsError, match="NaN or infinite logits after 3 tokens"):
        llm.prefill([5, 6, 7])


def _run_with_deadline(fn, seconds: float):
    """fn() on a thread; its exception or result, or a failure if it has not returned in time
    (the thread is left behind: a daemon that spins is what this guards against)."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"did not return within {seconds} s"
    return box


def test_generate_with_the_pool_held_by_prefill_caches_fails_clearly(make_llm) -> None:
    llm = make_llm(num_blocks=10)
    cache, _ = llm.prefill(list(range(10, 150)))  # 140 tokens: 9 of the 10 blocks
    box = _run_with_deadline(lambda: llm.generate(list(range(20, 60)), SamplingParams(max_tokens=8, **GREEDY),
                                                  use_tqdm=False), 120)
    e = box.get("error")
    assert isinstance(e, EngineStalledError), box
    assert "1 open prefill() caches hold 140 tokens in 9 blocks" in str(e) and "close" in str(e)
    assert not llm.engine.has_unfinished_requests()
    cache.close()
    out = llm.generate(list(range(20, 60)), SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    assert len(out.token_ids) == 8


def test_async_engine_tells_bad_input_from_an_engine_failure(make_llm) -> None:
    llm = make_llm()
    engine = AsyncEngine(llm.engine)

    async def first(prompt, params, rid=None):
        async for out in engine.generate(prompt, params, rid):
            return out

    try:
        with pytest.raises(InvalidParam) as e:  # validation: refused before it is submitted
            engine.inputs.process([5, 6], SamplingParams(max_tokens=2048))
        assert e.value.param == "max_tokens" and engine.is_alive

        def broken(sched):
            raise ValueError("an internal bug, not the client's input")

        llm.runner.execute = broken  # a failure inside step()
        with pytest.raises(EngineDeadError, match="an internal bug") as e:
            asyncio.run(first([5, 6], SamplingParams(max_tokens=4)))
        assert not engine.is_alive
        del llm.runner.execute
    finally:
        engine.shutdown()
    for rid in list(llm.engine.requests):
        llm.engine.abort_request(rid)


def test_async_engine_hands_over_the_tokens_it_made_before_it_failed(make_llm) -> None:
    """A reader that was slow when the engine died still gets every token made before the failure,
    then the error (the error does not overwrite an unread output)."""
    llm = make_llm()
    sp = SamplingParams(max_tokens=20, **GREEDY)
    ref = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    real_step, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("boom")
        return real_step()

    llm.engine.step = step
    engine = AsyncEngine(llm.engine)

    async def read() -> list:
        gen = engine.generate([5, 6, 7], sp)
        got = [await gen.__anext__()]
        while engine.is_alive:  # nobody reads while the engine makes two more tokens and fails
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError, match="boom"):
            async for out in gen:
                got.append(out)
        return got

    try:
        got = asyncio.run(read())
    finally:
        engine.shutdown()
        del llm.engine.step
    for rid in list(llm.engine.requests):
        llm.engine.abort_request(rid)
    assert [t for out in got for t in out.outputs[0].delta_token_ids] == ref[:3]


def test_delta_outputs_carry_only_the_step_and_the_final_one_the_whole(make_llm) -> None:
    from kvserve.outputs import OutputKind

    llm = make_llm()
    engine = llm.engine
    prompt = prompts_of(llm, [9])[0]
    sp = SamplingParams(max_tokens=40, logprobs=1, **GREEDY)
    engine.add_request("d", prompt, sp, output_kind=OutputKind.DELTA)
    engine.add_request("c", prompt, sp)  # the default: cumulative
    engine.add_request("f", prompt, sp, output_kind=OutputKind.FINAL_ONLY)
    seen: dict[str, list] = {"d": [], "c": [], "f": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    deltas, cumulative = seen["d"], seen["c"]
    assert len(deltas) == len(cumulative) == 40 and len(seen["f"]) == 1
    # A streamed step copies what it added, not what came before: no step's output grows with the
    # output so far (the cumulative kind's step k copies k tokens).
    for out in deltas[:-1]:
        c = out.outputs[0]
        assert c.token_ids == [] and c.text == "" and c.logprobs == []
        assert len(c.delta_token_ids) == 1 and len(c.delta_logprobs) == 1
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 41))
    final = deltas[-1].outputs[0]
    assert final.token_ids == cumulative[-1].outputs[0].token_ids == seen["f"][0].outputs[0].token_ids
    assert final.text == "".join(o.outputs[0].delta_text for o in deltas) == cumulative[-1].outputs[0].text
    assert [lp.token_id for lp in final.logprobs] == final.token_ids
    assert sum((o.outputs[0].delta_token_ids for o in deltas), []) == final.token_ids
