"""What the engine hands back: per request, per completion, with the delta of the last step."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class OutputKind(enum.Enum):
    """What a request's outputs carry after each step (vLLM's RequestOutputKind).

    CUMULATIVE: everything so far, every step (copies grow with the output: for callers that
    read snapshots). DELTA: what the step added (delta_*), the cumulative fields only on the final
    output: a step's work does not grow with the output (the server's streams). FINAL_ONLY: no
    output until the request finishes (offline batches)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class CompletionOutput:
    index: int  # 0 .. n-1
    # Everything so far (stop string trimmed): every step under OutputKind.CUMULATIVE, on the
    # final output only under DELTA.
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # What the last engine step added (the streaming delta).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request reached the engine (or the server)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing comes
    # before it); on the final output (and every one under CUMULATIVE) once the prompt is computed.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # An embedding request's pooled prompt: the mean of its final hidden states, L2-normalised.
    embedding: list[float] | None = None

    # The offline API's shorthand for n == 1.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
