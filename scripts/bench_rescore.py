"""What re-scoring by default costs: single-query p50 latency with and without re-scoring the top N candidates at
full dimension from the memory-mapped stash, at 100,000 and 1,000,000 documents.

The data: rows drawn from a Gaussian with the mean and covariance of real embeddings (the moments of an index
built on SciFact), written block by block into a .npy (never whole in RAM) and indexed by the library itself
(precomputed vectors; flat index at d/3; stash kept), so the Searcher timed is the one users get. Queries come from
the same Gaussian, one at a time; for each query every depth is timed in a shuffled order, so other load on the
machine falls on all of them alike. The stash is memory-mapped once (``Searcher.warm_up``) and, having just been
written, is in the page cache: these are warm-cache figures.

    python scripts/bench_rescore.py --prepare-only                 # generate + build (no timing)
    python scripts/bench_rescore.py                                # time it, holding the benchmark lock
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

from retrieval.build import build_index
from retrieval.corpus import CorpusSpec
from retrieval.indexdir import IndexDir
from retrieval.manifest import RESCORE_DEPTH
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 65536
DEPTHS = (0, 20, RESCORE_DEPTH, 100, 200)
SOURCES = {  # the real embeddings whose moments the Gaussian copies
    "all-MiniLM-L6-v2": ROOT / "indexes" / "bench" / "scifact-all-minilm-l6-v2",
    "all-mpnet-base-v2": ROOT / "indexes" / "bench" / "scifact-all-mpnet-base-v2",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SOURCES))
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--queries", type=int, default=300, help="timed queries (after 30 untimed)")
    ap.add_argument("--work", type=Path, default=ROOT / "indexes" / "bench")
    ap.add_argument("--out", type=Path, default=benchlib.RESULTS / "rescore")
    ap.add_argument("--prepare-only", action="store_true", help="generate and build, time nothing")
    args = ap.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark
    info = benchlib.machine()
    benchlib.print_machine(info)
    report: dict[str, Any] = {"machine": info, "command": benchlib.command_line(), "depths": DEPTHS, "runs": []}
    for model in args.models.split(","):
        for n in (int(s) for s in args.sizes.split(",")):
            directory, queries = prepare(model, n, args.work)
            if not args.prepare_only:
                report["runs"].append(time_it(model, n, directory, queries, args.queries))
    if args.prepare_only:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(args.out / "rescore.json", report)
    benchlib.write_md(args.out / "rescore.md", markdown(report))
    print(markdown(report))


def prepare(model: str, n: int, work: Path) -> tuple[Path, np.ndarray]:
    """The index directory of ``n`` Gaussian rows with ``model``'s SciFact moments, built once; and its queries."""
    source = IndexDir(SOURCES[model]).moments()
    d = source.dim
    folder = work / f"rescore-{d}-{n}"
    directory = folder / "index"
    queries_path = folder / "queries.npy"
    if (directory / "manifest.json").is_file() and queries_path.is_file():
        return directory, np.load(queries_path)
    folder.mkdir(parents=True, exist_ok=True)
    lam, u = np.linalg.eigh(source.covariance())
    factor = (u * np.sqrt(np.clip(lam, 0, None))).astype(np.float32)  # x = mean + z @ factor.T
    mean = source.mean.astype(np.float32)
    rng = np.random.default_rng(0)
    vectors = folder / "vectors.npy"
    print(f"generating {n:,} x {d} rows...", file=sys.stderr)
    out = np.lib.format.open_memmap(vectors, mode="w+", dtype=np.float32, shape=(n, d))
    for start in range(0, n, BLOCK):
        b = min(BLOCK, n - start)
        out[start : start + b] = rng.standard_normal((b, d), dtype=np.float32) @ factor.T + mean
    out.flush()
    del out
    queries = np.random.default_rng(1).standard_normal((1000, d), dtype=np.float32) @ factor.T + mean
    print(f"building a flat index at d/3 = {d // 3} from them...", file=sys.stderr)
    build_index(CorpusSpec(vectors), None, directory, TransformSpec(dim=d // 3))
    vectors.unlink()  # the stash holds them now
    np.save(queries_path, queries)
    return directory, queries


def time_it(model: str, n: int, directory: Path, queries: np.ndarray, n_queries: int) -> dict[str, Any]:
    searcher = Searcher.load(directory, verify="none")
    assert searcher.rescore_depth(SearchParams()) == RESCORE_DEPTH  # a reduced index with a stash re-scores
    searcher.warm_up()  # opens the stash's memory maps once
    rng = np.random.default_rng(2)
    times: dict[int, list[float]] = {depth: [] for depth in DEPTHS}
    for i in range(30 + n_queries):
        query = queries[i % len(queries)][None, :]
        for depth in rng.permutation(DEPTHS):
            params = SearchParams(k=10, rescore=int(depth))
            start = time.perf_counter()
            searcher.search_raw(query, params)
            if i >= 30:
                times[int(depth)].append(time.perf_counter() - start)
    base = np.asarray(times[0])
    rows = []
    for depth in DEPTHS:
        t = np.asarray(times[depth])
        rows.append(
            {
                "depth": depth,
                "p50_ms": float(np.median(t) * 1000),
                "p99_ms": float(np.percentile(t, 99) * 1000),
                "added_p50_ms": float((np.median(t) - np.median(base)) * 1000),
                "added_paired_median_ms": float(np.median(t - base) * 1000),
            }
        )
    manifest = searcher.manifest
    run = {
        "model": model,
        "n": n,
        "d": manifest.transform.d,
        "dim": manifest.transform.dim,
        "index": manifest.index.kind,
        "stash_mib": round((manifest.stash.bytes if manifest.stash else 0) / 2**20, 1),
        "queries": n_queries,
        "rows": rows,
    }
    print(benchlib.md_table(rows, COLUMNS), flush=True)
    return run


COLUMNS = [
    ("depth", "re-score depth"),
    ("p50_ms", "search p50 ms"),
    ("p99_ms", "p99 ms"),
    ("added_p50_ms", "added p50 ms"),
    ("added_paired_median_ms", "added, paired median ms"),
]


def markdown(report: dict[str, Any]) -> str:
    lines = [benchlib.machine_md(report["machine"]), "", f"Command: `{report['command']}`", ""]
    for run in report["runs"]:
        lines += [
            f"### {run['model']}: {run['n']:,} rows, {run['d']} -> {run['k']} dims, {run['index']} index, "
            f"stash {run['stash_mib']:,} MiB ({run['queries']} single queries, k = 10)",
            "",
            benchlib.md_table(run["rows"], COLUMNS),
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
