"""Speculative decoding: prompt-lookup drafts (engine/drafter.py) planned per sequence
(engine/speculative.py) and verified in the batch (engine/verify.py)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvserve import SamplingParams, SpeculativeConfig
from kvserve.engine.drafter import lookup, match
from kvserve.engine.sampler import Sampler, SamplingRow
from kvserve.engine.verify import rows_for, verify
from kvserve.kv.block_pool import prefix_block_hashes

SPEC = SpeculativeConfig(num_speculative_tokens=4, max_step_rows=128, row_cost=0.0)  # every sequence may draft
GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in lengths]


def copy_heavy(seed: int, segment: int = 12, times: int = 4) -> list[int]:
    """A passage said several times over: what prompt lookup feeds on."""
    [seg, tail] = random_prompts([segment, 3], seed)
    return seg * times + tail


def test_lookup_proposes_what_followed_the_most_recent_longest_match() -> None:
    a = np.array([1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3], dtype=np.int32)
    assert lookup(a, 3, 1, 3) == [4, 8, 2]  # the 3-gram (1 2 3) beats the later 2-gram (2 3)
    assert lookup(a, 3, 1, 2) == [5, 1, 2]  # up to 2-grams: the most recent (2 3) wins
    assert lookup(a, 1, 1, 3) == [4]
    b = np.array([5, 6, 7, 9, 7], dtype=np.int32)
    assert lookup(b, 4, 1, 3) == [9, 7]  # only what exists is proposed
    assert lookup(b, 4, 2, 3) == []  # no 2-gram match
    assert lookup(np.array([1, 2, 3], dtype=np.int32), 4, 1, 3) == []
    assert match(a, 3, 1, 8) == (3, [4, 8, 2])  # with the length of the match it continues
    assert match(a, 3, 1, 2) == (2, [5, 1, 2])
    assert match(b, 4, 1, 3) == (1, [9, 7]) and match(b, 4, 2, 3) == (0, [])


def test_draft_length_follows_acceptance_and_probes_back_off() -> None:
    from kvserve.engine.speculative import PROBE_EVERY, PROBE_TOKENS, SpecState

    st = SpecState()
    assert st.k(4) == 4  # optimistic at first
    ks = []
    for _ in range(4):  # every draft rejected outright
        st.observe(ks[-1] if ks else 4, 0)
        ks.append(st.k(4))
    assert ks == sorted(ks, reverse=True) and ks[-1] == 0
    waits = []
    for _ in range(3):  # idle until a probe, which fails: the next one comes twice as late
        n = 1
        while (k := st.k(4)) == 0:
            n += 1
        assert k == PROBE_TOKENS
        waits.append(n)
        st.observe(k, 0)
    assert waits[0] <= PROBE_EVERY and waits[1:] == [2 * PROBE_EVERY, 4 * PROBE_EVERY]
    for _ in range(6):  # drafts accepted again: back to full length
        st.observe(2, 2)
    assert st.k(4) == 4 and st.k(1) == 1


def test_match_agrees_with_a_plain_loop_on_random_token_strings() -> None:
    def plain(a: list[int], k: int, n_min: int, n_max: int) -> tuple[int, list[int]]:
        best, at = 0, -1
        for j in range(len(a) - 1):  # earlier occurrences of the last token; the latest longest wins
            n = 0
            while n < n_max and j - n >= 0 and a[j - n] == a[len(a) - 1 - n]:
                n += 1
            if n >= max(best, 1):
                best, at = n, j
        return (best, a[at + 1 : at + 1 + k]) if best >= n_min and k >= 1 else (0, [])

    rng = random.Random(5)
    for _ in range(3000):
        a = [rng.randrange(rng.choice([2, 3, 5, 20])) for _ in range(rng.randrange(1, 60))]
        k, n_min = rng.randrange(1, 6), rng.randrange(1, 4)
        n_max = rng.randrange(n_min, 10)
        assert match(np.array(a, dtype=np.int32), k, n_min, n_max) == plain(a, k, n_min, n_max), (a, k, n_min, n_max)


def test_match_acceptance_is_learned_per_match_length_and_extends_with_each_accepted_token() -> None:
    from kvserve.engine.speculative import MATCH_CAP, MatchAcceptance

    m = MatchAcceptance()
    assert [m.alpha(n) for n in (1, 2, 3)] == pytest.approx([1 / 2, 2 / 3, 3 / 4])  # the prior, n / (n + 1)
    assert m.alpha(MATCH_CAP + 5) == m.alpha(MATCH_CAP)
    assert m.chances(2, 3) == pytest.approx([2 / 3, 2 / 3 * 3 / 4, 2 / 3 * 3 / 4 * 4 / 5])
    before = list(m.tried)
    m.observe(2, 4, 2)  # tokens 1-2 kept (at match lengths 2 and 3), token 3 (length 4) rejected, 4 untried
    touched = [n for n in range(MATCH_CAP + 1) if m.tried[n] != before[n]]
    assert touched == [2, 3, 4] and m.tried[2] == pytest.approx(0.995 * before[2] + 1)
    assert m.alpha(4) < 4 / 5 < m.alpha(3)
    for _ in range(300):  # 1-token matches fail, 8-token ones hold
        m.observe(1, 1, 0)
        m.observe(MATCH_CAP, 4, 4)
    assert m.alpha(1) < 0.05 and m.alpha(MATCH_CAP) > 0.95
    assert m.chances(1, 2, factor=1.0)[0] < 0.05 and m.chances(MATCH_CAP, 2, factor=2.0) == pytest.approx([0.99, 0.99 ** 2])


class PeekDrafter:
    """A stand-in for prompt lookup: k tokens of 7, continuing a match of `n[seq_id]` tokens."""

    def __init__(self, n: dict[str, int]) -> None:
        self.n = n

    def peek(self, requests):
        return [(self.n[seq.seq_id], [7] * k if self.n[seq.seq_id] else []) for seq, k in requests]

    def propose(self, requests):
        return [tokens for _, tokens in self.peek(requests)]


def test_a_lookup_draft_is_weighed_by_its_match_length_and_the_sequences_record(make_llm) -> None:
    from kvserve.engine.speculative import MATCH_CAP, Speculator

    llm = make_llm()
    eng = llm.engine
    for rid in ("long", "short", "none"):
        eng.add_request(rid, random_prompts([5], seed=7)[0], SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    long, short, none = eng.scheduler.running
    drafter = PeekDrafter({long.seq_id: MATCH_CAP, short.seq_id: 1, none.seq_id: 0})
    sp = Speculator(SpeculativeConfig(num_speculative_tokens=4, max_step_rows=16, row_cost=0.2), 1000, drafter)
    for _ in range(3):
        sp.record_step(3, 0.030)  # a row costs 2 ms of a 30 ms step of 3 tokens: worth drafting above gain 0.2
    for _ in range(300):
        sp.matches.observe(1, 1, 0)
        sp.matches.observe(MATCH_CAP, 4, 4)
    drafts = sp.plan([long, short, none])
    assert {s.seq_id: len(d) for s, d in drafts.items()} == {long.seq_id: 4}  # a 1-token match no longer pays
    for _ in range(6):  # this sequence's long matches keep failing: its own record scales them down
        sp.observe(long, len(sp.plan([long]).get(long, [])) or 0, 0)
    assert sp.plan([long]) == {}
    idle = 0
    while not sp.plan([long]):  # not drafting, its record fades and it tries again
        idle += 1
        assert idle < 200
    assert idle > 5
    for rid in ("long", "short", "none"):
        eng.abort_request(rid)


class FixedDrafter:
    """A stand-in drafter (any Drafter plugs in): always proposes k tokens of 7."""

    def propose(self, requests):
        return [[7] * k for _, k in requests]


def test_drafted_rows_per_step_are_capped_best_acceptance_first(make_llm) -> None:
    from kvserve.engine.speculative import Speculator

    llm = make_llm()
    eng = llm.engine
    for i in range(3):
        eng.add_request(f"r{i}", random_prompts([5], seed=i)[0], SamplingParams(max_tokens=10, **GREEDY))
    eng.step()  # the prompts are computed: three decoding sequences
    seqs = list(eng.scheduler.running)
    sp = Speculator(SpeculativeConfig(num_speculative_tokens=4, max_step_rows=8), 1000, FixedDrafter())
    # 3 decode rows + 5 drafted = 8; equal gains go shallowest first (one draft forward serves them)
    assert [len(d) for d in sp.plan(seqs).values()] == [2, 2, 1]
    sp.observe(seqs[0], 4, 1)  # the first sequence's record falls below the others' (untried)
    drafts = sp.plan(seqs)
    assert [len(drafts.get(s, [])) for s in seqs] == [0, 3, 2]
    for rid in ("r0", "r1", "r2"):
        eng.abort_request(rid)


def test_step_times_fit_the_engines_own_steps() -> None:
    from kvserve.engine.speculative import ROW_SHARE, StepTimes

    st = StepTimes()
    assert st.line() == (1.0 - ROW_SHARE, ROW_SHARE)  # nothing measured: in units of a one-row step
    st.record(2, 0.030)  # the first step of a row count is not counted (it also grows buffers)
    assert st.line() == (1.0 - ROW_SHARE, ROW_SHARE)
    st.record(2, 0.010)
    assert st.line() == pytest.approx((0.010 - 2 * ROW_SHARE * 0.005, ROW_SHARE * 0.005))
    for rows in (1, 2, 3, 5, 1, 4) * 2:  # exactly 4 ms + 3 ms a row
        st.record(rows, 0.004 + 0.003 * rows)
    assert st.line() == pytest.approx((0.004, 0.003))
    assert StepTimes(row_cost=0.0).line() == (1.0, 0.0)


def test_a_draft_is_planned_only_where_its_rows_pay(make_llm) -> None:
    from kvserve.engine.speculative import Speculator

    llm = make_llm()
    eng = llm.engine
    eng.add_request("r", random_prompts([5], seed=3)[0], SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    [seq] = eng.scheduler.running
    costly = Speculator(SpeculativeConfig(num_speculative_tokens=4), 1000, FixedDrafter())
    free = Speculator(SpeculativeConfig(num_speculative_tokens=4, row_cost=0.0), 1000, FixedDrafter())
    for sp in (costly, free):
        assert [len(d) for d in sp.plan([seq]).values()] == [4]  # untried: optimistic, and rows cheap a priori
        sp.observe(seq, 4, 1)  # acceptance 2/3: k = 3 by acceptance alone
    for _ in range(10):  # each drafted row costs a whole one-row step here
        costly.record_step(1, 0.010)
        costly.record_step(2, 0.020)
    # gains 2/3, 4/9, 8/27 against a row that costs what the step's one token does: none pays
    assert costly.plan([seq]) == {}
    assert [len(d) for d in free.plan([seq]).values()] == [3]
    for _ in range(30):  # now a row costs a tenth: the first two drafted tokens pay, the third not
        costly.record_step(1, 0.010)
        costly.record_step(2, 0.011)
    a, b = costly.step_times.line()
    assert [len(d) for d in costly.plan([seq]).values()] == [3 if 8 / 27 * (a + 3 * b) > (1 + 2 / 3 + 4 / 9) * b else 2]
    eng.abort_request("r")


class BehindDrafter(FixedDrafter):
    """FixedDrafter that must first read `lag[seq_id]` tokens of a sequence, and reports a catch-up."""

    def __init__(self, lag: dict[str, int], prefill: tuple[int, float] = (0, 0.0)) -> None:
        self.lag = lag
        self.prefill = prefill

    def behind(self, seq) -> int:
        return self.lag.get(seq.seq_id, 0)

    def propose(self, requests):
        self.prefill_tokens, self.prefill_seconds = self.prefill
        return super().propose(requests)


def test_a_sequence_behind_drafts_only_when_its_budget_repays_the_catch_up(make_llm) -> None:
    from kvserve.engine.speculative import CatchUpCost, Speculator

    llm = make_llm()
    eng = llm.engine
    for rid, max_tokens in (("short", 15), ("long", 16)):
        eng.add_request(rid, random_prompts([5], seed=4)[0], SamplingParams(max_tokens=max_tokens, **GREEDY))
    eng.step()  # prompts computed: one token out each, 14 and 15 to go
    short, long = eng.scheduler.running
    drafter = BehindDrafter({short.seq_id: 100, long.seq_id: 100})
    sp = Speculator(SpeculativeConfig(num_speculative_tokens=4, row_cost=0.1), 1000, drafter)
    for _ in range(3):
        sp.record_step(2, 0.020)  # T(R) = 18 ms + 1 ms a row (row_cost: a tenth of a row's share)
    sp.catch_up = CatchUpCost(fixed=0.001)  # catching up 100 tokens: 0.1 s
    # Untried (gains 1): a token is worth T(2) / 2 = 10 ms, a row saves 9 ms net; each may have 3 of
    # the 6 drafted rows a step (max_step_rows 8): 27 ms a step of 4 tokens, so 14 tokens to go repay
    # 14 / 4 * 27 = 94.5 ms < 100, 15 repay 101.25 ms.
    assert {s.seq_id: len(d) for s, d in sp.plan([short, long]).items()} == {long.seq_id: 4}
    fresh = Speculator(SpeculativeConfig(num_speculative_tokens=4), 1000, BehindDrafter(drafter.lag))
    assert list(fresh.plan([short, long])) == [short]  # nothing measured: one catch-up a step, to time it
    drafter.lag = {}  # caught up (the drafter read nothing more): both draft
    assert {s.seq_id: len(d) for s, d in sp.plan([short, long]).items()} == {short.seq_id: 3, long.seq_id: 3}
    for rid in ("short", "long"):
        eng.abort_request(rid)


def test_a_draft_models_forwards_are_weighed_with_the_targets_rows(make_llm) -> None:
    from kvserve.engine.speculative import Speculator

    llm = make_llm()
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"r{i}", random_prompts([5], seed=20 + i)[0], SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    seqs = list(eng.scheduler.running)

    def speculator(d0: float) -> Speculator:
        sp = Speculator(SpeculativeConfig(num_speculative_tokens=4, max_step_rows=8), 1000, FixedDrafter())
        for rows in (1, 2, 3, 4) * 2:  # (the first step of a row count is not counted)
            sp.record_step(rows, 0.010 + 0.001 * rows)  # the target: 10 ms + 1 ms a row
            sp.draft_times.record(rows, d0 + 0.0005 * rows)  # a draft forward: d0 + 0.5 ms a row
        return sp

    # Four untried sequences, d0 = 4 ms: one drafted row alone costs a whole draft forward (4 tokens
    # in 14 ms against 5 in 19.5 ms), four side by side share it (8 tokens in 24 ms): all four draft one.
    assert [len(d) for d in speculator(0.004).plan(seqs).values()] == [1, 1, 1, 1]
    # One sequence, d0 = 20 ms: each draft token costs a forward of its own, and none pays.
    assert speculator(0.020).plan(seqs[:1]) == {}
    for i in range(4):
        eng.abort_request(f"r{i}")


def test_a_catch_up_is_timed_per_token_and_kept_out_of_the_step_times(make_llm) -> None:
    from kvserve.engine.speculative import Speculator

    llm = make_llm()
    eng = llm.engine
    eng.add_request("r", random_prompts([5], seed=5)[0], SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    [seq] = eng.scheduler.running
    sp = Speculator(SpeculativeConfig(num_speculative_tokens=2), 1000, BehindDrafter({}, prefill=(200, 0.5)))
    assert sp.catch_up.per_token == 0.0  # unmeasured: the first catch-up goes ahead
    sp.plan([seq])
    assert sp.catch_up.per_token == pytest.approx(0.0025) and sp.num_catch_up_tokens == 200
    for _ in range(3):  # each step: 0.5 s of catch-up and 30 ms of three rows
        sp.plan([seq])
        sp.record_step(3, 0.530)
    assert sp.step_times.line() == pytest.approx((0.030 - 3 * 0.4 * 0.010, 0.4 * 0.010))  # (ROW_SHARE)
    eng.abort_request("r")


def test_greedy_output_is_identical_with_speculation_in_mixed_batches(make_llm) -> None:
    off = make_llm(caching=False, max_num_batched_tokens=32, max_num_seqs=16)
    on = make_llm(caching=False, speculative=SPEC, max_num_batched_tokens=32, max_num_seqs=16)
    # Random prompts and copy-heavy ones; a 70-token prompt is prefilled in chunks beside the decodes.
    prompts = random_prompts([3, 70, 17, 33, 9], seed=0) + [copy_heavy(s) for s in range(5)]
    params = [SamplingParams(max_tokens=12 + 2 * i, **GREEDY) for i in range(len(prompts))]
    ref = off.generate(prompts, params, use_tqdm=False)
    got = on.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(o.finish_reason == "length" and len(o.token_ids) == sp.max_tokens for o, sp in zip(got, params))
    s = on.engine.stats()
    assert s.spec_draft_tokens > s.spec_accepted_tokens > 0  # drafts were accepted, and some rejected
    assert s.generation_tokens == sum(sp.max_tokens for sp in params)


def test_rejected_slots_are_rolled_back_block_for_block(make_llm) -> None:
    off = make_llm()
    on = make_llm(speculative=SPEC)
    prompts = random_prompts([30, 7], seed=1) + [copy_heavy(s, segment=9, times=5) for s in (10, 11)]
    sp = SamplingParams(max_tokens=29, **GREEDY)
    for i, p in enumerate(prompts):
        on.engine.add_request(f"r{i}", p, sp)
    manager, pool = on.manager, on.manager.pool
    finished = {}
    while on.engine.has_unfinished_requests():
        for out in on.engine.step():
            if out.finished:
                finished[out.request_id] = out.prompt_token_ids + out.outputs[0].token_ids
        pool.check_invariant()
        for seq in on.engine.scheduler.running:  # exactly the blocks of its computed tokens, no more
            assert manager.num_held_blocks(seq.seq_id) == manager.blocks_needed(seq.num_computed_tokens)
    s = on.engine.stats()
    assert s.spec_draft_tokens > s.spec_accepted_tokens > 0
    # Every published block holds verified tokens: its hash is on a finished sequence's real chain.
    real = {h for tokens in finished.values() for h, _ in prefix_block_hashes(tokens, manager.block_size)}
    published = {b.block_hash for b in pool.blocks if b.block_hash is not None}
    assert published == real
    ref = off.generate(prompts, sp, use_tqdm=False)
    assert [finished[f"r{i}"][len(p):] for i, p in enumerate(prompts)] == [o.token_ids for o in ref]
    # The same blocks are used, cached and free as without speculation.
    assert (pool.num_used_blocks, pool.num_cached_free_blocks, pool.num_free_blocks) == \
        (0, off.manager.pool.num_cached_free_blocks, off.manager.pool.num_free_blocks)


def test_stops_inside_an_accepted_run_end_the_output_at_the_right_token(make_llm) -> None:
    off = make_llm(caching=False)
    on = make_llm(caching=False, speculative=SPEC)
    p = copy_heavy(3)
    full = off.generate(p, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0]
    stop_id = full.token_ids[9]
    stop_text = off.tokenizer.decode(full.token_ids[12:14])
    cases = [SamplingParams(max_tokens=24, stop_token_ids=[stop_id], **GREEDY),
             SamplingParams(max_tokens=24, stop=[stop_text], **GREEDY),
             SamplingParams(max_tokens=24, min_tokens=11, stop_token_ids=[stop_id], **GREEDY),
             SamplingParams(max_tokens=7, **GREEDY)]
    for sp in cases:
        a, b = off.generate(p, sp, use_tqdm=False)[0], on.generate(p, sp, use_tqdm=False)[0]
        assert (b.token_ids, b.text, b.finish_reason, b.outputs[0].stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.outputs[0].stop_reason)
    assert on.engine.stats().spec_accepted_tokens > 0


def test_logprobs_penalties_and_bias_agree_with_speculation_off(make_llm) -> None:
    off = make_llm(caching=False)
    on = make_llm(caching=False, speculative=SPEC)
    prompts = [copy_heavy(s) for s in (4, 5)]
    params = [SamplingParams(max_tokens=16, logprobs=3, **GREEDY),
              SamplingParams(max_tokens=16, frequency_penalty=0.3, logit_bias={prompts[1][0]: 2.0}, **GREEDY)]
    ref = off.generate(prompts, params, use_tqdm=False)
    got = on.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(ref[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert b.token_id == a.token_id and b.logprob == pytest.approx(a.logprob, abs=1e-4)
        assert [t for t, _ in b.top] == [t for t, _ in a.top]
    assert on.engine.stats().spec_accepted_tokens > 0


def test_a_request_that_opts_out_is_never_drafted_for(make_llm) -> None:
    llm = make_llm(speculative=SPEC)
    eng = llm.engine
    eng.add_request("yes", copy_heavy(6), SamplingParams(max_tokens=30, **GREEDY))
    eng.add_request("no", copy_heavy(6), SamplingParams(max_tokens=30, speculative=False, **GREEDY))
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    yes, no = eng.timeline.get("yes")["summary"], eng.timeline.get("no")["summary"]
    assert no["drafted_tokens"] == 0 and no["decode_steps"] == 29
    assert yes["accepted_tokens"] > 0 and yes["decode_steps"] < 29
    assert outs["yes"].outputs[0].token_ids == outs["no"].outputs[0].token_ids
    steps = eng.timeline.activity()["steps"]
    assert sum(s["accepted_tokens"] for s in steps) == yes["accepted_tokens"]


def _draws(row0: SamplingRow, row1_params: SamplingParams, logits: torch.Tensor, draft: list[int], n: int):
    """The first two tokens a verify step emits over n seeded draws (-1: none emitted second)."""
    sampler = Sampler(logits.shape[1])
    rows, drafts = [], []
    for i in range(n):
        gen = Sampler.make_generator(i)
        base = SamplingRow(row0.params, [], [], gen)
        rows += rows_for(base, draft)
        drafts.append(draft)
    out = verify(sampler, logits.repeat(n, 1), rows, drafts)
    first = torch.tensor([v.token_ids[0] for v in out])
    second = torch.tensor([v.token_ids[1] if len(v.token_ids) > 1 else -1 for v in out])
    return first, second


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0, "a token outside the target's support was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("rank", [1, 5, 30])  # the draft is the 2nd, the 6th best token, or outside top-k
def test_rejection_sampling_keeps_the_target_distribution(rank: int) -> None:
    v, n, temperature, top_k, penalty = 40, 12_000, 0.8, 12, 0.7
    logits = torch.randn(2, v, generator=torch.Generator().manual_seed(rank)) * 1.5
    d = int(logits[0].argsort(descending=True)[rank])
    params = SamplingParams(temperature=temperature, top_k=top_k, frequency_penalty=penalty)
    first, second = _draws(SamplingRow(params, [], [], None), params, logits, [d], n)

    def target(row: torch.Tensor) -> torch.Tensor:
        p = torch.zeros(v)
        top = row.topk(top_k).indices
        p[top] = (row[top] / temperature).softmax(dim=-1)
        return p

    p0 = target(logits[0])
    counts = torch.bincount(first, minlength=v)
    kept = int((p0 > 0).sum())
    assert _chi2(counts, p0) < 3 * kept + 20  # kept - 1 degrees of freedom: p < 1e-5 beyond this
    # After an accepted draft the next token is row 1's, with the draft counted in the penalty.
    after = second[first == d]
    if rank < top_k:
        assert after.numel() > 300 and int((after == -1).sum()) == 0
        row1 = logits[1].clone()
        row1[d] -= penalty
        p1 = target(row1)
        assert _chi2(torch.bincount(after, minlength=v), p1) < 3 * int((p1 > 0).sum()) + 20
    else:
        assert after.numel() == 0  # outside the target's support: never accepted
    # Rejected (or replaced) drafts emit one token only.
    assert bool((second[first != d] == -1).all())


@pytest.mark.slow
def test_default_model_greedy_is_the_same_with_and_without_drafts() -> None:
    """The default model's quantized weights take the native decode step: drafts travel as extra
    decode rows of the same sequence there."""
    from kvserve import LLM, CacheConfig

    # No prefix cache: the second run's prompt would otherwise be prefilled in a smaller chunk,
    # whose matmuls round differently (see LLM's batch_invariant), whatever the drafts do.
    llm = LLM(speculative=SPEC, cache=CacheConfig(enable_prefix_caching=False))
    text = open(__file__).read()[:300]
    ids = llm.encode_chat([{"role": "user", "content": "Repeat this text exactly:\n\n" + text}])
    sps = [SamplingParams(max_tokens=32, temperature=0.0, speculative=s) for s in (False, True)]
    plain, spec = (llm.generate(ids, sp, use_tqdm=False)[0] for sp in sps)
    assert spec.token_ids == plain.token_ids
    assert llm.engine.stats().spec_accepted_tokens > 0
    llm.manager.pool.check_invariant()
    assert llm.manager.pool.num_used_blocks == 0


@pytest.mark.slow
def test_server_speculates_with_the_flag_and_a_request_may_opt_out(tmp_path_factory) -> None:
    from server_harness import MODEL_NAME, start_server

    server = start_server(tmp_path_factory, "--speculative", "ngram", "--num-speculative-tokens", "3")
    try:
        body = {"model": MODEL_NAME, "prompt": copy_heavy(7), "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        with server.client() as c:
            plain = c.post("/v1/completions", json=body | {"speculative": False})
            assert plain.status_code == 200, plain.text
            assert server.metric("kvserve_spec_decode_num_draft_tokens_total") == 0
            spec = c.post("/v1/completions", json=body)
            assert spec.status_code == 200, spec.text
            assert spec.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
            chat = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 4, "speculative": False,
                                                        "messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 200, chat.text
        accepted = server.metric("kvserve_spec_decode_num_accepted_tokens_total")
        drafted = server.metric("kvserve_spec_decode_num_draft_tokens_total")
        assert drafted >= accepted > 0
        assert server.metric("kvserve_spec_decode_acceptance_rate") == pytest.approx(accepted / drafted)
    finally:
        server.stop()
