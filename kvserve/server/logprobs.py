"""Log-probabilities in OpenAI's two shapes, with each token's text and exact bytes.

Completions (legacy): {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"};
with echo, the prompt's tokens first (the first with null logprob and top_logprobs).
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
A token may hold part of a character (byte-level BPE): its text then shows U+FFFD and its bytes
are the real ones, so a client can join the bytes of consecutive tokens.
"""
from __future__ import annotations

import functools
import math
import re

from tokenizers import decoders

from kvserve.outputs import TokenLogprob
from kvserve.tokenizer import Tokenizer

_FLOOR = -9999.0  # JSON has no -inf


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte is shown as one printable character; inverse map."""
    shown = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in shown:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Token id -> (text, bytes), cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_of = _byte_level_alphabet() if isinstance(tokenizer.backend.decoder, decoders.ByteLevel) else None

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per server, lives as long
    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.backend.id_to_token(token_id) or ""
        special = token_id in self.tokenizer.special_token_ids
        if self._byte_of is not None and not special and all(ch in self._byte_of for ch in piece):
            return [self._byte_of[ch] for ch in piece]
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece byte fallback
            return [int(piece[3:5], 16)]
        return list(self.text(token_id).encode("utf-8"))


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else _FLOOR


def completion_logprobs(lps: list[TokenLogprob], texts: TokenTexts, offset: int, skipped: frozenset[int]) -> tuple[dict, int]:
    """The legacy block for these tokens, text offsets counted from `offset`; and the next offset.
    Tokens in `skipped` (special tokens left out of the text) take no room in it."""
    block: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        text = texts.text(lp.token_id)
        block["tokens"].append(text)
        block["token_logprobs"].append(_finite(lp.logprob))
        top = {texts.text(t): _finite(v) for t, v in lp.top}
        top.setdefault(text, _finite(lp.logprob))
        block["top_logprobs"].append(top)
        block["text_offset"].append(offset)
        if lp.token_id not in skipped:
            offset += len(text)
    return block, offset


def prompt_logprobs(prompt_ids: list[int], lps: list[TokenLogprob | None], texts: TokenTexts,
                    skipped: frozenset[int]) -> dict:
    """The legacy block for an echoed prompt (`lps` as RequestOutput.prompt_logprobs: the first
    None): its first token has a null logprob and null top_logprobs, as OpenAI's echo has; text
    offsets count from the start of the prompt's text."""
    first = prompt_ids[0]
    text = texts.text(first)
    rest, _ = completion_logprobs([lp for lp in lps[1:] if lp is not None], texts,
                                  0 if first in skipped else len(text), skipped)
    return {"tokens": [text, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def chat_logprobs(lps: list[TokenLogprob], texts: TokenTexts) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": texts.text(token_id), "logprob": _finite(logprob), "bytes": texts.bytes(token_id)}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}
