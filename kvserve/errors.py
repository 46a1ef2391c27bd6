"""kvserve's own exceptions: each says what was wrong and what to do about it."""
from __future__ import annotations


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
    """A request parameter with a value kvserve cannot take; `param` names it as the API does
    ("temperature", "prompt", "max_tokens"), so a server can say which without parsing the text."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
