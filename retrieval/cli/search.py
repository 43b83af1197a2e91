"""Commands that read an index: ``search`` (one query, or a file of them) and ``info``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from retrieval.cli import home
from retrieval.cli.options import (
    DefaultSearch,
    EfOption,
    IndexOption,
    NprobeOption,
    RescoreOption,
    adds_search_options,
    search_params,
)
from retrieval.cli.shell import out, progress_bars, safe, user_errors
from retrieval.errors import ConfigError, RetrievalError
from retrieval.manifest import Manifest
from retrieval.search import SearchParams


@user_errors
@adds_search_options
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
    **hybrid: Any,
) -> None:
    """Search an index with a text query, or with every query of a file (--queries)."""
    from retrieval.search import Searcher

    if query is not None and queries is not None:
        raise ConfigError("give a QUERY or `queries` (a file of queries), not both", "queries")
    if query is None and queries is None:
        raise ConfigError("give a QUERY to search for, or `queries` (a file of queries)", "queries")
    directory = index_dir or home.default_index()
    knobs = {"k": k, "rescore": rescore, "ef_search": ef_search, "nprobe": nprobe}
    params = search_params(directory, hybrid, **knobs)
    if query is not None:
        search_one(query, directory, params, as_json)
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


def search_one(query: str, directory: Path, params: SearchParams, as_json: bool = False) -> None:
    """One query, its hits printed: the index checked by sizes and sampled hashes (a whole sha256 of a 3 GB index
    would cost seconds per one-shot search), the query encoded without torch where the model allows."""
    from retrieval.search import Searcher

    searcher = Searcher.load(directory, encoder=one_query_encoder(directory), verify="quick")
    show_hits(searcher.search(query, params), as_json, f"{query!r} in {directory}")


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
