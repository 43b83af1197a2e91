"""The command line: a thin typer shell that parses options, shows progress, prints results, maps errors.

Every default comes from the library's specs (``TransformSpec``, ``IndexSpec``, ``EncoderSpec``,
``BuildOptions``, ``SearchParams``), and every value is checked there too: the library names a bad parameter,
this module renders it as its flag. Text from users and documents is never read as rich markup.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from retrieval import files
from retrieval.build import BuildOptions, build_index, check_target
from retrieval.cli import home
from retrieval.corpus import Corpus, CorpusSpec
from retrieval.encode.transformer import POOLINGS, PRECISIONS, EncoderSpec, model_dim
from retrieval.errors import ConfigError, Interrupted, RetrievalError, Terminated, render
from retrieval.files import not_utf8
from retrieval.index import IndexSpec
from retrieval.indexdir import RESCORE_DEPTH, Manifest, trained_on_rows
from retrieval.search import SearchParams
from retrieval.serve.service import ServeOptions
from retrieval.stash import DTYPES
from retrieval.tune import AUTO_QUERIES, DEFAULT_GAMMAS
from retrieval.whitening import DEFAULT_GAMMA, TransformSpec


class _OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a wrong type, a missing argument) as one line on stderr, like every other error."""

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, standalone_mode: bool = True, **kw: Any
    ) -> Any:
        try:
            code = super().main(args, prog_name, standalone_mode=False, **kw)
        except typer.Abort:
            print("error: aborted", file=sys.stderr)
            code = 1
        except typer.TyperException as exc:  # typer's own click: usage errors, bad values, missing arguments
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            print(f"error: {' '.join(message.split())} (see --help)", file=sys.stderr)
            code = getattr(exc, "exit_code", 2)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # while a command's arguments are parsed (inside a command, ``user_errors``)
            print("error: interrupted", file=sys.stderr)
            raise typer.Exit(130) from None


app = typer.Typer(
    cls=_OneLineErrors,
    help="Whitened dense retrieval: build a FAISS index from a parquet corpus, then search it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
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


def _print_version(given: bool) -> None:
    if given:
        from retrieval import __version__

        print(f"retrieval {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress details.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_time=False, show_path=False, markup=False)],
        force=True,
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
    the same line says so; the exit status is 143."""

    def exit_143(signum: int, frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def choice(name: str, value: str | None, allowed: Sequence[str]) -> None:
    """Refuse a value outside ``allowed`` before any model is loaded."""
    if value is not None and value not in allowed:
        raise ConfigError(f"unknown `{name}` {value!r}; choose one of {', '.join(allowed)}", name)


# ----- index -----------------------------------------------------------------------------------------------
TextOption = Annotated[str, typer.Option(help="Column with the document text.")]
IdOption = Annotated[
    str | None,
    typer.Option(
        help="Column with document ids \\[default: id if present, else row numbers; <file>:<row> for a folder or glob]."
    ),
]
TitleOption = Annotated[str | None, typer.Option(help="Column prepended to the text, as BEIR does.")]
SkipEmptyOption = Annotated[bool, typer.Option(help="Leave out rows with null or empty text instead of failing.")]
CorpusArg = Annotated[
    Path,
    typer.Argument(
        help="Parquet file with one document per row, a folder of parquet files, a glob in quotes "
        "('data/part-*.parquet'), or a .npy array of vectors."
    ),
]
ENGINES = ("local", "ray")
DefaultTransform, DefaultIndex, DefaultEncoder, DefaultBuild = (
    TransformSpec(),
    IndexSpec(),
    EncoderSpec(),
    BuildOptions(),
)
DefaultSearch = SearchParams()


@app.command()
@user_errors
def index(
    corpus: CorpusArg,
    dim: Annotated[
        int | None,
        typer.Option(help="Output dimension k: whitens down to k \\[default: the encoder's own, raw vectors]."),
    ] = None,
    gamma: Annotated[
        float | None,
        typer.Option(
            help=f"Eigenvalue power: W = U_k diag(lambda^(-gamma/2)); 1 whitens, 0 only rotates; given, it whitens "
            f"\\[default: {DEFAULT_GAMMA:g} with --dim]."
        ),
    ] = DefaultTransform.gamma,
    epsilon: Annotated[
        float, typer.Option(help="Added to eigenvalues, relative to the largest.")
    ] = DefaultTransform.epsilon,
    no_whiten: Annotated[bool, typer.Option("--no-whiten", help="Raw baseline: L2-normalised encoder output.")] = False,
    center: Annotated[
        bool | None,
        typer.Option(
            "--center/--no-center",
            help="Fit the kernel on x - mean (the paper) or on x as it is (the second moment) "
            "\\[default: centred at full dimension, uncentred with --dim].",
        ),
    ] = DefaultTransform.center,
    model: Annotated[
        str, typer.Option(help="Local folder, installed offline model, or hub name.")
    ] = DefaultEncoder.model,
    pooling: Annotated[str, typer.Option(help=f"Token pooling: {', '.join(POOLINGS)}.")] = DefaultEncoder.pooling,
    extra_pooling: Annotated[
        list[str] | None, typer.Option(help="Also stash this pooling (repeatable), for `retrieval tune`.")
    ] = None,
    text_column: TextOption = "text",
    id_column: IdOption = None,
    title_column: TitleOption = None,
    vectors_column: Annotated[
        str | None, typer.Option(help="Column of precomputed embeddings (list of floats): skip encoding.")
    ] = None,
    skip_empty: SkipEmptyOption = False,
    max_length: Annotated[int | None, typer.Option(help="Tokens per text \\[default: the model's].")] = None,
    batch_size: Annotated[int, typer.Option(help="Texts per forward pass.")] = DefaultEncoder.batch_size,
    precision: Annotated[
        str,
        typer.Option(
            help=f"{', '.join(PRECISIONS)}: auto is fp32, or on a CPU with native bf16 the faster of the two on "
            "the first batch."
        ),
    ] = DefaultEncoder.precision,
    index_type: Annotated[
        str, typer.Option(help="flat, hnsw, ivf, or a FAISS index_factory string (HNSW32, IVF1024,SQ8, ...).")
    ] = DefaultIndex.kind,
    m: Annotated[int, typer.Option("--m", help="HNSW: neighbours per node.")] = DefaultIndex.m,
    ef_construction: Annotated[int, typer.Option(help="HNSW: build-time beam width.")] = DefaultIndex.ef_construction,
    ef_search: Annotated[int, typer.Option(help="HNSW: default search beam width.")] = DefaultIndex.ef_search,
    nlist: Annotated[int | None, typer.Option(help="IVF: lists \\[default: ~4 sqrt(N), at most N/39].")] = None,
    nprobe: Annotated[int | None, typer.Option(help="IVF: lists probed per query \\[default: ~sqrt(nlist)].")] = None,
    train_size: Annotated[int | None, typer.Option(help="IVF/PQ: training sample rows.")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Index directory \\[default: indexes/<stem>].")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing index (only once the new one is done).")] = False,
    keep_vectors: Annotated[
        bool, typer.Option(help="Keep the raw-vector stash (for refit/tune/rescore).")
    ] = DefaultBuild.keep_vectors,
    stash_dtype: Annotated[str, typer.Option(help=f"Stash precision: {', '.join(DTYPES)}.")] = DefaultBuild.stash_dtype,
    resume: Annotated[
        bool, typer.Option(help="Continue an interrupted build of the same corpus and settings.")
    ] = False,
    engine: Annotated[
        str, typer.Option(help="Where texts are encoded: local (this process) or ray (Ray Data workers).")
    ] = "local",
    address: Annotated[
        str | None,
        typer.Option(help="Ray: a running cluster (auto, host:port, ray://host:port) \\[default: start a local Ray]."),
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Ray: encoding workers \\[default: one per CPU].")] = None,
) -> None:
    """Build a whitened FAISS index from a parquet corpus (a file, a folder or a glob) or a .npy of vectors."""
    from retrieval.distributed import RayEngine, RayOptions, window_rows

    choice("pooling", pooling, POOLINGS)
    choice("precision", precision, PRECISIONS)
    choice("stash_dtype", stash_dtype, DTYPES)
    choice("engine", engine, ENGINES)
    if engine == "local" and (address is not None or workers is not None):
        raise ConfigError("`address` and `workers` are for `engine` ray", "engine")
    target = out_dir or home.default_out(corpus)
    spec = CorpusSpec(corpus, text_column, id_column, title_column, vectors_column, skip_empty)
    transform = TransformSpec(dim=dim, gamma=gamma, epsilon=epsilon, whiten=False if no_whiten else None, center=center)
    index_spec = IndexSpec(index_type, m, ef_construction, ef_search, nlist, nprobe, train_size)
    ray_options = RayOptions(address, workers)
    transform.check()  # every value checked before a model is loaded; dim against d once it is known
    index_spec.check()
    given = {"nlist": nlist, "nprobe": nprobe, "train_size": train_size}  # None unless given; the rest, unless changed
    given |= {
        name: value
        for name, value in (("m", m), ("ef_construction", ef_construction), ("ef_search", ef_search))
        if value != getattr(DefaultIndex, name)
    }
    index_spec.check_given(given)
    ray_options.check()
    check_target(target, overwrite)
    source = Corpus(spec)  # the file(s) and their columns, before seconds go into loading a model
    if not source.precomputed:
        transform.check(model_dim(model))  # a local model's config knows d: refused now, not after a load
    # Ray: windows sized for the workers. Local: the default, grown past 4M rows as Ray's grow, so a big build
    # stays at a few thousand stash parts (each registration rewrites stash.json: 100M rows in 2,048-row
    # windows would be 48,828 parts and hours of rewriting)
    rows = source.num_rows
    window = window_rows(rows) if engine == "ray" else max(DefaultBuild.window_rows, window_rows(rows))
    options = BuildOptions(keep_vectors, stash_dtype, tuple(extra_pooling or ()), overwrite, resume, window)
    options.check()
    encoder_spec = EncoderSpec(model, pooling, max_length, batch_size, precision)
    encoder = None
    if not source.precomputed:
        encoder = encoder_spec.load()
    try:
        with ExitStack() as stack:
            stack.enter_context(sigterm_exits())  # the lock is released; a Ray started for the build is shut down
            ray = None
            if engine == "ray":
                ray = stack.enter_context(RayEngine(encoder_spec, ray_options))
            update = stack.enter_context(progress_bars())
            manifest = build_index(spec, encoder, target, transform, index_spec, options, progress=update, engine=ray)
    except KeyboardInterrupt as stop:
        raise Interrupted.by(
            stop,
            ": the parts encoded so far are kept; rerun the same command with --resume to continue"
            if files.work_dir(files.resolved(target)).exists()
            else "; nothing was written",
        ) from None
    home.remember(target)
    err.print(summary_line(target, manifest, "built"), markup=False)


def summary_line(directory: Path, manifest: Manifest, verb: str) -> str:
    t = manifest.transform
    fit = "raw"
    if t.kind == "whitening":
        centring = ", uncentred" if t.spec.center is False else ""
        fit = f"gamma {t.spec.gamma}{centring}, explained variance {t.explained_variance:.1%}"
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in manifest.timings.items())
    size = sum(f["bytes"] for f in manifest.files.values()) + (manifest.stash.bytes if manifest.stash else 0)
    return (
        f"{verb} {safe(str(directory))}: {manifest.n:,} rows, {t.d} -> {t.k} dims ({fit}); {manifest.index.kind} "
        f"index; {_bytes(size)} on disk\n  time: {stages}"
    )


def _bytes(n: float) -> str:
    """Decimal units, as `retrieval info` gives sizes (the same index was "6.2 MB" built and "6.5 MB" in info)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


# ----- search ----------------------------------------------------------------------------------------------
IndexOption = Annotated[Path | None, typer.Option("--index", help="Index directory \\[default: the last built].")]
EfOption = Annotated[int | None, typer.Option("--ef-search", "--ef", help="HNSW search beam width.")]
NprobeOption = Annotated[int | None, typer.Option(help="IVF lists probed.")]
RescoreOption = Annotated[
    int | None,
    typer.Option(
        help="Re-rank this many candidates at full dimension from the stash; 0: off "
        f"\\[default: the index's: {RESCORE_DEPTH} when it kept its stash and has fewer dims than the encoder "
        "or lossy FAISS codes (PCA, PQ, SQ8), else off]."
    ),
]


@app.command()
@user_errors
def search(
    query: Annotated[str | None, typer.Argument(help="The query text (or give --queries).")] = None,
    index_dir: IndexOption = None,
    k: Annotated[int, typer.Option("-k", "--k", help="Number of hits.")] = DefaultSearch.k,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per hit, one per line.")] = False,
    rescore: RescoreOption = DefaultSearch.rescore,
    ef_search: EfOption = None,
    nprobe: NprobeOption = None,
    queries: Annotated[
        Path | None,
        typer.Option(
            help="Search every query of a file, in batches: a parquet (texts in --text-column, ids from query_id "
            "if present, else row numbers), or text with one query per line (ids: line numbers); - reads standard "
            "input. With --json each hit also carries its query_id.",
            dir_okay=False,
        ),
    ] = None,
    text_column: Annotated[
        str | None, typer.Option(help="--queries parquet: the column of query texts \\[default: text].")
    ] = None,
) -> None:
    """Search an index with a text query, or with every query of a file (--queries)."""
    from retrieval.search import Searcher

    if query is not None and queries is not None:
        raise ConfigError("give a QUERY or `queries` (a file of queries), not both", "queries")
    if query is None and queries is None:
        raise ConfigError("give a QUERY to search for, or `queries` (a file of queries)", "queries")
    params = SearchParams(k=k, rescore=rescore, ef_search=ef_search, nprobe=nprobe)
    params.check()
    directory = index_dir or home.default_index()
    if query is not None:
        # sizes and sampled hashes: a whole sha256 of a 3 GB index would cost seconds per one-shot search
        searcher = Searcher.load(directory, encoder=one_query_encoder(directory), verify="quick")
        show_hits(searcher.search(query, params), as_json, f"{query!r} in {directory}")
        return
    assert queries is not None
    from retrieval.evaluate import QueryFile

    asked = QueryFile(queries, text_column)  # checked whole before any hit is printed
    searcher = Searcher.load(directory, verify="quick")
    with progress_bars() as update:
        for chunk in asked.chunks():  # batches for the encoder and FAISS; printed as each is done
            for query_id, text, hits in zip(
                chunk.ids, chunk.texts, searcher.search_batch(chunk.texts, params), strict=True
            ):
                show_hits(hits, as_json, f"{query_id}: {text!r}", query_id)
            update("search", len(chunk), len(asked))


def show_hits(hits: Sequence[Any], as_json: bool, title: str, query_id: str | None = None) -> None:
    """Hits as JSON lines (with ``query_id`` first when given), or as a table under ``title``."""
    if as_json:
        first = {} if query_id is None else {"query_id": query_id}
        for hit in hits:
            print(json.dumps(first | {"rank": hit.rank, "id": hit.id, "score": hit.score, "text": hit.text}))
        return
    table = Table(title=Text(safe(title)), title_justify="left")
    for name in ("rank", "score", "id", "text"):  # a narrow terminal folds ids and texts, never cuts the numbers
        number = name in ("rank", "score")
        table.add_column(name, justify="right" if number else "left", overflow="fold", no_wrap=number)
    for hit in hits:
        text = hit.text if len(hit.text) <= 200 else hit.text[:197] + "..."
        table.add_row(str(hit.rank), f"{hit.score:.4f}", Text(safe(hit.id)), Text(safe(text)))
    out.print(table)


def one_query_encoder(directory: Path) -> Any:
    """The encoder for one query: a BERT model in numpy (``numpy_bert``; importing torch and transformers took
    ~3 s of CPU, most of a one-shot search), or None where it does not apply: Searcher loads the index's own."""
    from retrieval.encode import numpy_bert

    try:
        return numpy_bert.load(Manifest.load(directory).encoder)
    except RetrievalError:
        return None  # Searcher.load reports what is wrong with the directory


# ----- info ------------------------------------------------------------------------------------------------
@app.command()
@user_errors
def info(
    index_dir: Annotated[Path | None, typer.Argument(help="Index directory \\[default: the last built].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full manifest and spectrum as JSON.")] = False,
    verify: Annotated[bool, typer.Option(help="Check every file's checksum, stash parts included.")] = False,
) -> None:
    """Show what an index holds: model, pooling, d -> k, gamma, N, sizes, spectrum, drift."""
    from retrieval.info import describe_index

    directory = index_dir or home.default_index("name it: `retrieval info DIR`")
    report = describe_index(directory, verify="full" if verify else "none")
    if as_json:
        print(json.dumps(report, indent=2))
        return
    table = Table(show_header=False, title=Text(safe(str(directory))), title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in report["summary"].items():
        table.add_row(key, Text(safe(str(value))))
    out.print(table)


# ----- add / refit -----------------------------------------------------------------------------------------
AS_BUILT = "\\[default: as the index was built]"
IndexDirArg = Annotated[Path, typer.Argument(help="Index directory to change in place (atomically).", file_okay=False)]


@app.command()
@user_errors
def add(
    index_dir: IndexDirArg,
    corpus: CorpusArg,
    text_column: Annotated[str | None, typer.Option(help=f"Column with the document text {AS_BUILT}.")] = None,
    id_column: Annotated[
        str | None, typer.Option(help=f"Column with document ids, '' for row numbers {AS_BUILT}.")
    ] = None,
    title_column: Annotated[
        str | None, typer.Option(help=f"Column prepended to the text, '' for none {AS_BUILT}.")
    ] = None,
    vectors_column: Annotated[str | None, typer.Option(help=f"Column of precomputed embeddings {AS_BUILT}.")] = None,
    skip_empty: Annotated[
        bool | None, typer.Option("--skip-empty/--no-skip-empty", help=f"Leave out empty texts {AS_BUILT}.")
    ] = None,
) -> None:
    """Encode new documents and add them to an index with its existing kernel (see `info` for drift)."""
    from retrieval.update import add as add_rows
    from retrieval.update import read_like_build

    spec = read_like_build(
        index_dir, corpus, text_column=text_column, id_column=id_column, title_column=title_column,
        vectors_column=vectors_column, skip_empty=skip_empty,
    )  # fmt: skip
    with sigterm_exits(), progress_bars() as update:
        manifest = add_rows(index_dir, spec, progress=update)
    rows = manifest.corpus.added[-1]["rows"]
    err.print(f"added {rows:,} rows to {safe(str(index_dir))}: now {manifest.n:,}", markup=False)


@app.command()
@user_errors
def remove(
    index_dir: IndexDirArg,
    ids: Annotated[list[str] | None, typer.Argument(help="Ids of the documents to remove.", show_default=False)] = None,
    ids_from: Annotated[
        Path | None,
        typer.Option(help="A file of ids to remove, one per line ('-': standard input).", dir_okay=False),
    ] = None,
    missing_ok: Annotated[
        bool, typer.Option("--missing-ok", help="Skip ids the index does not hold instead of refusing them all.")
    ] = False,
) -> None:
    """Remove documents by id, from the index and its stash, with its existing kernel: nothing is encoded."""
    from retrieval.update import remove as remove_rows

    wanted = [*(ids or []), *(read_ids(ids_from) if ids_from is not None else [])]
    if not wanted:
        raise ConfigError("no ids to remove: give them as arguments or with --ids-from FILE (one per line)", "ids")
    with sigterm_exits(), progress_bars() as update:
        manifest = remove_rows(index_dir, wanted, missing_ok=missing_ok, progress=update)
    if manifest is None:
        err.print(f"none of the {len(set(wanted)):,} ids is in {safe(str(index_dir))}: nothing changed", markup=False)
        return
    rows = manifest.corpus.removed[-1]["rows"]
    err.print(f"removed {rows:,} rows from {safe(str(index_dir))}: now {manifest.n:,}", markup=False)
    faiss_info = manifest.index.faiss
    if faiss_info.get("empty_lists", 0) * 2 > faiss_info.get("nlist", 0):
        from retrieval.info import lists_line

        err.print(f"IVF lists: {lists_line(faiss_info)}", markup=False)


def read_ids(path: Path) -> list[str]:
    """Ids from a text file (or standard input for ``-``), one per ``\n``-ended line (``\r\n`` too); empty
    lines skipped, nothing else stripped (an id may hold spaces, and any character but a newline: ``\f``,
    U+2028 and U+0085 are not line ends here, as they are to ``str.splitlines``); a leading BOM is dropped."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text ({error.reason}); write one id per line", "ids_from") from None
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}", "ids_from") from None
    lines = (line.removesuffix("\r") for line in text.split("\n"))
    return [line for line in lines if line]  # "  " is an id like any other: looked for, not dropped


@app.command()
@user_errors
def refit(
    index_dir: IndexDirArg,
    dim: Annotated[int | None, typer.Option(help="Output dimension k \\[default: keep].")] = None,
    gamma: Annotated[
        float | None, typer.Option(help="Eigenvalue power: 1 whitens, 0 rotates \\[default: keep].")
    ] = None,
    epsilon: Annotated[float | None, typer.Option(help="Added to eigenvalues, relative \\[default: keep].")] = None,
    whiten: Annotated[
        bool | None, typer.Option("--whiten/--no-whiten", help="Whiten, or the raw baseline \\[default: keep].")
    ] = None,
    center: Annotated[
        bool | None,
        typer.Option(
            "--center/--no-center",
            help="Fit on x - mean, or on x as it is \\[default: keep; with a new --dim, that dim's default].",
        ),
    ] = None,
    pooling: Annotated[str | None, typer.Option(help="Stashed pooling to fit on \\[default: keep].")] = None,
    index_type: Annotated[
        str | None, typer.Option(help="flat, hnsw, ivf, or a FAISS index_factory string \\[default: keep].")
    ] = None,
    m: Annotated[int | None, typer.Option("--m", help="HNSW: neighbours per node.")] = None,
    ef_construction: Annotated[int | None, typer.Option(help="HNSW: build-time beam width.")] = None,
    ef_search: Annotated[int | None, typer.Option(help="HNSW: default search beam width.")] = None,
    nlist: Annotated[int | None, typer.Option(help="IVF: number of lists.")] = None,
    nprobe: Annotated[int | None, typer.Option(help="IVF: lists probed per query.")] = None,
    train_size: Annotated[int | None, typer.Option(help="IVF/PQ: training sample rows.")] = None,
) -> None:
    """Re-fit the kernel and rebuild the index from the stash, without re-encoding; unset options keep their values."""
    from retrieval.update import index_spec, transform_spec
    from retrieval.update import refit as refit_index

    choice("pooling", pooling, POOLINGS)
    generation = Manifest.load(index_dir).generation  # first: the settings kept are read from this version or later
    transform = transform_spec(
        index_dir, dim=dim, gamma=gamma, epsilon=epsilon, whiten=whiten, center=center, pooling=pooling
    )
    knobs = {"m": m, "ef_construction": ef_construction, "ef_search": ef_search, "nlist": nlist, "nprobe": nprobe}
    spec = index_spec(index_dir, kind=index_type, train_size=train_size, **knobs)
    with sigterm_exits(), progress_bars() as update:
        manifest = refit_index(index_dir, transform, spec, progress=update, generation=generation)
    err.print(summary_line(index_dir, manifest, "refitted"), markup=False)


@app.command()
@user_errors
def calibrate(
    index_dir: Annotated[
        Path, typer.Argument(help="Index directory (changed in place, atomically, only with --apply).", file_okay=False)
    ],
    queries: Annotated[
        Path,
        typer.Option(
            help="Queries like the ones the index will serve: a parquet file (a text column) or a .npy of encoder "
            "vectors. No judgements needed: their exact neighbours are the truth.",
            exists=True,
            dir_okay=False,
        ),
    ],
    text_column: Annotated[str, typer.Option(help="The queries' text column.")] = "text",
    target_recall: Annotated[float, typer.Option(help="recall@10 the chosen ef-search / nprobe must reach.")] = 0.95,
    rescore: Annotated[
        int | None,
        typer.Option(
            help="Measure searches that re-score this many candidates at full dimension, as they are served; 0: "
            "the index alone \\[default: the index's own depth].",
        ),
    ] = None,
    apply: Annotated[bool, typer.Option(help="Make the chosen value the index's default (atomic).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the measurement as JSON.")] = False,
) -> None:
    """Measure the smallest ef-search (HNSW) or nprobe (IVF) whose recall@10 on your queries reaches a target."""
    from retrieval.calibrate import check_target, query_sample
    from retrieval.evaluate import read_texts
    from retrieval.update import calibrate_index

    check_target(target_recall)
    if queries.suffix == ".npy":
        raw = _read_vectors(queries)
    else:
        from retrieval.search import Searcher

        if not Manifest.load(index_dir).encoder.encodes_text:
            raise ConfigError(
                f"{index_dir} was built from precomputed vectors: give --queries as a .npy of query vectors", "queries"
            )
        texts = read_texts(queries, text_column)
        texts = [texts[i] for i in query_sample(len(texts))]  # the sample calibrate_index takes, before encoding
        raw = Searcher.load(index_dir).encode(texts)
    with sigterm_exits():
        result, manifest = calibrate_index(index_dir, raw, target_recall, str(queries.resolve()), apply, rescore)
    if as_json:
        print(json.dumps(result.to_dict() | {"applied": apply}))
        return
    table = Table()
    table.add_column(result.knob, justify="right")
    table.add_column("recall@10", justify="right")
    for value, recall in result.curve:
        table.add_row(str(value), f"{recall:.4f}", style="bold" if value == result.value else None)
    out.print(table)
    reached = "reaches" if result.reached else "is this index's best, short of"
    line = f"{result.knob} {result.value}: recall@10 {result.recall:.4f} {result.measured_as} on {result.queries} "
    line += f"queries {reached} the target {target_recall:g}"
    if not result.reached and manifest.corpus.changed_since_training and trained_on_rows(manifest.index.factory):
        # measured (QA): IVF16,SQ8 after adding rows unlike the first, 0.38 at every nprobe; refitted, 0.96
        line += (
            "; rows were added or removed since its lists and codes were trained on the first ones: "
            "`retrieval refit` trains them on the rows there are now"
        )
    now = f"; now the default (version {manifest.generation})" if apply else "; --apply makes it the default"
    err.print(line + now, markup=False)


def _read_vectors(path: Path) -> Any:
    import numpy as np

    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:  # EOFError: an empty file
        raise ConfigError(f"{path} is not a readable .npy of query vectors ({error})", "queries") from error


# ----- demo ------------------------------------------------------------------------------------------------
@app.command()
@user_errors
def demo(
    dim: Annotated[int, typer.Option(help="Output dimension.")] = 128,
    k: Annotated[int, typer.Option("-k", help="Hits per query.")] = 3,
) -> None:
    """Index the Python standard library's docstrings (built here, no download) and run a few searches."""
    from retrieval.cli.demo import DEMO_QUERIES, write_demo_corpus

    TransformSpec(dim=dim).check(model_dim(DefaultEncoder.model))  # before the demo corpus is written
    SearchParams(k=k).check()
    corpus = home.index_root() / "stdlib-docs.parquet"
    with files.output_errors(corpus):
        rows = write_demo_corpus(corpus)
    err.print(f"wrote {rows:,} docstring paragraphs of this Python's standard library to {corpus}", markup=False)
    # An interrupted demo's encoded parts are picked up again: its corpus is the same, whenever it is written.
    resume = files.work_dir(files.resolved(home.default_out(corpus))).exists()
    build = index.__wrapped__  # type: ignore[attr-defined]  # its errors are the demo's: said once, by user_errors
    try:
        build(corpus, dim=dim, title_column="title", overwrite=True, resume=resume)
    except ConfigError as refused:  # another Python's stdlib, or another encoder: that build is not this one
        if not (resume and refused.param == "resume"):
            raise
        build(corpus, dim=dim, title_column="title", overwrite=True)
    except Interrupted as stop:  # its message names `index --resume`, which the demo does by itself
        word = "terminated" if stop.exit_code == 143 else "interrupted"
        again = Interrupted(f"{word}: rerun `retrieval demo` to continue")
        again.exit_code = stop.exit_code
        raise again from None
    for query in DEMO_QUERIES:
        search(query, index_dir=home.default_out(corpus), k=k)  # type: ignore[call-arg]


# ----- eval ------------------------------------------------------------------------------------------------
eval_app = typer.Typer(
    help="Measure quality: IR metrics against qrels, or STS Spearman against gold scores.", no_args_is_help=True
)
app.add_typer(eval_app, name="eval")
IndexArg = Annotated[Path, typer.Argument(help="Index directory.", exists=True, file_okay=False)]
IR_DEPTH = 100  # eval ir reports Recall@100 and MAP@100: hits retrieved per query, at least


@eval_app.command("ir")
@user_errors
def eval_ir(
    index_dir: IndexArg,
    queries: Annotated[Path, typer.Option(help="Queries parquet (query_id, text).", exists=True, dir_okay=False)],
    qrels: Annotated[Path, typer.Option(help="Qrels parquet (query_id, doc_id, score).", exists=True, dir_okay=False)],
    depth: Annotated[int, typer.Option(help=f"Hits retrieved per query (at least {IR_DEPTH}).")] = IR_DEPTH,
    rescore: RescoreOption = DefaultSearch.rescore,
    ef_search: EfOption = None,
    nprobe: NprobeOption = None,
    per_query: Annotated[Path | None, typer.Option(help="Write per-query metrics here (JSON lines).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as JSON.")] = False,
) -> None:
    """nDCG@10, Recall@10/100, MRR@10, MAP@100 of an index on queries with relevance judgements."""
    from retrieval.evaluate import evaluate_ir, read_judged
    from retrieval.search import Searcher

    if depth < IR_DEPTH:  # below it, Recall@100 and MAP@100 would be measured on fewer hits than they say
        raise ConfigError(f"`depth` must be at least {IR_DEPTH}, the deepest cut-off reported (got {depth})", "depth")
    if per_query is not None:
        writable_file(per_query, "per_query")  # before the evaluation, not after it
    params = SearchParams(k=depth, rescore=rescore, ef_search=ef_search, nprobe=nprobe)
    params.check()
    result = evaluate_ir(Searcher.load(index_dir), *read_judged(queries, qrels), params)
    if per_query:
        lines = "".join(json.dumps({"query_id": q, **m}) + "\n" for q, m in result.per_query.items())
        with files.output_errors(per_query):
            files.write_atomic(per_query, lines.encode())  # whole or not at all
    if as_json:
        print(json.dumps({"queries": result.n_queries, **result.metrics}))
        return
    title = safe(f"{index_dir} on {queries.name} ({result.n_queries} queries)")
    table = Table(title=Text(title), title_justify="left")
    for name in result.metrics:
        table.add_column(name, justify="right")
    table.add_row(*(f"{v:.4f}" for v in result.metrics.values()))
    out.print(table)


@eval_app.command("sts")
@user_errors
def eval_sts(
    pairs: Annotated[
        list[Path],
        typer.Argument(help="Pair files (sentence1, sentence2, score[, subset]).", exists=True, dir_okay=False),
    ],
    index_dir: Annotated[Path | None, typer.Option("--index", help="Use this index's encoder and transform.")] = None,
    model: Annotated[str, typer.Option(help="Encoder when no --index.")] = DefaultEncoder.model,
    pooling: Annotated[
        str, typer.Option(help=f"Pooling when no --index: {', '.join(POOLINGS)}.")
    ] = DefaultEncoder.pooling,
    dim: Annotated[
        int | None, typer.Option(help="Whiten down to this dimension \\[default: none, the raw vectors].")
    ] = None,
    gamma: Annotated[
        float | None,
        typer.Option(help=f"Eigenvalue power; given, it whitens \\[default with --dim: {DEFAULT_GAMMA:g}]."),
    ] = DefaultTransform.gamma,
    fit_file: Annotated[
        list[Path] | None, typer.Option(help="More pair files whose sentences join the fit (e.g. train/dev splits).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Spearman x100 between cosine and gold score, raw and transformed ("wmean" and "all" aggregations).

    Without --index the transform is fitted on "target": every sentence of the given pair files (and
    --fit-file files), no labels. With --index, the index's own transform (fitted on its corpus) is used.
    """
    from retrieval.encode.transformer import Encoder
    from retrieval.evaluate import evaluate_sts, read_pairs
    from retrieval.search import Searcher
    from retrieval.whitening import RawTransform, Whitening

    choice("pooling", pooling, POOLINGS)
    if index_dir is not None:  # the index's own encoder and transform: these would be ignored in silence
        given = {"model": model != DefaultEncoder.model, "pooling": pooling != DefaultEncoder.pooling}
        given |= {"dim": dim is not None, "gamma": gamma is not None, "fit_file": bool(fit_file)}
        ignored = [name for name, value in given.items() if value]
        if ignored:
            raise ConfigError(
                f"`{ignored[0]}` does not apply with `index`, which brings its own encoder and transform: give one "
                "or the other",
                ignored[0],
            )
    sets = [read_pairs(p) for p in pairs]
    fit_sets = [read_pairs(p) for p in fit_file or []]
    transform: Whitening | RawTransform | TransformSpec
    fit_name = ""
    if index_dir:
        searcher = Searcher.load(index_dir)
        if searcher.encoder is None:
            raise ConfigError(f"{index_dir} was built from precomputed vectors: it has no text encoder for STS")
        encoder: Encoder = searcher.encoder
        transform, fit_name = searcher.transform, f"index {index_dir}"
    else:
        transform = TransformSpec(dim=dim, gamma=gamma)
        transform.check()
        encoder = EncoderSpec(model, pooling).load()
    with progress_bars() as update:
        report = evaluate_sts(sets, encoder, transform, fit_sets, fit_name, progress=update)
    if as_json:
        print(json.dumps(report.to_dict()))
        return
    table = Table(title=Text(safe(f"STS Spearman x100; transform fitted on {report.fit}")), title_justify="left")
    for name in ("file", "raw wmean", "raw all", "transformed wmean", "transformed all"):
        table.add_column(name, justify="left" if name == "file" else "right")
    for row in report.results:
        r, t = row["raw"], row["transformed"]
        table.add_row(
            Text(safe(row["file"])), f"{r['wmean']:.2f}", f"{r['all']:.2f}", f"{t['wmean']:.2f}", f"{t['all']:.2f}"
        )
    out.print(table)


# ----- tune ------------------------------------------------------------------------------------------------
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


@app.command()
@user_errors
def tune(
    index_dir: Annotated[Path | None, typer.Argument(help="Index directory whose stash is swept (IR).")] = None,
    queries: Annotated[Path | None, typer.Option(help="Dev queries parquet (choose on these).")] = None,
    qrels: Annotated[Path | None, typer.Option(help="Dev qrels parquet.")] = None,
    test_queries: Annotated[Path | None, typer.Option(help="Test queries parquet (report on these).")] = None,
    test_qrels: Annotated[Path | None, typer.Option(help="Test qrels parquet.")] = None,
    pairs: Annotated[Path | None, typer.Option(help="STS: dev pairs parquet (choose on these).")] = None,
    test_pairs: Annotated[Path | None, typer.Option(help="STS: test pairs parquet.")] = None,
    fit_file: Annotated[list[Path] | None, typer.Option(help="STS: more pair files for the fit.")] = None,
    model: Annotated[str, typer.Option(help="STS: encoder (IR uses the index's).")] = DefaultEncoder.model,
    poolings: Annotated[str | None, typer.Option(help="Comma-separated poolings \\[default: all stashed].")] = None,
    dims: Annotated[str, typer.Option(help="Comma-separated output dimensions to try.")] = "",
    gammas: Annotated[str, typer.Option(help="Comma-separated gammas to try.")] = ",".join(
        f"{g:g}" for g in DEFAULT_GAMMAS
    ),
    metric: Annotated[str | None, typer.Option(help="Choose on this \\[default: nDCG@10, or STS 'all'].")] = None,
    results: Annotated[Path | None, typer.Option(help="Folder for tune.json and tune.png.")] = None,
    apply: Annotated[
        bool, typer.Option(help="Re-fit the index with the chosen transform, raw included (atomic).")
    ] = False,
    auto: Annotated[
        bool,
        typer.Option(
            help="No qrels: choose on pseudo-queries made from the index's own documents (a sentence taken out "
            "is the query, the rest of its document the one relevant hit), by the one-standard-error rule: the "
            "gentlest candidate (raw, more dimensions, smaller gamma) within one standard error of the best."
        ),
    ] = False,
    auto_queries: Annotated[int, typer.Option(help="--auto: how many pseudo-queries.")] = AUTO_QUERIES,
    seed: Annotated[int, typer.Option(help="--auto: seed of the documents sampled.")] = 0,
) -> None:
    """Sweep pooling x k x gamma (and raw) WITHOUT re-encoding the corpus; choose on dev, report on test.

    With --auto no qrels are needed: the dev split is made of pseudo-queries from the corpus itself."""
    from retrieval import tune as tuning
    from retrieval.evaluate import read_judged, read_pairs

    if (index_dir is None) == (pairs is None):
        raise ConfigError("give an INDEX_DIR with `queries`/`qrels` or `auto` (IR), or `pairs` (STS)")
    if apply and index_dir is None:  # before any encoding, not after the whole sweep
        raise ConfigError("`apply` re-fits an index: it needs INDEX_DIR", "apply")
    if auto and (index_dir is None or queries is not None or qrels is not None):
        raise ConfigError("`auto` tunes an INDEX_DIR on pseudo-queries: give it without `queries` and `qrels`", "auto")
    if not tuning.MIN_AUTO_QUERIES <= auto_queries <= 100_000:
        raise ConfigError(
            f"`auto_queries` must be between {tuning.MIN_AUTO_QUERIES} and 100,000 (got {auto_queries})",
            "auto_queries",
        )
    if seed < 0:
        raise ConfigError(f"`seed` must be 0 or more (got {seed})", "seed")
    if results is not None:
        writable_folder(results, "results")  # before the sweep: a bad path would fail after it, and skip `apply`
    if test_pairs is not None and pairs is None:
        raise ConfigError("`test_pairs` goes with `pairs` (STS); for an index, give `test_queries`/`test_qrels`")
    pools = [p for p in (poolings or "").split(",") if p] or None
    for pooling in pools or []:
        choice("poolings", pooling, POOLINGS)
    dim_list, gamma_list = numbers("dims", dims, int), numbers("gammas", gammas)
    with progress_bars() as update:
        if index_dir is not None:
            if not auto and (queries is None or qrels is None):
                raise ConfigError("IR tuning needs `queries` and `qrels` (the dev split), or `auto`", "queries")
            if (test_queries is None) != (test_qrels is None):
                raise ConfigError("`test_queries` and `test_qrels` go together: give both or neither", "test_qrels")
            test = read_judged(test_queries, test_qrels) if test_queries and test_qrels else None
            sweep = (pools, dim_list, gamma_list or tuning.DEFAULT_GAMMAS, metric or "nDCG@10", update)
            if auto:
                result = tuning.tune_auto(index_dir, auto_queries, seed, test, *sweep)
            else:
                assert queries is not None and qrels is not None
                result = tuning.tune_index(index_dir, read_judged(queries, qrels), test, *sweep)
        else:
            assert pairs is not None
            result = tuning.tune_pairs(
                read_pairs(pairs),
                read_pairs(test_pairs) if test_pairs else None,
                [read_pairs(p) for p in fit_file or []],
                EncoderSpec(model),
                pools or ["mean"],
                dim_list,
                gamma_list or tuning.DEFAULT_GAMMAS,
                metric or "all",
                update,
            )
    if index_dir is not None and not auto:
        err.print("tuned on the stashed vectors: the corpus was not re-encoded", markup=False)
    elif auto:
        err.print(
            f"tuned on {result.dev_source}: only their {result.corpus_rows_encoded:,} documents were encoded again",
            markup=False,
        )
    _report_tuning(result, results)
    if apply:
        assert index_dir is not None
        from retrieval.update import refit

        scorer = result.scorer.candidate if result.scorer else None
        with sigterm_exits():
            manifest = refit(index_dir, result.best.candidate, scorer=scorer)
        err.print(summary_line(index_dir, manifest, "refitted"), markup=False)


def _report_tuning(result: Any, folder: Path | None) -> None:
    metric = result.metric
    rule = " (one-SE rule: the gentlest within one standard error of the best)" if result.rule == "one-SE" else ""
    table = Table(title=f"tuning: chosen on dev by {metric}{rule}", title_justify="left")
    for name in ("candidate", f"dev {metric}", f"test {metric}", "search ms"):
        table.add_column(name, justify="left" if name == "candidate" else "right")
    for trial in result.trials:
        style = "bold green" if trial is result.best else None
        test = f"{trial.test[metric]:.4f}" if trial.test else "-"
        ms = f"{trial.search_ms:.3f}" if trial.search_ms is not None else "-"
        table.add_row(trial.candidate.label, f"{trial.dev[metric]:.4f}", test, ms, style=style)
    out.print(table)
    best = result.best
    line = f"chosen: {best.candidate.label}: dev {best.dev[metric]:.4f}"
    if best.test:
        line += f", test {best.test[metric]:.4f}"
        if result.raw and result.raw.test:
            raw = result.raw.test[metric]  # 0 on a test split raw finds nothing relevant in: no ratio to show
            line += f" (raw {raw:.4f}, {best.test[metric] / raw:.1%} of raw)" if raw else f" (raw {raw:.4f})"
    out.print(line + ("" if result.dev_source == "dev split" else f" (dev: {result.dev_source})"), markup=False)
    if result.scorer is not None and result.scorer.dim > best.dim:
        out.print(f"re-scoring at full dimension by: {result.scorer.candidate.label}", markup=False)
    if folder:
        png = write_tuning(result, folder)
        err.print(f"wrote {folder / 'tune.json'}" + (f" and {png}" if png else ""), markup=False)


def write_tuning(result: Any, folder: Path) -> Path | None:
    """``tune.json`` and ``tune.png`` (when matplotlib is installed) into ``folder``: both new, or, failed or
    interrupted, neither touched (each is written under a temporary name, then both renamed) and a folder made
    for them removed again. Returns the plot's path."""
    from retrieval.plots import plot_tuning

    split = "test" if result.best.test else "dev"
    made = not folder.exists()
    temporary = [folder / f".tune.{os.getpid()}.png", folder / f".tune.{os.getpid()}.json"]
    with files.output_errors(folder):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            png = plot_tuning(result, temporary[0], split=split, title=f"{result.metric} ({split})")
            files.write_atomic(temporary[1], json.dumps(result.to_dict(), indent=1).encode())
            if png is None:
                (folder / "tune.png").unlink(missing_ok=True)  # an earlier run's plot would belong to other results
            else:
                os.replace(png, folder / "tune.png")
            os.replace(temporary[1], folder / "tune.json")
        except BaseException:
            for path in temporary:
                path.unlink(missing_ok=True)
            if made and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
            raise
    return None if png is None else folder / "tune.png"


# ----- serve -----------------------------------------------------------------------------------------------
DefaultServe = ServeOptions()


def _threads_option(value: str, name: str) -> int | str:
    """auto, or a whole number (range checked by ServeOptions)."""
    value = value.strip().lower()
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"`{name}` must be auto or a positive integer (got {value!r})", name) from None


@app.command()
@user_errors
def serve(
    index_dir: Annotated[Path | None, typer.Argument(help="Index directory \\[default: the last built].")] = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="RETRIEVAL_API_KEY",
            show_default=False,
            help="Require `Authorization: Bearer KEY` on every API route but /health; the page, /docs and "
            "/openapi.json stay open (or set RETRIEVAL_API_KEY).",
        ),
    ] = None,
    max_batch: Annotated[int, typer.Option(help="Micro-batching: queries per engine batch.")] = DefaultServe.max_batch,
    max_wait_ms: Annotated[
        float, typer.Option(help="Micro-batching: wait this long for more queries after the first.")
    ] = DefaultServe.max_wait_ms,
    fill_wait_ms: Annotated[
        float,
        typer.Option(
            help="Micro-batching: while a batch holds fewer queries than were in flight when the last one ended "
            "(those it answered and those waiting), wait this long for the rest."
        ),
    ] = DefaultServe.fill_wait_ms,
    torch_threads: Annotated[
        str, typer.Option(help="torch intra-op threads, or auto: the engine times its batches and keeps the faster.")
    ] = str(DefaultServe.torch_threads),
    blas_threads: Annotated[int, typer.Option(help="numpy BLAS threads (flat scans).")] = DefaultServe.blas_threads,
    engine_workers: Annotated[
        int, typer.Option(help="Engine threads, each encoding and searching one batch at a time.")
    ] = DefaultServe.engine_workers,
    faiss_threads: Annotated[
        int, typer.Option(help="FAISS OpenMP threads in the engine.")
    ] = DefaultServe.faiss_threads,
    max_queries: Annotated[int, typer.Option(help="Queries in one request.")] = DefaultServe.max_queries,
    max_query_chars: Annotated[int, typer.Option(help="Characters in one query.")] = DefaultServe.max_query_chars,
    max_k: Annotated[int, typer.Option(help="Hits per query.")] = DefaultServe.max_k,
    max_body_bytes: Annotated[int, typer.Option(help="Request body size (413 above).")] = DefaultServe.max_body_bytes,
    max_queue: Annotated[int, typer.Option(help="Queries waiting before 429.")] = DefaultServe.max_queue,
    watch_interval: Annotated[
        float, typer.Option(help="Seconds between looks at the index directory for a new version (0: off).")
    ] = DefaultServe.watch_interval,
    shutdown_timeout: Annotated[int, typer.Option(help="On SIGTERM, seconds to let requests in flight finish.")] = 30,
) -> None:
    """Serve an index over HTTP (FastAPI): /search, /embed, /info, /health, /ready, /metrics, a page at /."""
    from retrieval.indexdir import IndexDir

    try:
        from retrieval.serve import app as server
    except ImportError as exc:
        raise RetrievalError(
            f"the server needs its extra ({exc.name} is missing): pip install 'retrieval[server]' "
            "(from a checkout: pip install -e '.[server]')"
        ) from exc
    if not 0 <= port <= 65535:
        raise ConfigError(f"`port` must be between 0 and 65535 (got {port})", "port")
    if shutdown_timeout < 0:
        raise ConfigError(f"`shutdown_timeout` must be 0 or more seconds (got {shutdown_timeout})", "shutdown_timeout")
    options = ServeOptions(
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        fill_wait_ms=fill_wait_ms,
        torch_threads=_threads_option(torch_threads, "torch_threads"),
        faiss_threads=faiss_threads,
        blas_threads=blas_threads,
        engine_workers=engine_workers,
        max_queries=max_queries,
        max_query_chars=max_query_chars,
        max_k=max_k,
        max_body_bytes=max_body_bytes,
        max_queue=max_queue,
        watch_interval=watch_interval,
    )
    options.check()
    server.check_api_key(api_key)
    directory = index_dir or home.default_index("name it: `retrieval serve DIR`")
    IndexDir(directory).manifest()  # a missing or foreign directory fails here, in one line, not in the server
    err.print(f"serving {safe(str(directory))} on http://{host}:{port}/ (docs at /docs)", markup=False)
    try:
        server.run(directory, options, host=host, port=port, api_key=api_key, shutdown_timeout=shutdown_timeout)
    finally:  # served: what remains is the interpreter's teardown (1-2 s of torch's exit hooks), and a Ctrl-C
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # there died by the signal or printed an exit hook's traceback


def run() -> None:
    for stream in (sys.stdout, sys.stderr):  # a terminal or pipe that is not UTF-8 (PYTHONIOENCODING=ascii, a
        if hasattr(stream, "reconfigure"):  # latin-1 locale): a hit in Chinese crashed the table; now escaped
            stream.reconfigure(errors="backslashreplace")
    app(prog_name="retrieval")


if __name__ == "__main__":  # pragma: no cover
    run()
