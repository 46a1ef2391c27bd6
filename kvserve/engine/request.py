"""A request's state in the engine: one Request, n Sequences (one per completion)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.sampler import Generator
from kvserve.outputs import OutputKind, RequestMetrics, TokenLogprob
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import IncrementalDetokenizer


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One completion: prompt + output tokens, and how many of them have K/V in the cache."""

    seq_id: str
    index: int  # which of the request's n completions
    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    generator: Generator | None = None  # the seeded sampling generator
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    admitted_at: int = -1  # admission counter at last admission (preemption order)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] | None = None
    # What the text stream has handed out; the rest is held back while it may start a stop string.
    emitted_text_len: int = 0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    matcher: Any = None  # the grammar's state when params.constraint is set (kvserve/structured/)
    grammar_refused: bool = False  # the matcher refused the last sampled token

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    max_output_tokens: int  # params.max_tokens, or what the context leaves
    output_kind: OutputKind = OutputKind.CUMULATIVE
    # n > 1: the first completion's prompt blocks are computed and cached, so the others may
    # start (and take them from the prefix cache). Never reset, so preemption cannot deadlock.
    prompt_cached: bool = False
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
