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

    python scripts/bench_calibrate.py --index DIR [--index DIR ...] --queries Q [--label NAME] --out results/calibrate

``--queries``: a .npy of raw query vectors (rows as the index's encoder gives them, its pooling), or an .npz
and a key (``file.npz:mean``; several joined by ``+``). ``--build SOURCE --kinds hnsw,ivf --dims 384,128
--work DIR``: first build those indexes from SOURCE's stash (hard-linked copies, then ``refit``), as
bench_scale does. Appends to ``--out``/bench_calibrate.json and rewrites the table from all of its rows.
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


def load_queries(spec: str) -> np.ndarray:
    parts = []
    for item in spec.split("+"):
        path, _, key = item.partition(":")
        if path.endswith(".npz"):
            parts.append(np.load(path)[key or "mean"])
        else:
            parts.append(np.load(path))
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


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


def p50_ms(index: Any, queries: np.ndarray, knob: str, value: int) -> float:
    from retrieval.index import search_parameters

    params = search_parameters(index, **{knob: value})
    times = []
    for row in queries[:SINGLES]:
        start = time.perf_counter()
        index.search(row[None, :], 10, params=params)
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
    dev, test = queries[np.sort(order[: len(order) // 2])], queries[np.sort(order[len(order) // 2 :])]
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
    return {
        "label": label,
        "index": str(directory),
        "n": manifest.n,
        "dim": manifest.transform.k,
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

    indexes = list(args.index)
    if args.build:
        if args.work is None:
            raise SystemExit("--build needs --work (where the built indexes go)")
        dims = [int(d) for d in args.dims.split(",")]
        indexes += build(args.build, args.kinds.split(","), dims, args.work)
    raw = load_queries(args.queries)
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
    (args.out / "bench_calibrate.md").write_text(
        "# Search knobs measured on queries, checked on held-out ones\n\n" + table + "\n\n"
        + benchlib.machine_md(info) + "\n"
    )  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
