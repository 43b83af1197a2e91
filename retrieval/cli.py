"""The command line: a thin typer shell that parses options, shows progress, prints results, maps errors."""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from retrieval import home
from retrieval.build import DEFAULT_EPSILON, DEFAULT_GAMMA, BuildOptions, TransformSpec, build_index
from retrieval.corpus import CorpusSpec
from retrieval.encoder import DEFAULT_MODEL, POOLINGS, PRECISIONS, TransformerEncoder
from retrieval.errors import RetrievalError
from retrieval.index import IndexSpec
from retrieval.manifest import Manifest

app = typer.Typer(
    help="Whitened dense retrieval: build a FAISS index from a parquet corpus, then search it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()
F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F) -> F:
    """Turn a RetrievalError into one line on stderr and exit status 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except RetrievalError as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress details.")] = False) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_time=False, show_path=False)],
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


# ----- index -----------------------------------------------------------------------------------------------
Corpus = Annotated[Path, typer.Argument(help="Parquet file with one document per row.", dir_okay=False)]


@app.command()
@user_errors
def index(
    corpus: Corpus,
    dim: Annotated[int | None, typer.Option(help="Output dimension k (default: the encoder's own).")] = None,
    gamma: Annotated[
        float, typer.Option(help="Eigenvalue power: W = U_k diag(lambda^(-gamma/2)); 1 whitens, 0 only rotates.")
    ] = DEFAULT_GAMMA,
    epsilon: Annotated[float, typer.Option(help="Added to eigenvalues, relative to the largest.")] = DEFAULT_EPSILON,
    no_whiten: Annotated[bool, typer.Option("--no-whiten", help="Raw baseline: L2-normalised encoder output.")] = False,
    model: Annotated[str, typer.Option(help="Local folder, installed offline model, or hub name.")] = DEFAULT_MODEL,
    pooling: Annotated[str, typer.Option(help=f"Token pooling: {', '.join(POOLINGS)}.")] = "mean",
    extra_pooling: Annotated[
        list[str] | None, typer.Option(help="Also stash this pooling (repeatable), for `retrieval tune`.")
    ] = None,
    text_column: Annotated[str, typer.Option(help="Column with the document text.")] = "text",
    id_column: Annotated[
        str | None, typer.Option(help="Column with document ids [default: id if present, else row numbers].")
    ] = None,
    title_column: Annotated[str | None, typer.Option(help="Column prepended to the text, as BEIR does.")] = None,
    vectors_column: Annotated[
        str | None, typer.Option(help="Column of precomputed embeddings (list of floats): skip encoding.")
    ] = None,
    skip_empty: Annotated[
        bool, typer.Option(help="Leave out rows with null or empty text instead of failing.")
    ] = False,
    max_length: Annotated[int | None, typer.Option(help="Tokens per text [default: the model's].")] = None,
    batch_size: Annotated[int, typer.Option(help="Texts per forward pass.")] = 32,
    precision: Annotated[str, typer.Option(help="fp32, bf16, or auto (bf16 where the CPU has it).")] = "auto",
    index_type: Annotated[
        str, typer.Option(help="flat, hnsw, ivf, or a FAISS index_factory string (HNSW32, IVF1024,SQ8, ...).")
    ] = "flat",
    m: Annotated[int, typer.Option("--m", help="HNSW: neighbours per node.")] = 32,
    ef_construction: Annotated[int, typer.Option(help="HNSW: build-time beam width.")] = 200,
    ef_search: Annotated[int, typer.Option(help="HNSW: default search beam width.")] = 128,
    nlist: Annotated[int | None, typer.Option(help="IVF: number of lists [default: ~4 sqrt(N)].")] = None,
    nprobe: Annotated[int | None, typer.Option(help="IVF: lists probed per query [default: ~sqrt(nlist)].")] = None,
    train_size: Annotated[int | None, typer.Option(help="IVF/PQ: training sample rows.")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Index directory [default: indexes/<stem>].")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing index (only once the new one is done).")] = False,
    keep_vectors: Annotated[bool, typer.Option(help="Keep the raw-vector stash (for refit/tune/rescore).")] = True,
    stash_dtype: Annotated[str, typer.Option(help="Stash precision: float32 or float16.")] = "float32",
    resume: Annotated[
        bool, typer.Option(help="Continue an interrupted build of the same corpus and settings.")
    ] = False,
) -> None:
    """Build a whitened FAISS index from a parquet corpus."""
    if precision not in PRECISIONS:
        raise typer.BadParameter(f"choose one of {', '.join(PRECISIONS)}", param_hint="--precision")
    target = out_dir or home.default_out(corpus)
    spec = CorpusSpec(corpus, text_column, id_column, title_column, vectors_column, skip_empty)
    encoder = None
    if vectors_column is None:
        encoder = TransformerEncoder(model, pooling, max_length, batch_size, precision)
    with progress_bars() as update:
        manifest = build_index(
            spec,
            encoder,
            target,
            TransformSpec(dim=dim, gamma=gamma, epsilon=epsilon, whiten=not no_whiten),
            IndexSpec(index_type, m, ef_construction, ef_search, nlist, nprobe, train_size),
            BuildOptions(keep_vectors, stash_dtype, tuple(extra_pooling or ()), overwrite, resume),
            progress=update,
        )
    home.remember(target)
    err.print(summary(target, manifest), highlight=False)


def summary(directory: Path, manifest: Manifest) -> str:
    t = manifest.transform
    fit = f"gamma {t['gamma']}, explained variance {t['explained_variance']:.1%}" if t["kind"] == "whitening" else "raw"
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in manifest.timings.items())
    size = sum(f["bytes"] for f in manifest.files.values())
    return (
        f"built {directory}: {manifest.n:,} rows, {t['d']} -> {t['k']} dims ({fit}); {manifest.index['type']} index; "
        f"{_bytes(size)} on disk\n  time: {stages}"
    )


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


# ----- search ----------------------------------------------------------------------------------------------
IndexDir = Annotated[Path | None, typer.Option("--index", help="Index directory [default: the last built].")]


@app.command()
@user_errors
def search(
    query: Annotated[str, typer.Argument(help="The query text.")],
    index_dir: IndexDir = None,
    k: Annotated[int, typer.Option("-k", "--k", help="Number of hits.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per hit, one per line.")] = False,
    ef_search: Annotated[int | None, typer.Option("--ef", help="HNSW search beam width.")] = None,
    nprobe: Annotated[int | None, typer.Option(help="IVF lists probed.")] = None,
) -> None:
    """Search an index with a text query."""
    from retrieval.search import Searcher

    directory = index_dir or home.default_index()
    searcher = Searcher.load(directory)
    hits = searcher.search(query, k, ef_search=ef_search, nprobe=nprobe)
    if as_json:
        for hit in hits:
            out.print_json(
                json.dumps({"rank": hit.rank, "id": hit.id, "score": hit.score, "text": hit.text}), indent=None
            )
        return
    table = Table(title=f"{query!r} in {directory}", title_justify="left")
    for name, justify in (("rank", "right"), ("score", "right"), ("id", "left"), ("text", "left")):
        table.add_column(name, justify=justify, overflow="fold" if name == "text" else "ellipsis")
    for hit in hits:
        text = hit.text if len(hit.text) <= 200 else hit.text[:197] + "..."
        table.add_row(str(hit.rank), f"{hit.score:.4f}", hit.id, text)
    out.print(table)


# ----- info ------------------------------------------------------------------------------------------------
@app.command()
@user_errors
def info(
    index_dir: Annotated[Path | None, typer.Argument(help="Index directory [default: the last built].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full manifest and spectrum as JSON.")] = False,
    verify: Annotated[bool, typer.Option(help="Check every file's checksum.")] = False,
) -> None:
    """Show what an index holds: model, pooling, d -> k, gamma, N, sizes, spectrum."""
    from retrieval.info import describe_index

    directory = index_dir or home.default_index()
    report = describe_index(directory, verify=verify)
    if as_json:
        out.print_json(json.dumps(report))
        return
    table = Table(show_header=False, title=str(directory), title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in report["summary"].items():
        table.add_row(key, str(value))
    out.print(table)


# ----- demo ------------------------------------------------------------------------------------------------
@app.command()
@user_errors
def demo(
    dim: Annotated[int, typer.Option(help="Output dimension.")] = 128,
    k: Annotated[int, typer.Option("-k", help="Hits per query.")] = 3,
) -> None:
    """Index the Python standard library's docstrings (built here, no download) and run a few searches."""
    from retrieval.demo import DEMO_QUERIES, write_demo_corpus

    corpus = home.index_root() / "stdlib-docs.parquet"
    rows = write_demo_corpus(corpus)
    err.print(f"wrote {rows:,} docstring paragraphs of this Python's standard library to {corpus}")
    index(corpus, dim=dim, title_column="title", overwrite=True)  # type: ignore[call-arg]
    for query in DEMO_QUERIES:
        search(query, index_dir=home.default_out(corpus), k=k)


def run() -> None:
    app(prog_name="retrieval")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
