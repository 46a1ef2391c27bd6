"""Fill in the middle: `/v1/completions` with a `suffix` asks for the text between prompt and suffix.

Code models trained for it (StarCoder, SantaCoder, SmolLM 1, Qwen2.5-Coder, DeepSeek-Coder) read the
two sides in PSM order — prefix marker, prefix, suffix marker, suffix, middle marker — and write the
middle after the last marker:

    <fim_prefix>{prompt}<fim_suffix>{suffix}<fim_middle>

The markers are found in the vocabulary by their spellings (`SPELLINGS`, one set per family). They
go in as control tokens; the client's prompt and suffix are encoded as plain text, so a suffix that
spells "<fim_middle>" or "<|im_start|>" stays those characters (kvserve/tokenizer/special_text.py's rule for
chat content, here for completions' two text fields). A vocabulary without a full set of markers has
no way to say where the hole is: the request is a 400 naming `suffix` (SmolLM2's vocabulary is one:
it has `<|im_start|>` where SmolLM 1 had `<fim_prefix>`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.errors import InvalidParam

if TYPE_CHECKING:
    from kvserve.tokenizer import Tokenizer

# (prefix, suffix, middle) markers, PSM order, by model family.
SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, SmolLM 1
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def fim_token_ids(tokenizer: Tokenizer) -> tuple[int, int, int] | None:
    """The vocabulary's (prefix, suffix, middle) marker ids, or None if it has no full set."""
    for spelling in SPELLINGS:
        pre, suf, mid = (tokenizer.token_to_id(s) for s in spelling)
        if pre is not None and suf is not None and mid is not None:
            return pre, suf, mid
    return None


def no_fim_error() -> InvalidParam:
    known = "; ".join(" ".join(s) for s in SPELLINGS)
    return InvalidParam("suffix", "suffix (fill in the middle) needs a model whose vocabulary has fill-in-the-middle "
                        f"tokens ({known}); this model's has none: leave suffix out, or serve a code model trained "
                        "for it")


def encode_fim(tokenizer: Tokenizer, prefix: str, suffix: str, max_tokens: int | None = None) -> list[int]:
    """The PSM prompt ids: markers as control tokens, prefix and suffix as plain text; BOS in front
    if the model asks for one. InvalidParam("suffix") if the vocabulary has no markers;
    PromptTooLong past `max_tokens` (checked before encoding all of a long text)."""
    ids = fim_token_ids(tokenizer)
    if ids is None:
        raise no_fim_error()
    pre, suf, mid = ids
    head = [tokenizer.bos_token_id] if tokenizer.adds_bos and tokenizer.bos_token_id is not None else []
    return [*head, pre, *tokenizer.encode_plain(prefix, max_tokens), suf,
            *tokenizer.encode_plain(suffix, max_tokens), mid]
