"""The errors a user can fix: each carries one line saying what is wrong and what to do.

Messages name parameters as the library spells them, in backticks (`dim`, `ef_search`): each front end renders
them its own way (the CLI as ``--dim``, the HTTP service as the JSON field name) with ``render``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

PARAM = re.compile(r"`([a-z][a-z0-9_]*)`")


class RetrievalError(Exception):
    """Base class. ``str(err)`` is a single line meant for the user; the CLI prints it and exits 1."""


class ConfigError(RetrievalError):
    """A parameter value that cannot work (``dim`` out of range, negative ``gamma``, ...)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class CorpusError(RetrievalError):
    """The input corpus is missing, not parquet, lacks a column, or holds bad values."""


class ModelError(RetrievalError):
    """The encoder model cannot be found or loaded."""


class IndexDirError(RetrievalError):
    """An index directory is missing, incomplete, corrupt, or was built differently than asked."""


class BusyError(IndexDirError):
    """Another process is writing the index directory."""


class PlantedLinkError(IndexDirError):
    """A symbolic link (or another kind of file) at one of the names retrieval keeps beside an index for itself:
    a lock file, a work folder, a previous version. Never followed: a link there could make a writer create,
    lock, rename or delete something outside the index."""


class Interrupted(RetrievalError):
    """The user stopped the command (Ctrl-C, or SIGTERM); the message says what was kept and how to continue."""

    exit_code = 130

    @classmethod
    def by(cls, stop: KeyboardInterrupt, rest: str = "") -> Interrupted:
        """ "interrupted" (Ctrl-C, exit 130) or "terminated" (SIGTERM, ``Terminated``, exit 143), then ``rest``."""
        terminated = isinstance(stop, Terminated)
        interrupted = cls(("terminated" if terminated else "interrupted") + rest)
        interrupted.exit_code = 143 if terminated else 130
        return interrupted


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, a timeout, docker stop), raised where Ctrl-C would be: it unwinds the command the same way."""


def render(err: BaseException, name: Callable[[str], str]) -> str:
    """The message with every `param` replaced by ``name(param)``, and nothing else changed."""
    return PARAM.sub(lambda match: name(match.group(1)), str(err))
