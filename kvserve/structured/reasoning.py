"""A thinking model's output → its reasoning and its answer, whole or streamed.

Qwen3, QwQ and the DeepSeek-R1 distills write their reasoning between `<think>` and `</think>`,
then the answer. Qwen3 writes the opening tag itself; R1's chat template ends the prompt with
`<think>\n`, so its output starts inside the reasoning (`inside=True`: the caller looks at the
prompt's end). A model thinks when its chat template speaks of both tags (`thinks`); Qwen3's
turns thinking off with the template variable `enable_thinking: false` (chat_template_kwargs),
which writes an empty block into the prompt instead.

The split holds back only a tail that may still become a tag, so a stream's pieces concatenate to
the whole split's: the reasoning without its tags or the whitespace that opens it, and the answer
without the whitespace that follows `</think>`. Output that does not open with `<think>` (after
whitespace) is all answer; output cut off inside the reasoning is all reasoning.
"""
from __future__ import annotations

from collections.abc import Callable

OPEN, CLOSE = "<think>", "</think>"
REASONING, CONTENT = "reasoning", "content"


def thinks(template_source: str) -> bool:
    """Whether a chat template is a thinking model's (its turns carry <think> blocks)."""
    return OPEN in template_source and CLOSE in template_source


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its last characters) leaves the model inside <think>."""
    return prompt_tail.rstrip().endswith(OPEN)


def _held(text: str, tag: str) -> int:
    """The length of text's longest tail that is a proper start of tag (kept until more comes)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningSplit:
    """Feed text deltas of one choice; get (REASONING | CONTENT, text) parts back."""

    def __init__(self, inside: bool = False) -> None:
        self.state = REASONING if inside else "start"  # start: the output may still open with <think>
        self.opened = inside  # whether there is a reasoning block (empty or not)
        self.pending = ""
        self.strip = True  # the whitespace opening the reasoning, or following </think>, is dropped
        self.reasoning = ""  # all of it so far
        self.content = ""

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.pending += delta
        out: list[tuple[str, str]] = []
        while self.pending:
            if self.strip:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
            if self.state == "start":
                if self.pending.startswith(OPEN):
                    self.pending, self.state, self.strip = self.pending[len(OPEN):], REASONING, True
                    self.opened = True
                    continue
                if OPEN.startswith(self.pending):
                    break  # may still be the tag
                self.state, self.strip = CONTENT, False
            elif self.state == REASONING:
                self.strip = False
                end = self.pending.find(CLOSE)
                if end >= 0:
                    out.append((REASONING, self.pending[:end]))
                    self.pending, self.state, self.strip = self.pending[end + len(CLOSE):], CONTENT, True
                    continue
                keep = _held(self.pending, CLOSE)
                out.append((REASONING, self.pending[: len(self.pending) - keep]))
                self.pending = self.pending[len(self.pending) - keep:]
                break
            else:
                self.strip = False
                out.append((CONTENT, self.pending))
                self.pending = ""
        return self._kept(out)

    def finish(self) -> list[tuple[str, str]]:
        """What was held back: a tag's start that never completed is text after all."""
        rest, self.pending = self.pending, ""
        if not rest:
            return []
        return self._kept([(REASONING if self.state == REASONING else CONTENT, rest)])

    def _kept(self, parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
        parts = [(kind, text) for kind, text in parts if text]
        for kind, text in parts:
            if kind == REASONING:
                self.reasoning += text
            else:
                self.content += text
        return parts


def split(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a whole output, as a stream of it splits."""
    s = ReasoningSplit(inside)
    s.feed(text)
    s.finish()
    return (s.reasoning if s.opened else None), s.content


def reasoning_tokens(token_ids: list[int], decode: Callable[[list[int]], str], inside: bool = False) -> int:
    """How many of an output's tokens are its reasoning (usage's reasoning_tokens): those up to and
    with the one that completes `</think>`, all of them if the block never closes, none if the output
    does not open one. The block's end is found by the fewest tokens whose text holds it (a binary
    search: `</think>` may be one token or several)."""
    text = decode(token_ids)
    if not inside and not text.lstrip().startswith(OPEN):
        return 0
    start = text.find(OPEN) + len(OPEN) if not inside else 0
    if CLOSE not in text[start:]:
        return len(token_ids)
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if CLOSE in decode(token_ids[:mid])[start:]:
            hi = mid
        else:
            lo = mid + 1
    return lo
