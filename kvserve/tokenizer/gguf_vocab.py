"""A `tokenizers.Tokenizer` built from the vocabulary a GGUF file carries in its metadata.

A GGUF has no tokenizer.json: it stores tokens, token types, merges or scores and special ids under
`tokenizer.ggml.*`. Two vocabulary kinds are rebuilt here:
- `gpt2`: byte-level BPE (SmolLM, Llama 3, Qwen2). The `pre` key names how text is split before
  BPE; the merges in the file were learned on pieces split that way.
- `llama`: SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Phi-3, Gemma). Merges are
  derived from the token scores, best score first. Two families differ, as transformers' GGUF
  tokenizers (the reference the tests compare with) rebuild them: Phi-3 puts its space in front of
  every piece of text (a normalizer: "  hi" is ▁▁▁hi, as llama.cpp and its own tokenizer.json
  encode it); Gemma has no such space, stores its tokens of several spaces as spaces, and ranks
  its merges by the tokens' order in the file, not their scores.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from kvserve.errors import ModelFormatError
from kvserve.gguf_reader import open_gguf

log = logging.getLogger(__name__)

# GGUF token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# How text is split before BPE, by the GGUF `pre` name. Each regex keeps its matches as pieces.
_GPT2 = None  # the GPT-2 rule built into the ByteLevel pre-tokenizer
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS: dict[str, str | None] = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2, "smollm": _GPT2,
    "starcoder": _GPT2, "refact": _GPT2, "codeshell": _GPT2, "command-r": _GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}
# Vocabularies whose own tokenizer isolates every digit before the GPT-2 rule; the `exact` mode
# reproduces that, the default mode splits as the Hugging Face GGUF conversion does (GPT-2 rule only).
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell", "command-r"}
# `exact` mode: Qwen2's own tokenizer NFC-normalizes text first.
_NFC = {"qwen2", "deepseek-r1-qwen"}


@dataclass(frozen=True)
class GgufVocab:
    """What kvserve needs from a GGUF's tokenizer metadata, with the backend built from it."""

    backend: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    end_of_turn_ids: tuple[int, ...]  # tokenizer.ggml.eot_token_id / eom_token_id
    chat_template: str | None


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value section of a GGUF file (arrays as lists), read with the gguf package."""
    reader = open_gguf(Path(path))
    try:
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: corrupt GGUF metadata ({e}); download or convert it again") from None


def write_gguf_fields(writer: Any, fields: dict[str, Any]) -> None:
    """read_gguf_metadata's fields back into a gguf.GGUFWriter, each in the type it was read as
    (integer lists as arrays, ints as uint32): models and test files built with the default
    model's tokenizer copy it this way."""
    import gguf

    for key, value in fields.items():
        if isinstance(value, list) and value and isinstance(value[0], int):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))


def build_gguf_vocab(meta: dict[str, Any], *, exact_pre_tokenizer: bool = False) -> GgufVocab:
    """The backend tokenizer and special ids a GGUF's metadata describes."""
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError("GGUF without tokenizer.ggml.tokens; use a model file with its vocabulary.")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    names = ("bos", "eos", "unknown", "padding", "eot", "eom")
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in names}
    arch = meta.get("general.architecture", "")
    # Control tokens and the named special ids are special (skippable); user-defined ones are kept whole.
    named = {i for k, i in ids.items() if i is not None and k in ("bos", "eos", "unknown", "padding")}
    special = [i for i, ty in enumerate(types) if ty == _CONTROL or i in named]
    user_defined = [i for i, ty in enumerate(types) if ty == _USER_DEFINED]
    if model == "gpt2":
        backend = _byte_level(meta, tokens, set(special + user_defined), exact_pre_tokenizer)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
    elif model == "llama":
        backend = _sentencepiece(meta, tokens, ids["unknown"], exact_pre_tokenizer, arch)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", True)  # SentencePiece adds BOS unless told not to
    else:
        raise ModelFormatError(
            f"tokenizer {model!r} (architecture {arch!r}) in this GGUF is not supported; kvserve reads "
            "'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies."
        )
    backend.add_special_tokens([_added(tokens[i], True) for i in special])
    backend.add_tokens([_added(tokens[i], False) for i in user_defined])
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    backend.post_processor = _bos_eos_processor(
        (tokens[ids["bos"]], ids["bos"]) if add_bos and ids["bos"] is not None else None,
        (tokens[ids["eos"]], ids["eos"]) if add_eos and ids["eos"] is not None else None,
    )
    return GgufVocab(
        backend=backend,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        end_of_turn_ids=tuple(i for i in (ids["eot"], ids["eom"]) if i is not None),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.PostProcessor | None:
    """A post-processor that puts `bos` (text, id) in front of and/or `eos` after each sequence."""
    if bos is None and eos is None:
        return None

    def seq(name: str, type_id: int) -> list[str]:
        before = [f"{bos[0]}:{type_id}"] if bos else []
        return before + [f"${name}:{type_id}"] + ([f"{eos[0]}:{type_id}"] if eos else [])

    return processors.TemplateProcessing(
        single=seq("A", 0), pair=seq("A", 0) + seq("B", 1), special_tokens=[t for t in (bos, eos) if t]
    )


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _byte_level(meta: dict[str, Any], tokens: list[str], whole: set[int], exact: bool) -> Tokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelFormatError("gpt2-type GGUF vocabulary without tokenizer.ggml.merges: a damaged file.")
    # Normal tokens are stored in the byte alphabet (space as "Ġ"); one in plain text is respelled.
    # Tokens in `whole` (added tokens) keep their text: they are matched whole in the input.
    spell = _bytes_to_unicode()
    alphabet = set(spell.values())
    vocab = {
        t if i in whole or set(t) <= alphabet else "".join(spell[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    backend = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        log.warning("GGUF pre-tokenizer %r is unknown to kvserve: splitting by the GPT-2 rule, "
                    "ids may differ from the model's own tokenizer", pre)
    split = _PRE_SPLITS.get(pre, _GPT2)
    steps: list[pre_tokenizers.PreTokenizer]
    if split is None:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if exact and pre in _DIGITS_FIRST:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    if exact and pre in _NFC:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(meta: dict[str, Any], tokens: list[str], unk: int | None, exact: bool, arch: str) -> Tokenizer:
    gemma = arch.startswith("gemma")
    if gemma:  # its tokens of several spaces are stored as spaces; text reaches BPE with ▁ for each
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = [-float(i) for i in range(len(tokens))] if gemma else meta.get("tokenizer.ggml.scores")
        merges = _merges_from_scores(vocab, scores or [0.0] * len(tokens))
    unk_token = tokens[unk] if unk is not None else None
    backend = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # no space in front: each space is a ▁
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(steps)
        return backend
    if arch == "phi3":  # a ▁ in front of every piece of text, after a special token too
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)])
        return backend
    # A space is '▁'; the text gets one in front (only at its start, not after special tokens).
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True) if exact else True
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, ranked by the whole token's score."""
    found = []
    for token, score in zip(vocab, (scores[i] for i in vocab.values())):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token))]
        pairs = [(left, right) for left, right in pairs if left in vocab and right in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(left, right, score) for left, right in pairs]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest move to U+0100 onwards."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(moved)}}
