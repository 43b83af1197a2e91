"""Probe of the int8 stash's gap to the float32 stash in re-scoring (issue 41): coding or the noise of few queries?

On the stashes ``bench_codes.py`` builds (``--stashes``), each set's candidates are the exact raw cosine top
``DEPTH`` (so re-scoring from the float32 stash gives exact raw search back, and any change is the coding's
alone), re-scored from the float32 stash, the int8 stash (``VectorStash`` dtype int8: directions in 255 steps per
dimension of each part, lengths in float32) and a float16 stash. Per set: nDCG@10 of each, the relative gap to
float32, how many queries' nDCG@10 moved at all, the largest single-query move, a paired bootstrap interval of
the gap (queries resampled, 2,000 draws), and the rms error of the re-scored cosines.

    python scripts/probe_int8_gap.py

Writes results/codes/int8-gap.json and int8-gap.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import basket  # noqa: E402
import bench_codes  # noqa: E402
import benchlib  # noqa: E402

from retrieval.evaluate import to_run
from retrieval.metrics import evaluate_run
from retrieval.search import rescore
from retrieval.stash import VectorStash
from retrieval.whitening import RawTransform, l2_normalize

DEPTH = 100
DRAWS = 2000


def per_query(data: dict[str, Any], rows: np.ndarray) -> np.ndarray:
    """nDCG@10 of each query (those with judgements), in the queries' order."""
    ranked = np.arange(rows.shape[1], 0, -1, dtype=np.float32)[None, :].repeat(len(rows), axis=0)
    run = to_run(data["queries"].ids, ranked, rows, data["ids"])
    per = evaluate_run(run, data["qrels"]).per_query
    return np.array([per[q]["nDCG@10"] for q in data["queries"].ids if q in per])


def copy_as(stash: VectorStash, root: Path, dtype: str) -> VectorStash:
    coded = VectorStash.create(root, stash.dim, ["mean"], dtype)
    ids, start = stash.ids(), 0
    for block in stash.iter_blocks(bench_codes.WINDOW):
        coded.append({"mean": block}, ids[start : start + len(block)], [""] * len(block))
        start += len(block)
    return coded


def measure(name: str, model: str, stashes: Path, data_dir: Path) -> dict[str, Any]:
    data = bench_codes.collection(name, model, stashes, data_dir)
    docs, raw = data["docs"], data["raw"]
    exact = l2_normalize(raw) @ l2_normalize(docs).T
    top = np.argsort(-exact, axis=1, kind="stable")[:, :DEPTH]
    scorer = RawTransform(docs.shape[1])
    out: dict[str, Any] = {"set": name, "queries": len(raw)}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {"float32": data["stash"]}
        stores |= {dtype: copy_as(data["stash"], Path(tmp) / dtype, dtype) for dtype in ("int8", "float16")}
        found = {dtype: rescore(store, scorer, raw, top, 10) for dtype, store in stores.items()}
        rows_read = {dtype: store.read_rows(top.ravel()) for dtype, store in stores.items()}
    reference = per_query(data, found["float32"][1])
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(reference), (DRAWS, len(reference)))
    for dtype in ("int8", "float16"):
        scores = per_query(data, found[dtype][1])
        moved = scores - reference
        gaps = scores[draws].mean(axis=1) / reference[draws].mean(axis=1) - 1
        low, high = np.percentile(gaps, [2.5, 97.5])
        out |= {
            f"{dtype} gap %": 100 * (scores.mean() / reference.mean() - 1),
            f"{dtype} 95% interval %": f"{100 * low:+.3f} .. {100 * high:+.3f}",
            f"{dtype} queries moved": int((moved != 0).sum()),
            f"{dtype} largest move": float(np.abs(moved).max()),
            f"{dtype} top-10 lists changed": int((found[dtype][1] != found["float32"][1]).any(axis=1).sum()),
            f"{dtype} rms cosine error": _rms(rows_read[dtype], rows_read["float32"], raw),
        }
    out["float32 nDCG@10"] = float(reference.mean())
    return out


def _rms(coded: np.ndarray, exact: np.ndarray, raw: np.ndarray) -> float:
    """rms difference of the cosine each candidate row gets with its own query, coded against float32."""
    queries = np.repeat(l2_normalize(raw), DEPTH, axis=0)
    return float(np.sqrt(np.mean((np.einsum("ij,ij->i", l2_normalize(coded) - l2_normalize(exact), queries)) ** 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--stashes", type=Path, default=basket.WORK / "codes")
    parser.add_argument("--data", type=Path, default=basket.DATA)
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "codes")
    args = parser.parse_args()
    info = benchlib.machine()
    rows = [measure(name, args.model, args.stashes, args.data) for name in bench_codes.SETS]
    columns = [(k, k) for k in rows[0]]
    args.out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(args.out / "int8-gap.json", {"machine": info, "depth": DEPTH, "rows": rows})
    text = [
        f"# int8 and float16 stashes against float32: re-scoring the exact top {DEPTH} ({args.model})\n",
        benchlib.md_table(rows, columns),
        "\n" + benchlib.machine_md(info),
    ]
    benchlib.write_md(args.out / "int8-gap.md", "\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
