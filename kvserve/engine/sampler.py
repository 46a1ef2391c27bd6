"""The batched sampler: one engine step's logits [B, V] → one token (and logprobs) per row.

Rows belong to different requests, so every parameter is a per-row tensor and every stage runs
as torch ops over the rows that need it. Order of the stages:
  float32 → min_tokens ban → repetition penalty → frequency/presence penalties
  → greedy argmax (temperature 0) | temperature → top-k → top-p → min-p → sample.
Sampling is argmax(probs / E) with E ~ Exponential(1) — the exponential form of the Gumbel-max
trick, which draws from `probs` exactly. Each row draws a fixed V noise values from its own
generator, so a seeded row's tokens never depend on the rest of the batch.
Logprobs describe the raw model distribution (log_softmax of the float32 logits before any
penalty, ban or temperature), which is what OpenAI-compatible servers report by default.

Greedy rows (temperature below GREEDY_TEMPERATURE) take the argmax: when a whole batch is greedy
with no logprobs, penalties or bans, one max over [B, V] is all the sampler does, no sort.
A row whose logits hold NaN or +inf, or are all -inf, gets no token: its id is NO_TOKEN (-1) and
the engine finishes that sequence with finish_reason "error" (LLM.prefill/decode raise
NonFiniteLogitsError), so a broken forward never turns silently into text.
Seeded rows draw from a numpy PCG64 generator seeded with all 64 bits of the seed (torch's CPU
generator keeps only 32).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.outputs import TokenLogprob
from kvserve.sampling_params import SamplingParams

NEG_INF = float("-inf")
NO_TOKEN = -1  # the token id of a row whose logits were not finite
Generator = torch.Generator | np.random.Generator
TOP_P_CANDIDATES = (256, 4096)  # top-p looks among this many best tokens before it sorts all V


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


def _keep_at_least(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Drop (-inf) every logit below its row's threshold [b, 1]; ties at the threshold stay."""
    return x.masked_fill(x < threshold, NEG_INF)


def apply_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep every token whose logit is at least the row's top_k-th largest ([b] long, 1..V)."""
    top_vals = x.topk(int(top_k.max()), dim=-1).values  # [b, max_k], descending
    return _keep_at_least(x, top_vals.gather(1, top_k[:, None] - 1))


def _top_p_threshold(
    best: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's best logits (descending [b, K]) and logsumexp [b, 1]: the logit of the last
    token top-p keeps [b, 1], and whether the kept prefix ends inside these K [b]."""
    probs = (best - lse).exp()
    mass = probs.cumsum(dim=-1)
    kept = (mass - probs) < top_p  # the mass of better tokens is still short of top_p: a prefix
    last = (kept.sum(dim=-1, keepdim=True) - 1).clamp_min(0)  # rank 0 always stays
    return best.gather(1, last), mass[:, -1] >= top_p[:, 0]


def apply_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of best tokens whose probability reaches top_p [b, 1]; the top token
    always stays. Sorting all V is slow on CPU, so look among the best few first and widen only
    for the rows whose kept set does not end there (flat distributions)."""
    vocab_size = x.shape[1]
    lse = x.logsumexp(dim=-1, keepdim=True)  # [b, 1]
    threshold = torch.empty_like(lse)
    rest = torch.arange(x.shape[0], device=x.device)  # rows still without a threshold
    for k in (*TOP_P_CANDIDATES, vocab_size):
        k = min(k, vocab_size)
        best = x[rest].topk(k, dim=-1).values  # [r, k], descending
        found, covered = _top_p_threshold(best, lse[rest], top_p[rest])
        if k == vocab_size:
            covered[:] = True
        threshold[rest[covered]] = found[covered]
        rest = rest[~covered]
        if rest.numel() == 0:
            break
    return _keep_at_least(x, threshold)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [b, 1] times the row's largest."""
    probs = x.softmax(dim=-1)
    return x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), NEG_INF)


class Sampler:
    def __init__(self, vocab_size: int, seed: int | None = None):
        # Columns past vocab_size (a padded LM head) are dropped before sampling.
        self.vocab_size = vocab_size
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}  # one per device, made lazily

    @staticmethod
    def make_generator(seed: int) -> np.random.Generator:
        """A generator for a request seed: every one of its 64 bits counts (negative seeds are
        taken as two's complement)."""
        return np.random.Generator(np.random.PCG64(seed % 2**64))

    def shared_generator(self, device: torch.device) -> Generator:
        if device not in self._shared:
            if self.seed is None:
                self._shared[device] = torch.Generator(device)
                self._shared[device].seed()  # nondeterministic
            else:
                self._shared[device] = self.make_generator(self.seed)
        return self._shared[device]

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be [{len(rows)}, >= {self.vocab_size}] (one row per SamplingRow), "
                f"got {list(logits.shape)}"
            )
        logits = logits[:, : self.vocab_size]
        if all(r.params.greedy and r.params.logprobs is None and not r.has_penalties
               and not r.banned_token_ids for r in rows):
            # Hot path: argmax (exact in any float dtype, no float32 copy), and one amax that says
            # whether each row was finite (it propagates NaN).
            tokens = argmax(logits).tolist()
            finite = logits.amax(dim=-1).isfinite()
            if not bool(finite.all()):
                tokens = [t if ok else NO_TOKEN for t, ok in zip(tokens, finite.tolist())]
            return SamplerOutput(tokens, [None] * len(rows))

        raw = logits.float()  # [B, V]; the caller's tensor when it is already float32
        finite = raw.amax(dim=-1).isfinite()  # [B]; NaN, +inf or all -inf: no token
        x = raw
        if any(r.banned_token_ids for r in rows):
            x = raw.clone()
            ban_tokens(x, rows)
        penalised = [i for i, r in enumerate(rows) if r.has_penalties]
        if penalised:
            if x is raw and len(penalised) < len(rows):
                x = raw.clone()  # its rows are written in place
            x = _on_rows(x, rows, penalised, apply_penalties)

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
        device = x.device
        # Shifting by the row max first keeps a tiny temperature from turning logits into inf-inf.
        x = (x - x.amax(dim=-1, keepdim=True)) / _column(rows, "temperature", device)
        vocab_size = x.shape[1]
        k_rows = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab_size]
        if k_rows:
            x = _on_rows(x, rows, k_rows, lambda sub, rs: apply_top_k(
                sub, torch.tensor([r.params.top_k for r in rs], device=device)))
        p_rows = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
        if p_rows:  # on the renormalised top-k distribution
            x = _on_rows(x, rows, p_rows, lambda sub, rs: apply_top_p(
                sub, _column(rs, "top_p", device)))
        min_p_rows = [i for i, r in enumerate(rows) if r.params.min_p > 0.0]
        if min_p_rows:
            x = _on_rows(x, rows, min_p_rows, lambda sub, rs: apply_min_p(
                sub, _column(rs, "min_p", device)))
        probs = x.softmax(dim=-1)  # [b, V]
        return argmax(probs / self._noise(rows, vocab_size, device))

    def _noise(
        self, rows: list[SamplingRow], vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        """Exponential(1) noise [b, V]: V draws per row from that row's own generator (seeded rows)
        or from the shared one, so a seeded row's draws never depend on the batch around it."""
        noise = torch.empty(len(rows), vocab_size, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            shared = self.shared_generator(device)
            noise[unseeded] = self._draw((len(unseeded), vocab_size), shared).to(device)
        for i, r in enumerate(rows):  # per-row generators: the one loop over B that must stay
            if r.generator is not None:
                noise[i] = self._draw((vocab_size,), r.generator).to(device)
        return noise

    @staticmethod
    def _draw(shape: tuple[int, ...], generator: Generator) -> torch.Tensor:
        # -log(U), U ~ Uniform[0, 1): Exponential(1) in (0, inf], never 0, so a zero-probability
        # token can never win. Four times faster than exponential_() on CPU.
        if isinstance(generator, np.random.Generator):
            uniform = torch.from_numpy(generator.random(shape, dtype=np.float32))
        else:
            uniform = torch.rand(shape, generator=generator, device=generator.device)
        return uniform.log_().neg_()

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
        k_max = min(max(rows[i].params.logprobs for i in wanted), raw.shape[1])
        top_vals, top_ids = logprobs.topk(k_max, dim=-1)  # [w, k_max], best first
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(wanted):
            k = rows[i].params.logprobs
            top = list(zip(top_ids[j][:k], top_vals[j][:k]))
            result[i] = TokenLogprob(token_id=token_ids[i], logprob=chosen_lp[j], top=top)
        return result
