"""Probe of the binary re-rank's blend weight (``codes.WHITENED_WEIGHT``): nDCG@10 of whitened binary codes alone,
their top 400 Hamming candidates re-ranked by ``codes.blend`` at each weight of the whitened cosine (1: the
whitened cosine alone; 0: the raw decoder's estimate alone), minus the raw sign bits' (the anchor), and the
recall@10 of exact raw search that re-scoring the re-ranked top 50 from the float32 stash reaches (what the
re-scoring depth rule of ``bench_codes.py`` weighs), on SciFact test and the IR dev basket, at d bits (d/8 + 2
bytes) and d - 16 bits (d/8 bytes in all), on the stashes
``bench_codes.py`` builds (``--stashes``). Flat indexes through the library (``index.train`` with the raw rows,
``index.add_rows``), so the decoder is the one a build learns.

    python scripts/probe_rerank_weight.py                 # all-MiniLM-L6-v2
    python scripts/probe_rerank_weight.py --weights 0,0.5,1 --out DIR

Writes results/codes/rerank-weight.json and rerank-weight.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import basket  # noqa: E402
import bench_codes  # noqa: E402
import benchlib  # noqa: E402

from retrieval.codes import SCALAR_BYTES, BinaryIndex, blend
from retrieval.index import RERANK_DEPTH, IndexSpec, add_rows, create_index, train
from retrieval.search import rescore
from retrieval.whitening import RawTransform, TransformSpec

WEIGHTS = (0.0, 0.25, 0.4, 0.5, 0.75, 1.0)
RESCORED = 50  # the re-scoring depth of binary codes with a decoder (manifest.RESCORE_DEPTHS)


def measure(data: dict[str, Any], bits: int, weights: tuple[float, ...]) -> dict[float, tuple[float, float]]:
    """(nDCG@10 x100 of the re-ranked top 10, recall@10 after re-scoring its top RESCORED) at each weight,
    whitened to ``bits`` dims (the library's defaults)."""
    docs, queries = data["docs"], data["raw"]
    transform = TransformSpec(dim=bits, whiten=True).fit(data["stash"].moments())
    index = create_index(IndexSpec("flat", codes="binary"), bits, len(docs))
    assert isinstance(index, BinaryIndex)
    train(index, transform.transform(docs), docs, transform)
    add_rows(index, transform, docs)
    assert index.decoder is not None and index.scalars is not None
    vectors = transform.transform(queries)
    _, rows = index.search(vectors, RERANK_DEPTH, rerank=0)
    found = rows >= 0
    whitened = index.asymmetric(vectors, rows)
    codes = index.codes_of(np.where(found, rows, 0).ravel()).reshape(*rows.shape, -1)
    estimated = index.decoder.scores(queries, codes, index.scalars[np.where(found, rows, 0)], found)
    out = {}
    for weight in weights:
        order = np.argsort(-blend(whitened, estimated, found, weight), axis=1, kind="stable")[:, :RESCORED]
        top = np.take_along_axis(rows, order, axis=1)
        _, rescored = rescore(data["stash"], RawTransform(docs.shape[1]), queries, top, 10)
        out[weight] = (100 * bench_codes.ndcg(data, top[:, :10]), bench_codes.recall(data, rescored))
    return out


def anchor(data: dict[str, Any]) -> float:
    import faiss

    docs, queries = data["docs"], data["raw"]
    binary = faiss.IndexBinaryFlat(docs.shape[1])
    binary.add(np.packbits(docs > 0, axis=1))
    return 100 * bench_codes.ndcg(data, binary.search(np.packbits(queries > 0, axis=1), 10)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--stashes", type=Path, default=basket.WORK / "codes", help="as bench_codes.py's")
    parser.add_argument("--data", type=Path, default=basket.DATA, help="the shared evaluation data")
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "codes")
    parser.add_argument(
        "--weights", type=lambda text: tuple(float(w) for w in text.split(",")), default=WEIGHTS, help="0-1"
    )
    args = parser.parse_args()
    info = benchlib.machine()
    benchlib.print_machine(info)
    rows = []
    for name in bench_codes.SETS:
        data = bench_codes.collection(name, args.model, args.stashes, args.data)
        d, base = data["docs"].shape[1], anchor(data)
        for bits in (d, d - 8 * SCALAR_BYTES):
            for weight, (score, found) in measure(data, bits, args.weights).items():
                row = {"set": name, "bits": bits, "weight": weight, "ndcg": score, "gain": score - base}
                rows.append(row | {"recall": found})
        print(f"{name}: done", file=sys.stderr, flush=True)
    table = []
    dev_sets = set(bench_codes.DEV)
    for bits in dict.fromkeys(r["bits"] for r in rows):
        for weight in args.weights:
            cells = {r["set"]: r["gain"] for r in rows if (r["bits"], r["weight"]) == (bits, weight)}
            dev = [cells[s] for s in bench_codes.DEV]
            recall = [r["recall"] for r in rows if (r["bits"], r["weight"]) == (bits, weight) and r["set"] in dev_sets]
            bytes_ = bits / 8 + SCALAR_BYTES
            line = {"bits": bits, "bytes": bytes_, "weight": weight, **cells}
            line |= {"dev_mean": float(np.mean(dev)), "worst": float(min(cells.values()))}
            table.append(line | {"recall": float(np.mean(recall))})
    args.out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(args.out / "rerank-weight.json", {"machine": info, "model": args.model, "rows": rows})
    columns = [("bits", "bits"), ("bytes", "B/vector"), ("weight", "weight of the whitened cosine")]
    columns += [(s, f"{s} - anchor") for s in bench_codes.SETS]
    columns += [("dev_mean", "dev basket mean"), ("worst", "worst set")]
    columns += [("recall", f"recall@10 of raw search, top {RESCORED} re-scored, dev basket mean")]
    md = [f"# The binary re-rank's blend weight: nDCG@10 x100 of the codes alone, {args.model}", ""]
    md += [benchlib.machine_md(info), "", benchlib.md_table(table, columns), ""]
    benchlib.write_md(args.out / "rerank-weight.md", "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
