"""What every command shares: the consoles, errors as one line and an exit status, text made safe for a terminal,
progress bars, SIGTERM as Ctrl-C, checks of output paths and number lists, the line a build ends with."""

from __future__ import annotations

import functools
import signal
import sys
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from retrieval.errors import ConfigError, Interrupted, RetrievalError, Terminated, render
from retrieval.files import not_utf8
from retrieval.manifest import Manifest

err = Console(stderr=True, soft_wrap=True, highlight=False)  # status lines carry paths: never break them
out = Console(highlight=False)
F = TypeVar("F", bound=Callable[..., Any])

FLAGS = {
    "k": "-k",
    "whiten": "--no-whiten",
    "keep_vectors": "--no-keep-vectors",
    "center": "--center/--no-center",
    "query": "the query",
}


def flag(name: str) -> str:
    """The CLI flag of a library parameter name."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def user_errors(func: F) -> F:
    """Turn a RetrievalError into one line on stderr and exit status 1 (parameters shown as their flags), and
    Ctrl-C or SIGTERM into one line and exit status 130 or 143."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            _check_paths(kwargs)
            with sigterm_exits():  # every command: SIGTERM is "error: terminated" and 143, as Ctrl-C is 130
                return func(*args, **kwargs)
        except KeyboardInterrupt as stop:
            exc: RetrievalError = Interrupted.by(stop)
        except RetrievalError as caught:
            exc = caught
        err.print(Text.assemble(("error: ", "bold red"), safe(render(exc, flag))))
        raise typer.Exit(getattr(exc, "exit_code", 1))

    return wrapper  # type: ignore[return-value]


def _check_paths(options: dict[str, Any]) -> None:
    """Refuse a path argument whose name is not UTF-8 in one line: deep in pyarrow or FAISS it was a traceback
    (and FAISS's half-written output was left behind)."""
    for name, value in options.items():
        for path in value if isinstance(value, list) else [value]:
            shown = not_utf8(path) if isinstance(path, Path) else None
            if shown is not None:
                raise ConfigError(f"the path {shown} is not UTF-8: rename it, or give another", name)


# Embedding, override and isolate controls: they reorder the rest of the terminal line ("Trojan Source")
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
ESCAPED = frozenset(("Cc", "Cs", "Zl", "Zp"))  # controls, lone surrogates, line and paragraph separators


def safe(text: str) -> str:
    """Text for a terminal: control characters (ANSI escapes, BEL, NUL, CR...), separators and bidi overrides
    shown as escapes, not obeyed; newlines and tabs kept. Spaces of every kind (no-break, ideographic) and the
    joiners of emoji sequences and Persian words are text, and stay (``str.isprintable`` escaped them all)."""
    return "".join(
        repr(c)[1:-1] if (unicodedata.category(c) in ESCAPED and c not in "\n\t") or c in BIDI_CONTROLS else c
        for c in text
    )


@contextmanager
def progress_bars() -> Iterator[Callable[[str, int, int], None]]:
    """A progress callback for the library, drawn as rich bars on stderr (rows, rows/s, ETA)."""
    bars = Progress(
        TextColumn("{task.description:>7}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>9}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=not err.is_terminal,
        disable=not err.is_terminal,
    )
    tasks: dict[str, Any] = {}

    def update(stage: str, advance: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bars.add_task(stage, total=total, rate="")
        bars.advance(tasks[stage], advance)
        task = bars.tasks[tasks[stage]]
        if task.speed:
            bars.update(tasks[stage], rate=f"{task.speed:,.0f} rows/s")

    with bars:
        yield update


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """SIGTERM ends the command as Ctrl-C does, unwinding it: what it started is stopped on the way out, a
    writer's lock and unfinished work directory are removed (a build's encoded parts stay, for --resume), and
    the same line says so; the exit status is 143. A signal whose exception Python dropped (raised inside a
    weakref callback or a finaliser, such as the import system's module-lock callbacks: reported to
    ``sys.unraisablehook`` as "Exception ignored", and a build ran on to exit 0) still ends the command as soon as
    its work returns; one that code caught on purpose (a graceful shutdown) does not."""
    dropped: list[bool] = []
    previous_hook = sys.unraisablehook

    def exit_143(signum: int, frame: Any) -> None:
        raise Terminated

    def unraisable(report: Any) -> None:
        if isinstance(report.exc_value, Terminated):
            dropped.append(True)
        previous_hook(report)

    previous = signal.signal(signal.SIGTERM, exit_143)
    sys.unraisablehook = unraisable
    try:
        yield
        if dropped:
            raise Terminated
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = previous_hook


def choice(name: str, value: str | None, allowed: Sequence[str]) -> None:
    """Refuse a value outside ``allowed`` before any model is loaded."""
    if value is not None and value not in allowed:
        raise ConfigError(f"unknown `{name}` {value!r}; choose one of {', '.join(allowed)}", name)


def writable_file(path: Path, name: str) -> None:
    """Refuse, before any work, an output file that could not be written: a folder, or one in no folder."""
    if path.is_dir():
        raise ConfigError(f"`{name}` {path} is a folder: name a file", name)
    if not path.parent.is_dir():
        raise ConfigError(f"`{name}` {path}: the folder {path.parent} does not exist", name)


def writable_folder(path: Path, name: str) -> None:
    """Refuse, before any work, an output folder that could not be made: it, or a folder above it, is a file."""
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"`{name}` {path}: {folder} is a file, not a folder", name)


def numbers(name: str, text: str, kind: type = float) -> list[Any]:
    """A comma-separated list of numbers, or one clear error naming the option."""
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"`{name}` takes comma-separated numbers (got {text!r})", name) from None


def summary_line(directory: Path, manifest: Manifest, verb: str) -> str:
    t = manifest.transform
    fit = "raw"
    if t.kind == "whitening":
        centring = ", uncentred" if t.spec.center is False else ""
        fit = f"gamma {t.spec.gamma}{centring}, explained variance {t.explained_variance:.1%}"
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in manifest.timings.items())
    size = sum(f["bytes"] for f in manifest.files.values()) + (manifest.stash.bytes if manifest.stash else 0)
    return (
        f"{verb} {safe(str(directory))}: {manifest.n:,} rows, {t.d} -> {t.dim} dims ({fit}); {manifest.index.kind} "
        f"index; {bytes_text(size)} on disk\n  time: {stages}"
    )


def bytes_text(n: float) -> str:
    """Decimal units, as `retrieval info` gives sizes (the same index was "6.2 MB" built and "6.5 MB" in info)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"
