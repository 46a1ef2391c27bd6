"""kvserve.tokenizer against transformers' tokenizer of the same GGUF: ids, text, chat prompts, streaming."""
from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import pytest

from kvserve.tokenizer.chat_template import ChatTemplateError
from kvserve.errors import ModelNotFoundError
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer
from kvserve.tokenizer.gguf_vocab import read_gguf_metadata, write_gguf_fields

CHINESE_PROSE = (
    "清晨的山谷里弥漫着薄雾，远处传来几声鸟鸣。老人沿着石板路慢慢走向田边，手里提着一篮刚摘下的青菜。"
    "他停下脚步，望着被阳光一点点照亮的稻田，想起了年轻时在这里插秧的日子。那时候村子里热闹得很，"
    "孩子们在河边追逐嬉戏，大人们忙着收割。如今年轻人大多去了城市，只剩下他和几位老邻居守着这片土地。"
)
CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag, 👍🏿 thumbs",
    "flags: 🇺🇸🇯🇵🇫🇷🇩🇪 and keycaps 1️⃣#️⃣",
    "中文字符和标点：你好，世界！",
    CHINESE_PROSE,
    "日本語のテキスト：東京は晴れ、カタカナとひらがな。",
    "한국어 문장입니다. 안녕하세요!",
    "النص العربي من اليمين إلى اليسار مع أرقام ١٢٣",
    "combining: e\u0301 n\u0303 a\u0308\u0304 Z\u0351\u0308\u033d\u0353 and precomposed é ñ",
    "   leading spaces",
    "trailing spaces   ",
    "runs    of     spaces\n\n\n\nnewlines\t\t\ttabs \t \n mixed\r\n",
    "\n",
    " ",
    "digits 1234567 3.14159 0.000001 -42 1e10 ½ ²³",
    "a  1, x   12, hello\n\n 3",  # spaces before digits
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
    '{"key": [1, 2, {"nested": null}], "s": "a\\"b"}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special mid-word: abc<|im_end|>def<|endoftext|>",
    "<|im_start|><|im_start|> <|im_end|>",
    "not special: <|im_star|> <im_end> < |im_end| >",
    "don't won't it's I'm we'll they'd you've",
    "URL https://example.com/a?b=c&d=e#frag and email a.b@c.org",
    "math ∑_{i=1}^n x_i² ≤ ∞, ∀x ∈ ℝ",
    "mixed العربية English 中文 русский текст",
    "control \x00 \x01 \x7f chars",
    "a replacement char \ufffd in the text",
    "supercalifragilisticexpialidocious" * 3,
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🐔 中文"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces \n\n and <|im_end|> inside "}],
]


@pytest.fixture(scope="module")
def tok(default_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf)


def _ids(s: str) -> str:
    return s[:20] + ("…" if len(s) > 20 else "")


# -- ids and text equal the reference -----------------------------------------------------------
@pytest.mark.parametrize("text", CORPUS, ids=_ids)
def test_encode_equals_reference(tok, hf_tokenizer, text):
    assert tok.encode(text) == hf_tokenizer(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", CORPUS, ids=_ids)
def test_decode_equals_reference(tok, hf_tokenizer, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tokenizer.decode(ids) == text  # byte-level BPE is lossless
    assert tok.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_model_facts(tok, hf_tokenizer):
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.adds_bos) == (1, 2, False)
    assert tok.eos_token_ids == {2}  # <|im_end|>: EOS and the template's end of turn
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("no such token") is None
    assert tok.id_to_token(905) == hf_tokenizer.convert_ids_to_tokens(905) == "Ġworld"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_token(10**6)


def test_exact_pre_tokenizer_splits_digits_apart(default_gguf, tok, hf_tokenizer):
    """The model's own tokenizer isolates digits before the GPT-2 rule; the reference does not.
    They differ only where whitespace runs into a digit."""
    exact = Tokenizer.from_gguf(default_gguf, exact_pre_tokenizer=True)
    assert [exact.id_to_token(i) for i in exact.encode("a  1")] == ["a", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("a  1")] == ["a", "Ġ", "Ġ", "1"]
    same = [t for t in CORPUS if exact.encode(t) == hf_tokenizer(t)["input_ids"]]
    assert len(same) == len(CORPUS) - 3  # "a  1, x   12", "½ ²³" and Arabic-Indic "١٢٣"


# -- streaming detokenization ---------------------------------------------------------------------
def _stream(tok: Tokenizer, ids: list[int], sizes, skip: bool, prompt_ids=None) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_ids=prompt_ids)
    deltas, i = [], 0
    for n in sizes:
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text and detok.token_ids == ids
    return deltas, detok.text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", CORPUS, ids=_ids)
def test_incremental_detokenizer(tok, text, skip):
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=skip)
    rng = random.Random(len(text))
    chunked = [rng.randint(1, 4) for _ in ids]
    for sizes in ([1] * len(ids), chunked):
        deltas, streamed = _stream(tok, ids, sizes, skip)
        assert streamed == full
        if "\ufffd" not in text:
            assert not any("\ufffd" in d for d in deltas)
            assert deltas[-1] == ""  # nothing was left held back


def test_incremental_detokenizer_random_ids(tok):
    """Arbitrary ids (invalid UTF-8, specials anywhere) still concatenate to the full decode."""
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            _, streamed = _stream(tok, ids, [rng.randint(1, 3) for _ in ids], skip)
            assert streamed == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_with_prompt(tok):
    prompt = tok.encode_chat([{"role": "user", "content": "hi"}])
    ids = tok.encode(" Hello 世界! 👨‍👩‍👧<|im_end|>", add_special_tokens=False)
    _, streamed = _stream(tok, ids, [1] * len(ids), True, prompt_ids=prompt)
    assert streamed == " Hello 世界! 👨‍👩‍👧"


def test_incremental_window_stays_small(tok):
    ids = tok.encode(CHINESE_PROSE * 20)
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.add([i])
        assert len(detok._window) <= 8
    assert detok.text == tok.decode(ids)


# -- chat template --------------------------------------------------------------------------------
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: f"{len(m)}msgs")
def test_chat_template_equals_reference(tok, hf_tokenizer, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == ref
    ref_ids = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )["input_ids"]
    # transformers turns special-token spellings inside content into control tokens; kvserve keeps
    # them text unless asked (a user must not forge a turn), and is otherwise identical.
    spelt = any(tok.has_special_text(m["content"]) for m in messages)
    assert tok.encode_chat(messages, add_generation_prompt, special_tokens_in_content=True) == ref_ids
    assert (tok.encode_chat(messages, add_generation_prompt) == ref_ids) == (not spelt)


def test_template_variables_and_helpers(tok):
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ messages[0] | tojson }}|{{ extra_flag }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
        "{% generation %}gen{% endgeneration %}|{{ strftime_now('%Y') | length }}"
    )
    out = tok.with_chat_template(template).apply_chat_template(
        [{"role": "user", "content": "é<>", "name": None}, {"role": "x", "content": ""}], extra_flag=7
    )
    assert out == '<|im_start|>|<|im_end|>|{"role": "user", "content": "é<>"}|7|user|gen|4'


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{{ messages.__class__.__base__.__subclasses__() }}", "unsafe"),
        ("{{ cycler.__init__.__globals__ }}", "unsafe"),
        ("{% set x = messages.append(1) %}", "unsafe"),
        ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    ],
)
def test_template_sandbox_and_errors(tok, template, message):
    bad = tok.with_chat_template(template)
    with pytest.raises(ValueError, match=message):
        bad.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_are_clear(tok, default_gguf):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.with_chat_template("{% for m in messages %}")
    with pytest.raises(ValueError, match="dict"):
        tok.apply_chat_template(["hi"])
    plain = Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2)  # a model with no template: ChatML
    assert not plain.has_chat_template
    assert plain.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# -- other sources: a Hugging Face directory, other GGUF vocabularies -----------------------------
def test_from_hf_dir_and_load(tmp_path, tok, hf_tokenizer, default_gguf):
    hf_tokenizer.save_pretrained(tmp_path)
    from_dir = Tokenizer.load(tmp_path)
    for text in CORPUS:
        assert from_dir.encode(text) == tok.encode(text)
    for messages in CONVERSATIONS:
        assert from_dir.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert (from_dir.bos_token_id, from_dir.eos_token_ids) == (tok.bos_token_id, tok.eos_token_ids)
    assert Tokenizer.load(default_gguf).encode("a b") == tok.encode("a b")
    with pytest.raises(ModelNotFoundError):
        Tokenizer.load(tmp_path / "missing")


def test_hf_dir_bos_template_and_stop_ids(tmp_path, hf_tokenizer):
    """A tokenizer.json that adds BOS, the template inside tokenizer_config.json, an eos list in
    generation_config.json."""
    from tokenizers import Tokenizer as Backend, processors
    from transformers import AutoTokenizer

    hf_tokenizer.save_pretrained(tmp_path)
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(chat_template=template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours, ref = Tokenizer.from_hf_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in CORPUS:
        assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.adds_bos and ours.encode("x")[0] == 1
    assert ours.eos_token_ids == {0, 2}
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.encode_chat(messages)[:2] == [1, 9690]  # the template's <|im_start|> is the BOS: not doubled


def _write_gguf(path: Path, fields: dict, arch: str = "llama") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    write_gguf_fields(writer, fields)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow  # ~4 s each: transformers converts the vocabulary
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_variants_equal_reference(tmp_path, default_gguf, pre):
    """The default model's vocabulary re-labelled: other split rules, BOS on, a user-defined token."""
    from transformers import AutoTokenizer

    meta = read_gguf_metadata(default_gguf)
    types = list(meta["tokenizer.ggml.token_type"])
    types[16] = 4  # <empty_output> as a user-defined (not special) token
    fields = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    fields.update({"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.token_type": types})
    path = _write_gguf(tmp_path / "v.gguf", fields)
    ours, ref = Tokenizer.from_gguf(path), AutoTokenizer.from_pretrained(tmp_path, gguf_file="v.gguf")
    for text in CORPUS + ["x<empty_output>y"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == 1  # BOS added
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert 16 not in ours.special_token_ids and 1 in ours.special_token_ids


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory) -> Path:
    """A small SentencePiece-style vocabulary (▁ for space, <0xXX> byte fallback, scores) trained here."""
    from tokenizers import Tokenizer as Backend, models, pre_tokenizers, trainers

    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    backend.train_from_iterator([t for t in CORPUS if t.isascii()] * 20 + ["我们 世界 你好"], trainer)
    learned = sorted(backend.get_vocab().items(), key=lambda kv: kv[1])[3:]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in learned]
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    scores = [0.0] * 259 + [-float(i) for i in range(len(learned))]
    fields = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return _write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", fields)


def test_sentencepiece_gguf_equals_reference(sentencepiece_gguf):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf(sentencepiece_gguf)
    ref = AutoTokenizer.from_pretrained(sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name)
    assert ours.adds_bos and ours.bos_token_id == 1
    for text in CORPUS + ["<s>hi</s> there", "  two leading"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        for skip in (True, False):
            full = ours.decode(ids, skip_special_tokens=skip)
            assert full == ref.decode(ids, skip_special_tokens=skip), text
            rng = random.Random(len(text))
            _, streamed = _stream(ours, ids, [rng.randint(1, 3) for _ in ids], skip)
            assert streamed == full, text


def test_sentencepiece_stream_keeps_leading_space_after_prompt(sentencepiece_gguf):
    ours = Tokenizer.from_gguf(sentencepiece_gguf)
    prompt, reply = ours.encode("hello"), ours.encode(" world 世", add_special_tokens=False)
    _, streamed = _stream(ours, reply, [1] * len(reply), True, prompt_ids=prompt)
    whole = ours.decode(prompt + reply, skip_special_tokens=True)
    assert streamed == whole[len(ours.decode(prompt, skip_special_tokens=True)) :] == " world 世"
    assert ours.decode(reply) == "world 世"  # decoded alone, the first space is dropped


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory) -> Path:
    """A small vocabulary spelt as a Gemma GGUF is: no space in front of text, tokens of several spaces
    stored as spaces, no merges (their order is the tokens' order), Gemma's control tokens."""
    from tokenizers import Tokenizer as Backend, models, pre_tokenizers, trainers

    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False)
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    backend.train_from_iterator([t for t in CORPUS if t.isascii()] * 20 + ["我们 世界 你好"], trainer)
    learned = [t for t, _ in sorted(backend.get_vocab().items(), key=lambda kv: kv[1])]
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    spaces = [" " * n for n in range(2, 6)]
    tokens = control + [f"<0x{b:02X}>" for b in range(256)] + spaces + learned
    types = [3] * len(control) + [6] * 256 + [1] * (len(spaces) + len(learned))
    fields = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    return _write_gguf(tmp_path_factory.mktemp("gemma") / "gemma.gguf", fields, "gemma3")


def test_a_gemma_gguf_vocabulary_equals_transformers(gemma_gguf):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf(gemma_gguf)
    ref = AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)
    assert ours.adds_bos and ours.bos_token_id == 2
    for text in CORPUS + ["<start_of_turn>user\n  two  spaces<end_of_turn>", "  lead", "a     b"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    assert ours.encode("a  b", add_special_tokens=False)[1] == 262  # "  " (the vocabulary's "▁▁"), whole


def test_phi3s_gguf_vocabulary_encodes_as_llama_cpp_does() -> None:
    """llama.cpp's own vocabulary test for Phi-3 (its models/ggml-vocab-phi-3.gguf and the ids its
    tokenizer gives each text): every text, leading spaces included."""
    from benchmarks.peers import llama_cpp_sources

    models = llama_cpp_sources(progress=lambda _: None) / "models"
    ours = Tokenizer.from_gguf(models / "ggml-vocab-phi-3.gguf")
    texts = (models / "ggml-vocab-phi-3.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = (models / "ggml-vocab-phi-3.gguf.out").read_text().split("\n")
    pairs = list(zip(texts, expected))
    assert len(pairs) > 40
    for text, ids in pairs:
        assert ours.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()], repr(text)
