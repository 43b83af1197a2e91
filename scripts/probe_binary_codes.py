"""Probe of 48-byte codes (issue 41): what makes whitened codes beat the raw vectors' sign bits at d/8 bytes.

At the bytes of d sign bits, on the stashes ``bench_codes.py`` builds (``--stashes``), for SciFact test and the
IR dev basket (CISI, CACM, NPL, SciFact train): sign bits of the raw vectors (the anchor) and after ITQ; sign
bits of whitened vectors (gamma 0.3 and 0.5) at d dimensions, and at d/2 dimensions projected to d bits (an
orthonormal-row projection refined by ITQ's alternation); each bit's threshold at zero after centring or at its
median; scored by Hamming distance (symmetric: the query's bits) or asymmetrically (the query's rotated floats
against the documents' +-1 bits); and 4-bit codes of whitened d/4 dimensions (FAISS's SQ4, the same bytes).
nDCG@10 x100 of the codes alone (no re-scoring), exact flat search in numpy.

    python scripts/probe_binary_codes.py --models all-MiniLM-L6-v2
    python scripts/probe_binary_codes.py --gammas 0,0.1,0.2,0.3 --out DIR    # other whitening strengths

Writes results/codes/binary-probe.json and binary-probe.md.
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

from retrieval.codes import ITQ_ITERATIONS, ROTATION_SEED, fit_rotation
from retrieval.index import IndexSpec, create_index
from retrieval.whitening import TransformSpec, l2_normalize

TASKS = ("scifact", *bench_codes.DEV)
GAMMAS = (0.3, 0.5)


def signs(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, 1.0, -1.0).astype(np.float32)


def projection(centred: np.ndarray, bits: int) -> np.ndarray:
    """A (k, bits) matrix with orthonormal rows, bits >= k: ITQ's alternation (sign, then orthogonal Procrustes)
    from a random one; square, it is ``codes.fit_rotation``."""
    k = centred.shape[1]
    if k == bits:
        return fit_rotation(centred, "itq")
    q, _ = np.linalg.qr(np.random.default_rng(ROTATION_SEED).standard_normal((bits, k)))
    matrix = q.T.astype(np.float32)
    for _ in range(ITQ_ITERATIONS):
        u, _, wt = np.linalg.svd((centred.T @ signs(centred @ matrix)).astype(np.float64), full_matrices=False)
        matrix = (u @ wt).astype(np.float32)
    return matrix


def measure(data: dict[str, Any], gammas: tuple[float, ...] = GAMMAS) -> dict[str, float]:
    docs, queries = data["docs"], data["raw"]
    d = docs.shape[1]

    def score(similarity: np.ndarray) -> float:
        return 100 * bench_codes.ndcg(data, np.argsort(-similarity, axis=1, kind="stable")[:, :10])

    out = {"raw float32": score(l2_normalize(queries) @ l2_normalize(docs).T)}
    out["raw sign bits, Hamming (anchor)"] = score(signs(queries) @ signs(docs).T)
    out["raw sign bits, asymmetric"] = score(l2_normalize(queries) @ signs(docs).T)
    centre = docs.mean(axis=0)
    rotation = fit_rotation(docs - centre, "itq")
    rotated_docs, rotated_queries = (docs - centre) @ rotation, (queries - centre) @ rotation
    out["raw ITQ bits, Hamming"] = score(signs(rotated_queries) @ signs(rotated_docs).T)
    out["raw ITQ bits, asymmetric"] = score(rotated_queries @ signs(rotated_docs).T)
    moments = data["stash"].moments()
    for gamma in gammas:
        for k in (d, d // 2):
            transform = TransformSpec(dim=k, whiten=True, gamma=gamma).fit(moments)
            whitened, whitened_queries = transform.transform(docs), transform.transform(queries)
            centre = whitened.mean(axis=0)
            matrix = projection(whitened - centre, d)
            rotated_docs, rotated_queries = (whitened - centre) @ matrix, (whitened_queries - centre) @ matrix
            median = np.median(rotated_docs, axis=0)
            name = f"whitened {k} g={gamma} ITQ bits"
            out[f"{name}, Hamming"] = score(signs(rotated_queries) @ signs(rotated_docs).T)
            out[f"{name}, asymmetric"] = score(rotated_queries @ signs(rotated_docs).T)
            out[f"{name} at medians, Hamming"] = score(signs(rotated_queries - median) @ signs(rotated_docs - median).T)
            out[f"{name} at medians, asymmetric"] = score((rotated_queries - median) @ signs(rotated_docs - median).T)
        k = d // 4
        transform = TransformSpec(dim=k, whiten=True, gamma=gamma).fit(moments)
        whitened, whitened_queries = transform.transform(docs), transform.transform(queries)
        index = create_index(IndexSpec("flat", codes="sq4"), k, len(whitened))
        index.train(whitened)
        index.add(whitened)
        out[f"whitened {k} g={gamma} sq4"] = 100 * bench_codes.ndcg(data, index.search(whitened_queries, 10)[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["all-MiniLM-L6-v2"])
    parser.add_argument("--stashes", type=Path, default=basket.WORK / "codes", help="as bench_codes.py's")
    parser.add_argument("--data", type=Path, default=basket.DATA, help="the shared evaluation data")
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "codes")
    parser.add_argument(
        "--gammas",
        type=lambda text: tuple(float(g) for g in text.split(",")),
        default=GAMMAS,
        help="whitening strengths of the whitened codes (0: the PCA rotation alone)",
    )
    args = parser.parse_args()
    info = benchlib.machine()
    benchlib.print_machine(info)
    rows = []
    for model in args.models:
        for name in TASKS:
            print(f"{model} {name}...", file=sys.stderr, flush=True)
            found = measure(bench_codes.collection(name, model, args.stashes, args.data), args.gammas)
            rows += [{"model": model, "set": name, "variant": v, "ndcg": x} for v, x in found.items()]
    table = []
    for model in args.models:
        for variant in dict.fromkeys(r["variant"] for r in rows if r["model"] == model):
            cells = {r["set"]: r["ndcg"] for r in rows if (r["model"], r["variant"]) == (model, variant)}
            anchor = {r["set"]: r["ndcg"] for r in rows if r["variant"] == "raw sign bits, Hamming (anchor)"}
            gain = [cells[s] - anchor[s] for s in bench_codes.DEV]
            table.append({"model": model, "variant": variant, **cells, "dev_mean": float(np.mean(gain))})
            table[-1] |= {"scifact_gain": cells["scifact"] - anchor["scifact"], "dev_worst": float(np.min(gain))}
    args.out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(args.out / "binary-probe.json", {"machine": info, "rows": rows})
    columns = [("model", "model"), ("variant", "codes of d/8 bytes (48 B for MiniLM)")]
    columns += [(name, name) for name in TASKS]
    columns += [("scifact_gain", "SciFact - anchor"), ("dev_mean", "dev basket - anchor, mean")]
    columns += [("dev_worst", "worst dev set - anchor")]
    md = ["# 48-byte codes: nDCG@10 x100 of the codes alone", "", benchlib.machine_md(info), ""]
    md += [benchlib.md_table(table, columns), ""]
    benchlib.write_md(args.out / "binary-probe.md", "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
