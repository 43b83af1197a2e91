"""Commands that measure an index's knobs and transform: ``calibrate`` (efSearch / nprobe) and ``tune`` (pooling x
dim x gamma, raw included)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from retrieval.cli.options import DefaultEncoder
from retrieval.cli.shell import (
    choice,
    err,
    numbers,
    out,
    progress_bars,
    safe,
    sigterm_exits,
    summary_line,
    user_errors,
    writable_folder,
)
from retrieval.encode.spec import POOLINGS, EncoderSpec
from retrieval.errors import ConfigError
from retrieval.index import trained_on_rows
from retrieval.plots import write_results
from retrieval.tune import AUTO_QUERIES, DEFAULT_GAMMAS


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
    mode: Annotated[
        str | None,
        typer.Option(
            help="Measure searches in this mode: dense or hybrid (a lexical search has no knob) \\[default: hybrid "
            "where the index has a lexical part and the queries are texts, else dense].",
        ),
    ] = None,
    apply: Annotated[bool, typer.Option(help="Make the chosen value the index's default (atomic).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the measurement as JSON.")] = False,
) -> None:
    """Measure the smallest ef-search (HNSW) or nprobe (IVF) whose recall@10 on your queries reaches a target."""
    from retrieval.calibrate import check_target, query_sample
    from retrieval.evaluate import read_texts
    from retrieval.update import calibrate_index, check_calibration

    check_target(target_recall)
    # before the encoder loads and the queries are encoded
    manifest, mode = check_calibration(index_dir, rescore, mode, queries.suffix != ".npy")
    texts = None
    if queries.suffix == ".npy":
        raw = _read_vectors(queries)
    else:
        from retrieval.search import Searcher

        if not manifest.encoder.encodes_text:
            raise ConfigError(
                f"{index_dir} was built from precomputed vectors: give --queries as a .npy of query vectors", "queries"
            )
        texts = read_texts(queries, text_column)
        texts = [texts[i] for i in query_sample(len(texts))]  # the sample calibrate_index takes, before encoding
        raw = Searcher.load(index_dir).encode(texts)
    with sigterm_exits():
        result, manifest = calibrate_index(
            index_dir,
            raw,
            target_recall,
            str(queries.resolve()),
            apply,
            rescore,
            mode,
            texts if mode == "hybrid" else None,
        )
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
            help="No qrels: measure on pseudo-queries made from the index's own documents (a sentence taken "
            "out, its rarest words, its first half; the rest of the document the one relevant hit) and keep the "
            "index's current setting unless a candidate beats it on every kind by a margin (then the gentlest "
            "such; never a centring kernel for an uncentred index, nor a larger gamma than the index's, or than "
            "the default from raw vectors)."
        ),
    ] = False,
    auto_queries: Annotated[int, typer.Option(help="--auto: how many pseudo-queries of each kind.")] = AUTO_QUERIES,
    seed: Annotated[int, typer.Option(help="--auto: seed of the documents sampled.")] = 0,
    mode: Annotated[
        str,
        typer.Option(
            help="dense: sweep the transform; hybrid: choose how the index fuses BM25 with dense search (RRF or "
            "a convex mix at several dense weights), on --queries/--qrels."
        ),
    ] = "dense",
) -> None:
    """Sweep pooling x k x gamma (and raw) WITHOUT re-encoding the corpus; choose on dev, report on test.

    With --auto no qrels are needed: the dev split is made of pseudo-queries from the corpus itself.
    With --mode hybrid the fusion of a hybrid index is chosen instead."""
    from retrieval import tune as tuning
    from retrieval.evaluate import read_judged, read_pairs

    choice("mode", mode, ("dense", "hybrid"))
    if mode == "hybrid":
        if index_dir is None or queries is None or qrels is None or auto:
            raise ConfigError(
                "`mode` hybrid chooses an INDEX_DIR's fusion on `queries` and `qrels` (pseudo-queries are sentences "
                "of the indexed texts, which BM25 finds verbatim: they cannot judge a fusion)",
                "mode",
            )
        if (test_queries is None) != (test_qrels is None):
            raise ConfigError("`test_queries` and `test_qrels` go together: give both or neither", "test_qrels")
        test = read_judged(test_queries, test_qrels) if test_queries and test_qrels else None
        _tune_fusion(index_dir, read_judged(queries, qrels), test, metric or "nDCG@10", apply)
        return

    tuning.check_request(
        index=index_dir is not None, pairs=pairs is not None, queries=queries is not None, qrels=qrels is not None,
        test_pairs=test_pairs is not None, auto=auto, apply=apply, auto_queries=auto_queries, seed=seed,
    )  # fmt: skip
    if results is not None:
        writable_folder(results, "results")  # before the sweep: a bad path would fail after it, and skip `apply`
    pools = [p for p in (poolings or "").split(",") if p] or None
    for pooling in pools or []:
        choice("poolings", pooling, POOLINGS)
    dim_list, gamma_list = numbers("dims", dims, int), numbers("gammas", gammas)
    with progress_bars() as update:
        if index_dir is not None:
            tuning.check_ir_splits(
                queries is not None, qrels is not None, test_queries is not None, test_qrels is not None, auto
            )
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
    if apply and result.decision is not None and result.decision.kept:
        err.print(f"--apply: {index_dir} is unchanged", markup=False)
    elif apply:
        assert index_dir is not None
        from retrieval.update import refit

        scorer = result.scorer.candidate if result.scorer else None
        with sigterm_exits():
            manifest = refit(index_dir, result.best.candidate, scorer=scorer, generation=result.generation)
        err.print(summary_line(index_dir, manifest, "refitted"), markup=False)


def _tune_fusion(index_dir: Path, dev: Any, test: Any, metric: str, apply: bool) -> None:
    from retrieval.tune_fusion import tune_fusion

    with progress_bars() as update:
        result = tune_fusion(index_dir, dev, test, metric, progress=update)
    table = Table(title=f"fusion: chosen on dev by {metric}", title_justify="left")
    for name in ("candidate", f"dev {metric}", f"test {metric}"):
        table.add_column(name, justify="left" if name == "candidate" else "right")
    for trial in result.trials:
        style = "bold green" if trial is result.best else None
        test_value = f"{trial.test[metric]:.4f}" if trial.test else "-"
        table.add_row(trial.label, f"{trial.dev[metric]:.4f}", test_value, style=style)
    out.print(table)
    out.print(f"chosen: {result.best.label}: dev {result.best.dev[metric]:.4f}", markup=False)
    if apply:
        from retrieval.update import set_fusion

        assert result.best.fusion is not None
        with sigterm_exits():
            manifest = set_fusion(index_dir, result.best.fusion)
        version = f"version {manifest.generation}"
        err.print(f"{safe(str(index_dir))}: hybrid searches now fuse by {result.best.label} ({version})", markup=False)


def _report_tuning(result: Any, folder: Path | None) -> None:
    metric = result.metric
    rule = {
        "one-SE": " (one-SE rule: the gentlest within one standard error of the best)",
        "safe": " (dev: the mean over the kinds of pseudo-query; kept unless a candidate wins on each kind)",
    }.get(result.rule, "")
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
    for line in result.decision.lines() if result.decision else ():
        out.print(line, markup=False)
    if folder:
        png = write_results(result, folder)
        err.print(f"wrote {folder / 'tune.json'}" + (f" and {png}" if png else ""), markup=False)
