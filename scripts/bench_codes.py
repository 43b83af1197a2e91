"""Compressed codes: bytes per vector against nDCG@10, per model x code x dimension, with and without
re-scoring from the stash (float32 and int8), beside the anchors' recipe (int8 and binary codes of the raw vectors).

Each IR set's corpus is encoded once into a stash (an index built with the raw transform, under indexes/bench);
everything else works on the stashed vectors in memory, through the library: the kernel fitted on the stash's
moments (``TransformSpec(dim=k).fit``), a flat index of each code (``index.create_index``: FAISS scalar quantizers,
or ``codes.BinaryIndex``), re-scoring by ``search.rescore`` from the float32 stash and from an int8 copy of it.

Per (model, set, dimension, code): nDCG@10 of the codes alone (their top 10) and re-scored (the top ``depth`` by
raw cosine), recall@10 against exact raw search, the index's bytes per vector (in RAM) and with the stash (on
disk). Depths swept: DEPTHS; the default of each code is the smallest depth whose re-scored top 10 finds what the
uncompressed index's does, within half a point of recall@10 against exact raw search (``choose_depths``).
Anchors: int8 codes of the raw vectors as sentence-transformers' ``quantize_embeddings`` makes them (each
dimension's range over the corpus, 256 levels, dot product of the codes) and binary codes (sign bits of the raw
vector, Hamming). Latency: single-query p50 (transform, search, re-score) for flat and IVF indexes of each code at
LATENCY_ROWS rows: every document vector of the four sets plus noisy copies
of them (real text alone is 21k rows here), MiniLM only.

    python scripts/bench_codes.py            # both models (mpnet if installed)
    python scripts/bench_codes.py --models all-MiniLM-L6-v2 --no-latency
    python scripts/bench_codes.py --stashes DIR ...    # raw stashes built elsewhere (DIR/<set>-<model>)
    python scripts/bench_codes.py --sets cisi --no-latency --out A; ... --combine A/codes.json B/codes.json

Writes results/codes/codes.json, codes.md and pareto.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import basket  # noqa: E402
import benchlib  # noqa: E402

from retrieval.build import BuildOptions, build_index
from retrieval.codes import SCALAR_BYTES, BinaryIndex, search_extras
from retrieval.corpus import CorpusSpec
from retrieval.encode.models import resolve_model
from retrieval.evaluate import read_qrels, read_queries, to_run
from retrieval.index import (
    CODES,
    RERANK_DEPTH,
    IndexSpec,
    add_rows,
    create_index,
    default_search_params,
    search_parameters,
    train,
    train_size,
)
from retrieval.indexdir import IndexDir
from retrieval.manifest import RESCORE_DEPTH
from retrieval.metrics import evaluate_run
from retrieval.moments import RunningMoments
from retrieval.search import rescore
from retrieval.stash import VectorStash
from retrieval.whitening import RawTransform, TransformSpec, l2_normalize

SETS = ("scifact", "cisi", "cacm", "npl", "scifact-train")  # <corpus>[-train]: that corpus's test or train queries
DEV = ("cisi", "cacm", "npl", "scifact-train")  # the IR dev basket; SciFact test is the held-out headline
DEPTHS = (0, 20, 50, 100, 200, 400)
RERANKS = (RERANK_DEPTH, 1000)  # Hamming candidates re-ranked asymmetrically (the top max(DEPTHS) of them kept)
# re-ranked as the library does (whitened codes: the blend with the raw decoder's estimate), and by the whitened
# asymmetric cosine alone (the decoder left out)
ASYMMETRIC = (*(f"binary-asym{r}" for r in RERANKS), f"binary-whitened{RERANK_DEPTH}")
LOST = 0.005  # recall@10 (against exact raw search) a default depth may lose to the uncompressed index
LATENCY_ROWS = 100_000
LATENCY_QUERIES = 200
LATENCY_TRAIN = 20_000
WINDOW = 2048  # rows per stash part, as a build writes them


# ----- data --------------------------------------------------------------------------------------------------
def collection(name: str, model: str, stashes: Path, data: Path) -> dict[str, Any]:
    """The set's stash (encoded once, cached), its queries' raw vectors, qrels, doc ids and exact raw top 10."""
    corpus, split = name.removesuffix("-train"), "train" if name.endswith("-train") else "test"
    directory = stashes / f"{corpus}-{model.lower()}"
    if not (directory / "manifest.json").is_file():
        spec = CorpusSpec(data / corpus / "corpus.parquet", id_column="doc_id", title_column="title")
        print(f"encoding the {corpus} corpus with {model}...", file=sys.stderr)
        build_index(spec, basket.encoder(model), directory, TransformSpec.raw(), options=BuildOptions(overwrite=True))
    stash = IndexDir(directory).stash()
    queries = read_queries(data / corpus / f"queries-{split}.parquet")
    raw_queries = basket.encode_cached(model, f"{corpus}-queries-{split}", queries.texts)["mean"]
    docs = np.concatenate(list(stash.iter_blocks()))
    exact = np.argsort(-(l2_normalize(raw_queries) @ l2_normalize(docs).T), axis=1, kind="stable")[:, :10]
    return {
        "stash": stash,
        "docs": docs,
        "queries": queries,
        "raw": raw_queries.astype(np.float32),
        "qrels": read_qrels(data / corpus / f"qrels-{split}.parquet"),
        "ids": stash.ids(),
        "exact": exact,
    }


def int8_copy(stash: VectorStash, root: Path) -> VectorStash:
    """The stash's vectors in an int8 stash, in parts of a build's window."""
    coded = VectorStash.create(root, stash.dim, ["mean"], "int8")
    ids = stash.ids()
    start = 0
    for block in stash.iter_blocks(WINDOW):
        coded.append({"mean": block}, ids[start : start + len(block)], [""] * len(block))
        start += len(block)
    return coded


def ndcg(data: dict[str, Any], rows: np.ndarray) -> float:
    ranked = np.arange(rows.shape[1], 0, -1, dtype=np.float32)[None, :].repeat(len(rows), axis=0)
    run = to_run(data["queries"].ids, ranked, rows, data["ids"])
    return float(evaluate_run(run, data["qrels"]).metrics["nDCG@10"])


def recall(data: dict[str, Any], rows: np.ndarray) -> float:
    return float(np.mean([len(set(a[:10]) & set(b)) / 10 for a, b in zip(rows, data["exact"], strict=True)]))


# ----- one model, one set --------------------------------------------------------------------------------------
def measure_set(data: dict[str, Any], model: str, name: str, int8: VectorStash) -> list[dict[str, Any]]:
    d, n = data["stash"].dim, len(data["docs"])
    raw_score = ndcg(data, data["exact"])
    scorer = RawTransform(d)
    rows_out = []
    # d/4: 4-bit codes of it take d/8 bytes, as many as the sign bits of all d dimensions
    dims = [("raw", d), ("whitened", d), ("whitened", d // 2), ("whitened", d // 3), ("whitened", d // 4)]
    dims += [("whitened", d // 6)]
    # binary codes of d bytes in all: d - 16 bits and the raw decoder's 2 bytes, the kernel as the library
    # defaults it below full dimension (uncentred) and centred
    dims += [("whitened", d - 8 * SCALAR_BYTES), ("whitened-centred", d - 8 * SCALAR_BYTES)]
    moments = data["stash"].moments()
    for kind, k in dims:
        spec = TransformSpec(dim=k, whiten=True, center=True if kind == "whitened-centred" else None)
        spec = TransformSpec.raw() if kind == "raw" else spec  # whitened at d too
        transform = spec.fit(moments)
        docs, queries = transform.transform(data["docs"]), transform.transform(data["raw"])
        for code in (*CODES, "binary-random"):
            if k == d - 8 * SCALAR_BYTES and not code.startswith("binary"):
                continue  # the 48-byte binary case only
            index_spec = IndexSpec("flat", codes="binary", rotation="random") if code == "binary-random" else None
            index_spec = index_spec or IndexSpec("flat", codes=code)
            index = create_index(index_spec, k, n)
            if train_size(index, index_spec, n):  # as a build trains: a binary index learns its raw decoder too
                train(index, docs, data["docs"], transform)
            add_rows(index, transform, data["docs"])
            decoded = isinstance(index, BinaryIndex) and index.decoder is not None
            # binary codes by Hamming distance alone, and re-ranked from RERANKS candidates as a search does (the
            # queries' raw vectors given), and by the whitened asymmetric cosine alone where there is a decoder
            searches: dict[str, dict[str, Any]] = {code: {"rerank": 0} if code.startswith("binary") else {}}
            if code == "binary":
                searches |= {f"binary-asym{r}": {"rerank": r, "raw": data["raw"]} for r in RERANKS}
                searches |= {f"binary-whitened{RERANK_DEPTH}": {"rerank": RERANK_DEPTH}} if decoded else {}
            for label, extra in searches.items():
                _, top = index.search(queries, max(DEPTHS), **extra)
                row: dict[str, Any] = {"model": model, "set": name, "transform": kind, "dim": k, "code": label}
                row |= {"raw_ndcg": raw_score, "ndcg": ndcg(data, top[:, :10]), "recall": recall(data, top)}
                row["ram_bytes"] = index_spec.bytes_per_vector(k, SCALAR_BYTES if decoded else 0)
                for depth in DEPTHS[1:]:
                    for stash_label, stash in (("f32", data["stash"]), ("i8", int8)):
                        _, found = rescore(stash, scorer, data["raw"], top[:, :depth], 10)
                        row[f"ndcg_{stash_label}_{depth}"] = ndcg(data, found)
                        row[f"recall_{stash_label}_{depth}"] = recall(data, found)
                rows_out.append(row)
    rows_out += anchors(data, model, name, raw_score, int8)
    return rows_out


def anchors(data: dict[str, Any], model: str, name: str, raw_score: float, int8: VectorStash) -> list[dict[str, Any]]:
    """The published recipe on the raw vectors: int8 codes on each dimension's corpus range (dot product of the
    codes, as sentence-transformers' ``quantize_embeddings`` ranks), and sign bits (Hamming)."""
    import faiss

    docs, queries = data["docs"], data["raw"]
    low, high = docs.min(axis=0), docs.max(axis=0)
    steps = (high - low) / 255

    def to_int8(x: np.ndarray) -> np.ndarray:
        return (np.clip(np.rint((x - low) / steps), 0, 255) - 128).astype(np.float32)

    tops = {"raw-int8": np.argsort(-(to_int8(queries) @ to_int8(docs).T), axis=1, kind="stable")[:, : max(DEPTHS)]}
    binary = faiss.IndexBinaryFlat(docs.shape[1])
    binary.add(np.packbits(docs > 0, axis=1))
    tops["raw-binary"] = binary.search(np.packbits(queries > 0, axis=1), max(DEPTHS))[1]
    out = []
    d = docs.shape[1]
    for code, top in tops.items():
        row: dict[str, Any] = {"model": model, "set": name, "transform": "anchor", "dim": d, "code": code}
        row |= {"raw_ndcg": raw_score, "ndcg": ndcg(data, top[:, :10]), "recall": recall(data, top)}
        row["ram_bytes"] = d if code == "raw-int8" else d / 8
        for depth in DEPTHS[1:]:
            for label, stash in (("f32", data["stash"]), ("i8", int8)):
                _, found = rescore(stash, RawTransform(d), queries, top[:, :depth], 10)
                row[f"ndcg_{label}_{depth}"] = ndcg(data, found)
                row[f"recall_{label}_{depth}"] = recall(data, found)
        out.append(row)
    return out


# ----- choosing the default depths -------------------------------------------------------------------------------
def choose_depths(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per code, the smallest depth whose re-scored top 10 finds as much of exact raw search's top 10 as the
    uncompressed index of the same dimensions does at that depth, less LOST (mean over the dev basket's sets where
    measured, else every set; re-scored from the float32 stash: the codes' loss alone), at every whitened
    dimension the code is for: d/3 to d for scalar codes, d for binary ones (None: no depth swept did). nDCG@10
    is reported beside."""

    rows = [r for r in rows if r["set"] in DEV] or rows  # chosen on the dev basket where it was measured

    def mean_recall(code: str, model: str, dim: int, depth: int) -> float:
        group = [r for r in rows if (r["code"], r["transform"], r["model"], r["dim"]) == (code, "whitened", model, dim)]
        return float(np.mean([r[f"recall_f32_{depth}"] for r in group]))

    chosen: dict[str, Any] = {}
    for code in ("sq8", "sq4", "binary", *ASYMMETRIC):
        binary = code.startswith("binary")
        cases = {(r["model"], r["dim"]) for r in rows if r["code"] == code and r["transform"] == "whitened"}
        cases = {(m, k) for m, k in cases if (k == _d({"model": m}) if binary else 3 * k >= _d({"model": m}))}
        chosen[code] = next(
            (
                depth
                for depth in DEPTHS[1:]
                if cases and all(mean_recall(code, *c, depth) >= mean_recall("fp32", *c, depth) - LOST for c in cases)
            ),
            None,
        )
    return chosen


def _d(row: dict[str, Any]) -> int:
    return 384 if "MiniLM" in row["model"] else 768


# ----- latency -------------------------------------------------------------------------------------------------
def latency(model: str, sets: dict[str, dict[str, Any]], depths: dict[str, Any], rows: int) -> list[dict[str, Any]]:
    """Single-query p50 at ``rows`` rows: transform + search + re-score (the code's default depth) from an int8
    stash on disk (memory-mapped, warm), flat and IVF kinds, raw d and whitened d and d/3. Every index is built
    first; then each query is timed on every one in a shuffled order, so load from other jobs falls on all alike."""
    rng = np.random.default_rng(0)
    real = np.concatenate([data["docs"] for data in sets.values()])
    spread = real.std(axis=0)
    copies = [real] + [real + 0.3 * spread * rng.standard_normal(real.shape) for _ in range(-(-rows // len(real)) - 1)]
    docs = np.concatenate(copies)[:rows].astype(np.float32)
    queries = np.concatenate([data["raw"] for data in sets.values()])[:LATENCY_QUERIES]
    d = docs.shape[1]
    with tempfile.TemporaryDirectory() as tmp:
        stash = VectorStash.create(Path(tmp) / "s", d, ["mean"], "int8")
        for start in range(0, len(docs), WINDOW * 8):
            block = docs[start : start + WINDOW * 8]
            stash.append({"mean": block}, [str(i) for i in range(start, start + len(block))], [""] * len(block))
        list(stash.iter_parts())  # mapped once, as a searcher maps it
        moments = RunningMoments(d)
        moments.update(docs)
        configs = []
        for kind, k in (("raw", d), ("whitened", d), ("whitened", d // 3)):
            spec = TransformSpec.raw() if kind == "raw" else TransformSpec(dim=k, whiten=True)
            transform = spec.fit(moments)
            vectors = transform.transform(docs)
            for index_kind in ("flat", "ivf"):
                for code in CODES:
                    # IVF lists trained on 20k rows (k-means on FAISS's default 50 per list took minutes per index
                    # here): the lists' quality moves recall, not the time a probe takes
                    train_rows = LATENCY_TRAIN if index_kind == "ivf" else None
                    index_spec = IndexSpec(index_kind, codes=code, train_size=train_rows)
                    index = create_index(index_spec, k, len(docs))
                    sample = train_size(index, index_spec, len(docs))
                    if sample:
                        chosen = rng.choice(len(docs), sample, replace=False)
                        train(index, vectors[chosen], docs[chosen], transform)
                    add_rows(index, transform, docs)
                    params = search_parameters(index, **default_search_params(index, index_spec))
                    depth = depths.get(code) or (RESCORE_DEPTH if k < d else 0)
                    row = {"model": model, "rows": len(docs), "transform": kind, "dim": k, "kind": index_kind}
                    row |= {"code": code, "depth": depth, "ram_bytes": index_spec.bytes_per_vector(k)}
                    configs.append((row, transform, index, params, []))
        print(f"  timing {len(configs)} indexes of {len(docs):,} rows", file=sys.stderr)
        for query in queries:
            q = query[None, :]
            for number in rng.permutation(len(configs)):
                row, transform, index, params, times = configs[number]
                began = time.perf_counter()
                extra = search_extras(index, q)  # as a searcher hands them over
                _, top = index.search(transform.transform(q), max(10, row["depth"]), params=params, **extra)
                if row["depth"]:
                    rescore(stash, RawTransform(d), q, top, 10)
                times.append(time.perf_counter() - began)
    return [row | {"p50_ms": 1000 * float(np.median(times[10:]))} for row, *_, times in configs]


# ----- report --------------------------------------------------------------------------------------------------
def summary(rows: list[dict[str, Any]], depths: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (model, transform, dim, code): SciFact test, and nDCG@10 as a share of raw averaged over the dev basket's
    sets (every set measured where none of them was) and its worst set."""
    out = []
    keys = sorted({(r["model"], r["transform"], r["dim"], r["code"]) for r in rows}, key=lambda k: (k[0], -k[2], k))
    for model, transform, dim, code in keys:
        every = [r for r in rows if (r["model"], r["transform"], r["dim"], r["code"]) == (model, transform, dim, code)]
        group = [r for r in every if r["set"] in DEV] or every
        depth = depths.get(DEPTH_OF.get(code, "")) or (max(DEPTHS) if code in DEPTH_OF else 50)
        scifact = next((r for r in every if r["set"] == "scifact"), None) or dict.fromkeys(group[0], float("nan"))
        share = {
            key: [r[key] / r["raw_ndcg"] for r in group] for key in ("ndcg", f"ndcg_i8_{depth}", f"ndcg_f32_{depth}")
        }
        out.append(
            {
                "model": model.split("-")[1],
                "transform": transform,
                "dim": dim,
                "code": code,
                "ram": group[0]["ram_bytes"],
                "disk": group[0]["ram_bytes"] + _d(group[0]),  # + the int8 stash
                "depth": depth,
                "scifact": 100 * scifact["ndcg"],
                "scifact_i8": 100 * scifact[f"ndcg_i8_{depth}"],
                "scifact_f32": 100 * scifact[f"ndcg_f32_{depth}"],
                "mean_share": float(np.mean(share["ndcg"])),
                "mean_share_i8": float(np.mean(share[f"ndcg_i8_{depth}"])),
                "worst_share_i8": float(np.min(share[f"ndcg_i8_{depth}"])),
                "recall": float(np.mean([r["recall"] for r in group])),
                "recall_i8": float(np.mean([r[f"recall_i8_{depth}"] for r in group])),
            }
        )
    return out


def targets(rows: list[dict[str, Any]], depths: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 41's two quality targets before and in re-scoring, per (model, set): whitened codes against the
    anchors' codes of the raw vectors at the same bytes (nDCG@10 x100, codes alone), and int8-stash re-scoring
    against float32-stash re-scoring (relative, mean over every code and dimension at its default depth)."""

    def score(group: list[dict[str, Any]], transform: str, dim: int, code: str) -> float:
        found = [r["ndcg"] for r in group if (r["transform"], r["dim"], r["code"]) == (transform, dim, code)]
        return 100 * found[0] if found else float("nan")

    out = []
    for model, name in sorted({(r["model"], r["set"]) for r in rows}):
        group = [r for r in rows if (r["model"], r["set"]) == (model, name)]
        d = _d(group[0])
        bits = d - 8 * SCALAR_BYTES  # with the decoder's scalars, the anchor's d / 8 bytes
        binary = score(group, "anchor", d, "raw-binary")
        shift = []
        for r in group:
            depth = depths.get(DEPTH_OF.get(r["code"], "")) or (max(DEPTHS) if r["code"] in DEPTH_OF else 50)
            shift.append(r[f"ndcg_i8_{depth}"] / r[f"ndcg_f32_{depth}"] - 1)
        out.append(
            {
                "model": model.split("-")[1],
                "set": name,
                "raw_binary": binary,
                "w_binary": score(group, "whitened", d, "binary") - binary,
                "w_binary_whitened": score(group, "whitened", d, f"binary-whitened{RERANK_DEPTH}") - binary,
                "w_binary_asym": score(group, "whitened", d, f"binary-asym{RERANK_DEPTH}") - binary,
                "w_binary_same": score(group, "whitened", bits, f"binary-asym{RERANK_DEPTH}") - binary,
                "w_binary_centred": score(group, "whitened-centred", bits, f"binary-asym{RERANK_DEPTH}") - binary,
                "raw_binary_asym": score(group, "raw", d, f"binary-asym{RERANK_DEPTH}") - binary,
                "w_sq4": score(group, "whitened", d // 4, "sq4") - binary,
                "raw_int8": score(group, "anchor", d, "raw-int8"),
                "w_sq8": score(group, "whitened", d, "sq8") - score(group, "anchor", d, "raw-int8"),
                "int8_stash": 100 * float(np.mean(shift)),
                "int8_stash_worst": 100 * float(np.min(shift)),
            }
        )
    return out


TARGET_COLUMNS = [
    ("model", "model"),
    ("set", "set"),
    ("raw_binary", "raw sign bits, d/8 B"),
    ("w_binary", "whitened ITQ bits, d/8 B, Hamming (+-)"),
    ("w_binary_whitened", f"whitened ITQ bits, d/8 B, top {RERANK_DEPTH} re-ranked by the whitened cosine (+-)"),
    ("w_binary_asym", f"whitened ITQ bits + scalars, d/8 + 2 B, top {RERANK_DEPTH} re-ranked as searched (+-)"),
    ("w_binary_same", "whitened d - 16 bits + scalars, d/8 B, as searched (+-)"),
    ("w_binary_centred", "the same, centred kernel (+-)"),
    ("raw_binary_asym", f"raw ITQ bits, top {RERANK_DEPTH} re-ranked asymmetrically (+-)"),
    ("w_sq4", "whitened d/4 sq4, d/8 B (+-)"),
    ("raw_int8", "raw int8, d B"),
    ("w_sq8", "whitened sq8, d B (+-)"),
    ("int8_stash", "int8 vs float32 stash re-scored, mean %"),
    ("int8_stash_worst", "worst row %"),
]


# whose default depth each row is shown at (fp32 and fp16 at the reduced index's 50; a code no swept depth
# satisfied at the deepest)
DEPTH_OF = {"sq8": "sq8", "sq4": "sq4", "binary": "binary", "binary-random": "binary", "raw-int8": "sq8"}
DEPTH_OF |= {"raw-binary": "binary"} | {code: code for code in ASYMMETRIC}

COLUMNS = [
    ("model", "model"),
    ("transform", "vectors"),
    ("dim", "dims"),
    ("code", "code"),
    ("ram", "B/vector in RAM"),
    ("disk", "B/vector with int8 stash"),
    ("scifact", "SciFact nDCG@10 x100, codes alone"),
    ("depth", "re-score depth"),
    ("scifact_i8", "SciFact, re-scored (int8 stash)"),
    ("scifact_f32", "SciFact, re-scored (float32 stash)"),
    ("mean_share", "share of raw, dev basket, codes alone"),
    ("mean_share_i8", "share of raw, re-scored"),
    ("worst_share_i8", "worst dev set, re-scored"),
    ("recall", "recall@10 vs exact raw, codes alone"),
    ("recall_i8", "recall@10, re-scored"),
]


def pareto_plot(table: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, key, title in ((axes[0], "mean_share", "codes alone"), (axes[1], "mean_share_i8", "re-scored")):
        for model in sorted({r["model"] for r in table}):
            for group, marker in (("whitened", "o"), ("whitened-centred", "^"), ("raw", "s"), ("anchor", "x")):
                points = [r for r in table if r["model"] == model and r["transform"] == group]
                ax.scatter(
                    [r["ram"] for r in points], [r[key] for r in points], marker=marker, label=f"{model} {group}"
                )
            front, best = [], -1.0
            for r in sorted((r for r in table if r["model"] == model), key=lambda r: r["ram"]):
                if r[key] > best:
                    front.append(r)
                    best = r[key]
            ax.plot([r["ram"] for r in front], [r[key] for r in front], "-", alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per vector in the index")
        ax.set_title(f"nDCG@10 / raw, mean of the IR dev basket, {title}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of raw float32 nDCG@10")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(basket.MODELS))
    parser.add_argument("--sets", nargs="+", default=list(SETS))
    parser.add_argument(
        "--stashes",
        type=Path,
        default=basket.WORK / "codes",
        help="where each set's raw stash is (built if absent): an index directory <set>-<model> of mean pooling",
    )
    parser.add_argument("--data", type=Path, default=basket.DATA, help="the shared evaluation data")
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--latency-rows", type=int, default=LATENCY_ROWS)
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "codes")
    parser.add_argument(
        "--combine", nargs="+", type=Path, help="codes.json files of earlier runs: their rows, not measured again"
    )
    args = parser.parse_args()
    info = benchlib.machine(torch_too=True)
    benchlib.print_machine(info)
    models = [m for m in args.models if _installed(m)]
    rows: list[dict[str, Any]] = []
    lat: list[dict[str, Any]] = []
    for path in args.combine or []:
        earlier = json.loads(path.read_text())
        info = earlier["machine"] if not rows else info  # the machine the measurements ran on, as it was then
        rows += earlier["rows"]
        lat += earlier["latency"]
    minilm = "all-MiniLM-L6-v2"
    for model in models if not args.combine else []:
        for name in args.sets:
            data = collection(name, model, args.stashes, args.data)
            with tempfile.TemporaryDirectory() as tmp:
                int8 = int8_copy(data["stash"], Path(tmp) / "int8")
                print(f"{model} {name}: {len(data['docs']):,} docs, {len(data['raw'])} queries", file=sys.stderr)
                rows += measure_set(data, model, name, int8)
    depths = choose_depths(rows)
    if not args.no_latency and not args.combine and minilm in models:  # combined: the earlier runs' timings
        names = [name for name in args.sets if not name.endswith("-train")]  # each corpus once
        sets = {name: collection(name, minilm, args.stashes, args.data) for name in names}
        lat = latency(minilm, sets, depths, args.latency_rows)
    table = summary(rows, depths)
    out = benchlib.out_dir("codes", args.out.parent) if args.out == benchlib.RESULTS / "codes" else args.out
    out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(out / "codes.json", {"machine": info, "depths": depths, "rows": rows, "latency": lat})
    md = ["# Codes: bytes per vector against nDCG@10", "", benchlib.machine_md(info), ""]
    md += [f"Default re-scoring depths (re-scored recall@10 within {LOST} of fp32 codes' at that depth): {depths}", ""]
    md += [benchlib.md_table(table, COLUMNS), ""]
    md += ["## Targets: before re-scoring (nDCG@10 x100, codes alone) and int8 against float32 stash", ""]
    md += [benchlib.md_table(targets(rows, depths), TARGET_COLUMNS), ""]
    if lat:
        md += [f"## Single-query p50 at {lat[0]['rows']:,} rows (ms)", ""]
        columns = [("transform", "vectors"), ("dim", "dims"), ("kind", "index"), ("code", "code"), ("depth", "depth")]
        md += [benchlib.md_table(lat, [*columns, ("ram_bytes", "B/vector"), ("p50_ms", "p50 ms")]), ""]
    (out / "codes.md").write_text("\n".join(md))
    pareto_plot(table, out / "pareto.png")
    print("\n".join(md))


def _installed(model: str) -> bool:
    try:
        resolve_model(model)
    except Exception as err:  # noqa: BLE001 - any failure to find the model means: skip it, say why
        print(f"skipping {model}: {err}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    main()
