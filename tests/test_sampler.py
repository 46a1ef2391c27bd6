"""The batched sampler: greedy, penalties, top-k/p, min-p, seeds, min_tokens, logprobs."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.sampler import CANDIDATE_CUTOFFS, NO_TOKEN, Sampler, SamplingRow, apply_penalties, argmax
from kvserve.errors import InvalidParam
from kvserve.sampling_params import SamplingParams

V = 1000


def row(generator=None, prompt=(), output=(), eos=(), **params) -> SamplingRow:
    params = SamplingParams(**params)
    return SamplingRow(params, list(prompt), list(output), generator, frozenset(eos))


def random_logits(b: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def repeat(logits_row: torch.Tensor, n: int) -> torch.Tensor:
    return logits_row[None, :].expand(n, -1).contiguous()  # [n, V]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = random_logits(8).to(dtype)
    expected = logits.float().argmax(dim=-1).tolist()
    fast = Sampler(V)(logits, [row(temperature=0.0) for _ in range(8)])
    assert fast.token_ids == expected and fast.logprobs == [None] * 8
    # Off the fast path (logprobs asked for) the answer is the same.
    slow = Sampler(V)(logits, [row(temperature=0.0, logprobs=0) for _ in range(8)])
    assert slow.token_ids == expected


def test_greedy_ties_pick_lowest_id():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [5.0, 5.0, 5.0, 5.0]])
    out = Sampler(4)(logits, [row(temperature=0.0), row(temperature=0.0, logprobs=1)])
    assert out.token_ids == [1, 0]


def test_penalties_hand_computed():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, 0.0]])
    prompt, output = [1], [2, 2, 3]

    rep = apply_penalties(logits, [row(prompt=prompt, output=output, repetition_penalty=2.0)])
    assert rep.tolist() == [[1.0, 1.0, -2.0, 0.25, 3.0, 0.0]]  # 2/2, -1*2, 0.5/2; only seen ids

    freq = apply_penalties(logits, [row(prompt=prompt, output=output, frequency_penalty=0.5)])
    assert freq.tolist() == [[1.0, 2.0, -2.0, 0.0, 3.0, 0.0]]  # output counts: id2 x2, id3 x1

    pres = apply_penalties(logits, [row(prompt=prompt, output=output, presence_penalty=0.25)])
    assert pres.tolist() == [[1.0, 2.0, -1.25, 0.25, 3.0, 0.0]]  # prompt id 1 untouched

    both = apply_penalties(logits, [row(prompt=prompt, output=output, repetition_penalty=2.0,
                                        frequency_penalty=0.5, presence_penalty=0.25)])
    assert both.tolist() == [[1.0, 1.0, -3.25, -0.5, 3.0, 0.0]]  # repetition first, then OpenAI's


def test_penalties_steer_greedy_per_row():
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0]]).repeat(3, 1)
    rows = [
        row(temperature=0.0, output=[1]),  # no penalty: 1
        row(temperature=0.0, output=[1], presence_penalty=0.5),  # 3 - 0.5 < 2.9: 2
        row(temperature=0.0, prompt=[1], repetition_penalty=1.1),  # 3 / 1.1 < 2.9: 2
    ]
    assert Sampler(4)(logits, rows).token_ids == [1, 2, 2]


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_narrowest_filters_equal_greedy(params):
    logits = random_logits(64, seed=1)
    out = Sampler(V, seed=0)(logits, [row(temperature=1.5, **params) for _ in range(64)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def draws(sampler: Sampler, logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    out = sampler(repeat(logits_row, n), [row(**params) for _ in range(n)])
    return torch.tensor(out.token_ids)


def test_top_k_top_p_min_p_stay_in_allowed_set():
    logits = random_logits(1, seed=2)[0]
    order = logits.argsort(descending=True)
    probs = logits.softmax(dim=-1)
    sampler = Sampler(V, seed=0)

    top5 = set(order[:5].tolist())
    got = set(draws(sampler, logits, 2000, top_k=5).tolist())
    assert got == top5  # all of them, nothing else

    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[mass_before < 0.6].tolist())
    assert 2 < len(nucleus) < 50
    got = set(draws(sampler, logits, 4000, top_p=0.6).tolist())
    assert got <= nucleus and len(got) > len(nucleus) // 2

    allowed = set(torch.nonzero(probs >= 0.05 * probs.max()).flatten().tolist())
    got = set(draws(sampler, logits, 4000, min_p=0.05).tolist())
    assert got <= allowed and len(got) > len(allowed) // 2

    # Combined: top-p over the renormalised top-10, then min-p.
    p10 = logits[order[:10]].softmax(dim=-1)
    kept = order[:10][(p10.cumsum(0) - p10) < 0.8]
    kept = kept[probs[kept] >= 0.2 * probs[kept].max()]
    got = set(draws(sampler, logits, 2000, top_k=10, top_p=0.8, min_p=0.2).tolist())
    assert got == set(kept.tolist())


def test_top_p_beyond_the_candidates_sorts_the_row():
    # One peaked token and a long tail just past the first cutoff: 0.95 of the mass needs tail
    # tokens that the first look (within CANDIDATE_CUTOFFS[0] of the best) does not see.
    tail = random_logits(1, seed=8, scale=0.1)[0] - (CANDIDATE_CUTOFFS[0] + 1.0)
    logits = tail.clone()
    logits[7] = 0.0
    probs = logits.softmax(dim=-1)
    order = logits.argsort(descending=True)
    nucleus = set(order[(probs[order].cumsum(0) - probs[order]) < 0.95].tolist())
    assert float(probs[7]) < 0.95 and 1 < len(nucleus) < V
    peaked = logits.clone()
    peaked[3] = 5.0  # a second row in the same call, whose nucleus ends among its first candidates
    out = Sampler(V, seed=0)(torch.stack([logits, peaked] * 1000), [row(top_p=0.95)] * 2000)
    got = set(out.token_ids[0::2])
    assert got <= nucleus and len(got) > 20  # the tail was reached
    assert set(out.token_ids[1::2]) <= {3, 7}


def test_temperature_sampling_matches_softmax():
    v, n, temperature = 16, 40_000, 0.7
    logits = random_logits(1, v=v, seed=3, scale=1.0)[0]
    expected = (logits / temperature).softmax(dim=-1) * n
    tokens = draws(Sampler(v, seed=0), logits, n, temperature=temperature)
    counts = torch.bincount(tokens, minlength=v)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50.0  # 15 degrees of freedom: p < 1e-4 that an exact sampler exceeds this
    # And the temperature matters: the untempered distribution does not fit.
    flat = logits.softmax(dim=-1) * n
    assert float(((counts - flat) ** 2 / flat).sum()) > 200.0


def test_filtered_sampling_matches_the_renormalised_softmax():
    # top-k keeps 12 tokens of a 1000-token row; they are drawn in proportion to their
    # tempered probabilities, renormalised over the 12 (the gathered-tokens path of the draw).
    n, temperature = 40_000, 0.8
    logits = random_logits(1, seed=11, scale=1.0)[0]
    top = logits.topk(12).indices
    expected = (logits[top] / temperature).softmax(dim=-1) * n
    tokens = draws(Sampler(V, seed=0), logits, n, temperature=temperature, top_k=12)
    counts = torch.bincount(tokens, minlength=V)
    assert int(counts.sum()) == int(counts[top].sum())  # nothing outside the 12
    chi2 = float(((counts[top] - expected) ** 2 / expected).sum())
    assert chi2 < 45.0  # 11 degrees of freedom: p < 1e-5 that an exact sampler exceeds this


def test_same_seed_same_tokens_in_any_batch():
    steps = 5
    alone, crowded = [], []
    lonely_gen, crowded_gen = Sampler.make_generator(1234), Sampler.make_generator(1234)
    lonely, busy = Sampler(V, seed=1), Sampler(V, seed=2)
    for step in range(steps):
        logits = random_logits(6, seed=10 + step)
        target = dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, frequency_penalty=0.3)
        out = lonely(logits[3:4], [row(lonely_gen, output=alone, **target)])
        alone.append(out.token_ids[0])
        # The same sequence at position 3 among greedy, unseeded and other seeded rows.
        rows = [
            row(temperature=0.0),
            row(temperature=1.0),
            row(Sampler.make_generator(99), temperature=1.2, top_p=0.5),
            row(crowded_gen, output=crowded, **target),
            row(temperature=1.0, logprobs=3, repetition_penalty=1.3, prompt=[1, 2]),
            row(Sampler.make_generator(1234 + step), temperature=0.5),
        ]
        crowded.append(busy(logits[[0, 1, 2, 3, 4, 5]], rows).token_ids[3])
    assert alone == crowded
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_rows_use_the_shared_generator():
    logits = random_logits(4, seed=4, scale=0.5)
    a = Sampler(V, seed=7)(logits, [row() for _ in range(4)]).token_ids
    b = Sampler(V, seed=7)(logits, [row() for _ in range(4)]).token_ids
    c = Sampler(V, seed=8)(logits, [row() for _ in range(4)]).token_ids
    assert a == b and a != c


def test_min_tokens_bans_eos_and_stop_ids():
    eos, stop = 2, 5
    logits = torch.zeros(1, 8)
    logits[0, eos], logits[0, stop], logits[0, 6] = 10.0, 9.0, 1.0
    sampler = Sampler(8, seed=0)

    def pick(output: list[int], **params) -> int:
        r = row(output=output, eos={eos}, min_tokens=3, stop_token_ids=[stop], temperature=0.0,
                **params)
        return sampler(logits, [r]).token_ids[0]

    assert pick([0]) == 6 and pick([0, 0]) == 6
    assert pick([0, 0], ignore_eos=True) == 6  # min_tokens is a floor whatever ignore_eos says
    assert pick([0, 0, 0]) == eos  # the floor is reached
    # Sampling never reaches a banned id either.
    rows = [row(output=[0], eos={eos}, min_tokens=3, stop_token_ids=[stop], temperature=2.0)] * 500
    assert not {eos, stop} & set(sampler(repeat(logits[0], 500), rows).token_ids)


def test_all_tokens_banned_falls_back_to_raw_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    ban = dict(output=[], eos={0, 1, 2}, min_tokens=1, logprobs=1)
    rows = [row(temperature=0.0, **ban), row(temperature=1.0, **ban),
            row(temperature=1.0, top_k=2, top_p=0.5, min_p=0.5, presence_penalty=1.0, **ban)]
    assert Sampler(3)(logits, rows).token_ids == [1, 0, 2]


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(3, seed=5)
    rows = [
        row(temperature=0.8, top_k=20, repetition_penalty=1.5, prompt=[1, 2, 3], logprobs=5),
        row(temperature=0.0, logprobs=0),
        row(temperature=1.0),
    ]
    out = Sampler(V, seed=0)(logits.to(torch.bfloat16), rows)
    expected = logits.to(torch.bfloat16).float().log_softmax(dim=-1)
    for i, k in ((0, 5), (1, 0)):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(expected[i, lp.token_id]), abs=1e-6)
        assert len(lp.top) == k
        best = expected[i].topk(k) if k else None
        assert [t for t, _ in lp.top] == (best.indices.tolist() if k else [])
        assert [p for _, p in lp.top] == pytest.approx(best.values.tolist() if k else [], abs=1e-6)
        assert [p for _, p in lp.top] == sorted((p for _, p in lp.top), reverse=True)
    assert out.logprobs[2] is None


def test_padded_vocab_columns_are_never_chosen():
    logits = torch.cat([random_logits(2, v=10), torch.full((2, 6), 100.0)], dim=1)  # [2, 16]
    out = Sampler(10, seed=0)(logits, [row(temperature=0.0), row(temperature=1.0, logprobs=2)])
    assert all(t < 10 for t in out.token_ids)
    assert out.token_ids[0] == logits[0, :10].argmax().item()


def test_tiny_temperature_is_greedy_not_nan():
    logits = random_logits(8, seed=6)
    out = Sampler(V, seed=0)(logits, [row(temperature=1e-30) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_bad_logits_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="one row per SamplingRow"):
        Sampler(V)(random_logits(2), [row()])


def test_caller_logits_are_not_modified():
    logits = random_logits(3, seed=7)
    before = logits.clone()
    rows = [
        row(temperature=0.0, output=[1], eos={4}, min_tokens=5, presence_penalty=1.0),
        row(temperature=0.5, top_p=0.9, min_p=0.1, prompt=[3], repetition_penalty=2.0),
        row(Sampler.make_generator(-5), temperature=1.0, top_k=3, logprobs=2),
    ]
    Sampler(V, seed=0)(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [1e-46, 1e-30, 9e-6])
def test_temperature_below_the_greedy_threshold_is_greedy(temperature):
    # 1e-46 is 0 in float32: dividing by it turned the best logit into NaN and sampled garbage.
    logits = random_logits(8, seed=11)
    rows = [row(temperature=temperature), row(temperature=temperature, logprobs=1)] * 4
    out = Sampler(V, seed=0)(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_seeds_differing_above_bit_32_draw_differently():
    logits = torch.zeros(1, V)  # uniform: every draw is the generator's
    draws = []
    for seed in (5, 5 + 2**32, 5 + 7 * 2**40, 5 + 2**63):
        gen = Sampler.make_generator(seed)
        draws.append(tuple(Sampler(V)(logits, [row(gen, temperature=1.0)]).token_ids[0] for _ in range(8)))
    assert len(set(draws)) == len(draws)
    again = Sampler.make_generator(5 + 7 * 2**40)
    assert tuple(Sampler(V)(logits, [row(again, temperature=1.0)]).token_ids[0] for _ in range(8)) == draws[2]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seeds_outside_64_bits_are_refused_by_name(seed):
    with pytest.raises(InvalidParam, match=r"seed must be null or an integer in \[-2\*\*63, 2\*\*64 - 1\]") as e:
        SamplingParams(seed=seed)
    assert e.value.param == "seed" and isinstance(e.value, ValueError)
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-(2**63))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.0, logprobs=2),
                                    dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, presence_penalty=0.5)])
def test_non_finite_logits_never_give_a_token(poison, params):
    logits = random_logits(3, seed=12)
    logits[1, 7] = poison
    all_neg_inf = torch.full((1, V), float("-inf"))
    logits = torch.cat([logits, all_neg_inf])
    out = Sampler(V, seed=0)(logits, [row(**params) for _ in range(4)])
    assert out.token_ids[1] == NO_TOKEN and out.token_ids[3] == NO_TOKEN
    assert 0 <= out.token_ids[0] < V and 0 <= out.token_ids[2] < V
    assert out.logprobs[1] is None and out.logprobs[3] is None
    if "logprobs" in params:
        assert out.logprobs[0].token_id == out.token_ids[0]


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.0, logprobs=2),
                                    dict(temperature=0.0, presence_penalty=0.5), dict(temperature=0.8, seed=3)])
def test_a_precomputed_argmax_serves_the_greedy_hot_path_alone(params):
    """best (each row's argmax and its logit, as the native decode step hands them over) is the greedy hot
    path's answer, a non-finite logit there no token; rows the hot path does not take sample the logits."""
    logits = random_logits(4, seed=5)
    logits[1, 9] = float("nan")
    logits[3, :] = float("-inf")
    best = ([7, 9, 11, 0], [1.0, float("nan"), float("inf"), float("-inf")])  # not the logits' argmax: told apart
    rows = [row(**params) for _ in range(4)]
    got = Sampler(V, seed=0)(logits, rows, best)
    if params == dict(temperature=0.0):
        assert got.token_ids == [7, NO_TOKEN, NO_TOKEN, NO_TOKEN]
    else:
        assert got.token_ids == Sampler(V, seed=0)(logits, rows).token_ids
        assert got.token_ids[1] == got.token_ids[3] == NO_TOKEN


def test_fast_argmax_equals_torch_with_ties():
    x = torch.randn(5, 4000, generator=torch.Generator().manual_seed(3))
    x[2, [10, 20, 30]] = 100.0  # a tie: the lowest id wins, as in torch
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist() and argmax(x)[2] == 10


def test_logit_bias_plus_100_is_picked_and_minus_100_is_banned():
    logits = random_logits(3)
    best = logits.argmax(dim=-1).tolist()
    worst = logits.argmin(dim=-1).tolist()
    rows = [row(temperature=0.0, logit_bias={worst[0]: 100.0}),  # the least likely token wins
            row(temperature=0.0, logit_bias={best[1]: -100.0}),  # the best is out of reach
            row(temperature=0.0)]  # a row without a bias in the same batch is untouched
    out = Sampler(V)(logits, rows)
    second = logits[1].clone()
    second[best[1]] = float("-inf")
    assert out.token_ids == [worst[0], int(second.argmax()), best[2]]
    # Sampled rows too: at temperature 1, a -100 bias keeps a token out of 200 draws, +100 makes it every draw.
    gen = Sampler.make_generator(7)
    flat = torch.zeros(1, 8)  # eight equally likely tokens
    banned = [Sampler(8)(flat, [row(generator=gen, temperature=1.0, logit_bias={t: -100.0 for t in range(7)})])
              for _ in range(200)]
    assert {o.token_ids[0] for o in banned} == {7}
    forced = [Sampler(8)(flat, [row(generator=gen, temperature=1.0, logit_bias={5: 100.0})]) for _ in range(200)]
    assert {o.token_ids[0] for o in forced} == {5}


def test_logit_bias_leaves_logprobs_raw():
    logits = random_logits(1)
    worst = int(logits.argmin())
    out = Sampler(V)(logits, [row(temperature=0.0, logprobs=0, logit_bias={worst: 100.0})])
    assert out.token_ids == [worst]
    assert out.logprobs[0].logprob == pytest.approx(float(logits.log_softmax(-1)[0, worst]), abs=1e-5)


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: float("nan")}, {-1: 1.0}, {i: 1.0 for i in range(301)}, {1: True}])
def test_logit_bias_out_of_range_names_the_field(bias):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias" and "at most 300 token ids" in str(e.value)
