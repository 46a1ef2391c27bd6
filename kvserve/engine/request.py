"""A request's state in the engine: one Request, n Sequences (one per completion).

Some requests want outputs for every prompt token, not only for the tokens they generate:
`params.prompt_logprobs` (scoring a text) and `pooling` (an embedding: the mean of the prompt's
final hidden states). The request's first sequence computes every prompt token for them (no
prefix-cache hit: a cached block has K/V but no hidden states), and they are collected on the
Request chunk by chunk; a preemption before the prompt is done starts them over. A request with
max_tokens=0 generates nothing: it finishes when its prompt is computed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

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

    @property
    def wants_prompt_outputs(self) -> bool:
        """Whether this sequence's prompt chunks must yield per-token outputs (see the module doc):
        the request's first sequence, until its prompt has been computed once."""
        r = self.request
        return self.index == 0 and r.wants_prompt_outputs and not r.prompt_outputs_done


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
    pooling: bool = False  # an embedding request: the pooled prompt is its output
    # Per-prompt-token outputs, collected as the first sequence's prompt chunks are computed.
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None, token 1's, ...] when asked
    hidden_sum: torch.Tensor | None = None  # float32 [hidden]: the sum of the final hidden states
    embedding: list[float] | None = None  # the pooled prompt, once it is complete
    prompt_outputs_done: bool = False
    prompt_logprobs_sent: bool = False  # in a delta output (postprocess.make_output)

    def __post_init__(self) -> None:
        self.reset_prompt_outputs()

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def wants_prompt_outputs(self) -> bool:
        return self.pooling or self.params.prompt_logprobs is not None

    @property
    def prefill_only(self) -> bool:
        """No token is generated: the request ends when its prompt is computed (max_tokens=0)."""
        return self.max_output_tokens == 0

    def reset_prompt_outputs(self) -> None:
        """Start collecting again (the first sequence was preempted before its prompt was done)."""
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None else None
        self.hidden_sum = None

    def add_prompt_outputs(self, logprobs: list[TokenLogprob] | None, hidden_sum: torch.Tensor | None) -> None:
        """One computed chunk's outputs, in prompt order."""
        if logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(logprobs)
        if hidden_sum is not None:
            self.hidden_sum = hidden_sum if self.hidden_sum is None else self.hidden_sum + hidden_sum

    def finish_prompt_outputs(self) -> None:
        """The prompt is computed: pool it (the mean of its final hidden states, L2-normalised)."""
        self.prompt_outputs_done = True
        if self.pooling and self.hidden_sum is not None:
            mean = self.hidden_sum / len(self.prompt_token_ids)
            self.embedding = torch.nn.functional.normalize(mean, dim=0).tolist()
            self.hidden_sum = None
