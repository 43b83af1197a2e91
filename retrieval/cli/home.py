"""Where index directories live by default, and which one ``search`` uses when none is named."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from retrieval import files
from retrieval.errors import IndexDirError

LAST_NAME = ".last-built"
log = logging.getLogger(__name__)


def index_root() -> Path:
    """``$RETRIEVAL_INDEX_ROOT``, else ``indexes/`` under the current directory."""
    return Path(os.environ.get("RETRIEVAL_INDEX_ROOT", "indexes"))


def default_out(corpus_path: Path) -> Path:
    """``indexes/<corpus stem>``: the file's stem, the folder's name, or a glob's last fixed folder's name."""
    path = Path(corpus_path)
    while any(c in path.name for c in "*?["):
        path = path.parent
    if path.name in ("", ".", ".."):  # "." or "..": the folder's own name, never indexes/.. (the root's parent)
        path = path.absolute().resolve()
    return index_root() / (path.stem or "corpus")


def remember(directory: Path) -> None:
    """Make ``directory`` the index ``search`` uses by default. A pointer that cannot be written (a read-only
    working directory, an index root that is a file) is a warning: the index itself is built and complete.
    Written atomically, by renaming a new file into place: a symbolic link planted at the pointer's name is
    replaced, never written through."""
    root = index_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        pointer = str(_pointer(Path(directory).resolve(), root.resolve())) + "\n"
        files.write_atomic(root / LAST_NAME, os.fsencode(pointer))
    except (OSError, IndexDirError) as err:
        log.warning(
            "%s is complete, but it could not be recorded as the default index in %s (%s); name it when you "
            "search: `retrieval search --index %s`",
            directory,
            root / LAST_NAME,
            getattr(err, "strerror", None) or err,
            directory,
        )


def default_index(name_it: str = "pass --index DIR") -> Path:
    """The last index built, or a clear error when there is none, ending in how the command names another
    (``name_it``: search takes ``--index DIR``, info and serve the directory as an argument)."""
    pointer = index_root() / LAST_NAME
    if index_root().exists() and not index_root().is_dir():
        raise IndexDirError(f"the index root {index_root()} is a file: set RETRIEVAL_INDEX_ROOT to a folder")
    if not pointer.is_file():
        raise IndexDirError(
            f"no index has been built yet (nothing recorded in {pointer}); run `retrieval index CORPUS.parquet` "
            f"first, or {name_it}"
        )
    # a relative pointer is the root's, an absolute one stands; only the newline goes (a name may start with a space)
    directory = index_root() / pointer.read_text().rstrip("\n")
    if not os.path.lexists(directory) and files.renamed_aside(files.resolved(directory)) is None:
        raise IndexDirError(
            f"the default index (the last one built, as recorded in {pointer}) is gone from {directory}: it was "
            f"moved or deleted; {name_it} to use another index, or build one with `retrieval index CORPUS`"
        )
    return directory


def _pointer(directory: Path, root: Path) -> Path:
    """How the pointer names ``directory``: relative to the index root when inside it, so a project copied or
    moved with its ``indexes/`` finds its own index (an absolute path sent a copy to the original's index, and
    a moved project to a path that no longer exists); absolute otherwise."""
    try:
        return directory.relative_to(root)
    except ValueError:
        return directory
