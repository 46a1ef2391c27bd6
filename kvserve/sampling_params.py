"""SamplingParams: how one request's tokens are chosen and when it stops.

Ranges follow OpenAI's documented ones (vLLM's names for the extras). validate() raises
InvalidParam (a ValueError) naming the parameter, in its message and in `.param`, with its
allowed range, before any KV block is allocated.

Edge cases, decided here once:
- A temperature below GREEDY_TEMPERATURE (1e-5) is greedy: dividing logits by a smaller one
  overflows float32 (1e-46 is 0 there) and could only approximate argmax anyway.
- logit_bias maps token ids to a number in [-100, 100] added to their logits (OpenAI's range and
  its 300-entry cap); ids are checked against the vocabulary by the engine, which knows it.
- max_tokens=0 generates nothing: the prompt is only read (scored, with prompt_logprobs) and
  the request finishes with finish_reason "length".
- A seed is any integer in [SEED_MIN, SEED_MAX] = [-2^63, 2^64 - 1]: all 64 bits count (seeds
  that differ only above bit 32 draw differently); a negative seed is its two's complement.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidParam, shown
from kvserve.structured.spec import Constraint

MAX_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (argmax)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Stop conditions are checked on every token: bounded so no request can make that expensive.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 256
MAX_LOGIT_BIAS, LOGIT_BIAS_LIMIT = 300, 100.0  # entries; |bias| (OpenAI's limits)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 means off; >1 discourages tokens already seen
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16  # None: up to the context length; 0: the prompt only (no token generated)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's plus k top ones
    # None: none; k: each prompt token's logprob given the tokens before it, plus the k most
    # likely tokens at its place (the first prompt token has none). Scoring a prompt: with max_tokens=0.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    priority: int = 0  # lower runs first under the "priority" policy
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # The output must match this (JSON schema, regex, choice, grammar): kvserve/structured/.
    constraint: Constraint | None = None
    # False: never drafted for, even when the engine speculates (engine/speculative.py). Greedy
    # output is the same either way; seeded sampling draws the same distribution, other tokens.
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(name: str, allowed: str) -> InvalidParam:
            return InvalidParam(name, f"{name} must be {allowed}, got {shown(getattr(self, name))}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", "a finite number in [0, 2]")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise bad("top_k", "-1 (off) or an integer >= 1")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "a number in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", "null or an integer in [-2**63, 2**64 - 1]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            raise bad("max_tokens", "an integer >= 0")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}]")
        stops_ok = all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop)
        if not stops_ok or len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters")
        ids_ok = all(is_int(t) and t >= 0 for t in self.stop_token_ids)
        if not ids_ok or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} non-negative token ids")
        if self.logit_bias is not None:
            bias = self.logit_bias
            ok = isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS and all(
                is_int(t) and t >= 0 and is_num(b) and -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT
                for t, b in bias.items())
            if not ok:
                raise InvalidParam("logit_bias", f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers "
                                   f"in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias!r:.200}")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", "true or false")
        if not is_int(self.priority):
            raise bad("priority", "an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def with_defaults(defaults: Mapping[str, Any], given: Mapping[str, Any], **fixed: Any) -> SamplingParams:
    """Every API's one way from a request to its SamplingParams: the sampling fields it `given`
    (None: left out) over the server's or model's `defaults` (generation_defaults.py) over this
    class's own, and the fields no default applies to (`fixed`: max_tokens, stop, ...) as they are."""
    return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if v is not None}}, **fixed)
