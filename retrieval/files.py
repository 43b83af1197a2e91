"""Files on disk: checksums, atomic writes, one writer at a time, and swapping a finished directory into place."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retrieval.errors import IndexDirError


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
    """Undo an interrupted ``publish`` for a reader: restore the previous version if the target is missing.

    Not while a writer holds the target: there the gap is a publish in progress, not an interrupted one.
    """
    if not target.exists() and work_dir(target, "old").is_dir():
        try:
            with writing(target):  # taking the writer's lock restores it
                pass
        except IndexDirError:
            pass


@contextmanager
def writing(target: Path) -> Iterator[None]:
    """Hold the one writer's lock of ``target`` (build, add, refit), or fail at once if another process has it.

    Once the lock is held, an interrupted ``publish`` of the target is undone, so the writer starts from a whole
    index. The lock is ``flock`` on a hidden file beside the target, removed on release (a killed writer leaves
    the file but not the lock: the kernel drops it). Removing a lock file is safe only with a check: a process
    that opened it just before it was removed would lock a dead inode, so the lock counts only if the path
    still names the inode locked.
    """
    path = target.parent / f".{target.name}.lock"
    made = [d for d in [target.parent, *target.parent.parents] if not d.exists()]  # removed again if left empty
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise IndexDirError(
                f"another retrieval process is writing {target}; wait for it to finish, then try again"
            ) from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # a lock file removed under us: try again with a fresh one
    try:
        old = work_dir(target, "old")
        if not target.exists() and old.is_dir():
            os.rename(old, target)
        yield
    finally:
        os.unlink(path)  # before unlocking, so no one can take the lock on a file that is about to vanish
        os.close(fd)
        for directory in made:  # deepest first: a failed build leaves no empty folders behind
            try:
                directory.rmdir()
            except OSError:
                break


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (no copy, no risk to the source), copying where links are not possible."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
