"""``eval ir`` and ``eval sts``: quality against relevance judgements or gold similarity scores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from retrieval import files
from retrieval.cli.options import (
    DefaultEncoder,
    DefaultSearch,
    EfOption,
    IndexArg,
    NprobeOption,
    RescoreOption,
    adds_options,
    adds_search_options,
    search_params,
)
from retrieval.cli.shell import choice, out, progress_bars, safe, user_errors, writable_file
from retrieval.encode.spec import POOLINGS, EncoderSpec
from retrieval.errors import ConfigError
from retrieval.whitening import TransformSpec

eval_app = typer.Typer(
    help="Measure quality: IR metrics against qrels, or STS Spearman against gold scores.", no_args_is_help=True
)
IR_DEPTH = 100  # eval ir reports Recall@100 and MAP@100: hits retrieved per query, at least


@eval_app.command("ir")
@user_errors
@adds_search_options
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
    **hybrid: Any,
) -> None:
    """nDCG@10, Recall@10/100, MRR@10, MAP@100 of an index on queries with relevance judgements."""
    from retrieval.evaluate import evaluate_ir, read_judged
    from retrieval.search import Searcher

    if depth < IR_DEPTH:  # below it, Recall@100 and MAP@100 would be measured on fewer hits than they say
        raise ConfigError(f"`depth` must be at least {IR_DEPTH}, the deepest cut-off reported (got {depth})", "depth")
    if per_query is not None:
        writable_file(per_query, "per_query")  # before the evaluation, not after it
    knobs = {"k": depth, "rescore": rescore, "ef_search": ef_search, "nprobe": nprobe}
    params = search_params(index_dir, hybrid, **knobs)
    judged = read_judged(queries, qrels)  # before the encoder loads: a bad file is refused at once
    result = evaluate_ir(Searcher.load(index_dir), *judged, params)
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
@adds_options(TransformSpec, only=["dim", "gamma"])
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
    fit_file: Annotated[
        list[Path] | None, typer.Option(help="More pair files whose sentences join the fit (e.g. train/dev splits).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    **fit: Any,
) -> None:
    """Spearman x100 between cosine and gold score, raw and transformed ("wmean" and "all" aggregations).

    Without --index the transform is fitted on "target": every sentence of the given pair files (and
    --fit-file files), no labels. With --index, the index's own transform (fitted on its corpus) is used.
    """
    from retrieval.encode.spec import Encoder
    from retrieval.evaluate import evaluate_sts, read_pairs
    from retrieval.search import Searcher
    from retrieval.whitening import RawTransform, Whitening

    dim, gamma = fit["dim"], fit["gamma"]
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
