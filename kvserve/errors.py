"""kvserve's own exceptions: each says what was wrong and what to do about it."""
from __future__ import annotations

SHOWN_CHARS = 60  # of a client's value quoted back in an error message


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value` as an error message quotes it: its repr, cut to `limit` characters with its length
    said, so that a megabyte of bad input never comes back as a megabyte of error."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({size})"


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""


class ModelNotFoundError(KVServeError, FileNotFoundError):
    """A model name that is neither a known alias nor an existing path."""


class ModelFormatError(KVServeError, ValueError):
    """A model file that is truncated, corrupt, or of an unsupported architecture/quantization."""


class CacheClosedError(KVServeError, RuntimeError):
    """A KV cache used after close(): its blocks are already back in the pool."""


class OutOfBlocksError(KVServeError, RuntimeError):
    """The KV pool has no free block for a sequence that needs one."""


class InvalidParam(KVServeError, ValueError):
    """A request parameter (or the prompt) out of its allowed range; `param` names it as the API
    does ("temperature", "prompt", "max_tokens"), so a server can point the client at the field
    without parsing the message."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class NonFiniteLogitsError(KVServeError, RuntimeError):
    """The model produced NaN or +inf logits (or all -inf) for a sequence: no token can be chosen
    from them. Broken weights or an overflow in a low-precision dtype are the usual causes."""


class EngineStalledError(KVServeError, RuntimeError):
    """The engine has unfinished requests but can schedule none of them, now or ever, because
    blocks it cannot free (held outside the engine) keep the pool too full."""
