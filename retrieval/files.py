"""Files on disk: checksums, atomic writes, and swapping a finished directory into place."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name beside ``path``, flush to disk, then rename: readers see old or new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def work_dir(target: Path, purpose: str = "building") -> Path:
    """The hidden sibling where ``target`` is assembled; same filesystem, so the final rename is atomic."""
    return target.parent / f".{target.name}.{purpose}"


def publish(work: Path, target: Path) -> None:
    """Move a complete ``work`` directory to ``target``, replacing any previous one.

    The previous directory is first renamed aside and removed only after the new one is in place, so an
    interruption at any point leaves either the old index or the new one (or the old one, renamed aside, which
    ``recover`` puts back).
    """
    old = work_dir(target, "old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        os.rename(target, old)
    os.rename(work, target)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def replacing(target: Path, purpose: str) -> Iterator[Path]:
    """A fresh work directory for a new version of ``target``: published if the block completes, removed if not.

    A work directory left by an interrupted run is discarded first; the published target never depends on it.
    """
    work = work_dir(target, purpose)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    publish(work, target)


def recover(target: Path) -> None:
    """Undo an interrupted ``publish``: if the target vanished but its previous version is aside, restore it."""
    old = work_dir(target, "old")
    if not target.exists() and old.is_dir():
        os.rename(old, target)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (no copy, no risk to the source), copying where links are not possible."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
