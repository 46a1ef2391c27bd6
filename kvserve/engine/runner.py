"""ModelRunner: turns the scheduler's output into one flat batch, runs the model, samples.

Prefill chunks and single decode tokens travel together, without padding; each chunk brings
its block table. Logits are computed only for chunks that end at their sequence's last known
token (those are the ones that sample). `execute()` takes a SchedulerOutput whole and returns
the sampled tokens; `run()` is the forward alone, on hand-made chunks (LLM.prefill/decode).

A sequence that verifies a draft (SchedulerOutput.drafts) enters the batch as 1 + k one-token
rows at consecutive positions over the same block table: every row's K/V is stored before any row
attends, so row j sees the rows before it, which is causal attention over the chunk; a step of
decodes and drafts stays a decode step (the native call). Its rows' logits go to verify().

Decode steps are small (one token per sequence), so what surrounds the matmuls counts: the
step's index tensors are built in one torch.tensor call, and the attention backend derives its
per-step tensors once, not per layer.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from kvserve import cpu
from kvserve.engine.request import Sequence
from kvserve.engine.sampler import Sampler, SamplingRow
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.verify import Verified, rows_for, verify
from kvserve.model.attention import AttentionMetadata
from kvserve.model.llama import StepModel
from kvserve.model.native_decode import Best, NativeDecode
from kvserve.outputs import TokenLogprob
from kvserve.structured import grammar


@dataclass
class SeqChunk:
    token_ids: list[int]  # tokens to compute this step
    start_pos: int  # position of token_ids[0] (the sequence's num_computed_tokens)
    block_ids: list[int]  # the sequence's block table, covering start_pos + len(token_ids)
    need_logits: bool  # True when this chunk's last token is the sequence's newest


@dataclass
class PromptOutputs:
    """One prompt chunk's per-token outputs, for a sequence that wants them (request.py)."""

    seq: Sequence
    logprobs: list[TokenLogprob] | None  # for the chunk's prompt tokens after the first of the prompt
    hidden_sum: torch.Tensor | None  # float32 [hidden]: the sum of the chunk's final hidden states


@dataclass
class RunnerOutput:
    """What a step produced: one token per sequence that sampled, in batch order; the prompt
    chunks' outputs for the sequences that want them."""

    seqs: list[Sequence]
    token_ids: list[int]  # sampler.NO_TOKEN where the sequence's logits were not finite
    logprobs: list[TokenLogprob | None]
    prompt_outputs: list[PromptOutputs] = field(default_factory=list)
    # Sequences that verified a draft, and what each emits (1 to k + 1 tokens).
    spec_seqs: list[Sequence] = field(default_factory=list)
    verified: list[Verified] = field(default_factory=list)


# Prompt rows at positions below this run in the native step (ModelRunner._native_prompt_rows), the rest in the
# per-op forward. With the attention kernel's 512-bit passes every position (2 threads, Zen 5, 2026-12-08:
# 4,096- and 8,000-token prompts took 0.87 and 0.82-0.89x the time of a 2,048 cutoff on the 1B shape, 0.90-0.94
# and 0.70-0.78x on the default model); on lower builds from 2,048 on the per-op forward is as fast or faster
# (the default model's 4,096 tokens: ~1.0x at avx2, 0.85x on the portable build; below 2,000 tokens the native
# step took 0.85-0.98x its time).
NATIVE_PROMPT_CONTEXT = sys.maxsize if cpu.isa() == "avx512" else 2048
# Prompt logprobs take the LM head over every prompt position: this many rows at a time bounds
# the float32 logits held at once (256 x 49152 x 4 bytes = 48 MiB for the default model).
PROMPT_LOGITS_ROWS = 256


class ModelRunner:
    def __init__(
        self,
        model: StepModel,
        kv_caches: list[torch.Tensor],
        block_size: int,
        sampler: Sampler | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        kv_scales: list[torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        # An int8 pool's row scales, per layer [2, Hkv, num_blocks, block_size] (model/kv_int8.py).
        self.kv_scales = kv_scales
        self.block_size = block_size
        self.sampler = sampler or Sampler(model.config.vocab_size)
        self.eos_token_ids = eos_token_ids  # banned while a sequence is short of min_tokens
        # The pool comes from torch.empty: a block's memory may hold NaN until first written,
        # and masked attention over padding still multiplies it (0 * NaN = NaN). Zero each
        # block the first time it is written; later its stale contents are finite, and masked.
        self._never_written = bytearray(b"\x01") * kv_caches[0].shape[2]
        # Decode steps in one native call where the model allows it (None: the per-op forward).
        self.native = NativeDecode.build(model, kv_caches, block_size, kv_scales)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Compute the scheduled tokens and sample a token for each sequence that reached its end
        (and generates: a max_tokens=0 request samples nothing)."""
        chunks: list[SeqChunk] = []
        sampling: list[Sequence] = []
        wanting: list[int] = []  # chunks whose sequence wants prompt outputs
        drafted: list[Sequence] = []
        spec_rows: list[int] = []  # logits rows of the drafting sequences (in the order of `drafted`)
        for (seq, n), table in zip(sched.scheduled, sched.block_tables):
            start = seq.num_computed_tokens
            draft = sched.drafts.get(seq) if sched.drafts else None
            if draft:
                first = len(sampling) + len(spec_rows)  # logits rows so far
                for j, t in enumerate([seq.token_ids[start], *draft]):
                    chunks.append(SeqChunk([t], start + j, table, True))
                drafted.append(seq)
                spec_rows.extend(range(first, first + 1 + len(draft)))
                continue
            samples = start + n == len(seq.token_ids) and not seq.request.prefill_only
            chunks.append(SeqChunk(seq.token_ids[start : start + n], start, table, samples))
            if samples:
                sampling.append(seq)
            if seq.wants_prompt_outputs:
                wanting.append(len(chunks) - 1)
        # A greedy step (no draft, no grammar) takes each row's argmax from the native step, made while
        # the logits are in its threads' caches: read afterwards they come from the other core's cache.
        greedy = bool(sampling) and not drafted and all(s.params.greedy and s.matcher is None for s in sampling)
        logits, hidden, best = self._run(chunks, keep_hidden=bool(wanting), argmax=greedy)
        prompt_outputs = self._prompt_outputs(sched, chunks, wanting, hidden) if hidden is not None else []  # (kept for wanting)
        verified: list[Verified] = []
        if drafted:
            verified = self._verify(logits[spec_rows], drafted, [sched.drafts[s] for s in drafted])
            if sampling:
                logits = logits[sorted(set(range(logits.shape[0])) - set(spec_rows))]
        if not sampling:
            return RunnerOutput([], [], [], prompt_outputs, drafted, verified)
        rows = [self._row(s) for s in sampling]
        out = self.sampler(grammar.apply_masks(logits, sampling), rows, best)  # structured output: allowed tokens only
        return RunnerOutput(sampling, out.token_ids, out.logprobs, prompt_outputs, drafted, verified)

    def _row(self, s: Sequence) -> SamplingRow:
        # The prompt is copied out only for the repetition penalty, its one reader.
        return SamplingRow(s.params, s.token_ids[: s.num_prompt_tokens] if s.params.repetition_penalty != 1.0 else [],
                           s.output_token_ids, s.generator, self.eos_token_ids)

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> list[Verified]:
        rows = [r for s, d in zip(seqs, drafts) for r in rows_for(self._row(s), d)]
        return verify(self.sampler, logits, rows, drafts)

    @torch.inference_mode()
    def _prompt_outputs(self, sched: SchedulerOutput, chunks: list[SeqChunk], wanting: list[int],
                        hidden: torch.Tensor) -> list[PromptOutputs]:
        """Per-token outputs of the wanting chunks' prompt tokens, from the step's hidden states
        [T, hidden]: the sum of those states (pooling), and each next prompt token's logprob
        under the logits at the position before it (prompt_logprobs), with the k best."""
        offsets = _starts(chunks)
        outs: list[PromptOutputs] = []
        scored_counts: list[int] = []  # per out, the prompt tokens scored (its logprobs to come)
        rows: list[int] = []  # rows of `hidden` whose logits score a prompt token
        targets: list[int] = []  # the prompt token each of those rows scores
        for i in wanting:
            seq, c = sched.scheduled[i][0], chunks[i]
            p_end = min(c.start_pos + len(c.token_ids), seq.num_prompt_tokens)  # prompt positions [start, p_end)
            base = offsets[i] - c.start_pos  # row of position p: base + p
            hidden_sum = None
            if seq.request.pooling:
                hidden_sum = hidden[base + c.start_pos : base + p_end].float().sum(dim=0)
            logprobs: list[TokenLogprob] | None = None
            scored = range(0)
            if seq.params.prompt_logprobs is not None:
                scored = range(c.start_pos, min(p_end, seq.num_prompt_tokens - 1))  # the last has no next prompt token
                rows.extend(base + p for p in scored)
                targets.extend(seq.token_ids[p + 1] for p in scored)
                logprobs = []  # filled below
            outs.append(PromptOutputs(seq, logprobs, hidden_sum))
            scored_counts.append(len(scored))
        if rows:
            k_max = max(o.seq.params.prompt_logprobs or 0 for o in outs)
            results = iter(self._token_logprobs(hidden, rows, targets, k_max))  # in the order of `rows`
            for o, n in zip(outs, scored_counts):
                if o.logprobs is not None:
                    k = o.seq.params.prompt_logprobs
                    o.logprobs = [TokenLogprob(t, lp, top[:k]) for t, lp, top in (next(results) for _ in range(n))]
        return outs

    def _token_logprobs(self, hidden: torch.Tensor, rows: list[int], targets: list[int],
                        k: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """(target, its logprob, the k best (id, logprob)) under the logits of each row of hidden, of
        the raw distribution as the sampler reports it; the LM head PROMPT_LOGITS_ROWS rows at a time."""
        vocab = self.sampler.vocab_size
        out: list[tuple[int, float, list[tuple[int, float]]]] = []
        for a in range(0, len(rows), PROMPT_LOGITS_ROWS):
            idx = torch.tensor(rows[a : a + PROMPT_LOGITS_ROWS], dtype=torch.long)
            lp = self.model.logits(hidden[idx])[:, :vocab].log_softmax(dim=-1)  # [r, V] float32
            tgt = targets[a : a + PROMPT_LOGITS_ROWS]
            chosen = lp.gather(1, torch.tensor(tgt, dtype=torch.long)[:, None]).squeeze(1).tolist()
            if k:
                top_vals, top_ids = lp.topk(min(k, vocab), dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
            else:
                tops = [[] for _ in tgt]
            out.extend(zip(tgt, chosen, tops))
        return out

    def run(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits [number of chunks with need_logits, V] float32, in chunk order."""
        return self._run(chunks)[0]

    @torch.inference_mode()
    def _run(self, chunks: list[SeqChunk], keep_hidden: bool = False,
             argmax: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, Best | None]:
        """run()'s logits; with keep_hidden every token's final hidden state [T, hidden] (the per-op
        forward then, never the native decode step, which keeps none); with argmax, where the native
        step makes every row's logits, each row's argmax over the sampler's vocabulary (else None)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        fresh: list[int] = []  # blocks written for the first time this step
        if all(len(c.token_ids) == 1 for c in chunks):  # a decode step: one token per sequence
            for c in chunks:
                p = c.start_pos
                block = c.block_ids[p // bs]
                ids.append(c.token_ids[0])
                positions.append(p)
                slots.append(block * bs + p % bs)
                if self._never_written[block]:
                    fresh.append(block)
            last_rows = None if all(c.need_logits for c in chunks) else [i for i, c in enumerate(chunks) if c.need_logits]
        else:
            last_rows = []
            for c in chunks:
                n = len(c.token_ids)
                ids.extend(c.token_ids)
                for p in range(c.start_pos, c.start_pos + n):
                    positions.append(p)
                    slots.append(c.block_ids[p // bs] * bs + p % bs)
                if c.need_logits:
                    last_rows.append(len(ids) - 1)
                fresh.extend(b for b in c.block_ids[c.start_pos // bs : (c.start_pos + n - 1) // bs + 1]
                             if self._never_written[b])
        if fresh:
            for b in fresh:
                self._never_written[b] = 0
            idx = torch.tensor(fresh, dtype=torch.long)
            for kv in [*self.kv_caches, *(self.kv_scales or [])]:
                kv.index_fill_(2, idx, 0)
        if self.native is not None and len(ids) == len(chunks) and not keep_hidden:  # a decode step, in one call
            hidden, logits, best = self.native(ids, positions, slots, [c.block_ids for c in chunks], last_rows is None,
                                               argmax_cols=self.sampler.vocab_size if argmax else 0)
            if logits is not None:
                return logits, None, best
            return self._logits(hidden, last_rows), None, None
        if self.native is not None and not keep_hidden and len(ids) < self.native.integer_rows():
            return self._logits(self._native_prompt_rows(chunks, ids, positions, slots), last_rows), None, None
        hidden = self._forward(chunks, ids, positions, slots)
        return self._logits(hidden, last_rows), (hidden if keep_hidden else None), None

    def _forward(self, chunks: list[SeqChunk], ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """The per-op forward of the chunks' rows → final hidden states [T, hidden]."""
        step = torch.tensor([ids, positions, slots], dtype=torch.long)  # [3, T]: one allocation, not three
        meta = AttentionMetadata(
            slot_mapping=step[2],
            query_lens=[len(c.token_ids) for c in chunks],
            seq_lens=[c.start_pos + len(c.token_ids) for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            block_size=self.block_size,
        )
        return self.model.forward(step[0], step[1], self.kv_caches, meta, self.kv_scales)

    def _native_prompt_rows(self, chunks: list[SeqChunk], ids: list[int], positions: list[int],
                            slots: list[int]) -> torch.Tensor:
        """Prompt chunks through the native step as well: each row a query of its own, attending to its
        sequence's keys up to itself (the decode step's attention, one row at a time). Below
        NATIVE_PROMPT_CONTEXT that beats the per-op forward (no Python between operations); positions
        from it on take the per-op forward, in a second pass.
        Which path a row takes depends on its position alone, so its bits do not depend on its batch or
        its chunking, and a prompt row's K/V and logits are the ones decoding it would give."""
        if (native := self.native) is None:
            raise RuntimeError("prompt rows through the native decode step, which this model has not")
        # each chunk's rows below the cutoff (a decode row: always), the head; the rest, its tail
        head = [1 if len(c.token_ids) == 1 else min(len(c.token_ids), max(0, NATIVE_PROMPT_CONTEXT - c.start_pos))
                for c in chunks]
        starts = _starts(chunks)
        T, rows = len(ids), [r for h, r0 in zip(head, starts) for r in range(r0, r0 + h)]
        hidden = None
        if rows:
            native_hidden, _, _ = native([ids[r] for r in rows], [positions[r] for r in rows], [slots[r] for r in rows],
                                           [c.block_ids for c, h in zip(chunks, head) if h], False, [h for h in head if h])
            if len(rows) == T:
                return native_hidden
            hidden = torch.empty(T, native_hidden.shape[1])
            hidden[torch.tensor(rows, dtype=torch.long)] = native_hidden
        tails = [(SeqChunk(c.token_ids[h:], c.start_pos + h, c.block_ids, c.need_logits), r0 + h)
                 for c, h, r0 in zip(chunks, head, starts) if h < len(c.token_ids)]
        rest = [r for c, r0 in tails for r in range(r0, r0 + len(c.token_ids))]
        tail_hidden = self._forward([c for c, _ in tails], [ids[r] for r in rest], [positions[r] for r in rest],
                                    [slots[r] for r in rest])
        if hidden is None:
            return tail_hidden
        hidden[torch.tensor(rest, dtype=torch.long)] = tail_hidden
        return hidden

    def _logits(self, hidden: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
        """The LM head on the given rows (None: all); none at all when no row is asked for (a
        step of prompt chunks that sample nothing)."""
        if rows is None:
            return self.model.logits(hidden)
        if not rows:
            return torch.empty(0, self.sampler.vocab_size)
        return self.model.logits(hidden[torch.tensor(rows, dtype=torch.long)])


def _starts(chunks: list[SeqChunk]) -> list[int]:
    """The first row of each chunk in the step's rows."""
    out, r = [], 0
    for c in chunks:
        out.append(r)
        r += len(c.token_ids)
    return out
