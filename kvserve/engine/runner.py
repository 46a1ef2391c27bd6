"""ModelRunner: turns the scheduler's output into one flat batch, runs the model, samples.

Prefill chunks and single decode tokens travel together, without padding; each chunk brings
its block table. Logits are computed only for chunks that end at their sequence's last known
token (those are the ones that sample). `execute()` takes a SchedulerOutput whole and returns
the sampled tokens; `run()` is the forward alone, on hand-made chunks (LLM.prefill/decode).

Decode steps are small (one token per sequence), so what surrounds the matmuls counts: the
step's index tensors are built in one torch.tensor call, and the attention backend derives its
per-step tensors once, not per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.request import Sequence
from kvserve.engine.sampler import Sampler, SamplingRow
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.model.attention import AttentionMetadata
from kvserve.model.llama import LlamaModel
from kvserve.model.native_decode import NativeDecode
from kvserve.outputs import TokenLogprob
from kvserve.structured import grammar


@dataclass
class SeqChunk:
    token_ids: list[int]  # tokens to compute this step
    start_pos: int  # position of token_ids[0] (the sequence's num_computed_tokens)
    block_ids: list[int]  # the sequence's block table, covering start_pos + len(token_ids)
    need_logits: bool  # True when this chunk's last token is the sequence's newest


@dataclass
class RunnerOutput:
    """What a step produced: one token per sequence that sampled, in batch order."""

    seqs: list[Sequence]
    token_ids: list[int]  # sampler.NO_TOKEN where the sequence's logits were not finite
    logprobs: list[TokenLogprob | None]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[torch.Tensor],
        block_size: int,
        sampler: Sampler | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler or Sampler(model.config.vocab_size)
        self.eos_token_ids = eos_token_ids  # banned while a sequence is short of min_tokens
        # The pool comes from torch.empty: a block's memory may hold NaN until first written,
        # and masked attention over padding still multiplies it (0 * NaN = NaN). Zero each
        # block the first time it is written; later its stale contents are finite, and masked.
        self._never_written = bytearray(b"\x01") * kv_caches[0].shape[2]
        # Decode steps in one native call where the model allows it (None: the per-op forward).
        self.native = NativeDecode.build(model, kv_caches, block_size)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Compute the scheduled tokens and sample a token for each sequence that reached its end."""
        chunks, sampling = [], []
        for (seq, n), table in zip(sched.scheduled, sched.block_tables):
            start = seq.num_computed_tokens
            last = start + n == len(seq.token_ids)
            chunks.append(SeqChunk(seq.token_ids[start : start + n], start, table, last))
            if last:
                sampling.append(seq)
        logits = self.run(chunks)
        if not sampling:
            return RunnerOutput([], [], [])
        rows = [  # the prompt is copied out only for the repetition penalty, its one reader
            SamplingRow(s.params, s.token_ids[: s.num_prompt_tokens] if s.params.repetition_penalty != 1.0 else [],
                        s.output_token_ids, s.generator, self.eos_token_ids)
            for s in sampling
        ]
        out = self.sampler(grammar.apply_masks(logits, sampling), rows)  # structured output: allowed tokens only
        return RunnerOutput(sampling, out.token_ids, out.logprobs)

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits [number of chunks with need_logits, V] float32, in chunk order."""
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
            for kv in self.kv_caches:
                kv.index_fill_(2, idx, 0)
        if self.native is not None and len(ids) == len(chunks):  # a decode step, in one call
            hidden, logits = self.native(ids, positions, slots, [c.block_ids for c in chunks], last_rows is None)
            if logits is not None:
                return logits
            if last_rows is not None:
                hidden = hidden[torch.tensor(last_rows, dtype=torch.long)]
            return self.model.logits(hidden)
        step = torch.tensor([ids, positions, slots], dtype=torch.long)  # [3, T]: one allocation, not three
        meta = AttentionMetadata(
            slot_mapping=step[2],
            query_lens=[len(c.token_ids) for c in chunks],
            seq_lens=[c.start_pos + len(c.token_ids) for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            block_size=bs,
        )
        hidden = self.model.forward(step[0], step[1], self.kv_caches, meta)
        if last_rows is not None:
            hidden = hidden[torch.tensor(last_rows, dtype=torch.long)]
        return self.model.logits(hidden)
