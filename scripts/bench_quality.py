"""Quality of the transform, per encoder: raw vs PCA (gamma 0) vs full whitening (gamma 1) vs the tuned choice vs
FAISS's own PCAW{k},L2norm,Flat, on SciFact (nDCG@10, Recall@100) and STS-B / STS12-16 (Spearman x100).

Choices are made on dev splits only (SciFact train queries; STS-B dev) and reported on test. The corpus is
encoded once per model (all three poolings in one pass) into an index directory's stash; every transform is
then fitted from those vectors. Writes results/quality/quality.json and quality.md.

    python scripts/bench_quality.py                       # both models (mpnet: scripts/install_mpnet.sh)
    python scripts/bench_quality.py --models all-MiniLM-L6-v2 --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.encoder import POOLINGS, TransformerEncoder, resolve_model
from retrieval.evaluate import read_pairs, read_qrels, read_queries, to_run
from retrieval.indexdir import IndexDir
from retrieval.metrics import evaluate_run
from retrieval.moments import RunningMoments
from retrieval.tune import tune_ir, tune_sts
from retrieval.whitening import TransformSpec, l2_normalize

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
GAMMAS = (0.0, 0.25, 0.5, 0.75, 1.0)
STS_FILES = ("sts12", "sts13", "sts14", "sts15", "sts16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all-MiniLM-L6-v2,all-mpnet-base-v2")
    ap.add_argument("--work", type=Path, default=ROOT / "indexes" / "bench", help="index dirs + vector caches")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "quality")
    ap.add_argument("--quick", action="store_true", help="SciFact only, first 1000 docs; no STS12-16")
    args = ap.parse_args()
    if not DATA.is_dir():
        sys.exit(f"evaluation data not found at {DATA}")
    report: dict[str, Any] = {"machine": benchlib.machine(torch_too=True), "models": {}}
    for model in args.models.split(","):
        if resolve_model(model) is None:
            print(f"skipping {model}: not installed (see DEVELOPERS.md)", file=sys.stderr)
            continue
        start = time.perf_counter()
        report["models"][model] = {
            "scifact": scifact(model, args.work, args.quick),
            "sts": {} if args.quick else sts(model, args.work),
            "seconds": round(time.perf_counter() - start, 1),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(report, indent=1))
    (args.out / "quality.md").write_text(markdown(report))
    print(markdown(report))


def Candidate(pooling: str, dim: int, gamma: float | None) -> TransformSpec:  # noqa: N802 - reads like the type
    """A tuning candidate: the raw baseline when ``gamma`` is None."""
    if gamma is None:
        return TransformSpec(dim=dim, whiten=False, pooling=pooling)
    return TransformSpec(dim=dim, gamma=gamma, pooling=pooling)


def _gamma(spec: TransformSpec) -> float | None:
    return spec.gamma if spec.whiten else None


# ----- SciFact ----------------------------------------------------------------------------------------------
def scifact(model: str, work: Path, quick: bool) -> dict[str, Any]:
    corpus = DATA / "scifact" / "corpus.parquet"
    name = f"scifact-{model.lower()}" + ("-quick" if quick else "")
    directory = work / name
    if not (directory / "manifest.json").is_file():
        if quick:
            import pyarrow.parquet as pq

            corpus_slice = work / "scifact-1000.parquet"
            work.mkdir(parents=True, exist_ok=True)
            pq.write_table(pq.read_table(corpus).slice(0, 1000), corpus_slice)
            corpus = corpus_slice
        encoder = TransformerEncoder(model, "mean")
        print(f"encoding SciFact with {model} (3 poolings, one pass)...", file=sys.stderr)
        build_index(
            CorpusSpec(corpus, id_column="doc_id", title_column="title"),
            encoder,
            directory,
            TransformSpec(),
            options=BuildOptions(extra_poolings=("cls", "first-last-avg"), overwrite=True),
        )
    stash = IndexDir(directory).stash()
    ids = stash.ids()
    encoder = TransformerEncoder(model, "mean")
    dev = (
        read_queries(DATA / "scifact" / "queries-train.parquet"),
        read_qrels(DATA / "scifact" / "qrels-train.parquet"),
    )
    test = (
        read_queries(DATA / "scifact" / "queries-test.parquet"),
        read_qrels(DATA / "scifact" / "qrels-test.parquet"),
    )
    queries = {
        "dev": encoder.encode_poolings(dev[0].texts, POOLINGS),
        "test": encoder.encode_poolings(test[0].texts, POOLINGS),
    }
    split_of = {id(dev[0]): "dev", id(test[0]): "test"}

    def vectors(pooling: str, q: Any) -> np.ndarray:
        return queries[split_of[id(q)]][pooling]

    d = stash.dim
    dims = [k for k in (d, 256, 128, 64) if k <= d]
    third = d // 3
    grid = [Candidate(p, d, None) for p in POOLINGS]
    grid += [Candidate(p, k, g) for p in POOLINGS for k in sorted(set(dims + [third]), reverse=True) for g in GAMMAS]
    sweep = tune_ir(stash, ids, vectors, dev, test, grid, "nDCG@10")
    by = {(t.candidate.pooling, t.candidate.dim, _gamma(t.candidate)): t for t in sweep.trials}
    rows = []
    for pooling in POOLINGS:
        raw = by[(pooling, d, None)]
        rows.append(_ir_row(pooling, "raw", d, None, raw.test, raw.test))
        for k in sorted(set(dims + [third]), reverse=True):
            for label, gamma in (("PCA (gamma 0)", 0.0), ("whitening (gamma 1)", 1.0)):
                rows.append(_ir_row(pooling, label, k, gamma, by[(pooling, k, gamma)].test, raw.test))
            tuned = max((by[(pooling, k, g)] for g in GAMMAS), key=lambda t: t.dev["nDCG@10"])
            rows.append(_ir_row(pooling, "tuned gamma (dev)", k, tuned.candidate.gamma, tuned.test, raw.test))
            if pooling == "mean":
                metrics, finite = _faiss_pcaw(stash, ids, queries["test"]["mean"], test, k, pooling)
                label = "FAISS PCAW,L2norm" + ("" if finite else " (NaN vectors: a zero eigenvalue, no epsilon)")
                rows.append(_ir_row(pooling, label, k, 1.0, metrics, raw.test))
    best = sweep.best
    raw_mean = by[("mean", d, None)]
    third_choice = max((by[("mean", third, g)] for g in GAMMAS), key=lambda t: t.dev["nDCG@10"])
    result = {
        "docs": len(stash),
        "d": d,
        "rows": rows,
        "best_on_dev": best.to_dict(),
        "agreement_gamma1_vs_faiss": _faiss_agreement(stash, queries["test"]["mean"], min(256, d)),
        "target_third": {
            "k": third,
            "gamma": third_choice.candidate.gamma,
            "test_nDCG@10": third_choice.test["nDCG@10"],
            "raw_test_nDCG@10": raw_mean.test["nDCG@10"],
            "ratio": third_choice.test["nDCG@10"] / raw_mean.test["nDCG@10"],
            "rescore": _rescore(stash, ids, queries["test"]["mean"], test, third, third_choice.candidate.gamma),
        },
    }
    return result


def _ir_row(pooling: str, method: str, k: int, gamma: float | None, test: dict, raw: dict) -> dict[str, Any]:
    return {
        "pooling": pooling,
        "method": method,
        "k": k,
        "gamma": gamma,
        "nDCG@10": test["nDCG@10"],
        "Recall@100": test["Recall@100"],
        "vs_raw": test["nDCG@10"] / raw["nDCG@10"],
    }


def _all(stash: Any, pooling: str = "mean") -> np.ndarray:
    return np.concatenate(list(stash.iter_blocks(pooling=pooling)))


def _faiss_pcaw(stash: Any, ids: list[str], q: np.ndarray, test: tuple, k: int, pooling: str) -> tuple[dict, bool]:
    """FAISS's library baseline: PCAMatrix with eigen_power -0.5 (whitening), L2 norm, exact inner product.
    Returns the metrics and whether the transformed vectors were all finite."""
    index = faiss.index_factory(stash.dim, f"PCAW{k},L2norm,Flat", faiss.METRIC_INNER_PRODUCT)
    docs = _all(stash, pooling)
    index.train(docs)
    index.add(docs)
    pca = faiss.downcast_VectorTransform(faiss.downcast_index(index).chain.at(0))
    finite = bool(np.isfinite(pca.apply(docs)).all())
    scores, rows = index.search(np.ascontiguousarray(q), 100)
    return evaluate_run(to_run(test[0].ids, scores, rows, ids), test[1]).metrics, finite


def _faiss_agreement(stash: Any, q: np.ndarray, k: int) -> dict[str, float]:
    """How far FAISS's float32 PCAW is from our float64 gamma = 1 fit (epsilon 0): query-doc cosines compared."""
    from retrieval.whitening import Whitening

    docs = _all(stash)
    pca = faiss.PCAMatrix(stash.dim, k, -0.5, False)
    pca.max_points_per_d = max(1000, docs.shape[0] // stash.dim + 1)
    pca.train(docs)
    ours = Whitening.fit(RunningMoments.from_array(docs), dim=k, gamma=1.0, epsilon=0.0)
    s_faiss = l2_normalize(pca.apply(q)) @ l2_normalize(pca.apply(docs)).T
    s_ours = ours.transform(q) @ ours.transform(docs).T
    top_f = np.argsort(-s_faiss, axis=1)[:, :10]
    top_o = np.argsort(-s_ours, axis=1)[:, :10]
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top_f, top_o, strict=True)])
    return {
        "k": k,
        "max_abs_cosine_diff": float(np.abs(s_faiss - s_ours).max()),
        "mean_abs_cosine_diff": float(np.abs(s_faiss - s_ours).mean()),
        "top10_overlap": float(overlap),
    }


def _rescore(stash: Any, ids: list[str], q: np.ndarray, test: tuple, k: int, gamma: float | None) -> list[dict]:
    """Re-rank the reduced index's top N with the full raw vectors: quality and added milliseconds per query."""
    from retrieval.whitening import Whitening

    docs_raw = _all(stash)
    w = Whitening.fit(RunningMoments.from_array(docs_raw), dim=k, gamma=gamma or 0.0)
    index = faiss.IndexFlatIP(k)
    index.add(w.transform(docs_raw))
    full = l2_normalize(docs_raw)
    qn = l2_normalize(q)
    out = []
    for n in (0, 20, 50, 100, 200):
        scores, rows = index.search(w.transform(q), max(n, 100))
        start = time.perf_counter()
        if n:
            for i in range(len(q)):
                cand = rows[i, :n]
                s = full[cand] @ qn[i]
                order = np.argsort(-s)
                scores[i, :n], rows[i, :n] = s[order], cand[order]
        ms = (time.perf_counter() - start) * 1000 / len(q)
        metrics = evaluate_run(to_run(test[0].ids, scores, rows, ids), test[1]).metrics
        out.append(
            {
                "rescore": n,
                "nDCG@10": metrics["nDCG@10"],
                "Recall@100": metrics["Recall@100"],
                "rescore_ms_per_query": ms,
            }
        )
    return out


# ----- STS --------------------------------------------------------------------------------------------------
def sts(model: str, work: Path) -> dict[str, Any]:
    stsb = {s: read_pairs(DATA / "sts" / f"stsb-{s}.parquet") for s in ("train", "dev", "test")}
    years = {n: read_pairs(DATA / "sts" / f"{n}.parquet") for n in STS_FILES}
    sentences = list(dict.fromkeys(s for p in [*stsb.values(), *years.values()] for s in p.sentences()))
    vectors = _sts_vectors(model, sentences, work)
    d = next(iter(vectors["mean"].values())).shape[0]
    dims = sorted({k for k in (d, 256, 128, 64, d // 3) if k <= d}, reverse=True)
    grid = [Candidate(p, d, None) for p in POOLINGS] + [
        Candidate(p, k, g) for p in POOLINGS for k in dims for g in GAMMAS
    ]
    target_b = list(dict.fromkeys(s for p in stsb.values() for s in p.sentences()))
    sweep_b = tune_sts(vectors, target_b, stsb["dev"], stsb["test"], grid, "all")
    out: dict[str, Any] = {"fit": "target: all sentences of the task (STS-B: train+dev+test; STSnn: that year)"}
    out["stsb"] = [t.to_dict() for t in sweep_b.trials]
    out["stsb_best_on_dev"] = sweep_b.best.to_dict()
    per_pooling_choice = {}
    for pooling in POOLINGS:
        mine = [t for t in sweep_b.trials if t.candidate.pooling == pooling and t.candidate.whiten]
        per_pooling_choice[pooling] = max(mine, key=lambda t: t.dev["all"]).candidate
    out["stsb_choice_per_pooling"] = {p: c.label for p, c in per_pooling_choice.items()}
    targets = {}
    for pooling in POOLINGS:
        raw = next(t for t in sweep_b.trials if t.candidate == Candidate(pooling, d, None))
        third = [t for t in sweep_b.trials if t.candidate.pooling == pooling and t.candidate.dim == d // 3]
        chosen = max((t for t in third if t.candidate.whiten), key=lambda t: t.dev["all"])
        best = next(t for t in sweep_b.trials if t.candidate == per_pooling_choice[pooling])
        targets[pooling] = {
            "raw_test": raw.test["all"],
            "third": {"k": d // 3, "gamma": _gamma(chosen.candidate), "test": chosen.test["all"]},
            "dev_choice": {"label": best.candidate.label, "test": best.test["all"]},
        }
    out["stsb_targets"] = targets
    # STS12-16: no dev split; apply fixed settings and the STS-B dev choice, fitted on each year's sentences.
    years_out = {}
    for name, pairs in years.items():
        fixed = [Candidate(p, d, None) for p in POOLINGS]
        fixed += [Candidate(p, k, g) for p in POOLINGS for k in dims for g in (0.0, 1.0)]
        fixed += [c for c in per_pooling_choice.values() if c not in fixed]
        sweep = tune_sts(vectors, pairs.sentences(), pairs, None, fixed, "all")
        years_out[name] = [t.to_dict() for t in sweep.trials]
    out["years"] = years_out
    return out


def _sts_vectors(model: str, sentences: list[str], work: Path) -> dict[str, dict[str, np.ndarray]]:
    cache = work / f"sts-{model.lower()}.npz"
    if cache.is_file():
        data = np.load(cache, allow_pickle=False)
        if list(data["sentences"]) == sentences:
            return {p: dict(zip(sentences, data[p], strict=True)) for p in POOLINGS}
    print(f"encoding {len(sentences):,} STS sentences with {model}...", file=sys.stderr)
    encoder = TransformerEncoder(model, "mean")
    raw = encoder.encode_poolings(sentences, POOLINGS)
    work.mkdir(parents=True, exist_ok=True)
    np.savez(cache, sentences=np.array(sentences), **{p: raw[p] for p in POOLINGS})
    return {p: dict(zip(sentences, raw[p], strict=True)) for p in POOLINGS}


# ----- report -----------------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, faiss {m['faiss']}.", ""]
    for model, res in report["models"].items():
        sf = res["scifact"]
        lines += [
            f"### {model}: SciFact test ({sf['docs']} docs, d = {sf['d']}; choices on train queries)",
            "",
            "| pooling | method | k | gamma | nDCG@10 | Recall@100 | vs raw |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sf["rows"]:
            g = "-" if r["gamma"] is None else r["gamma"]
            lines.append(
                f"| {r['pooling']} | {r['method']} | {r['k']} | {g} | {r['nDCG@10']:.4f} | "
                f"{r['Recall@100']:.4f} | {r['vs_raw']:.1%} |"
            )
        t = sf["target_third"]
        a = sf["agreement_gamma1_vs_faiss"]
        lines += [
            "",
            f"At one third of the dimensions (k = {t['k']}, gamma {t['gamma']} chosen on dev): nDCG@10 "
            f"{t['test_nDCG@10']:.4f} vs raw {t['raw_test_nDCG@10']:.4f} = {t['ratio']:.2%} of raw.",
            "",
            "| re-score top N with full vectors | nDCG@10 | Recall@100 | added ms/query |",
            "|---|---|---|---|",
        ]
        for r in t["rescore"]:
            lines.append(
                f"| {r['rescore'] or 'none'} | {r['nDCG@10']:.4f} | {r['Recall@100']:.4f} | "
                f"{r['rescore_ms_per_query']:.3f} |"
            )
        lines += [
            "",
            f"FAISS PCAW{a['k']} vs ours (gamma 1, epsilon 0), query-doc cosines: max |diff| "
            f"{a['max_abs_cosine_diff']:.2e}, mean {a['mean_abs_cosine_diff']:.2e}, top-10 overlap "
            f"{a['top10_overlap']:.1%}.",
            "",
        ]
        if res["sts"]:
            lines += _sts_markdown(res["sts"])
    return "\n".join(lines) + "\n"


def _sts_markdown(s: dict[str, Any]) -> list[str]:
    lines = [
        f"STS, Spearman x100 (fit: {s['fit']}). STS-B: dev chooses, test reports.",
        "",
        "| pooling | method | k | gamma | STS-B dev | STS-B test |",
        "|---|---|---|---|---|---|",
    ]
    for t in s["stsb"]:
        if t["gamma"] in (None, 0.0, 1.0) or t["label"] in s["stsb_choice_per_pooling"].values():
            method = "raw" if t["gamma"] is None else {0.0: "PCA", 1.0: "whitening"}.get(t["gamma"], "tuned")
            if t["label"] in s["stsb_choice_per_pooling"].values():
                method += " (dev choice)"
            g = "-" if t["gamma"] is None else t["gamma"]
            lines.append(
                f"| {t['pooling']} | {method} | {t['dim']} | {g} | {t['dev']['all']:.2f} | {t['test']['all']:.2f} |"
            )
    lines += ["", "STS-B test, Spearman x100 (all): raw, the dev choice at k = d/3, the dev choice at any k:", ""]
    lines += ["| pooling | raw | k = d/3, gamma on dev | dev choice | gain over raw |", "|---|---|---|---|---|"]
    for pooling, t in s["stsb_targets"].items():
        third, choice = t["third"], t["dev_choice"]
        lines.append(
            f"| {pooling} | {t['raw_test']:.2f} | {third['test']:.2f} (k {third['k']}, gamma {third['gamma']}) | "
            f"{choice['test']:.2f} ({choice['label']}) | {choice['test'] - t['raw_test']:+.2f} |"
        )
    lines += [
        "",
        "STS12-16 (each fitted on its own sentences), wmean / all:",
        "",
        "| pooling | k | gamma | " + " | ".join(s["years"]) + " |",
        "|---|---|---|" + "---|" * len(s["years"]),
    ]
    first = next(iter(s["years"].values()))
    for i, t in enumerate(first):
        cells = [f"{s['years'][y][i]['dev']['wmean']:.1f} / {s['years'][y][i]['dev']['all']:.1f}" for y in s["years"]]
        g = "-" if t["gamma"] is None else t["gamma"]
        lines.append(f"| {t['pooling']} | {t['dim']} | {g} | " + " | ".join(cells) + " |")
    return lines + [""]


if __name__ == "__main__":
    main()
