"""Does a calibrated search knob still hold after ``retrieval add`` grows the index? ``add`` keeps the efSearch /
nprobe that ``calibrate --apply`` measured (same graph or lists, more rows); this measures what that costs.

For each index kind and starting size: a seeded shuffle of SOURCE's stash vectors (real encoder output) is cut
into the first ``start`` rows and the rest. ``retrieval index`` builds the start (``--dim``, reduced, so searches
re-score their top 50 as served), ``calibrate --apply`` chooses the knob on the dev half of the queries, and
``retrieval add`` adds the rest. Before and after the add, on the test half, as served (``retrieval.calibrate``'s
own measure): recall@10 at the kept value, single-query p50 at it, and the smallest value that reaches the target
then (what calibrating again would choose, given the test half).

    python scripts/bench_calibrate_growth.py --source INDEX_DIR --queries Q.npy --work DIR \
        [--kinds hnsw,ivf] [--dim 128] [--start 2000,11226] [--target 0.95] [--out results/calibrate]

``--queries``: as bench_calibrate (a .npy of raw query vectors, ``file.npz:key``, or a parquet of texts encoded by
SOURCE's encoder). Writes ``--out``/bench_calibrate_growth.json and .md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from bench_calibrate import load_queries, p50_ms  # noqa: E402


def cut(source: Path, start: int, work: Path) -> tuple[Path, Path]:
    """SOURCE's raw stash vectors, shuffled (seed 0), as ``start`` rows and the rest, each a .npy in ``work``."""
    from retrieval.indexdir import IndexDir

    first, rest = work / f"first-{start}.npy", work / f"rest-{start}.npy"
    if not (first.is_file() and rest.is_file()):
        stash = IndexDir(source).stash()
        vectors = np.concatenate(list(stash.iter_blocks()))
        order = np.random.default_rng(0).permutation(len(vectors))
        if not 0 < start < len(vectors):
            raise SystemExit(f"--start {start}: SOURCE holds {len(vectors)} rows; start from fewer")
        np.save(first, vectors[order[:start]])
        np.save(rest, vectors[order[start:]])
    return first, rest


def retrieval(*args: str) -> None:
    command = [sys.executable, "-m", "retrieval", *args]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=benchlib.retrieval_env())


def on_test(directory: Path, raw_test: np.ndarray, value: int, target: float) -> dict[str, Any]:
    """Served recall@10 of the test half at ``value``, its p50, and the smallest grid value reaching ``target``."""
    from retrieval.calibrate import exact_served, grid, knob_of, recall_with_ties, served_rows
    from retrieval.indexdir import IndexDir
    from retrieval.update import served_as

    index_dir = IndexDir(directory)
    manifest = index_dir.manifest()
    index, stash, transform = index_dir.faiss_index(), index_dir.stash(), index_dir.transform()
    pooling, depth = manifest.transform.pooling, manifest.rescoring.depth
    knob = knob_of(index)
    test = np.ascontiguousarray(transform.transform(raw_test), dtype=np.float32)
    served = served_as(index_dir, manifest, stash, raw_test, depth)
    scores, truth = exact_served(stash, transform, test, pooling, served)

    def recall(v: int) -> float:
        return round(recall_with_ties(served_rows(index, test, knob, v, served), truth, scores), 4)

    p50_ms(index, test, knob, value, max(10, depth))  # warm
    return {
        "n": manifest.n,
        "recall": recall(value),
        "p50_ms": p50_ms(index, test, knob, value, max(10, depth)),
        "needed": next((v for v in grid(knob, index) if recall(v) >= target), None),
        "factory": manifest.index.factory,
    }


def run(source: Path, kind: str, dim: int, start: int, raw: np.ndarray, target: float, work: Path) -> dict:
    from retrieval.update import calibrate_index

    order = np.random.default_rng(0).permutation(len(raw))
    dev, test = raw[np.sort(order[: len(raw) // 2])], raw[np.sort(order[len(raw) // 2 :])]
    first, rest = cut(source, start, work)
    directory = work / f"{kind}-{dim}-from-{start}"
    retrieval("index", str(first), "--dim", str(dim), "--index-type", kind, "--out", str(directory), "--overwrite")
    calibration, _ = calibrate_index(directory, dev, target, "dev half", apply=True)
    before = on_test(directory, test, calibration.value, target)
    retrieval("add", str(directory), str(rest))
    after = on_test(directory, test, calibration.value, target)
    return {
        "kind": kind,
        "dim": dim,
        "knob": calibration.knob,
        "value": calibration.value,
        "dev_recall": calibration.recall,
        "rescore": calibration.rescore,
        "target": target,
        "growth": round(after["n"] / before["n"], 1),
        **{f"before_{key}": value for key, value in before.items()},
        **{f"after_{key}": value for key, value in after.items()},
    }


COLUMNS = [
    ("kind", "kind"),
    ("dim", "dims"),
    ("knob", "knob"),
    ("value", "calibrated (dev half)"),
    ("before_n", "rows then"),
    ("before_recall", "test R@10"),
    ("before_p50_ms", "p50 ms"),
    ("before_needed", "test half needs"),
    ("after_n", "rows after add"),
    ("growth", "growth x"),
    ("after_recall", "test R@10, kept value"),
    ("after_p50_ms", "p50 ms"),
    ("after_needed", "test half needs"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="an index directory whose stash gives the rows")
    parser.add_argument("--queries", required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--kinds", default="hnsw,ivf")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--start", default="2000,11226", help="rows before the add (the rest are added)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--out", type=Path, default=Path("results/calibrate"))
    args = parser.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark

    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    raw = load_queries(args.queries, args.source)
    rows = []
    for start in (int(s) for s in args.start.split(",")):
        for kind in args.kinds.split(","):
            row = run(args.source, kind, args.dim, start, raw, args.target, args.work)
            rows.append(row | {"loadavg": list(os.getloadavg())})
            print({key: row[key] for key, _ in COLUMNS}, flush=True)
    info = benchlib.machine()
    benchlib.write_json(
        args.out / "bench_calibrate_growth.json",
        {"command": benchlib.command_line(), "source": str(args.source), "queries": len(raw), "runs": rows,
         "machine": info},
    )  # fmt: skip
    table = benchlib.md_table(rows, COLUMNS)
    benchlib.write_md(
        args.out / "bench_calibrate_growth.md",
        "# A calibrated knob through `retrieval add` (recall@10 as served, test half)\n\n"
        + f"`{benchlib.command_line()}`\n\n" + table + "\n\n" + benchlib.machine_md(info) + "\n"
    )  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
