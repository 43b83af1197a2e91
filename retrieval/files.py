"""Files on disk: checksums, atomic writes, one writer at a time, and swapping a finished directory into place."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from retrieval.errors import BusyError, IndexDirError, PlantedLinkError

QUICK_FULL_BELOW = 64 << 20  # files smaller than this are hashed whole even by the quick check
QUICK_BLOCKS, QUICK_BLOCK_BYTES = 64, 1 << 16  # larger ones: 64 blocks of 64 KiB spread from first byte to last
PART_SAMPLE_BLOCKS, PART_SAMPLE_BYTES = 4, 1 << 12  # a stash part's sampled hash: 4 pages (``part_fingerprint``)
log = logging.getLogger(__name__)


def more_open_files() -> None:
    """Raise this process's soft limit on open files to its hard limit (as Ray and most servers do), where it is
    lower. Each memory-mapped stash part holds a descriptor: a stash of more parts than the soft limit (often
    1,024) otherwise failed to re-score with "Too many open files"."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            pass  # the error that sent us here is reported as it is


def not_utf8(path: Path) -> str | None:
    """None for a path whose name is UTF-8 text; else the path to show (its undecodable bytes as ``\\xNN``).
    pyarrow, FAISS and the manifest take paths as UTF-8 text: such a name failed deep inside them."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def quick_sha256(
    path: Path, full_below: int | None = None, blocks: int | None = None, block_bytes: int | None = None
) -> str:
    """A cheap fingerprint: sha256 of the whole file when small, else of its size and 4 MiB sampled evenly
    (``QUICK_*`` unless given).

    What a one-shot search checks (2.9 GiB of index would take seconds to hash whole); it catches truncation,
    a zeroed or replaced file and most corruption, while ``sha256`` (``info --verify``, the service) catches all."""
    full_below = QUICK_FULL_BELOW if full_below is None else full_below
    blocks = QUICK_BLOCKS if blocks is None else blocks
    block_bytes = QUICK_BLOCK_BYTES if block_bytes is None else block_bytes
    size = os.path.getsize(path)
    if size < full_below:
        return sha256(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        for offset in np.linspace(0, max(size - block_bytes, 0), blocks).astype(np.int64).tolist():
            fh.seek(offset)
            digest.update(fh.read(block_bytes))
    return digest.hexdigest()


def part_fingerprint(path: Path) -> str:
    """A stash part's sampled hash: 4 pages of 4 KiB, first byte to last (the whole file below 16 KiB). A stash
    is hundreds of parts, so a one-shot search that re-scores checks 16 KiB of each (~0.1 ms a part, warm, most
    of it opening the file; 1M rows in 2,048-row parts: ~50 ms, not the 1.5 GB of a whole check); rows shuffled,
    zeroed or overwritten change every page, a single row edited may escape it."""
    return quick_sha256(path, PART_SAMPLE_BLOCKS * PART_SAMPLE_BYTES, PART_SAMPLE_BLOCKS, PART_SAMPLE_BYTES)


WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


@contextmanager
def write_errors(target: Path) -> Iterator[None]:
    """A full disk, a read-only tree or a permission refused while writing ``target``: one line, not a traceback.

    Writers publish only complete versions, so whatever failed, the previous index is unchanged."""
    try:
        yield
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        where = err.filename or target
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise IndexDirError(
                f"no space left on the device while writing {where}; free some space and run again "
                f"(the previous index at {target}, if any, is unchanged)"
            ) from err
        raise IndexDirError(
            f"cannot write {where} ({err.strerror}); index, add, remove, refit and --apply need a writable "
            "directory (search works on a read-only index)"
        ) from err


def resolved(target: Path) -> Path:
    """``target`` with symbolic links resolved: writers replace the real directory (a link to it stays valid),
    and one lock guards it whichever alias names it."""
    return Path(target).expanduser().resolve()


def inside(root: Path, name: str) -> bool:
    """True when ``name`` is a plain relative path that stays inside ``root``, symbolic links resolved."""
    path = Path(name)
    if not name or path.is_absolute() or ".." in path.parts:
        return False
    base = Path(root).resolve()
    target = (Path(root) / path).resolve()
    return base in target.parents


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name beside ``path``, flush to disk, then rename: readers see old or new, never half.

    The temporary name is the writing process's own, so two processes writing the same file (a retried Ray task
    and a dying attempt of it) never interleave their bytes in one temporary file. A failed or interrupted
    write removes it. A symbolic link at the temporary name is refused, never written through; one at ``path``
    is replaced by the file, not followed."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = _open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "temporary file", 0o666)  # a link there: left as is
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def output_errors(path: Path) -> Iterator[None]:
    """A result file or folder (``eval --per-query``, ``tune --results``, the demo's corpus) that cannot be
    written, a full disk or a read-only or forbidden place: one line, not a traceback."""
    try:
        yield
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise IndexDirError(f"no space left on the device while writing {path}: free some space") from err
        raise IndexDirError(f"cannot write {path} ({err.strerror}): choose a place you can write to") from err


# The work directories of updates (``replacing``): never resumed, so any left when a writer takes the lock is a
# killed writer's, and goes. A build's ("building") is kept for ``--resume``.
UPDATE_PURPOSES = ("adding", "refitting", "removing", "calibrating", "fusing")
# Every hidden sibling a writer makes beside an index ("old": the previous version, renamed aside by ``publish``)
OWN_PURPOSES = ("building", "old", *UPDATE_PURPOSES)


def _own_kind(path: Path) -> str:
    """What this tool keeps at ``path``, one of its own names beside an index, in words."""
    name = Path(path).name
    if name.endswith(".lock"):
        return "writer's lock file"
    if name.endswith(".old"):
        return "previous version of an index"
    if name.endswith(".tmp"):
        return "temporary file"
    return "work folder"


def refuse_link(path: Path) -> None:
    """Refuse a symbolic link at ``path``, one of this tool's own names (a lock file, a work folder, a previous
    version): followed, it would make a writer create, lock, rename or delete something outside the index."""
    if os.path.islink(path):
        raise PlantedLinkError(
            f"{path} is a symbolic link where retrieval keeps its {_own_kind(path)}, and such links are never "
            "followed: remove the link (retrieval did not make it), then run again"
        )


def _open_own(path: Path, flags: int, kind: str, mode: int = 0o644) -> int:
    """``os.open`` of one of this tool's own files without following a symbolic link at its name (refused in
    one line) and without blocking on a FIFO planted there; anything but a regular file is refused too."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_link(path)
        if err.errno in (errno.EISDIR, errno.ENXIO):  # a folder, or a FIFO or socket with no one at the other end
            raise PlantedLinkError(f"{path} is not a file but retrieval keeps its {kind} there: remove it") from err
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PlantedLinkError(f"{path} is not a file but retrieval keeps its {kind} there: remove it")
    os.set_blocking(fd, True)
    return fd


def work_dir(target: Path, purpose: str = "building") -> Path:
    """The hidden sibling where ``target`` is assembled; same filesystem, so the final rename is atomic."""
    return target.parent / f".{target.name}.{purpose}"


def publish(work: Path, target: Path, own: Collection[str] = ()) -> None:
    """Move a complete ``work`` directory to ``target``, replacing any previous one.

    Entries of the previous directory whose names are not in ``own`` (a user's notes, results) are carried into
    the new one first, as hard links (nothing is copied, and the originals stay until the swap has happened).
    The previous directory is renamed aside and removed only after the new one is in place, so an interruption
    at any point leaves either the old index or the new one (or the old one, renamed aside, which ``recover``
    puts back).
    """
    old = work_dir(target, "old")
    if os.path.lexists(old):
        remove_tree(old)
    if target.is_dir():
        for entry in target.iterdir():
            if entry.name not in own and not (work / entry.name).exists():
                _link_tree(entry, work / entry.name)
        keep_permissions(work, target)
    sync_tree(work)  # on disk before it is named: after a power cut the index is whole, never empty files
    if target.exists():
        os.rename(target, old)
    os.rename(work, target)
    sync_directory(target.parent)  # the renames themselves
    try:
        remove_tree(old)
    except OSError as err:  # the new version is in place; the next writer removes the old one (or says why)
        log.warning("%s is published, but its previous version %s could not be removed: %s", target, old, err)


def remove_tree(path: Path) -> None:
    """``shutil.rmtree`` of a tree this tool left at one of its own names (a previous version, a killed
    writer's work). A symbolic link there is refused, never followed nor removed. A write-protected tree
    (``chmod -R a-w``) could not be emptied, and every later writer failed on it: its folders are then opened
    up where this user owns them (only an owner may chmod; a group member of a shared index removes without
    it)."""
    refuse_link(path)
    if not path.exists():
        return
    try:
        shutil.rmtree(path)
        return
    except PermissionError:
        pass
    for directory, _, _ in os.walk(path):  # top-down: each folder writable before its entries are removed
        try:
            os.chmod(directory, stat.S_IMODE(os.stat(directory).st_mode) | stat.S_IRWXU)
        except PermissionError:
            pass
    shutil.rmtree(path)


def keep_permissions(work: Path, target: Path) -> None:
    """Give the new version ``work`` the permissions of the ``target`` it replaces: its folders the target's mode
    (and group, where this user may set it), each file written for it the same read/write bits (a folder of 700
    gets files of 600, 2775 gets 664). Every publish made them the writer's umask's: a private index (700/600)
    became readable by all after one ``add``. Files hard-linked from the old version keep their own mode."""
    info = os.stat(target)
    folder_mode, file_mode = stat.S_IMODE(info.st_mode), stat.S_IMODE(info.st_mode) & 0o666
    for directory, _, names in os.walk(work):
        paths = [(directory, folder_mode)]
        for name in names:
            path = os.path.join(directory, name)
            if not os.path.islink(path) and os.stat(path).st_nlink == 1:  # linked: the old version's own file
                paths.append((path, file_mode))
        for path, mode in paths:
            os.chmod(path, mode)
            if os.stat(path).st_gid != info.st_gid:
                try:
                    os.chown(path, -1, info.st_gid)
                except PermissionError:  # not a member of that group: the mode still applies
                    pass


def is_mount_point(path: Path) -> bool:
    """``os.path.ismount``, or ``path`` listed as a mount point in /proc/self/mountinfo: ismount compares devices
    with the parent's, so a bind mount within one file system (how containers mount volumes) passes unseen."""
    if os.path.ismount(path):
        return True
    try:
        lines = Path("/proc/self/mountinfo").read_bytes().splitlines()
    except OSError:
        return False
    unescape = re.compile(rb"\\([0-7]{3})")  # spaces, tabs, newlines and backslashes are written as \ooo
    wanted = os.fsencode(os.path.realpath(path))
    points = (line.split(b" ")[4] for line in lines if line.count(b" ") >= 4)
    return any(unescape.sub(lambda m: bytes([int(m.group(1), 8)]), point) == wanted for point in points)


def check_replaceable(target: Path) -> None:
    """Refuse, before any work, a ``target`` that a writer could not replace by renaming a new version into its
    place: a mount point (a container's volume: the rename failed with "Device or resource busy" after the whole
    encoding) or a write-protected folder (``chmod a-w``: it was replaced anyway, then its old version could not
    be removed)."""
    if not target.is_dir():
        return
    if is_mount_point(target):
        raise IndexDirError(
            f"{target} is a mount point, and a new version is published by renaming a folder into its place: "
            "mount the folder that holds it instead (the index is a folder inside the mount)"
        )
    if not os.access(target, os.W_OK) or not stat.S_IMODE(os.stat(target).st_mode) & 0o222:
        raise IndexDirError(
            f"{target} is write-protected; make it writable (`chmod -R u+w {target}`) to change it, or build "
            "another index beside it"
        )


def sync_tree(root: Path) -> None:
    """fsync every file under ``root``, then each directory (its entries), deepest first. Files the writers
    already flushed (the manifest, stash parts) cost nothing more; the rest were only in the page cache."""
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            path = os.path.join(directory, name)
            if stat.S_ISREG(os.lstat(path).st_mode):  # a user's link, FIFO or socket carried over: nothing to flush
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        sync_directory(Path(directory))


def sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_tree(src: Path, dst: Path) -> None:
    """``src`` (file, folder or symbolic link) recreated at ``dst`` with hard links, copying across devices."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=link_or_copy)
    else:
        link_or_copy(src, dst)


@contextmanager
def replacing(target: Path, purpose: str, own: Collection[str] = ()) -> Iterator[Path]:
    """A fresh work directory for a new version of ``target``: published if the block completes, removed if not.

    A work directory left by an interrupted run is discarded first; the published target never depends on it.
    """
    if purpose not in UPDATE_PURPOSES:
        raise ValueError(f"unknown update purpose {purpose!r}; add it to UPDATE_PURPOSES")
    work = work_dir(target, purpose)
    if os.path.lexists(work):
        remove_tree(work)
    work.mkdir()  # beside the target, which exists; never through a link planted at the name since
    try:
        yield work
        publish(work, target, own)
    except BaseException:  # interrupted in publish too: whichever version is in place stays, the work goes
        shutil.rmtree(work, ignore_errors=True)
        raise


def renamed_aside(target: Path) -> Path | None:
    """The previous version of a missing ``target`` that a ``publish`` interrupted between its two renames left
    aside (a real folder, not a link), else None. Only looked at: the next writer puts it back (``writing``)."""
    old = work_dir(target, "old")
    if os.path.lexists(target) or not stat.S_ISDIR(_lstat_mode(old)):
        return None
    return old


def restore(target: Path) -> None:
    """A writer's first step, before it reads the settings it keeps: put back the previous version that an
    interrupted ``publish`` left aside (``writing`` does, under the lock, and refuses a link there)."""
    target = resolved(target)
    if not os.path.lexists(target) and os.path.lexists(work_dir(target, "old")):
        with writing(target):
            pass


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


@contextmanager
def writing(target: Path) -> Iterator[None]:
    """Hold the one writer's lock of ``target`` (build, add, remove, refit), or fail at once if another process
    has it.

    Once the lock is held, an interrupted ``publish`` of the target is undone, so the writer starts from a whole
    index, and what a killed update left (``UPDATE_PURPOSES``) is removed. The lock is ``flock`` on a hidden
    file beside the target, removed on release (a killed writer leaves the file but not the lock: the kernel
    drops it). Removing a lock file is safe only with a check: a process that opened it just before it was
    removed would lock a dead inode, so the lock counts only if the path still names the inode locked.
    A symbolic link at the lock's name or at any of the work names (``OWN_PURPOSES``) is refused, not followed.
    """
    path = lock_path(target)
    made = [d for d in [target.parent, *target.parent.parents] if not d.exists()]  # removed again if left empty
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = _open_own(path, os.O_RDWR | os.O_CREAT, "writer's lock file")
        except BaseException:
            _remove_empty(made)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BusyError(
                f"another retrieval process is writing {target}; wait for it to finish, then try again"
            ) from None
        try:
            if os.fstat(fd).st_ino == os.lstat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # a lock file removed under us: try again with a fresh one
    try:
        for purpose in OWN_PURPOSES:
            refuse_link(work_dir(target, purpose))
        old = renamed_aside(target)
        if old is not None:
            os.rename(old, target)
        for purpose in UPDATE_PURPOSES:  # a killed update's work: gigabytes of a new index nobody will publish
            stale = work_dir(target, purpose)
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        check_replaceable(target)
        yield
    finally:
        os.unlink(path)  # before unlocking, so no one can take the lock on a file that is about to vanish
        os.close(fd)
        _remove_empty(made)


def _remove_empty(made: list[Path]) -> None:
    """Remove the folders a writer made for its target, deepest first, while they are empty: a failed build
    leaves no empty folders behind."""
    for directory in made:
        try:
            directory.rmdir()
        except OSError:
            break


def lock_path(target: Path) -> Path:
    """The hidden file beside ``target`` that its one writer holds locked."""
    return target.parent / f".{target.name}.lock"


def link_or_copy(src: Path | str, dst: Path | str) -> None:
    """Hard-link ``src`` to ``dst`` (no copy, no risk to the source), copying where links are not possible. A
    symbolic link at ``src`` is linked or copied as the link itself, never as the file it points to."""
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


PAGE = 4096


def touch_pages(data: np.ndarray | memoryview | bytes) -> int:
    """Read one byte of every page of ``data`` (a memory map): its pages become resident in this process now,
    not at the first requests that need them. Returns the bytes covered."""
    view = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    if view.size:
        int(view[::PAGE].max())
    return int(view.size)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
