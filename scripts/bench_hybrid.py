"""Hybrid search and metadata filters: quality of each mode, what the lexical part costs, filtered search at scale.

``ir``: every IR set in ../shared/data (scifact, cisi, cacm, npl), per model: an index built with the defaults
(the lexical part included; its share of the build's wall time and its size recorded), then nDCG@10 of the test
queries in each mode (dense, lexical, hybrid with the recorded default) and over a grid of fusions (RRF, convex
at several dense weights). The default fusion is chosen on SciFact's TRAIN queries (``--choose``), never on test.

``filters``: rows with a ``bucket`` column (uniform 0-999), so that filters keep 50%, 10%, 1% and 0.1% of the
rows: ``--corpus`` (e.g. the million rows ``make_spectrum.py sample`` writes) or N synthetic clustered 384-d rows.
For flat, HNSW and IVF: recall@10 of the filtered search against exact search over the kept rows, and p50 of
single queries, each timed right after the same query unfiltered (the ratio is taken under the same load); per
share, the path the library takes (``retrieval.filtered.RULES``), exact scoring of the kept rows and the selector
search; ``--sweep``: the selector search at each widening of ``SWEEPS``; ``--switch``: shares around the
exact-scoring switch; and what a new filter costs its first search.

    python scripts/bench_hybrid.py ir --models all-MiniLM-L6-v2 [--models all-mpnet-base-v2]
    python scripts/bench_hybrid.py filters --rows 100000 [--sweep] [--switch]

Heavy runs take the benchmark lock (benchlib). Writes results/hybrid/{ir,filters}.{json,md} (``--name N``:
results/N/; ``--results R``: the filters part's files are R.json, R.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

from retrieval import filtered  # noqa: E402
from retrieval.build import BuildOptions, build_index  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.encode.spec import EncoderSpec  # noqa: E402
from retrieval.evaluate import evaluate_ir, read_qrels, read_queries  # noqa: E402
from retrieval.filters import evaluate, parse  # noqa: E402
from retrieval.fusion import FusionSpec  # noqa: E402
from retrieval.index import IndexSpec  # noqa: E402
from retrieval.indexdir import IndexDir  # noqa: E402
from retrieval.search import Searcher, SearchParams  # noqa: E402
from retrieval.whitening import TransformSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "indexes" / "bench" / "hybrid"
SETS = ("scifact", "cisi", "cacm", "npl")
GRID = [FusionSpec("rrf", weight=0.5)] + [FusionSpec("convex", weight=w) for w in (0.3, 0.4, 0.5, 0.6, 0.7)]
SHARES = (0.5, 0.1, 0.01, 0.001)
KINDS = ("flat", "hnsw", "ivf")


def label(fusion: FusionSpec) -> str:
    return f"rrf k={fusion.rrf_k}" if fusion.method == "rrf" else f"convex {fusion.weight:.1f}"


# ----- IR -----------------------------------------------------------------------------------------------------
def build(args: argparse.Namespace, name: str, model: str) -> tuple[Path, dict[str, Any], Any]:
    """The hybrid index of set ``name`` for ``model`` (built with the defaults unless there), what building it cost,
    and the encoder its queries take. With ``--vectors-from``, the dense vectors come from the stash of an index of
    the same corpus built by retrieval with the same settings (raw, mean pooling, titles prepended): nothing is
    encoded again, and the dense build's cost is that index's recorded one."""
    directory = WORK / f"{name}-{model.lower()}"
    corpus = CorpusSpec(args.data / name / "corpus.parquet", id_column="doc_id", title_column="title")
    source = Path(args.vectors_from.format(set=name, model=model.lower())) if args.vectors_from else None
    built = IndexDir(source).manifest() if source is not None else None
    if built is not None:
        settings = built.corpus.settings
        same = (built.transform.kind, built.encoder.model, built.encoder.pooling) == ("raw", model, "mean")
        if not same or (settings.get("id_column"), settings.get("title_column")) != ("doc_id", "title"):
            raise SystemExit(f"{source} is not a raw mean-pooled {model} index of {name} with titles: not reused")
    if args.rebuild or not (directory / "manifest.json").is_file():
        start = time.perf_counter()
        if built is None:
            encoder = EncoderSpec(model, "mean").load()
            manifest = build_index(corpus, encoder, directory, TransformSpec(), options=BuildOptions(overwrite=True))
            dense = time.perf_counter() - start - manifest.timings.get("lexical", 0.0)
            precision = manifest.encoder.precision_used
        else:
            assert source is not None
            stash = IndexDir(source).stash()
            table = pa.concat_tables(stash.iter_docs())
            vectors = np.concatenate(list(stash.iter_blocks()))
            table = table.append_column(
                "vector", pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), vectors.shape[1])
            )
            WORK.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, WORK / f"{name}-{model.lower()}.parquet")
            spec = CorpusSpec(WORK / f"{name}-{model.lower()}.parquet", vectors_column="vector")
            manifest = build_index(spec, None, directory, TransformSpec(), options=BuildOptions(overwrite=True))
            dense = sum(built.timings.values())
            precision = built.encoder.precision_used
        lexical = manifest.timings.get("lexical", 0.0)
        assert manifest.lexical is not None
        cost = {
            "dense_build_s": dense,
            "lexical_s": lexical,
            "lexical_share_of_build": lexical / dense,  # what the lexical part adds to a dense build's wall time
            "lexical_mib": manifest.lexical.bytes / 2**20,
            "terms": manifest.lexical.terms,
            "docs": manifest.n,
            "vectors_from": str(source) if source else None,
            "precision": precision,  # the documents' encoding, which their queries take too
        }
        benchlib.write_json(directory / "bench-build.json", cost)
    cost = json.loads((directory / "bench-build.json").read_text())
    return directory, cost, EncoderSpec(model, "mean", precision=cost.get("precision") or "auto").load()


def ndcg(searcher: Searcher, queries: Any, qrels: Any, raw: np.ndarray, params: SearchParams) -> float:
    return evaluate_ir(searcher, queries, qrels, params, raw_queries=raw).metrics["nDCG@10"]


def run_ir(args: argparse.Namespace) -> None:
    out = benchlib.out_dir(args.name)
    info = benchlib.machine(torch_too=True)
    benchlib.print_machine(info)
    rows, choice_rows, missing = [], [], []
    for model in args.models:
        for name in args.sets:
            source = args.vectors_from and Path(args.vectors_from.format(set=name, model=model.lower()))
            if args.skip_missing and source and not (source / "manifest.json").is_file():
                missing.append(f"{model} on {name}")  # not encoded yet: left out, and the table says so
                continue
            directory, cost, encoder = build(args, name, model)
            searcher = Searcher.load(directory, encoder=None)
            for split in ("test", "train") if name == "scifact" else ("test",):
                queries = read_queries(args.data / name / f"queries-{split}.parquet")
                qrels = read_qrels(args.data / name / f"qrels-{split}.parquet")
                raw = encoder.encode(queries.texts)
                row: dict[str, Any] = {"model": model, "set": name, "split": split, "queries": len(queries.ids)}
                for mode in ("dense", "lexical", "hybrid"):  # hybrid: the default fusion of a new build
                    fusion = FusionSpec() if mode == "hybrid" else None
                    row[mode] = ndcg(searcher, queries, qrels, raw, SearchParams(k=100, mode=mode, fusion=fusion))
                for fusion in GRID:
                    params = SearchParams(k=100, mode="hybrid", fusion=fusion)
                    row[label(fusion)] = ndcg(searcher, queries, qrels, raw, params)
                row["best side"] = max(row["dense"], row["lexical"])
                row["hybrid / best side"] = row["hybrid"] / row["best side"]
                (choice_rows if split == "train" else rows).append(row | (cost if split == "test" else {}))
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    fusions = [label(f) for f in GRID]
    result = {"machine": info, "default_fusion": FusionSpec().to_dict(), "test": rows, "train": choice_rows}
    result["not_measured"] = missing
    if choice_rows:
        scifact = [r for r in choice_rows if r["model"] == args.models[0]]
        result["chosen_on_train"] = max(fusions, key=lambda f: scifact[0][f])
    benchlib.write_json(out / "ir.json", result)
    columns = [("model", "model"), ("set", "set"), ("dense", "dense"), ("lexical", "BM25"), ("hybrid", "hybrid")]
    columns += [("hybrid / best side", "hybrid / best side")] + [(f, f) for f in fusions]
    cost_columns = [("model", "model"), ("set", "set"), ("docs", "docs"), ("dense_build_s", "dense build s")]
    cost_columns += [("lexical_s", "lexical s"), ("lexical_share_of_build", "lexical / dense build")]
    cost_columns += [("lexical_mib", "lexical MiB"), ("terms", "terms")]
    text = [
        "# Hybrid search: nDCG@10 by mode (test queries)\n",
        f"Default fusion: {label(FusionSpec())}, depth {FusionSpec().depth} per side.\n",
        benchlib.md_table(rows, columns),
        "\n## SciFact train (where the default fusion is chosen)\n",
        benchlib.md_table(choice_rows, columns),
        f"\nBest on SciFact train: {result.get('chosen_on_train')}\n",
        f"\nNot measured (no encoded corpus): {', '.join(missing)}\n" if missing else "",
        "\n## The lexical part's cost\n",
        benchlib.md_table(rows, cost_columns),
        "\n" + benchlib.machine_md(info),
    ]
    (out / "ir.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


# ----- filters ------------------------------------------------------------------------------------------------
def synthetic(path: Path, n: int, d: int = 384, seed: int = 0) -> Path:
    """``n`` clustered unit vectors (a mixture of 1,000 Gaussians, like embeddings' clumps) and a ``bucket`` column
    (0-999, uniform) for filters of known selectivity."""
    if path.is_file():
        return path
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(1000, d)).astype(np.float32)
    labels = rng.integers(0, 1000, n)
    vectors = centres[labels] + 0.8 * rng.normal(size=(n, d)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    table = pa.table(
        {
            "id": [str(i) for i in range(n)],
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), d),
            "bucket": pa.array(rng.integers(0, 1000, n), pa.int32()),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def exact(searcher: Searcher, queries: np.ndarray, mask: np.ndarray, k: int = 10) -> list[set[int]]:
    """Each query's exact top ``k`` over the rows ``mask`` keeps, in the index's space (blocks of rows)."""
    rows = np.flatnonzero(mask)
    stash = searcher.stash()
    q = searcher.transform.transform(queries)
    best = np.full((len(q), k), -np.inf, dtype=np.float32)
    found = np.full((len(q), k), -1, dtype=np.int64)
    for first in range(0, len(rows), 100_000):
        block = rows[first : first + 100_000]
        scores = q @ searcher.transform.transform(stash.read_rows(block, searcher.manifest.transform.pooling)).T
        scores = np.concatenate([best, scores], axis=1)
        ids = np.concatenate([found, np.broadcast_to(block, (len(q), len(block)))], axis=1)
        order = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        best, found = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
    return [set(row[row >= 0].tolist()) for row in found]


def recall(found: list[set[int]], want: list[set[int]]) -> float:
    return float(np.mean([len(f & w) / max(len(w), 1) for f, w in zip(found, want, strict=True)]))


def timed(
    searcher: Searcher, queries: np.ndarray, params: SearchParams, rounds: int
) -> tuple[list[set[int]], float, float]:
    """(rows found per query, p50 ms, unfiltered p50 ms) of single queries, each filtered search timed right
    after the same query unfiltered, ``rounds`` times over the queries: the ratio of the two p50s is measured
    under the same load."""
    unfiltered = replace(params, where=None)
    searcher.search_vectors(queries[:1], params)  # warm-up (and the filter's rows, evaluated once)
    searcher.search_vectors(queries[:1], unfiltered)
    found: list[set[int]] = []
    times: list[float] = []
    base: list[float] = []
    for round_ in range(rounds):
        for query in queries:
            start = time.perf_counter()
            searcher.search_vectors(query[None], unfiltered)
            base.append(time.perf_counter() - start)
            start = time.perf_counter()
            hits = searcher.search_vectors(query[None], params)[0]
            times.append(time.perf_counter() - start)
            if round_ == 0:
                found.append({h.row for h in hits})
    return found, float(np.median(times)) * 1e3, float(np.median(base)) * 1e3


EXACT_MEASURED = 50_000  # exact scoring of more kept rows than this is not timed: a query reads them all
# The widenings swept: IVF's power of the share (per_k as shipped), HNSW's beam per row asked for (power as shipped)
SWEEPS = {
    "ivf": [("power", p) for p in (0.0, 0.25, 0.5, 0.75, 1.0)],
    "hnsw": [("per_k", c) for c in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)],
}
SWITCH_SHARES = (0.002, 0.005, 0.02, 0.05)  # where exact scoring and the selector search are both timed


def corpus_of(args: argparse.Namespace) -> CorpusSpec:
    """The rows to filter: ``--corpus`` (a parquet file with ``vector`` and ``bucket`` columns, such as
    ``make_spectrum.py sample`` writes), else ``--rows`` synthetic clumps."""
    path = args.corpus or synthetic(args.work / f"synthetic-{args.rows}.parquet", args.rows)
    return replace(CorpusSpec(path, vectors_column="vector"), columns=("bucket",))


def build_filters(args: argparse.Namespace, kind: str) -> Path:
    directory = args.work / f"{Path(str(corpus_of(args).path)).stem}-{kind}"
    if args.rebuild or not (directory / "manifest.json").is_file():
        options = BuildOptions(overwrite=True, lexical=None, resume=args.resume)
        index = IndexSpec(kind=kind, ef_construction=args.ef_construction)
        if kind == "ivf":
            index = replace(index, nlist=args.nlist, train_size=args.train_size)
        build_index(corpus_of(args), None, directory, TransformSpec.raw(), index, options=options)
    return directory


def query_vectors(args: argparse.Namespace, searcher: Searcher, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    if args.query_vectors is not None:
        queries = np.load(args.query_vectors).astype(np.float32)
        chosen = queries[np.sort(rng.choice(len(queries), min(args.queries, len(queries)), replace=False))]
        return chosen, f"{len(chosen)} real encoded queries ({args.query_vectors.name})"
    stash = searcher.stash()
    queries = stash.read_rows(rng.choice(len(stash), args.queries, replace=False), None)
    return queries + 0.3 * rng.normal(size=queries.shape).astype(np.float32), f"{args.queries} rows plus noise"


def paths(kind: str, shipped: filtered.Rule, kept: int, n: int, sweep: bool) -> list[tuple[str, filtered.Rule]]:
    """The paths measured at one share: the library's own choice, exact scoring of the kept rows, the selector
    search, and (``sweep``) the selector search at each widening of ``SWEEPS``."""
    out = [("default", shipped)]
    if kind == "flat":
        return out
    if kept <= EXACT_MEASURED and not shipped.exact(kept, n):
        out.append(("exact", replace(shipped, exact_share=1.0)))
    selector = replace(shipped, exact_rows=0, exact_share=0.0)
    if shipped.exact(kept, n):
        out.append(("selector", selector))
    if sweep:
        for field, value in SWEEPS[kind]:
            out.append((f"selector, {field} {value:g}", replace(selector, **{field: value})))
    return out


def setup_ms(searcher: Searcher, where: Any, queries: np.ndarray, params: SearchParams) -> dict[str, float]:
    """What a filter costs the first search that uses it: evaluating it over the kept columns, its row numbers
    and bitmap, and the first search itself (which gathers the kept rows' vectors when it scores them exactly)."""
    searcher._kept.clear()
    start = time.perf_counter()
    mask = evaluate(where, searcher.loaded.columns)
    evaluated = time.perf_counter()
    kept = filtered.Kept(mask)
    kept.selector()
    made = time.perf_counter()
    searcher._kept.clear()
    start_search = time.perf_counter()
    searcher.search_vectors(queries[:1], params)
    first = time.perf_counter() - start_search
    return {
        "evaluate ms": (evaluated - start) * 1e3,
        "rows + bitmap ms": (made - evaluated) * 1e3,
        "first search ms": first * 1e3,
    }


def measure_share(
    args: argparse.Namespace, searcher: Searcher, kind: str, queries: np.ndarray, share: float, sweep: bool
) -> list[dict[str, Any]]:
    """Every path's recall@10 and p50 (and the unfiltered p50 timed beside it) at one share kept."""
    where = parse(f"bucket < {round(1000 * share)}")
    mask = searcher.mask(where)
    kept, n = int(mask.sum()), len(mask)
    want = exact(searcher, queries, mask)
    params = SearchParams(k=10, mode="dense", where=where)
    rows = []
    for label, rule in paths(kind, filtered.rule_for(searcher.index), kept, n, sweep):
        searcher.filter_rule = rule
        try:
            found, p50, base = timed(searcher, queries, params, args.rounds)
            setup = setup_ms(searcher, where, queries, params) if label == "default" else {}
        finally:
            searcher.filter_rule = None
        taken = "exact" if kind != "flat" and rule.exact(kept, n) else "selector"
        rows.append(
            {"kind": kind, "kept": share, "rows kept": kept, "path": label, "takes": taken}
            | {"recall@10": recall(found, want), "p50 ms": p50, "unfiltered p50 ms": base}
            | {"p50 / unfiltered": p50 / base}
            | setup
        )
        print(rows[-1], flush=True)
    return rows


def run_filters(args: argparse.Namespace) -> None:
    if args.build_only:
        for kind in args.kinds:
            build_filters(args, kind)
        return
    benchlib.hold_bench_lock()
    out = benchlib.out_dir(args.name)
    info = benchlib.machine()
    benchlib.print_machine(info)
    rows, described = [], ""
    for kind in args.kinds:
        searcher = Searcher.load(build_filters(args, kind))
        queries, described = query_vectors(args, searcher, np.random.default_rng(1))
        everything = np.ones(searcher.index.ntotal, dtype=bool)
        found, p50, _ = timed(searcher, queries, SearchParams(k=10, mode="dense"), args.rounds)
        rows.append({"kind": kind, "kept": 1.0, "rows kept": searcher.index.ntotal, "path": "no filter"})
        rows[-1] |= {"recall@10": recall(found, exact(searcher, queries, everything)), "p50 ms": p50}
        rows[-1] |= {"unfiltered p50 ms": p50, "p50 / unfiltered": 1.0}
        for share in sorted(SHARES + (SWITCH_SHARES if args.switch else ()), reverse=True):
            rows += measure_share(args, searcher, kind, queries, share, args.sweep and share in SHARES)
    name = args.results or ("filters" if list(args.kinds) == list(KINDS) else f"filters-{'-'.join(args.kinds)}")
    n = rows[0]["rows kept"]
    what = f"rows of {args.corpus.name}" if args.corpus else "synthetic 384-d rows"
    rules = {kind: asdict(rule) for kind, rule in filtered.RULES.items()}
    record = {"machine": info, "rows": n, "corpus": what, "queries": described, "rounds": args.rounds}
    record |= {"rules": rules, "results": rows}
    benchlib.write_json(out / f"{name}.json", record)
    keys = ("kind", "kept", "rows kept", "path", "takes", "recall@10", "p50 ms", "unfiltered p50 ms")
    columns = [(k, k) for k in (*keys, "p50 / unfiltered")]
    setup = [(k, k) for k in ("kind", "kept", "rows kept", "takes", "evaluate ms", "rows + bitmap ms")]
    setup.append(("first search ms", "first search ms"))
    text = [
        f"# Filtered search: {n:,} {what}, {described}, single queries\n",
        f"Rules: {rules}. Each p50 over {args.rounds} rounds of the queries, the unfiltered search timed beside"
        " the filtered one.\n",
        benchlib.md_table(rows, columns),
        "\n## What a new filter costs its first search\n",
        benchlib.md_table([r for r in rows if "evaluate ms" in r], setup),
        "\n" + benchlib.machine_md(info),
    ]
    benchlib.write_md(out / f"{name}.md", "\n".join(text))
    print("\n".join(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("ir", "filters"))
    parser.add_argument("--models", action="append", help="encoder models (default all-MiniLM-L6-v2)")
    parser.add_argument("--sets", nargs="+", default=list(SETS))
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data", help="the shared IR sets")
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the filtered-search benchmark")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="index kinds (filters)")
    parser.add_argument("--rebuild", action="store_true", help="build the indexes again")
    parser.add_argument("--corpus", type=Path, help="filters: a parquet file of vector + bucket rows")
    parser.add_argument("--query-vectors", type=Path, help="filters: a .npy of raw query vectors")
    parser.add_argument("--work", type=Path, default=WORK, help="filters: where the indexes are built")
    parser.add_argument("--ef-construction", type=int, default=IndexSpec().ef_construction, help="filters: HNSW")
    parser.add_argument("--build-only", action="store_true", help="filters: build the indexes, time nothing")
    parser.add_argument("--rounds", type=int, default=3, help="filters: timed passes over the queries")
    parser.add_argument("--sweep", action="store_true", help="filters: the selector search at every widening")
    parser.add_argument("--switch", action="store_true", help="filters: shares around the exact-scoring switch")
    parser.add_argument("--results", help="filters: the results files' name (default filters[-KINDS])")
    parser.add_argument("--resume", action="store_true", help="filters: finish builds from their stashed parts")
    parser.add_argument("--nlist", type=int, help="filters: IVF lists (default: the library's)")
    parser.add_argument("--train-size", type=int, help="filters: IVF training rows (default: the library's)")
    parser.add_argument("--name", default="hybrid", help="the results/ folder")
    parser.add_argument(
        "--skip-missing",
        action="store_true",
        help="with --vectors-from: leave out (and name in the table) the sets and models without such an index",
    )
    parser.add_argument(
        "--vectors-from",
        help="reuse the raw vectors of existing indexes of the same sets and model (a pattern with {set} and "
        "{model}, e.g. indexes/bench/{set}-{model}); the dense build's cost is then theirs",
    )
    args = parser.parse_args()
    args.models = args.models or ["all-MiniLM-L6-v2"]
    run_ir(args) if args.part == "ir" else run_filters(args)


if __name__ == "__main__":
    main()
