"""The errors a user can fix: each carries one line saying what is wrong and what to do."""

from __future__ import annotations


class RetrievalError(Exception):
    """Base class. ``str(err)`` is a single line meant for the user; the CLI prints it and exits 1."""


class ConfigError(RetrievalError):
    """An option value that cannot work (``--dim`` out of range, negative gamma, ...)."""


class CorpusError(RetrievalError):
    """The input corpus is missing, not parquet, lacks a column, or holds bad values."""


class ModelError(RetrievalError):
    """The encoder model cannot be found or loaded."""


class IndexDirError(RetrievalError):
    """An index directory is missing, incomplete, corrupt, or was built differently than asked."""
