"""Text <-> token ids for one model: encode, decode, chat template, streaming detokenization.

The heavy lifting is the Rust `tokenizers` library: the backend is built from a GGUF's vocabulary
(kvserve/tokenizer/gguf_vocab.py) or read from a Hugging Face tokenizer.json. This module adds what a
server needs around it: BOS policy, end-of-turn ids, the sandboxed chat template
(kvserve/tokenizer/chat_template.py), and an incremental detokenizer whose deltas never split a character.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from kvserve.errors import ModelFormatError, ModelNotFoundError
from kvserve.tokenizer.chat_template import DEFAULT_CHATML, ChatPrompt, ChatTemplate, ChatTemplateError
from kvserve.tokenizer.gguf_vocab import build_gguf_vocab, read_gguf_metadata
from kvserve.tokenizer.special_text import SpecialTextMask
from kvserve.tokenizer.tool_messages import template_messages

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "PromptTooLong", "Tokenizer"]

# Long texts are counted in pieces of this many characters before being encoded whole, so a huge
# prompt is refused after reading about a context's worth of it (each piece holds the GIL briefly).
_PIECE_CHARS = 4096
# Cutting a text can split or merge a few tokens at the cut: allow this many per cut when counting.
_TOKENS_PER_CUT = 8


class PromptTooLong(ValueError):
    """A text that encodes to more than `limit` tokens (found before encoding all of it)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the text is more than {limit} tokens")
        self.limit = limit

# Special tokens that close a turn in common chat formats; those the template writes stop generation.
_END_OF_TURN = {
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<|END_OF_TURN_TOKEN|>", "</s>", "<|return|>",
}


class Tokenizer:
    """One model's tokenizer. Build it with `load`, `from_gguf` or `from_hf_dir`."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        stop_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        """`stop_token_ids`: more ids that end generation (end-of-turn ids the model names)."""
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.chat_template = ChatTemplate(chat_template or DEFAULT_CHATML)
        self.has_chat_template = chat_template is not None
        special = [(i, t.content) for i, t in backend.get_added_tokens_decoder().items() if t.special]
        self.special_token_ids: frozenset[int] = frozenset(i for i, _ in special)
        # The template's turn-closing specials stop generation like EOS does.
        used = {i for i, text in special if text in _END_OF_TURN and text in self.chat_template.source}
        self.eos_token_id = eos_token_id
        named_eos = {eos_token_id} if eos_token_id is not None else set()
        self._stop_token_ids = tuple(stop_token_ids)
        self.eos_token_ids: frozenset[int] = frozenset(named_eos | set(self._stop_token_ids) | used)
        # Whether encode(..., add_special_tokens=True) puts BOS in front (the model asks for it).
        with_specials = backend.encode("", add_special_tokens=True).ids
        self.adds_bos = bos_token_id is not None and with_specials[:1] == [bos_token_id]
        self._special_texts = tuple(text for _, text in special)
        self._plain: Backend | None = None  # made on first use: encodes special-token text as text
        self._vocab_digest: str | None = None  # fingerprint(): made on first use

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, **kwargs: Any) -> Tokenizer:
        """A GGUF file (by its contents: an Ollama blob has no suffix), or a directory holding
        tokenizer.json (or a single .gguf)."""
        path = Path(path)
        if path.is_file():
            return cls.from_gguf(path, **kwargs)
        if path.is_dir():
            if (path / "tokenizer.json").is_file():
                return cls.from_hf_dir(path)
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls.from_gguf(ggufs[0], **kwargs)
            raise ModelFormatError(
                f"{path} holds no tokenizer.json and not exactly one .gguf; point at the model file."
            )
        raise ModelNotFoundError(
            f"no tokenizer at {path}: pass a .gguf file or a Hugging Face model directory."
        )

    @classmethod
    def from_gguf(cls, path: str | Path, *, exact_pre_tokenizer: bool = False) -> Tokenizer:
        """From the vocabulary in a GGUF's metadata.

        exact_pre_tokenizer=False splits text as the Hugging Face GGUF conversion does, so ids equal
        the reference tokenizer used in tests. True splits as the model's own tokenizer.json does
        (SmolLM: every digit apart first). They differ where whitespace or a non-ASCII number runs
        into a digit: "a  1" is a, Ġ, Ġ, 1 by the first and a, ĠĠ, 1 by the second.
        """
        vocab = build_gguf_vocab(read_gguf_metadata(path), exact_pre_tokenizer=exact_pre_tokenizer)
        return cls(
            vocab.backend,
            bos_token_id=vocab.bos_token_id,
            eos_token_id=vocab.eos_token_id,
            stop_token_ids=vocab.end_of_turn_ids,
            chat_template=vocab.chat_template,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From tokenizer.json + tokenizer_config.json (+ generation_config.json) of a model directory."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"{path} has no tokenizer.json; pass a Hugging Face model directory.")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        bos_text, eos_text = _content(config.get("bos_token")), _content(config.get("eos_token"))
        bos = backend.token_to_id(bos_text) if bos_text else None
        eos = backend.token_to_id(eos_text) if eos_text else None
        # BOS/EOS adding is tokenizer.json's post-processor; the config's add_bos_token only restates it.
        stop = _read_json(path / "generation_config.json").get("eos_token_id")  # an id or a list of them
        stop = stop if isinstance(stop, list) else [] if stop is None else [stop]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            stop_token_ids=stop,
            chat_template=_hf_chat_template(path, config),
        )

    def with_chat_template(self, source: str) -> Tokenizer:
        """The same tokenizer with another chat template (e.g. one given on the command line)."""
        other = Tokenizer(
            self.backend,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            stop_token_ids=self._stop_token_ids,
            chat_template=source,
        )
        other._vocab_digest = self._vocab_digest  # the same vocabulary
        return other

    # -- text <-> ids ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Special tokens written in `text` (e.g. "<|im_start|>") become their ids; BOS is added only
        when the model asks for it and `add_special_tokens` is set.

        With `max_tokens`, a text that surely holds more raises PromptTooLong after only about that
        many tokens' worth of it was read: a 4 MiB prompt costs what a full context does."""
        if max_tokens is not None and len(text) > _PIECE_CHARS:
            self._check_length(text, max_tokens)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str, max_tokens: int | None = None) -> list[int]:
        """`text` as plain text: a special token's spelling ("<|im_start|>") is encoded as the
        characters it is made of, never as the control token. `max_tokens` as in encode()."""
        if max_tokens is not None and len(text) > _PIECE_CHARS:
            self._check_length(text, max_tokens)
        if self._plain is None:
            self._plain = Backend.from_str(self.backend.to_str())
            self._plain.encode_special_tokens = True
        return self._plain.encode(text, add_special_tokens=False).ids

    def has_special_text(self, text: str) -> bool:
        """Whether `text` spells one of the special tokens."""
        return any(t in text for t in self._special_texts)

    def _check_length(self, text: str, max_tokens: int) -> None:
        count, start, cuts = 0, 0, 0
        while start < len(text):
            end = start + _PIECE_CHARS
            if end < len(text):  # cut before a space where one is near: fewer tokens change
                space = text.rfind(" ", end - 256, end)
                end = space if space > start else end
            count += len(self.backend.encode(text[start:end], add_special_tokens=False).ids)
            cuts += 1
            if count - _TOKENS_PER_CUT * cuts > max_tokens:
                raise PromptTooLong(max_tokens)
            start = end

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, id: int) -> str:
        token = self.backend.id_to_token(id)
        if token is None:
            raise ValueError(f"token id {id} is outside the vocabulary (0..{self.vocab_size - 1}).")
        return token

    def token_to_id(self, tok: str) -> int | None:
        return self.backend.token_to_id(tok)

    def fingerprint(self, special_tokens_in_content: bool = False) -> str:
        """What decides a chat's prompt ids, hashed: the vocabulary and its rules, BOS, the chat
        template and the special-token rule. Two tokenizers with equal fingerprints turn the same
        messages into the same ids (a router checks it before hashing prompts for a replica)."""
        if self._vocab_digest is None:
            self._vocab_digest = hashlib.sha256(self.backend.to_str().encode()).hexdigest()
        parts = [self._vocab_digest, str(self.bos_token_id), str(self.adds_bos), self.chat_template.source,
                 str(special_tokens_in_content)]
        return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]

    # -- chat ------------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages`, by the model's own template (ChatML if it has none).
        `tools=[...]` (OpenAI's function list) and tool messages go through
        kvserve/tokenizer/tool_messages.py first (a template without tool support gets them as text)."""
        if not isinstance(messages, list):
            raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts.")
        if extra.get("tools") or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                     for m in messages):
            messages = template_messages(messages, extra.get("tools"), self.chat_template.source)
        named = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        variables = {k: self.backend.id_to_token(i) for k, i in named.items() if i is not None}
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, variables={**variables, **extra}
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        max_tokens: int | None = None,
        special_tokens_in_content: bool = False,
        **extra: Any,
    ) -> list[int]:
        """The prompt ids: the rendered template, with BOS in front only if the model wants one and
        the template did not already write it.

        Client text is text: a special token spelt in any string the template renders (content,
        names, tool calls, tools and their schemas) stays those characters, so a user cannot forge
        a turn (kvserve/tokenizer/special_text.py). Only the template's own markers are control tokens.
        `special_tokens_in_content=True` lets client text spell control tokens (for callers that
        build turns themselves). `max_tokens` bounds the work as in encode()."""
        mask = SpecialTextMask(self._special_texts)
        if not special_tokens_in_content:
            masked_messages, masked_extra = mask.mask(messages), mask.mask(extra)
        if special_tokens_in_content or not mask.used:
            text = self.apply_chat_template(messages, add_generation_prompt, **extra)
            ids = self.encode(text, add_special_tokens=False, max_tokens=max_tokens)
        else:
            text = self.apply_chat_template(masked_messages, add_generation_prompt, **masked_extra)
            if max_tokens is not None and len(text) > _PIECE_CHARS:
                self._check_length(text, max_tokens)
            ids = []
            for piece, spelt in mask.split(text):
                ids += self.encode_plain(piece) if spelt else self.encode(piece, add_special_tokens=False)
        if self.adds_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_prompt(self, prompt: ChatPrompt, special_tokens_in_content: bool = False,
                      max_tokens: int | None = None) -> list[int]:
        """A ChatPrompt's ids (`encode_chat`: client text stays text unless allowed)."""
        extra = {**(prompt.variables or {}), **({"tools": prompt.tools} if prompt.tools else {})}
        return self.encode_chat(prompt.messages, prompt.add_generation_prompt, max_tokens=max_tokens,
                                special_tokens_in_content=special_tokens_in_content, **extra)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas for streaming.

    Each call decodes only a short window: the ids since the previous emission (`prefix`) plus the
    new ones, and emits what the new ids add to the prefix's text. Text is held back while it ends
    in U+FFFD (a character whose bytes have not all arrived). With `skip_special_tokens` the special
    ids never enter the window, so a window always starts on a real token and SentencePiece's
    leading-space rule treats the prefix and the whole window alike.

    Without `prompt_ids`, `text` equals `tokenizer.decode(token_ids, skip_special_tokens)` once
    `flush()` has been called; with them, the first token's leading space is decoded in the
    prompt's context (it is kept, as in the full prompt + completion).
    """

    _PROMPT_CONTEXT = 5  # prompt ids kept as the first window's prefix

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: list[int] | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self.token_ids: list[int] = []
        self._parts: list[str] = []
        context = [i for i in (prompt_ids or ()) if i not in self._skipped][-self._PROMPT_CONTEXT :]
        self._window = context  # ids not yet behind the prefix; window[:read] was emitted
        self._read = len(context)

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def add(self, ids: list[int]) -> str:
        """Append `ids`; return the text they complete (possibly "")."""
        self.token_ids.extend(ids)
        self._window.extend(i for i in ids if i not in self._skipped)
        prefix, full = self._decode_window()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        return self._emit(full[len(prefix) :])

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end); call when done."""
        prefix, full = self._decode_window()
        return self._emit(full[len(prefix) :]) if len(full) > len(prefix) else ""

    def _decode_window(self) -> tuple[str, str]:
        """(text of the emitted prefix, text of the whole window), both decoded from the window start."""
        decode = self._tokenizer.backend.decode  # skipped ids never entered the window
        prefix = decode(self._window[: self._read], skip_special_tokens=False)
        return prefix, decode(self._window, skip_special_tokens=False)

    def _emit(self, delta: str) -> str:
        # The ids just emitted become the next prefix; older ones are never decoded again.
        del self._window[: self._read]
        self._read = len(self._window)
        self._parts.append(delta)
        return delta


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template
