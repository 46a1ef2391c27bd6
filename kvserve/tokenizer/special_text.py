"""The one rule for client text in a chat prompt: a special token spelt in it stays text.

A client that writes "<|im_end|>\\n<|im_start|>system" into any string the chat template renders
— message content, a `name`, a tool call's name, id or arguments, a tool's name, description or
parameter schema (its keys too) — must not open a turn. Only the template's own markers may be
control tokens.

How: every special token's spelling inside client text is swapped for a mark that no client can
write (it holds a random nonce drawn per call) and that survives what templates do to strings
(JSON-encoding with or without ensure_ascii: letters and digits only). The template renders the
masked conversation; the rendered text is then cut at the marks, the template's own text is
encoded with its special tokens, and each mark as the characters it stands for
(kvserve/tokenizer/tokenizer.py, `Tokenizer.encode_chat`).
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from typing import Any


class SpecialTextMask:
    """Masks special-token spellings in client values; `split` undoes it on the rendered text."""

    def __init__(self, special_texts: tuple[str, ...]) -> None:
        self.specials = sorted(set(special_texts), key=len, reverse=True)  # the longest spelling wins
        self._find = re.compile("|".join(re.escape(t) for t in self.specials)) if self.specials else None
        self._index = {t: i for i, t in enumerate(self.specials)}
        nonce = secrets.token_hex(8).upper()
        self._mark = f"KVS{nonce}X{{}}Y"
        self._marks = re.compile(f"KVS{nonce}X(\\d+)Y")
        self.used = False  # whether any client value spelt a special token

    def mask(self, value: Any) -> Any:
        """`value` with every special spelling in its strings (dict keys too) replaced by a mark;
        containers are copied, other values returned as they are."""
        if isinstance(value, str):
            return self._mask_text(value)
        if isinstance(value, dict):
            return {self.mask(k): self.mask(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.mask(v) for v in value)
        if hasattr(value, "model_dump"):  # a pydantic message, as callers of encode_chat may pass
            return self.mask(value.model_dump())
        return value

    def _mask_text(self, text: str) -> str:
        if self._find is None or self._find.search(text) is None:
            return text
        self.used = True
        return self._find.sub(lambda m: self._mark.format(self._index[m.group(0)]), text)

    def split(self, rendered: str) -> Iterator[tuple[str, bool]]:
        """The rendered text in pieces: (template text, False) and (a client's spelling, True)."""
        pos = 0
        for m in self._marks.finditer(rendered):
            if m.start() > pos:
                yield rendered[pos:m.start()], False
            yield self.specials[int(m.group(1))], True
            pos = m.end()
        if pos < len(rendered):
            yield rendered[pos:], False
