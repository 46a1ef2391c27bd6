"""The batched sampler: one engine step's logits [B, V] → one token (and logprobs) per row.

Rows belong to different requests, so every parameter is per row: bans, biases, penalties and greedy
rows run as torch ops over the rows that need them, sampled rows one by one in numpy (below).
Order of the stages:
  float32 → min_tokens ban → logit bias → repetition penalty → frequency/presence penalties
  → greedy argmax (temperature 0) | temperature → top-k → top-p → min-p → sample.
Filters are thresholds on the temperature-scaled logit (the best token is 0): min-p is one
directly (p >= min_p * p_best  <=>  s >= ln(min_p)); top-k and top-p sort only the tokens near the
best (within CANDIDATE_CUTOFFS, a prefix of the sorted row found in one pass), widening only when
the kept set does not end among them. The draw is by inverse CDF over the kept tokens with one
Uniform[0, 1) per row from the row's own generator, so a seeded row's tokens never depend on the
rest of the batch. Per row that is a handful of passes over V in numpy, not a sort or V random
draws (≈ 0.2–0.25 ms a row instead of ≈ 1 ms for 49152 tokens, on the Zen 3 and the Zen 4).
Logprobs describe the raw model distribution (log_softmax of the float32 logits before any
penalty, ban or temperature), which is what OpenAI-compatible servers report by default.

Greedy rows (temperature below GREEDY_TEMPERATURE) take the argmax: when a whole batch is greedy
with no logprobs, penalties or bans, one max over [B, V] is all the sampler does, no sort.
A row whose logits hold NaN or +inf, or are all -inf, gets no token: its id is NO_TOKEN (-1) and
the engine finishes that sequence with finish_reason "error" (LLM.prefill/decode raise
NonFiniteLogitsError), so a broken forward never turns silently into text.
Seeded rows draw from a numpy PCG64 generator seeded with all 64 bits of the seed (torch's CPU
generator keeps only 32). Rows that sample are computed on the CPU whatever the logits' device.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.outputs import TokenLogprob
from kvserve.sampling_params import SamplingParams

NEG_INF = float("-inf")
NO_TOKEN = -1  # the token id of a row whose logits were not finite
Generator = np.random.Generator
# Top-k and top-p look first among the tokens whose scaled logit is within this much of the best
# (e^-8 ≈ 3e-4 of its probability), then within the next cutoff, then at the whole row.
CANDIDATE_CUTOFFS = (8.0, 24.0)
# exp of a float32 below this is subnormal or 0 (under 1.2e-38 of the best token's weight), and a
# subnormal result costs ~100x a normal one on x86: at temperature 0.2 much of a real row lies
# there. Sums clamp to it; draws leave such tokens out.
EXP_FLOOR = -87.0


@dataclass
class SamplingRow:
    """One sequence to sample this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far by this sequence
    generator: Generator | None  # from params.seed; None: the sampler's shared generator
    # Banned, with params.stop_token_ids, while len(output_token_ids) < params.min_tokens
    # (whatever ignore_eos says: min_tokens is a floor on the output length).
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0)

    @property
    def banned_token_ids(self) -> set[int]:
        if len(self.output_token_ids) >= self.params.min_tokens:
            return set()
        return set(self.eos_token_ids) | set(self.params.stop_token_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row; NO_TOKEN where the row's logits were not finite
    logprobs: list[TokenLogprob | None]  # per row; None when params.logprobs is None


def _column(rows: list[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    """One SamplingParams field of every row as a [b, 1] float32 column."""
    return torch.tensor([float(getattr(r.params, name)) for r in rows], device=device)[:, None]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax [b, V] -> [b] long; the lowest index wins a tie, a NaN wins over numbers.
    On the CPU numpy's vectorised argmax is ~10x faster than torch's for one vocabulary row
    (≈ 10 µs against ≈ 100 µs for 49152 float32 values), so float32 goes through it."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _take(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """x[idx], without the copy when idx is every row."""
    return x if len(idx) == x.shape[0] else x[idx]


def _on_rows(
    x: torch.Tensor,
    rows: list[SamplingRow],
    idx: list[int],
    fn: Callable[[torch.Tensor, list[SamplingRow]], torch.Tensor],
) -> torch.Tensor:
    """x with the rows idx replaced by fn(those rows, their SamplingRows), in place unless idx is
    every row (then no gather/scatter copy at all). fn must not modify its input."""
    if len(idx) == x.shape[0]:
        return fn(x, rows)
    x[idx] = fn(x[idx], [rows[i] for i in idx])
    return x


def _token_counts(seqs: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each sequence: [b, V] float32 (ids outside [0, V) ignored)."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.tensor([s + [vocab_size] * (width - len(s)) for s in seqs], dtype=torch.long)
    ids = ids.reshape(len(seqs), width).to(device)  # [b, L]; reshape keeps width 0 2-D
    ids = ids.masked_fill((ids < 0) | (ids >= vocab_size), vocab_size)  # column V is the bin
    counts = torch.zeros(len(seqs), vocab_size + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab_size]


def ban_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """min_tokens: set each row's banned ids (eos ∪ stop_token_ids) to -inf, in place."""
    vocab_size = logits.shape[1]
    pairs = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids if 0 <= t < vocab_size]
    if pairs:
        row_idx, tok_idx = zip(*pairs)
        logits[list(row_idx), list(tok_idx)] = NEG_INF


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """logit_bias: add each row's bias to its tokens' logits, in place (ids are unique per row)."""
    vocab_size = logits.shape[1]
    triples = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()
               if 0 <= t < vocab_size]
    if triples:
        row_idx, tok_idx, bias = zip(*triples)
        rows_t = torch.tensor(row_idx, device=logits.device)
        toks_t = torch.tensor(tok_idx, device=logits.device)
        logits.index_put_((rows_t, toks_t), torch.tensor(bias, dtype=logits.dtype, device=logits.device),
                          accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt+output (positive logits divided, negative multiplied),
    then logit -= frequency * count + presence * (count > 0) over the output only."""
    device, vocab_size = logits.device, logits.shape[1]
    out_counts = _token_counts([r.output_token_ids for r in rows], vocab_size, device)  # [b, V]
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        prompt_counts = _token_counts([r.prompt_token_ids for r in rows], vocab_size, device)
        seen = (out_counts + prompt_counts) > 0
        penalty = _column(rows, "repetition_penalty", device)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if any(r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in rows):
        frequency = _column(rows, "frequency_penalty", device)
        presence = _column(rows, "presence_penalty", device)
        logits = logits - frequency * out_counts - presence * (out_counts > 0).float()
    return logits


def adjust(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits every row is chosen from: min_tokens bans, logit bias, then penalties. raw itself
    when no row asks for any (raw is never modified)."""
    x = raw
    if any(r.banned_token_ids for r in rows):
        x = raw.clone()
        ban_tokens(x, rows)
    if any(r.params.logit_bias for r in rows):
        if x is raw:
            x = raw.clone()
        apply_logit_bias(x, rows)
    penalised = [i for i, r in enumerate(rows) if r.has_penalties]
    if penalised:
        if x is raw and len(penalised) < len(rows):
            x = raw.clone()  # its rows are written in place
        x = _on_rows(x, rows, penalised, apply_penalties)
    return x


def filter_threshold(s: np.ndarray, params: SamplingParams) -> float:
    """The lowest scaled logit one row keeps after top-k, then top-p (over the top-k
    distribution), then min-p; ties with it stay. s: the row's logits minus its best, over the
    temperature (the best token is 0, and always stays)."""
    vocab = s.shape[0]
    k = params.top_k if 0 < params.top_k < vocab else 0
    top_p = params.top_p
    floor = math.log(params.min_p) if params.min_p > 0.0 else -math.inf
    if not k and top_p >= 1.0:
        return floor
    total = None  # the row's probability mass (unnormalised), for top-p without top-k
    for cutoff in (*CANDIDATE_CUTOFFS, math.inf):
        near = s[s >= -cutoff] if cutoff < math.inf else s  # the best tokens, unsorted
        if k and near.size < k and cutoff < math.inf:
            continue  # fewer than top-k keeps
        best = -np.sort(-near)  # descending
        threshold = float(best[k - 1]) if k else -math.inf
        if top_p < 1.0:
            kept = best[best >= threshold] if k else best
            w = np.exp(kept.astype(np.float64))
            if k:
                mass = float(w.sum())
            else:
                if total is None:  # clamped: a far token adds at most 1.2e-38 to the best's 1
                    total = float(torch.from_numpy(s).clamp(min=EXP_FLOOR).exp().sum(dtype=torch.float64))
                mass = total
            cum = np.cumsum(w)
            if cum[-1] < top_p * mass and cutoff < math.inf:
                continue  # the nucleus reaches past these candidates (a flat distribution)
            # A token stays while the tokens ranked above it hold less than top_p of the mass.
            n = max(1, int(np.count_nonzero(cum - w < top_p * mass)))
            threshold = max(threshold, float(kept[n - 1]))
        return max(threshold, floor)
    raise AssertionError("unreachable: the last cutoff takes the whole row")


def draw(s: np.ndarray, threshold: float, u: float) -> int:
    """The token whose interval holds u in the cumulative distribution of exp(s) over the tokens
    at or above threshold (inverse CDF: one uniform draw samples the row)."""
    threshold = max(threshold, EXP_FLOOR)
    if threshold >= -CANDIDATE_CUTOFFS[-1]:  # a few tokens near the best: gather them
        ids = np.flatnonzero(s >= threshold)
        cum = np.cumsum(np.exp(s[ids]), dtype=np.float64)
    else:  # much of the row: weigh all of it, 0 below the threshold (no gather, no subnormals)
        ids, row = None, torch.from_numpy(s)
        weights = row.clamp(min=EXP_FLOOR).exp_().masked_fill_(row < threshold, 0.0)
        # float64: float32 partial sums over a whole vocabulary drift by ~1e-5 of the mass, more
        # than a rare token's whole interval.
        cum = weights.cumsum(0, dtype=torch.float64).numpy()
    j = min(int(np.searchsorted(cum, u * cum[-1], side="right")), cum.size - 1)
    return j if ids is None else int(ids[j])


class Sampler:
    def __init__(self, vocab_size: int, seed: int | None = None):
        # Columns past vocab_size (a padded LM head) are dropped before sampling.
        self.vocab_size = vocab_size
        self.seed = seed
        self._shared: Generator | None = None  # made on first use

    @staticmethod
    def make_generator(seed: int) -> np.random.Generator:
        """A generator for a request seed: every one of its 64 bits counts (negative seeds are
        taken as two's complement)."""
        return np.random.Generator(np.random.PCG64(seed % 2**64))

    def shared_generator(self) -> Generator:
        """The unseeded rows' generator: from the sampler's seed, else from fresh OS entropy."""
        if self._shared is None:
            self._shared = (self.make_generator(self.seed) if self.seed is not None
                            else np.random.Generator(np.random.PCG64()))
        return self._shared

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 best: tuple[list[int], list[float]] | None = None) -> SamplerOutput:
        """One token per row. best: each row's argmax over logits[:, :vocab_size] and the logit there,
        where the caller made them with the logits (the native decode step does); a greedy batch then
        takes them as they are, without reading the logits again."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be [{len(rows)}, >= {self.vocab_size}] (one row per SamplingRow), "
                f"got {list(logits.shape)}"
            )
        # Hot path: argmax (exact in any float dtype, no float32 copy); a row was finite iff the
        # value it picked is (argmax picks a NaN or +inf where there is one; an all -inf row picks -inf).
        hot = all(r.params.greedy and r.params.logprobs is None and not r.has_penalties
                  and not r.banned_token_ids and not r.params.logit_bias for r in rows)
        if hot and best is not None:
            best_ids, best_values = best
            if not all(map(math.isfinite, best_values)):
                best_ids = [t if math.isfinite(v) else NO_TOKEN for t, v in zip(best_ids, best_values)]
            return SamplerOutput(best_ids, [None] * len(rows))
        logits = logits[:, : self.vocab_size]
        if hot:
            # On the CPU in numpy: a torch reduction over the row would start the OpenMP threads,
            # which costs more than the work while the cores serve other threads.
            picked = argmax(logits)
            ids = picked.tolist()
            rows_idx = torch.arange(len(ids))
            at = logits[rows_idx, picked]
            picked_values = at.numpy() if at.device.type == "cpu" and at.dtype == torch.float32 else at.float().cpu().numpy()
            if not np.isfinite(picked_values).all():
                ids = [t if np.isfinite(v) else NO_TOKEN for t, v in zip(ids, picked_values.tolist())]
            return SamplerOutput(ids, [None] * len(rows))

        raw = logits.float()  # [B, V]; the caller's tensor when it is already float32
        finite = raw.amax(dim=-1).isfinite()  # [B]; NaN, +inf or all -inf: no token
        x = adjust(raw, rows)

        tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            tokens[greedy] = argmax(_take(x, greedy))
        if sampled:
            tokens[sampled] = self._sample(_take(x, sampled), [rows[i] for i in sampled])
        if x is not raw:
            # Only possible misuse: every token banned. Fall back to the raw model's choice.
            dead = x.amax(dim=-1) == NEG_INF
            if dead.any():
                tokens[dead] = argmax(raw[dead])

        broken = not bool(finite.all())
        if broken:
            tokens[~finite] = 0  # a valid index for the logprob gather; replaced below
        token_ids = tokens.tolist()
        logprobs = self._logprobs(raw, token_ids, rows)
        if broken:
            for i in (~finite).nonzero().flatten().tolist():
                token_ids[i], logprobs[i] = NO_TOKEN, None
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row. x: [b, V] → [b] token ids."""
        a = x.detach().to("cpu", torch.float32).numpy()
        temperature = np.array([[r.params.temperature] for r in rows], dtype=np.float32)
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite rows are skipped below
            best = a.max(axis=1, keepdims=True)
            # Shifting by the row's best first keeps a tiny temperature from making inf - inf.
            scaled = (a - best) / temperature
        u = self._uniforms(rows)
        tokens = [draw(scaled[i], filter_threshold(scaled[i], r.params), u[i]) if math.isfinite(best[i, 0]) else 0
                  for i, r in enumerate(rows)]  # a non-finite row's 0 is replaced by the caller
        return torch.tensor(tokens, dtype=torch.long, device=x.device)

    def _uniforms(self, rows: list[SamplingRow]) -> list[float]:
        """One Uniform[0, 1) per row: from the row's own generator, or the shared one in row order."""
        unseeded = sum(r.generator is None for r in rows)
        shared = iter(self.shared_generator().random(unseeded).tolist() if unseeded else ())
        return [float(r.generator.random()) if r.generator is not None else next(shared) for r in rows]

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]
    ) -> list[TokenLogprob | None]:
        """The sampled token's and the k best tokens' log-probabilities under the raw logits."""
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(rows)
        if not wanted:
            return result
        logprobs = _take(raw, wanted).log_softmax(dim=-1)  # [w, V]
        chosen = torch.tensor([token_ids[i] for i in wanted], device=raw.device)
        chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
        k_max = min(max(rows[i].params.logprobs or 0 for i in wanted), raw.shape[1])
        best_vals, best_ids = logprobs.topk(k_max, dim=-1)  # [w, k_max], best first
        top_vals, top_ids = best_vals.tolist(), best_ids.tolist()
        for j, i in enumerate(wanted):
            k = rows[i].params.logprobs
            top = list(zip(top_ids[j][:k], top_vals[j][:k]))
            result[i] = TokenLogprob(token_id=token_ids[i], logprob=chosen_lp[j], top=top)
        return result
