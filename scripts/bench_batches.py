"""Query batches through ``Searcher.search_raw``: the query transform by numpy's BLAS or by FAISS's, side by side.

numpy's OpenBLAS and the FAISS wheel's OpenMP each keep a thread pool; numpy's threads spin for a while after a
threaded product. A batch of queries transformed by numpy and then searched by FAISS (HNSW, IVF) had the two
pools competing for the cores. ``Searcher`` now multiplies the queries of such indexes with FAISS's own BLAS
(``index.FaissProduct``). This script times both ways in one process, alternating, at each batch size:
milliseconds per query (the whole batch's wall time over its queries), the median of ``--runs`` passes over
``--queries`` query vectors. The queries are rows of the index's own stash (raw encoder vectors). Flat indexes
are skipped: their scan uses numpy's BLAS, and so do their queries.

An IVF-Flat index also answers a single query through a twin that spreads it over every core
(``index.one_query_twin``); for such indexes the script then times single queries both ways, alternating:
p50 and p99 over ``--singles`` queries (``--query-vectors``, held-out raw vectors, else stash rows), the median
of the runs, and whether the two ways found the same rows.

    python scripts/bench_batches.py --index ../scale-1m-work/joined/hnsw-256 --index ../scale-1m-work/joined/ivf-256
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

BATCHES = [1, 4, 8, 16, 32, 64, 256]


def time_batches(
    directory: str, queries: int, runs: int, batches: list[int], rescore: int | None
) -> list[dict[str, Any]]:
    from retrieval.indexdir import load
    from retrieval.search import Searcher, SearchParams

    searcher = Searcher(load(directory, "quick"), encoder=None)
    faiss_product = searcher._query_product
    if faiss_product is None:
        raise SystemExit(f"{directory}: a flat or unwhitened index: its queries never go through FAISS's BLAS")
    raw = searcher.stash().sample(queries, seed=1, pooling=searcher.manifest.transform.pooling)
    params = SearchParams(k=10, rescore=rescore)  # None: the index's default re-scoring, as a user's call gets
    searcher.search_raw(raw, params)  # warm: pages of the maps, FAISS's buffers

    def per_query_ms(batch: int) -> float:
        start = time.perf_counter()
        for i in range(0, len(raw), batch):
            searcher.search_raw(raw[i : i + batch], params)
        return 1000 * (time.perf_counter() - start) / len(raw)

    rows = []
    for batch in batches:
        times: dict[str, list[float]] = {"numpy": [], "faiss": []}
        for _ in range(runs):
            for way, product in (("numpy", None), ("faiss", faiss_product)):
                searcher._query_product = product
                times[way].append(per_query_ms(batch))
        numpy_ms, faiss_ms = (benchlib.median(times[way]) for way in ("numpy", "faiss"))
        row = {"index": Path(directory).name, "kind": searcher.manifest.index.kind, "batch": batch}
        row |= {"numpy_ms": numpy_ms, "faiss_ms": faiss_ms, "speedup": numpy_ms / faiss_ms, "runs": times}
        print(f"  {row['index']} batch {batch}: numpy {numpy_ms:.3f} ms/query, faiss {faiss_ms:.3f} ms/query")
        rows.append(row)
    searcher._query_product = faiss_product
    return rows


def time_single_queries(
    directory: str, vectors: Path | None, singles: int, runs: int, nprobe: int | None
) -> dict[str, Any] | None:
    """Single-query p50/p99, one core (FAISS's own IVF search) against the twin on every core; None when the
    index has no twin."""
    from retrieval.indexdir import load
    from retrieval.search import Searcher, SearchParams

    searcher = Searcher(load(directory, "quick"), encoder=None)
    twin = searcher._one_query
    if twin is None:
        return None
    pooling = searcher.manifest.transform.pooling
    raw = np.load(vectors)[:singles] if vectors else searcher.stash().sample(singles, seed=2, pooling=pooling)
    params = SearchParams(k=10, rescore=0, nprobe=nprobe)  # the index alone: the twin changes nothing after it

    def one_pass() -> tuple[list[float], np.ndarray]:
        times, found = [], []
        for row in raw:
            start = time.perf_counter()
            found.append(searcher.search_raw(row[None, :], params)[1][0])
            times.append(1000 * (time.perf_counter() - start))
        return times, np.array(found)

    p50: dict[str, list[float]] = {"one core": [], "twin": []}
    p99: dict[str, list[float]] = {"one core": [], "twin": []}
    rows: dict[str, np.ndarray] = {}
    for run in range(runs + 1):  # the first pass of each way warms the pages its lists live on
        for way, index in (("one core", None), ("twin", twin)):
            searcher._one_query = index
            times, rows[way] = one_pass()
            if run:
                p50[way].append(float(np.percentile(times, 50)))
                p99[way].append(float(np.percentile(times, 99)))
    searcher._one_query = twin
    row = {"index": Path(directory).name, "queries": len(raw)}
    row["nprobe"] = nprobe or searcher.manifest.index.search.get("nprobe")
    for way, key in (("one core", "one_core"), ("twin", "twin")):
        row |= {f"{key}_p50_ms": benchlib.median(p50[way]), f"{key}_p99_ms": benchlib.median(p99[way])}
    row["speedup"] = row["one_core_p50_ms"] / row["twin_p50_ms"]
    row["same_rows"] = float((np.sort(rows["one core"], axis=1) == np.sort(rows["twin"], axis=1)).all(axis=1).mean())
    row["runs"] = {"p50": p50, "p99": p99}
    print(f"  {row['index']} single queries: one core {row['one_core_p50_ms']:.3f} ms, twin {row['twin_p50_ms']:.3f}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", action="append", required=True, help="an HNSW or IVF index directory (repeat)")
    ap.add_argument("--queries", type=int, default=512, help="query vectors per pass (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="passes per way and batch size (default: %(default)s)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes (default: %(default)s)")
    ap.add_argument("--rescore", type=int, default=None, help="re-scoring depth (default: the index's own)")
    ap.add_argument("--query-vectors", type=Path, default=None, help="raw query vectors (.npy) for single queries")
    ap.add_argument("--singles", type=int, default=1000, help="single queries per pass (default: %(default)s)")
    ap.add_argument("--nprobe", type=int, default=None, help="IVF lists per single query (default: the index's)")
    ap.add_argument("--out", type=Path, default=benchlib.RESULTS / "batches")
    args = ap.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark

    info = benchlib.machine()
    benchlib.print_machine(info)
    batches = [int(b) for b in args.batches.split(",") if b]
    singles = [time_single_queries(d, args.query_vectors, args.singles, args.runs, args.nprobe) for d in args.index]
    rows = [
        row
        for directory in args.index
        for row in time_batches(directory, args.queries, args.runs, batches, args.rescore)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"command": benchlib.command_line(), "machine": info, "queries": args.queries, "rescore": args.rescore}
    result["rows"] = rows
    result["singles"] = [row for row in singles if row is not None]
    benchlib.write_json(args.out / "bench_batches.json", result)
    columns = [("index", "index"), ("kind", "kind"), ("batch", "batch"), ("numpy_ms", "numpy BLAS, ms/query")]
    columns += [("faiss_ms", "FAISS BLAS, ms/query"), ("speedup", "x")]
    rescoring = "re-scoring" if args.rescore is None else f"re-scoring depth {args.rescore}"
    text = "\n\n".join(
        [
            "# Query batches: the query transform by numpy's BLAS or FAISS's",
            f"`{result['command']}`",
            benchlib.machine_md(info),
            f"Each cell: median of {args.runs} passes over {args.queries} stash rows as queries, "
            f"`Searcher.search_raw` with the index's default knobs and {rescoring}, the two ways alternating; "
            "a single query takes numpy's product either way.",
            benchlib.md_table(rows, columns),
        ]
        if rows
        else ["# Single queries on IVF: one core or every core", f"`{result['command']}`", benchlib.machine_md(info)]
    )
    if result["singles"]:
        queries = f"{args.singles} held-out query vectors" if args.query_vectors else f"{args.singles} stash rows"
        columns = [("index", "index"), ("nprobe", "nprobe"), ("one_core_p50_ms", "one core p50 ms")]
        columns += [("twin_p50_ms", "every core (twin) p50 ms"), ("speedup", "x"), ("one_core_p99_ms", "one core p99")]
        columns += [("twin_p99_ms", "twin p99"), ("same_rows", "same top-10 rows")]
        text += "\n\n## Single queries on IVF-Flat: one core or the twin over every core\n\n"
        text += f"{queries}, no re-scoring, the two ways alternating, median of {args.runs} passes after one warm-up "
        text += "pass each; same top-10 rows: the share of queries whose rows agree as sets.\n\n"
        text += benchlib.md_table(result["singles"], columns)
    benchlib.write_md(args.out / "bench_batches.md", text)
    print(text)


if __name__ == "__main__":
    main()
