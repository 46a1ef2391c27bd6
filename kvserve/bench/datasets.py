"""The prompts a serving benchmark sends: random, shared-prefix, copy-heavy, or read from a JSONL file.

Prompts are text, not token ids: every OpenAI-compatible server accepts text, while token ids
only mean the same thing to a server with the same tokenizer. To keep the lengths right anyway,
random prompts are made of words that are exactly one token each under the model's tokenizer
(" the", " house", …), joined by single spaces: byte-level BPE splits text at spaces before it
merges, so N such words are N tokens. The servers' own `usage` then reports what each really
counted, and the result shows it next to the requested length.

The copy workload asks for a passage to be written out again with one word changed: passages of
real text (kvserve's own source files, which ship with it) of about input_len tokens. An answer
that copies its prompt is where speculative decoding by prompt lookup pays; random words are
where it cannot.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_WORD = re.compile(r"^ [a-z]{2,12}$")


@dataclass(frozen=True)
class Sample:
    prompt: str
    prompt_len: int  # tokens, by the local tokenizer (-1 where unknown: a JSONL prompt without one)
    output_len: int


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"  # random | prefix | copy | jsonl
    num_prompts: int = 100
    input_len: int = 128  # random: prompt tokens; prefix: tokens after the shared prefix; copy: the passage's
    output_len: int = 128
    prefix_len: int = 256  # prefix: tokens of each shared prefix
    num_prefixes: int = 4  # prefix: how many distinct prefixes the prompts share
    path: str | None = None  # jsonl: {"prompt": ...} (or {"messages": [...]}) per line, optional "output_len"
    seed: int = 0


class WordVocabulary:
    """Lower-case words that are one token each, with a space in front, under one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        words = []
        for token_id in range(tokenizer.vocab_size):
            if token_id in tokenizer.special_token_ids:
                continue
            text = tokenizer.decode([token_id])
            if _WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append(text)
        if len(words) < 100:
            raise ValueError(f"the tokenizer has only {len(words)} single-token words; random prompts need more")
        self.words = words

    def text(self, rng: random.Random, num_tokens: int) -> str:
        return "".join(rng.choice(self.words) for _ in range(num_tokens))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def default_tokenizer(model: str | None) -> Any:
    """kvserve's tokenizer for a model name kvserve can load (alias, .gguf, HF directory)."""
    from kvserve.model.loader import resolve_model_path
    from kvserve.tokenizer import Tokenizer

    return Tokenizer.load(resolve_model_path(model or "smollm2-135m"))


def random_samples(cfg: DatasetConfig, vocab: WordVocabulary) -> list[Sample]:
    rng = random.Random(cfg.seed)
    out = []
    for _ in range(cfg.num_prompts):
        text = vocab.text(rng, cfg.input_len)
        out.append(Sample(text, vocab.count(text), cfg.output_len))
    return out


def prefix_samples(cfg: DatasetConfig, vocab: WordVocabulary) -> list[Sample]:
    """num_prefixes shared prefixes; each prompt is one of them (in turn) plus its own suffix."""
    rng = random.Random(cfg.seed)
    prefixes = [vocab.text(rng, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    out = []
    for i in range(cfg.num_prompts):
        text = prefixes[i % cfg.num_prefixes] + vocab.text(rng, cfg.input_len)
        out.append(Sample(text, vocab.count(text), cfg.output_len))
    return out


COPY_INSTRUCTION = ("Rewrite the following passage exactly as it is, changing only the word \"{old}\" to \"{new}\" "
                    "wherever it appears. Reply with the passage only.\n\n{passage}")
_COPY_WORD = re.compile(r"\b[a-z]{4,12}\b")


COPY_CORPUS = Path(__file__).with_name("copy_corpus.txt")


def copy_files() -> list[list[str]]:
    """The copy corpus's files, as lines: kvserve modules frozen in COPY_CORPUS, so that the workload
    (and what drafting gains on it) does not move whenever kvserve's own source does."""
    files: list[list[str]] = []
    for line in COPY_CORPUS.read_text(encoding="utf-8").splitlines():
        if line.startswith("# ==== "):
            files.append([])
        elif files:
            files[-1].append(line)
    return files


def copy_samples(cfg: DatasetConfig, tokenizer: Any) -> list[Sample]:
    """Passages of about input_len tokens from the copy corpus, each with a word to change."""
    files = copy_files()
    rng = random.Random(cfg.seed)
    out: list[Sample] = []
    while len(out) < cfg.num_prompts:
        lines = rng.choice(files)
        start = rng.randrange(len(lines))
        taken, n = [], 0
        for line in lines[start:]:
            taken.append(line)
            n += len(tokenizer.encode(line + "\n", add_special_tokens=False))
            if n >= cfg.input_len:
                break
        words = sorted(set(_COPY_WORD.findall("\n".join(taken))))
        if n < cfg.input_len // 2 or len(words) < 2:
            continue  # the end of a file, or no words: draw again
        old, new = rng.sample(words, 2)
        prompt = COPY_INSTRUCTION.format(old=old, new=new, passage="\n".join(taken))
        out.append(Sample(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), cfg.output_len))
    return out


def jsonl_samples(cfg: DatasetConfig, tokenizer: Any | None) -> list[Sample]:
    if not cfg.path:
        raise ValueError("--dataset jsonl needs --dataset-path FILE")
    path = Path(cfg.path)
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"] if "prompt" in row else row["messages"][-1]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": \"...\"}} or {{\"messages\": [...]}}") from None
            n = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer is not None else -1
            out.append(Sample(prompt, n, int(row.get("output_len", cfg.output_len))))
            if len(out) == cfg.num_prompts:
                break
    if not out:
        raise ValueError(f"{path} holds no prompts")
    while len(out) < cfg.num_prompts:  # fewer lines than prompts asked: go round again
        out.append(out[len(out) % len(out)])
    return out


def load_samples(cfg: DatasetConfig, tokenizer: Any | None) -> list[Sample]:
    if cfg.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, not {cfg.num_prompts}")
    if cfg.name == "jsonl":
        return jsonl_samples(cfg, tokenizer)
    if cfg.name not in ("random", "prefix", "copy"):
        raise ValueError(f"--dataset must be random, prefix, copy or jsonl, not {cfg.name!r}")
    if tokenizer is None:
        raise ValueError(f"--dataset {cfg.name} needs a tokenizer (--tokenizer MODEL)")
    if cfg.name == "copy":
        return copy_samples(cfg, tokenizer)
    vocab = WordVocabulary(tokenizer)
    return random_samples(cfg, vocab) if cfg.name == "random" else prefix_samples(cfg, vocab)
