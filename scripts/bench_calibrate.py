"""Search knobs measured on queries (``retrieval calibrate``) against the rules of thumb a build uses, and against
the same measurement made on the corpus's own rows (tried first and dropped: it does not transfer).

For each index directory and query set, the queries are split in halves (seeded): **dev**, on which
``retrieval.calibrate`` chooses the smallest efSearch / nprobe reaching recall@10 0.95, and **test**, on which
every choice is checked. Recall is against exact neighbours in the index's space (ties counted as found);
p50 is one query at a time, 300 test queries.

* rule of thumb: efSearch 128; nprobe ~sqrt(nlist) (what a build sets);
* corpus rows: the smallest value reaching the target when 500 rows of the corpus, each left out of its own
  results, are the queries;
* dev queries: ``calibrate`` on the dev half;
* the test half's own choice: what an oracle would pick.

Indexes that re-score (reduced, stash kept: the top 50 re-ranked at full dimension by default) are also measured
as served: recall@10 of the re-scored top 10 against the exact top 50 re-scored alike (``calibrate``'s own
measure since it learnt re-scoring). For them the table's second part gives the test half's served recall of
the value chosen in the index's own space (what ``calibrate`` chose before) and of the value chosen as served,
and each value's p50 (the search of 50 candidates; re-scoring them costs the same at every value).

    python scripts/bench_calibrate.py --index DIR [--index DIR ...] --queries Q [--label NAME] --out results/calibrate

``--queries``: a .npy of raw query vectors (rows as the index's encoder gives them, its pooling), an .npz
and a key (``file.npz:mean``; several joined by ``+``), or a .parquet of texts (``text``, and ``title``
prepended where there is one, as corpus rows are), encoded by the first index's encoder and cached beside that
index (never beside the data: ``../shared`` is read-only to us) as ``<name>.<model>.<pooling>.npy``.
``--build SOURCE --kinds hnsw,ivf --dims 384,128 --work DIR``: first build those indexes from SOURCE's stash
(hard-linked copies, then ``refit``), as bench_scale does. Appends to ``--out``/bench_calibrate.json and
rewrites the table from all of its rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SINGLES = 300  # queries timed one at a time for each p50
CORPUS_ROWS = 500


def load_queries(spec: str, index: Path) -> np.ndarray:
    parts = []
    for item in spec.split("+"):
        path, _, key = item.partition(":")
        if path.endswith(".parquet"):
            parts.append(encode_texts(Path(path), index))
        elif path.endswith(".npz"):
            parts.append(np.load(path)[key or "mean"])
        else:
            parts.append(np.load(path))
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def encode_texts(path: Path, index: Path) -> np.ndarray:
    """A parquet file's texts (title prepended where there is one), encoded by ``index``'s own encoder; cached."""
    import pyarrow.parquet as pq

    from retrieval.encode.transformer import from_info
    from retrieval.indexdir import IndexDir

    info = IndexDir(index).manifest().encoder
    cache = index.parent / f"{path.stem}.{Path(info.model).name}.{info.pooling}.npy"
    if cache.is_file():
        return np.load(cache)
    table = pq.read_table(path)
    texts = table.column("text").to_pylist()
    if "title" in table.column_names:
        titles = table.column("title").to_pylist()
        texts = [f"{title or ''} {text}".strip() for title, text in zip(titles, texts, strict=True)]  # as corpus.py
    vectors = from_info(info).encode(texts)
    np.save(cache, vectors)
    return vectors


def build(source: Path, kinds: list[str], dims: list[int], work: Path) -> list[Path]:
    from retrieval.index import IndexSpec
    from retrieval.update import refit
    from retrieval.whitening import TransformSpec

    built = []
    for kind in kinds:
        for dim in dims:
            target = work / f"{kind}-{dim}"
            if not (target / "manifest.json").is_file():
                if target.exists():
                    shutil.rmtree(target)
                shutil.copytree(source, target, copy_function=os.link)  # refit publishes new files only
                print(f"building {target}", flush=True)
                refit(target, TransformSpec(dim=dim), IndexSpec(kind))
            built.append(target)
    return built


def p50_ms(index: Any, queries: np.ndarray, knob: str, value: int, k: int = 10) -> float:
    from retrieval.index import search_parameters

    params = search_parameters(index, **{knob: value})
    times = []
    for row in queries[:SINGLES]:
        start = time.perf_counter()
        index.search(row[None, :], k, params=params)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1000)


def corpus_rows_choice(index: Any, stash: Any, transform: Any, pooling: str, knob: str, target: float) -> tuple:
    """The dropped approach: 500 corpus rows as queries, each left out of its own exact and found neighbours."""
    from retrieval.calibrate import EXTRA, K, exact_neighbours, grid, recall_with_ties, search_with

    n = index.ntotal
    rows = np.sort(np.random.default_rng(0).choice(n, size=min(n, CORPUS_ROWS), replace=False))
    queries = np.ascontiguousarray(transform.transform(stash.read_rows(rows, pooling, keep=False)), dtype=np.float32)
    scores, exact = exact_neighbours(stash, transform, queries, pooling, keep=K + EXTRA + 1)
    mine = exact == rows[:, None]
    scores = np.stack([s[~m][: K + EXTRA] for s, m in zip(scores, mine, strict=True)])
    exact = np.stack([e[~m][: K + EXTRA] for e, m in zip(exact, mine, strict=True)])
    for value in grid(knob, index):
        found = search_with(index, queries, knob, value, K + 1)
        found = np.stack([f[f != r][:K] for f, r in zip(found, rows, strict=True)])
        recall = recall_with_ties(found, exact, scores)
        if recall >= target:
            return value, round(recall, 4)
    return None, None


def measure(directory: Path, raw_queries: np.ndarray, label: str, target: float) -> dict[str, Any]:
    import math

    from retrieval.calibrate import calibrate, exact_neighbours, grid, knob_of, recall_with_ties, search_with
    from retrieval.index import _ivf
    from retrieval.indexdir import IndexDir

    index_dir = IndexDir(directory)
    manifest = index_dir.manifest()
    index = index_dir.faiss_index()
    stash = index_dir.stash()
    transform = index_dir.transform()
    pooling = manifest.transform.pooling
    knob = knob_of(index)
    if knob is None:
        raise SystemExit(f"{directory}: a flat index has no knob to calibrate")
    queries = np.ascontiguousarray(transform.transform(raw_queries), dtype=np.float32)
    order = np.random.default_rng(0).permutation(len(queries))
    halves = np.sort(order[: len(order) // 2]), np.sort(order[len(order) // 2 :])
    dev, test = queries[halves[0]], queries[halves[1]]
    start = time.perf_counter()
    calibration = calibrate(index, stash, transform, dev, target, "dev half", pooling)
    seconds = time.perf_counter() - start
    scores, exact = exact_neighbours(stash, transform, test, pooling)

    def on_test(value: int) -> float:
        return round(recall_with_ties(search_with(index, test, knob, value), exact, scores), 4)

    rule = 128 if knob == "ef_search" else max(1, round(math.sqrt(_ivf(index).nlist)))
    oracle = next((value for value in grid(knob, index) if on_test(value) >= target), None)
    rows_value, rows_recall = corpus_rows_choice(index, stash, transform, pooling, knob, target)
    p50_ms(index, test, knob, calibration.value)  # warm
    served = {}
    if manifest.rescoring.depth:
        served = measure_served(index_dir, index, raw_queries[halves[0]], raw_queries[halves[1]], knob, target)
        served |= {"alone_served_recall": served["on_test"](calibration.value)}
        served |= {"rule_served_recall": served.pop("on_test")(rule)}
    return served | {
        "label": label,
        "index": str(directory),
        "n": manifest.n,
        "dim": manifest.transform.dim,
        "kind": manifest.index.kind,
        "factory": manifest.index.factory,
        "knob": knob,
        "target": target,
        "dev_queries": len(dev),
        "test_queries": len(test),
        "rule": rule,
        "rule_recall": on_test(rule),
        "rule_p50_ms": p50_ms(index, test, knob, rule),
        "rows": rows_value,
        "rows_sample_recall": rows_recall,
        "rows_recall": on_test(rows_value) if rows_value else None,
        "measured": calibration.value,
        "measured_dev_recall": calibration.recall,
        "measured_recall": on_test(calibration.value),
        "measured_p50_ms": p50_ms(index, test, knob, calibration.value),
        "oracle": oracle,
        "calibration_s": seconds,
        "curve": calibration.curve,
    }


def measure_served(
    index_dir: Any, index: Any, raw_dev: np.ndarray, raw_test: np.ndarray, knob: str, target: float
) -> dict[str, Any]:
    """``calibrate`` as served (re-scoring the index's default depth) on the dev half; its test-half recall."""
    from retrieval.calibrate import calibrate, exact_served, grid, recall_with_ties, served_rows
    from retrieval.update import served_as

    manifest = index_dir.manifest()
    depth, pooling = manifest.rescoring.depth, manifest.transform.pooling
    stash, transform = index_dir.stash(), index_dir.transform()
    dev = np.ascontiguousarray(transform.transform(raw_dev), dtype=np.float32)
    test = np.ascontiguousarray(transform.transform(raw_test), dtype=np.float32)
    start = time.perf_counter()
    served_dev = served_as(index_dir, manifest, stash, raw_dev, depth)
    chosen = calibrate(index, stash, transform, dev, target, "dev half", pooling, served_dev)
    seconds = time.perf_counter() - start
    served_test = served_as(index_dir, manifest, stash, raw_test, depth)
    scores, truth = exact_served(stash, transform, test, pooling, served_test)

    def on_test(value: int) -> float:
        return round(recall_with_ties(served_rows(index, test, knob, value, served_test), truth, scores), 4)

    oracle = next((value for value in grid(knob, index) if on_test(value) >= target), None)
    return {
        "rescore": depth,
        "served_measured": chosen.value,
        "served_measured_dev_recall": chosen.recall,
        "served_measured_recall": on_test(chosen.value),
        "served_measured_p50_ms": p50_ms(index, test, knob, chosen.value, depth),
        "served_oracle": oracle,
        "served_calibration_s": seconds,
        "served_curve": chosen.curve,
        "on_test": on_test,
    }


COLUMNS = [
    ("label", "queries"),
    ("n", "N"),
    ("kind", "kind"),
    ("dim", "dims"),
    ("knob", "knob"),
    ("rule", "rule of thumb"),
    ("rule_recall", "test R@10"),
    ("rule_p50_ms", "p50 ms"),
    ("rows", "corpus rows' choice"),
    ("rows_recall", "test R@10"),
    ("measured", "dev queries' choice"),
    ("measured_recall", "test R@10"),
    ("measured_p50_ms", "p50 ms"),
    ("oracle", "test queries' own choice"),
    ("calibration_s", "calibrate s"),
]
SERVED_COLUMNS = [
    ("label", "queries"),
    ("n", "N"),
    ("kind", "kind"),
    ("dim", "dims"),
    ("rescore", "re-scored"),
    ("rule", "rule of thumb"),
    ("rule_served_recall", "served test R@10"),
    ("measured", "choice in the index's space"),
    ("alone_served_recall", "served test R@10"),
    ("served_measured", "choice as served"),
    ("served_measured_recall", "served test R@10"),
    ("served_measured_p50_ms", "p50 ms (50 candidates)"),
    ("served_oracle", "test half's own choice"),
    ("served_calibration_s", "calibrate s"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", action="append", default=[], type=Path)
    parser.add_argument("--queries", required=True)
    parser.add_argument("--label", default="held-out")
    parser.add_argument("--limit", type=int, help="at most this many queries (a seeded sample)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--build", type=Path, help="build --kinds x --dims from this index's stash first")
    parser.add_argument("--kinds", default="hnsw,ivf")
    parser.add_argument("--dims", default="384,128")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path, default=Path("results/calibrate"))
    args = parser.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark

    indexes = list(args.index)
    if args.build:
        if args.work is None:
            raise SystemExit("--build needs --work (where the built indexes go)")
        dims = [int(d) for d in args.dims.split(",")]
        indexes += build(args.build, args.kinds.split(","), dims, args.work)
    if not indexes:
        raise SystemExit("give --index or --build")
    raw = load_queries(args.queries, indexes[0])
    if args.limit and len(raw) > args.limit:
        raw = raw[np.sort(np.random.default_rng(0).choice(len(raw), args.limit, replace=False))]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_calibrate.json"
    data = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    info = benchlib.machine()
    for directory in indexes:
        row = measure(directory, raw, args.label, args.target)
        row |= {"command": benchlib.command_line(), "loadavg": list(os.getloadavg())}
        print({k: row[k] for k, _ in COLUMNS}, flush=True)
        data["runs"] = [r for r in data["runs"] if (r["index"], r["label"]) != (row["index"], row["label"])] + [row]
        data["machine"] = info
        benchlib.write_json(path, data)
    table = benchlib.md_table(data["runs"], COLUMNS)
    served = benchlib.md_table([r for r in data["runs"] if r.get("rescore")], SERVED_COLUMNS)
    benchlib.write_md(
        args.out / "bench_calibrate.md",
        "# Search knobs measured on queries, checked on held-out ones\n\n" + table + "\n\n"
        + "## Re-scoring indexes, as served (recall@10 of the re-scored top 10 against exact search re-scored)\n\n"
        + served + "\n\n" + benchlib.machine_md(info) + "\n"
    )  # fmt: skip
    print(table + "\n\n" + served)


if __name__ == "__main__":
    main()
