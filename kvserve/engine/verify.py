"""Verification of drafted tokens: the target's logits at 1 + k positions → the tokens emitted.

A sequence that drafted d_1..d_k computed its last token and the draft in one step, so row j of
its logits (j = 0..k) is the target's distribution for the token after d_j (d_0: its last
token). Each row is processed exactly as the sampler processes a row — min_tokens bans, logit
bias, penalties over the output as it would be with d_1..d_j accepted, temperature, top-k/p,
min-p — so the tokens emitted are distributed exactly as without speculation:

- greedy: d_{j+1} is accepted while it is row j's argmax; then row j's argmax is emitted too
  (the model's own token), so a step emits 1..k+1 tokens.
- sampled (speculative rejection sampling for a deterministic draft, q = a point mass on d):
  d is accepted with probability p(d) under row j's processed distribution; on rejection the
  token is drawn from p with d removed and renormalised (max(0, p - q), normalised). Accepted or
  replaced, each token has probability p(t): P(t = d) = p(d), P(t = x != d) = (1 - p(d)) * p(x) /
  (1 - p(d)). When all k are accepted, row k is sampled as the sampler would.
Uniforms come from the sequence's own generator (seeded requests) or the sampler's shared one.
Logprobs, when asked, are the raw distribution's at each emitted token's row, as the sampler
reports them. A row whose logits are not finite ends the run with NO_TOKEN.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.sampler import EXP_FLOOR, NO_TOKEN, Sampler, SamplingRow, adjust, argmax, filter_threshold
from kvserve.outputs import TokenLogprob


@dataclass
class Verified:
    token_ids: list[int]  # the accepted draft tokens, then the model's own (NO_TOKEN: not finite)
    logprobs: list[TokenLogprob | None]  # per emitted token
    num_accepted: int


def rows_for(row: SamplingRow, draft: list[int]) -> list[SamplingRow]:
    """The sampling rows of a draft's 1 + k positions: row j sees the output with d_1..d_j in it."""
    out = row.output_token_ids
    return [row if j == 0 else SamplingRow(row.params, row.prompt_token_ids, out + draft[:j], row.generator,
                                          row.eos_token_ids) for j in range(len(draft) + 1)]


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]]) -> list[Verified]:
    """logits [sum(1 + k_i), >= V]: each sequence's 1 + k_i rows in turn; rows: the matching
    SamplingRows (rows_for); drafts: each sequence's d_1..d_k. One Verified per sequence."""
    logits = logits[:, : sampler.vocab_size]
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    greedy = [i for i, d in enumerate(drafts) if rows[starts[i]].params.greedy]
    sampled = [i for i, d in enumerate(drafts) if not rows[starts[i]].params.greedy]
    result: list[Verified | None] = [None] * len(drafts)
    if greedy:
        idx = [r for i in greedy for r in range(starts[i], starts[i + 1])]
        out = sampler(logits[idx], [rows[r] for r in idx])  # each row's own token: argmax after processing
        at = 0
        for i in greedy:
            d, n = drafts[i], len(drafts[i]) + 1
            target = out.token_ids[at : at + n]
            a = 0
            while a < len(d) and target[a] == d[a]:
                a += 1
            result[i] = Verified(d[:a] + [target[a]], out.logprobs[at : at + a + 1], a)
            at += n
    if sampled:  # bans, bias and penalties over all their rows at once
        idx = [r for i in sampled for r in range(starts[i], starts[i + 1])]
        raw = logits[idx].float()
        sub = [rows[r] for r in idx]
        x = adjust(raw, sub).detach().to("cpu", torch.float32).numpy()
        finite = raw.amax(dim=-1).isfinite().tolist()
        at = 0
        for i in sampled:
            n = len(drafts[i]) + 1
            result[i] = _verify_sampled(sampler, raw[at : at + n], x[at : at + n], finite[at : at + n],
                                        sub[at : at + n], drafts[i])
            at += n
    return result  # type: ignore[return-value]


def _verify_sampled(sampler: Sampler, raw: torch.Tensor, x: np.ndarray, finite: list[bool], rows: list[SamplingRow],
                    draft: list[int]) -> Verified:
    """One sequence's draft against its rows: raw logits [1 + k, V] float32, x the same processed."""
    gen = rows[0].generator or sampler.shared_generator()
    tokens: list[int] = []
    for j, row in enumerate(rows):
        if not finite[j]:
            tokens.append(NO_TOKEN)
            break
        w = _weights(x[j], row, raw[j])
        d = draft[j] if j < len(draft) else None
        if d is not None:
            u = float(gen.random())
            if u * w.sum() < w[d]:  # accepted with probability p(d)
                tokens.append(d)
                continue
            w[d] = 0.0  # rejected: the rest of p, renormalised
        cum = np.cumsum(w)
        u = float(gen.random())
        tokens.append(min(int(np.searchsorted(cum, u * cum[-1], side="right")), cum.size - 1))
        break
    a = len(tokens) - 1
    emitted = [t for t in tokens if t != NO_TOKEN]
    lps: list[TokenLogprob | None] = [None] * len(tokens)
    if rows[0].params.logprobs is not None and emitted:
        lps[: len(emitted)] = Sampler._logprobs(raw[: len(emitted)], emitted, rows[: len(emitted)])
    return Verified(tokens, lps, a)


def _weights(x: np.ndarray, row: SamplingRow, raw: torch.Tensor) -> np.ndarray:
    """Row's processed distribution, unnormalised, float64 [V]: what Sampler._sample draws from (the
    same temperature, threshold and floor); a point mass on the raw argmax when everything is banned."""
    best = x.max()
    if not np.isfinite(best):
        w = np.zeros(x.size)
        w[int(argmax(raw[None])[0])] = 1.0
        return w
    s = (x - best) / np.float32(row.params.temperature)
    threshold = max(filter_threshold(s, row.params), EXP_FLOOR)
    w = np.exp(np.maximum(s, EXP_FLOOR).astype(np.float64))
    w[s < threshold] = 0.0
    return w
