"""Text ↔ token ids for one model: the vocabulary (a GGUF's own, or tokenizer.json), the sandboxed
chat template, the rule that keeps client text from spelling control tokens, and incremental
detokenizing for streams.

  tokenizer.py      Tokenizer (encode, encode_chat, decode, fingerprint), IncrementalDetokenizer
  gguf_vocab.py     a GGUF file's vocabulary as a `tokenizers` backend; GGUF metadata fields
  chat_template.py  the chat template in jinja2's sandbox; ChatPrompt, the conversation it renders
  special_text.py   special-token spellings in client text masked, then encoded as text
"""
from kvserve.tokenizer.tokenizer import IncrementalDetokenizer, PromptTooLong, Tokenizer

__all__ = ["IncrementalDetokenizer", "PromptTooLong", "Tokenizer"]
