"""Query-time cost of the lexical part: one query and a batch of 16, ``LexicalIndex.search`` against bm25s's own
``retrieve`` on the same index, interleaved query by query, one thread.

Both score the same way (bm25s's ``get_scores``: the query terms' columns of the BM25 matrix summed into one
score per document); they differ in how the best ``k`` are chosen. bm25s runs ``np.argpartition`` over every
document's score, and a query's scores are zero for nearly every document, an array numpy partitions far more
slowly than one of distinct values; ``lexical.top_positive`` selects among the positive scores only. The top
``k`` of the two are checked to hold the same scores.

    python scripts/bench_lexical.py --index indexes/bench/serve-flat     # an index with its lexical part

``--index``: any index directory ``retrieval index`` built (its lexical part is on by default), e.g. the 100k
real-text index of ``scripts/bench_serve.py --phases build``. Queries: SciFact test claims and STS-B test
sentences. Writes results/hybrid/lexical-latency.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

from retrieval.fusion import FusionSpec  # noqa: E402
from retrieval.search import Searcher  # noqa: E402

DATA = benchlib.REPO.parent / "shared" / "data"
BATCH = 16


def queries(n: int) -> list[str]:
    claims = pq.read_table(DATA / "scifact" / "queries-test.parquet").column("text").to_pylist()
    sentences = pq.read_table(DATA / "sts" / "stsb-test.parquet").column("sentence1").to_pylist()
    return [text for pair in zip(claims, sentences, strict=False) for text in pair][:n]


def bm25s_search(lexical: Any, texts: list[str], k: int) -> list[np.ndarray]:
    """What ``LexicalIndex.search`` did before ``top_positive``: bm25s's ``retrieve``, one query at a time."""
    out = []
    for text in texts:
        terms = [t for t in lexical.analyzer.terms(text) if t in lexical._vocab]
        if not terms:
            out.append(np.zeros(0, dtype=np.float32))
            continue
        _, scores = lexical._bm25.retrieve([terms], k=k, show_progress=False, n_threads=0, sorted=True)
        out.append(scores[0][scores[0] > 0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=Path, default=benchlib.REPO / "indexes" / "bench" / "serve-flat")
    parser.add_argument("--queries", type=int, default=320)
    parser.add_argument("--k", type=int, default=FusionSpec().depth, help="candidates (hybrid's default depth)")
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "hybrid")
    args = parser.parse_args()
    benchlib.hold_bench_lock()
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    searcher = Searcher.load(args.index, verify="none")
    lexical = searcher.loaded.lexical
    if lexical is None:
        raise SystemExit(f"{args.index} has no lexical part: build it with `retrieval index` (lexical is the default)")
    texts = queries(args.queries)
    info = benchlib.machine()
    timings: dict[str, list[float]] = {"ours, 1 query": [], "bm25s, 1 query": []}
    timings |= {f"ours, {BATCH} queries": [], f"bm25s, {BATCH} queries": []}
    for text in texts[:8]:  # warm: the memory-mapped matrix's pages, the stemmer
        lexical.search([text], args.k)
        bm25s_search(lexical, [text], args.k)
    for i, text in enumerate(texts):
        start = time.perf_counter()
        scores, _ = lexical.search([text], args.k)
        timings["ours, 1 query"].append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs = bm25s_search(lexical, [text], args.k)
        timings["bm25s, 1 query"].append(time.perf_counter() - start)
        ours = scores[0][scores[0] > -np.inf]
        if not np.allclose(np.sort(ours), np.sort(theirs[0]), rtol=1e-6):
            raise SystemExit(f"query {i}: the two top {args.k} differ")
    for first in range(0, len(texts) - BATCH + 1, BATCH):
        batch = texts[first : first + BATCH]
        start = time.perf_counter()
        lexical.search(batch, args.k)
        timings[f"ours, {BATCH} queries"].append(time.perf_counter() - start)
        start = time.perf_counter()
        bm25s_search(lexical, batch, args.k)
        timings[f"bm25s, {BATCH} queries"].append(time.perf_counter() - start)
    rows = [
        {
            "search": name,
            "runs": len(times),
            "p50_ms": 1000 * float(np.median(times)),
            "p90_ms": 1000 * float(np.percentile(times, 90)),
        }
        for name, times in timings.items()
    ]
    for size in ("1 query", f"{BATCH} queries"):
        ours, theirs = (next(r for r in rows if r["search"] == f"{who}, {size}") for who in ("ours", "bm25s"))
        ours["bm25s / ours"] = theirs["p50_ms"] / ours["p50_ms"]
    report = {
        "index": os.path.relpath(args.index, benchlib.REPO),
        "documents": lexical.n,
        "k": args.k,
        "queries": len(texts),
        "rows": rows,
    }
    report |= {"machine": info, "command": benchlib.command_line()}
    args.out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(args.out / "lexical-latency.json", report)
    lines = ["# Lexical search: query-time cost", "", f"Command: `{report['command']}`", ""]
    lines += [benchlib.machine_md(info), ""]
    lines += [f"{lexical.n:,} documents, top {args.k}, {len(texts)} queries (SciFact claims, STS-B sentences), one "]
    lines += ["thread; the two interleaved query by query (batches: batch by batch). Milliseconds.", ""]
    columns = [("search", "search"), ("runs", "runs"), ("p50_ms", "p50 ms"), ("p90_ms", "p90 ms")]
    lines += [benchlib.md_table(rows, [*columns, ("bm25s / ours", "bm25s / ours, p50")]), ""]
    benchlib.write_md(args.out / "lexical-latency.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
