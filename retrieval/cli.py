"""The command line: a thin typer shell that parses options, shows progress, prints results, maps errors."""

from __future__ import annotations

import functools
import json
import logging
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
from retrieval.errors import ConfigError, RetrievalError
from retrieval.index import IndexSpec
from retrieval.manifest import Manifest

app = typer.Typer(
    help="Whitened dense retrieval: build a FAISS index from a parquet corpus, then search it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, soft_wrap=True)  # status lines carry paths: never break them
out = Console()
F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F) -> F:
    """Turn a RetrievalError into one line on stderr and exit status 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except RetrievalError as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False)
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
TextOption = Annotated[str, typer.Option(help="Column with the document text.")]
IdOption = Annotated[
    str | None, typer.Option(help="Column with document ids \\[default: id if present, else row numbers].")
]
TitleOption = Annotated[str | None, typer.Option(help="Column prepended to the text, as BEIR does.")]
SkipEmptyOption = Annotated[bool, typer.Option(help="Leave out rows with null or empty text instead of failing.")]
Corpus = Annotated[
    Path, typer.Argument(help="Parquet file with one document per row, or a .npy array of vectors.", dir_okay=False)
]


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
    text_column: TextOption = "text",
    id_column: IdOption = None,
    title_column: TitleOption = None,
    vectors_column: Annotated[
        str | None, typer.Option(help="Column of precomputed embeddings (list of floats): skip encoding.")
    ] = None,
    skip_empty: SkipEmptyOption = False,
    max_length: Annotated[int | None, typer.Option(help="Tokens per text \\[default: the model's].")] = None,
    batch_size: Annotated[int, typer.Option(help="Texts per forward pass.")] = 32,
    precision: Annotated[
        str, typer.Option(help="fp32, bf16, or auto (the faster on this CPU, timed on the first batch).")
    ] = "auto",
    index_type: Annotated[
        str, typer.Option(help="flat, hnsw, ivf, or a FAISS index_factory string (HNSW32, IVF1024,SQ8, ...).")
    ] = "flat",
    m: Annotated[int, typer.Option("--m", help="HNSW: neighbours per node.")] = 32,
    ef_construction: Annotated[int, typer.Option(help="HNSW: build-time beam width.")] = 200,
    ef_search: Annotated[int, typer.Option(help="HNSW: default search beam width.")] = 128,
    nlist: Annotated[int | None, typer.Option(help="IVF: number of lists \\[default: ~4 sqrt(N)].")] = None,
    nprobe: Annotated[int | None, typer.Option(help="IVF: lists probed per query \\[default: ~sqrt(nlist)].")] = None,
    train_size: Annotated[int | None, typer.Option(help="IVF/PQ: training sample rows.")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Index directory \\[default: indexes/<stem>].")] = None,
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
    if vectors_column is None and corpus.suffix != ".npy":
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
IndexDir = Annotated[Path | None, typer.Option("--index", help="Index directory \\[default: the last built].")]


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
    for name in ("rank", "score", "id", "text"):
        table.add_column(
            name,
            justify="right" if name in ("rank", "score") else "left",
            overflow="fold" if name == "text" else "ellipsis",
        )
    for hit in hits:
        text = hit.text if len(hit.text) <= 200 else hit.text[:197] + "..."
        table.add_row(str(hit.rank), f"{hit.score:.4f}", hit.id, text)
    out.print(table)


# ----- info ------------------------------------------------------------------------------------------------
@app.command()
@user_errors
def info(
    index_dir: Annotated[Path | None, typer.Argument(help="Index directory \\[default: the last built].")] = None,
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


# ----- add / refit -----------------------------------------------------------------------------------------
IndexDirArg = Annotated[Path, typer.Argument(help="Index directory to change in place (atomically).", file_okay=False)]


@app.command()
@user_errors
def add(
    index_dir: IndexDirArg,
    corpus: Corpus,
    text_column: TextOption = "text",
    id_column: IdOption = None,
    title_column: TitleOption = None,
    vectors_column: Annotated[
        str | None, typer.Option(help="Column of precomputed embeddings (for indexes built from vectors).")
    ] = None,
    skip_empty: SkipEmptyOption = False,
) -> None:
    """Encode new documents and add them to an index with its existing kernel (see `info` for drift)."""
    from retrieval.update import add as add_rows

    spec = CorpusSpec(corpus, text_column, id_column, title_column, vectors_column, skip_empty)
    with progress_bars() as update:
        manifest = add_rows(index_dir, spec, progress=update)
    err.print(f"added {manifest.corpus['added'][-1]['rows']:,} rows to {index_dir}: now {manifest.n:,}")


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

    transform = transform_spec(index_dir, dim=dim, gamma=gamma, epsilon=epsilon, whiten=whiten, pooling=pooling)
    knobs = {"m": m, "ef_construction": ef_construction, "ef_search": ef_search, "nlist": nlist, "nprobe": nprobe}
    spec = index_spec(index_dir, kind=index_type, train_size=train_size, **knobs)
    with progress_bars() as update:
        manifest = refit_index(index_dir, transform, spec, progress=update)
    err.print(summary(index_dir, manifest).replace("built", "refitted", 1), highlight=False)


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


# ----- eval ------------------------------------------------------------------------------------------------
eval_app = typer.Typer(
    help="Measure quality: IR metrics against qrels, or STS Spearman against gold scores.", no_args_is_help=True
)
app.add_typer(eval_app, name="eval")
IndexArg = Annotated[Path, typer.Argument(help="Index directory.", exists=True, file_okay=False)]
ParquetOpt = Annotated[Path, typer.Option(help="Parquet file.", exists=True, dir_okay=False)]


@eval_app.command("ir")
@user_errors
def eval_ir(
    index_dir: IndexArg,
    queries: Annotated[Path, typer.Option(help="Queries parquet (query_id, text).", exists=True, dir_okay=False)],
    qrels: Annotated[Path, typer.Option(help="Qrels parquet (query_id, doc_id, score).", exists=True, dir_okay=False)],
    depth: Annotated[int, typer.Option(help="Hits retrieved per query.")] = 100,
    rescore: Annotated[int, typer.Option(help="Re-rank this many candidates with the full stashed vectors.")] = 0,
    ef_search: Annotated[int | None, typer.Option("--ef", help="HNSW search beam width.")] = None,
    nprobe: Annotated[int | None, typer.Option(help="IVF lists probed.")] = None,
    per_query: Annotated[Path | None, typer.Option(help="Write per-query metrics here (JSON lines).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as JSON.")] = False,
) -> None:
    """nDCG@10, Recall@10/100, MRR@10, MAP@100 of an index on queries with relevance judgements."""
    from retrieval.evaluate import evaluate_ir, read_qrels, read_queries
    from retrieval.search import Searcher

    searcher = Searcher.load(index_dir)
    result = evaluate_ir(
        searcher, read_queries(queries), read_qrels(qrels), depth, rescore=rescore, ef_search=ef_search, nprobe=nprobe
    )
    if per_query:
        per_query.write_text("".join(json.dumps({"query_id": q, **m}) + "\n" for q, m in result.per_query.items()))
    if as_json:
        out.print_json(json.dumps({"queries": result.n_queries, **result.metrics}))
        return
    table = Table(title=f"{index_dir} on {queries.name} ({result.n_queries} queries)", title_justify="left")
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
    model: Annotated[str, typer.Option(help="Encoder when no --index.")] = DEFAULT_MODEL,
    pooling: Annotated[str, typer.Option(help=f"Pooling when no --index: {', '.join(POOLINGS)}.")] = "mean",
    dim: Annotated[int | None, typer.Option(help="Output dimension of the fitted transform.")] = None,
    gamma: Annotated[float, typer.Option(help="Eigenvalue power of the fitted transform.")] = DEFAULT_GAMMA,
    fit_file: Annotated[
        list[Path] | None, typer.Option(help="More pair files whose sentences join the fit (e.g. train/dev splits).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Spearman x100 between cosine and gold score, raw and transformed ("wmean" and "all" aggregations).

    Without --index the transform is fitted on "target": every sentence of the given pair files (and
    --fit-file files), no labels. With --index, the index's own transform (fitted on its corpus) is used.
    """
    from retrieval.evaluate import moments_of, read_pairs, sts_result
    from retrieval.search import Searcher
    from retrieval.whitening import RawTransform

    sets = [read_pairs(p) for p in pairs]
    fit_sets = [read_pairs(p) for p in fit_file or []]
    if index_dir:
        searcher = Searcher.load(index_dir)
        encoder, transform, fit_name = searcher.encoder, searcher.transform, f"index {index_dir}"
    else:
        encoder = TransformerEncoder(model, pooling)
    sentences = list(dict.fromkeys(s for p in sets + fit_sets for s in p.sentences()))
    with progress_bars() as update:
        update("encode", 0, len(sentences))
        raw_vectors = encoder.encode(sentences)  # type: ignore[union-attr]
        update("encode", len(sentences), len(sentences))
    vectors = dict(zip(sentences, raw_vectors, strict=True))
    if not index_dir:
        transform = TransformSpec(dim=dim, gamma=gamma).fit(moments_of(vectors, sentences))
        fit_name = f"target ({len(sentences):,} sentences of {', '.join(p.name for p in sets + fit_sets)})"
    raw = RawTransform(raw_vectors.shape[1])
    rows: list[dict[str, Any]] = [
        {"file": p.name, "raw": sts_result(vectors, p, raw), "transformed": sts_result(vectors, p, transform)}
        for p in sets
    ]
    if as_json:
        out.print_json(json.dumps({"fit": fit_name, "transform": repr(transform), "results": rows}))
        return
    table = Table(title=f"STS Spearman x100; transform fitted on {fit_name}", title_justify="left")
    for name in ("file", "raw wmean", "raw all", "transformed wmean", "transformed all"):
        table.add_column(name, justify="left" if name == "file" else "right")
    for row in rows:
        r, t = row["raw"], row["transformed"]
        table.add_row(row["file"], f"{r['wmean']:.2f}", f"{r['all']:.2f}", f"{t['wmean']:.2f}", f"{t['all']:.2f}")
    out.print(table)


# ----- tune ------------------------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


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
    model: Annotated[str, typer.Option(help="STS: encoder (IR uses the index's).")] = DEFAULT_MODEL,
    poolings: Annotated[str | None, typer.Option(help="Comma-separated poolings \\[default: all stashed].")] = None,
    dims: Annotated[str, typer.Option(help="Comma-separated output dimensions to try.")] = "",
    gammas: Annotated[str, typer.Option(help="Comma-separated gammas to try.")] = "0,0.25,0.5,0.75,1",
    metric: Annotated[str | None, typer.Option(help="Choose on this \\[default: nDCG@10, or STS 'all'].")] = None,
    results: Annotated[Path | None, typer.Option(help="Folder for tune.json, tune.md and tune.png.")] = None,
    apply: Annotated[bool, typer.Option(help="Re-fit the index with the chosen transform (atomic).")] = False,
) -> None:
    """Sweep pooling x k x gamma WITHOUT re-encoding the corpus; choose on dev, report on test."""
    from retrieval import tune as tuning
    from retrieval.evaluate import read_pairs, read_qrels, read_queries

    # ConfigError, not typer.BadParameter: one "error:" line and exit 1, like every other user error
    if (index_dir is None) == (pairs is None):
        raise ConfigError("give an INDEX_DIR with --queries/--qrels (IR), or --pairs (STS)")
    if apply and index_dir is None:  # before any encoding, not after the whole sweep
        raise ConfigError("--apply re-fits an index: it needs INDEX_DIR")
    if index_dir is not None:
        if queries is None or qrels is None:
            raise ConfigError("IR tuning needs --queries and --qrels (the dev split)")
        if (test_queries is None) != (test_qrels is None):
            raise ConfigError("--test-queries and --test-qrels go together: give both or neither")
        from retrieval.encoder import load_encoder
        from retrieval.manifest import Manifest
        from retrieval.search import Docs, stash_of

        manifest = Manifest.load(index_dir)
        stash = stash_of(index_dir)
        pools = poolings.split(",") if poolings else stash.poolings
        info = {**manifest.encoder, "pooling": pools[0]}
        encoder = load_encoder(info) if info.get("kind") == "transformers" else None
        if encoder is None:
            raise ConfigError("IR tuning needs a text encoder: this index was built from vectors")
        d = stash.dim
        grid = tuning.candidates(pools, [int(v) for v in _floats(dims)] or _default_dims(d), _floats(gammas), d)
        test = (read_queries(test_queries), read_qrels(test_qrels)) if test_queries and test_qrels else None
        with progress_bars() as update:
            result = tuning.tune_ir(
                stash,
                Docs(index_dir / "docs.parquet").ids,
                _all_poolings(encoder, pools),
                (read_queries(queries), read_qrels(qrels)),
                test,
                grid,
                metric or "nDCG@10",
                on_trial=lambda t: update("tune", 1, len(grid)),
            )
        err.print(f"tuned on {len(stash):,} stashed vectors: the corpus was not re-encoded", highlight=False)
    else:
        assert pairs is not None
        dev_pairs, test_set = read_pairs(pairs), read_pairs(test_pairs) if test_pairs else None
        fit_sets = [read_pairs(p) for p in fit_file or []]
        sentences = list(
            dict.fromkeys(s for p in [dev_pairs, *([test_set] if test_set else []), *fit_sets] for s in p.sentences())
        )
        pools = poolings.split(",") if poolings else ["mean"]
        encoder = TransformerEncoder(model, pools[0])
        with progress_bars() as update:
            update("encode", 0, len(sentences))
            raw = encoder.encode_poolings(sentences, pools, on_batch=lambda n: update("encode", n, len(sentences)))
        vectors = {p: dict(zip(sentences, raw[p], strict=True)) for p in pools}
        d = encoder.dim
        grid = tuning.candidates(pools, [int(v) for v in _floats(dims)] or _default_dims(d), _floats(gammas), d)
        result = tuning.tune_sts(vectors, sentences, dev_pairs, test_set, grid, metric or "all")
    _report_tuning(result, results)
    if apply:
        assert index_dir is not None
        from retrieval.update import refit

        best = result.best.candidate
        manifest = refit(index_dir, TransformSpec(dim=best.dim, gamma=best.gamma or 0.0, pooling=best.pooling))
        err.print(summary(index_dir, manifest), highlight=False)


def _all_poolings(encoder: Any, pools: list[str]) -> Callable[[str, Any], Any]:
    """Query vectors for one pooling, encoding each query split once for all poolings."""
    cache: dict[int, dict[str, Any]] = {}

    def vectors(pooling: str, queries: Any) -> Any:
        if id(queries) not in cache:
            cache[id(queries)] = encoder.encode_poolings(queries.texts, pools)
        return cache[id(queries)][pooling]

    return vectors


def _default_dims(d: int) -> list[int]:
    return [k for k in (d, 512, 384, 256, 128, 64) if k <= d]


def _report_tuning(result: Any, folder: Path | None) -> None:
    from retrieval.plots import plot_tuning

    metric = result.metric
    table = Table(title=f"tuning: chosen on dev by {metric}", title_justify="left")
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
            line += f" (raw {result.raw.test[metric]:.4f}, {best.test[metric] / result.raw.test[metric]:.1%} of raw)"
    out.print(line, highlight=False)
    if folder:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tune.json").write_text(json.dumps(result.to_dict(), indent=1))
        split = "test" if best.test else "dev"
        png = plot_tuning(result, folder / "tune.png", split=split, title=f"{metric} ({split})")
        err.print(f"wrote {folder / 'tune.json'}" + (f" and {png}" if png else ""), highlight=False)


def run() -> None:
    app(prog_name="retrieval")


if __name__ == "__main__":  # pragma: no cover
    run()
