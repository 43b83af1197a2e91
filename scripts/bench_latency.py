"""Latency of full vs reduced dimensions, side by side in one run: build time, size, batch QPS, single-query
p50/p99 for search alone and for encode + transform + search end to end, and recall@10 against exact
full-dimension neighbours.

The documents are N vectors (default 100,000): the model's real SciFact embeddings (from an index directory's
stash) topped up with samples of a Gaussian with their mean and covariance. Queries are real: SciFact test
claims, encoded by the real model (the end-to-end numbers include that encoding).

    python scripts/bench_latency.py --index-root indexes/bench      # index dirs from bench_quality.py
    python scripts/bench_latency.py --models all-MiniLM-L6-v2 --n 20000 --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import benchlib
import faiss
import numpy as np

from retrieval.encode.transformer import TransformerEncoder
from retrieval.evaluate import read_queries
from retrieval.index import IndexSpec, create_index, set_search_params, train
from retrieval.indexdir import IndexDir
from retrieval.metrics import knn_recall
from retrieval.moments import RunningMoments
from retrieval.scan import FlatScan
from retrieval.whitening import DEFAULT_GAMMA, RawTransform, TransformSpec, l2_normalize

DATA = benchlib.REPO.parent / "shared" / "data"
KINDS = ("flat", "hnsw", "ivf")
ENCODINGS = ("eager_fp32", "eager_bf16", "traced_fp32", "traced_bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all-MiniLM-L6-v2,all-mpnet-base-v2")
    ap.add_argument("--index-root", type=Path, default=benchlib.REPO / "indexes" / "bench")
    ap.add_argument("--n", type=int, default=100_000, help="documents in each index")
    ap.add_argument("--gamma", type=float, default=DEFAULT_GAMMA, help="gamma of the reduced transform")
    ap.add_argument("--runs", type=int, default=5, help="timed repetitions of batch searches (median)")
    ap.add_argument("--quick", action="store_true", help="flat only, 100 single queries")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark
    info = benchlib.machine(torch_too=True)
    benchlib.print_machine(info)
    queries = read_queries(DATA / "scifact" / "queries-test.parquet")
    report: dict[str, Any] = {"machine": info, "command": benchlib.command_line(), "n": args.n, "models": {}}
    for model in args.models.split(","):
        directory = args.index_root / f"scifact-{model.lower()}"
        if not (directory / "manifest.json").is_file():
            print(f"skipping {model}: no index at {directory} (run scripts/bench_quality.py first)", file=sys.stderr)
            continue
        report["models"][model] = bench_model(model, directory, queries.texts, args)
    out = args.out or benchlib.out_dir("latency")
    out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(out / "latency.json", report)
    text = markdown(report)
    benchlib.write_md(out / "latency.md", text)
    print(text)


def documents(directory: Path, n: int, seed: int = 0) -> np.ndarray:
    """Real stashed vectors, topped up to ``n`` with Gaussian samples of the same mean and covariance."""
    stash = IndexDir(directory).stash()
    real = np.concatenate(list(stash.iter_blocks(pooling="mean")))
    moments = RunningMoments.from_array(real)
    extra = max(0, n - real.shape[0])
    rng = np.random.default_rng(seed)
    # Sample via the Cholesky-free eigen route: robust to the covariance's zero eigenvalues.
    lam, u = np.linalg.eigh(moments.covariance())
    scale = u * np.sqrt(np.clip(lam, 0, None))
    samples = [real[:n]]
    for start in range(0, extra, 50_000):
        m = min(50_000, extra - start)
        samples.append((moments.mean + rng.standard_normal((m, real.shape[1])) @ scale.T).astype(np.float32))
    return np.ascontiguousarray(np.concatenate(samples))


def bench_model(model: str, directory: Path, query_texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    docs = documents(directory, args.n)
    d = docs.shape[1]
    reduced = 256 if d == 768 else d // 3
    encoder = TransformerEncoder(model, "mean")
    raw_queries = encoder.encode(query_texts)
    encoding = query_encoding(encoder, query_texts[: 50 if args.quick else 200])
    print(f"{model}: one query encoded: {encoding}", file=sys.stderr)
    print(f"{model}: {docs.shape[0]:,} docs x {d}; {len(query_texts)} queries; {d} -> {reduced}", file=sys.stderr)
    exact = faiss.IndexFlatIP(d)
    exact.add(l2_normalize(docs))
    _, truth = exact.search(l2_normalize(raw_queries), 10)  # exact full-dimension neighbours (raw cosine)
    moments = RunningMoments.from_array(docs)
    rows = []
    for kind in ("flat",) if args.quick else KINDS:
        for dim in (d, reduced):
            sw = benchlib.Stopwatch()
            with sw("fit"):
                transform = RawTransform(d) if dim == d else TransformSpec(dim=dim, gamma=args.gamma).fit(moments)
            with sw("transform"):
                vectors = transform.transform(docs)
            spec = IndexSpec(kind, ef_construction=80)
            index = create_index(spec, dim, len(vectors))
            if not index.is_trained:
                with sw("train"):
                    train(
                        index, vectors[np.random.default_rng(0).choice(len(vectors), min(len(vectors), 65536), False)]
                    )
            with sw("add"):
                index.add(vectors)
            q = transform.transform(raw_queries)
            _, same_space = faiss_exact(vectors, q)
            knob = tune_knob(index, kind, q, same_space)
            row = {
                "model": model,
                "kind": kind,
                "dim": dim,
                "build_s": sum(sw.seconds.values()),
                **{f"{k}_s": v for k, v in sw.seconds.items()},
                "bytes": len(faiss.serialize_index(index)),
                **knob,
            }
            row |= timings(index, q, args, vectors if kind == "flat" else None)
            row |= end_to_end(encoder, transform, index, query_texts, args, vectors if kind == "flat" else None)
            _, found = index.search(q, 10)
            row["recall@10_vs_exact_full"] = knn_recall(found, truth)
            rows.append(row)
            print(benchlib.md_table([row], COLUMNS), file=sys.stderr)
    ratios = {}
    for kind in {r["kind"] for r in rows}:
        full, red = (next(r for r in rows if r["kind"] == kind and r["dim"] == x) for x in (d, reduced))
        ratios[kind] = {k: full[k] / red[k] for k in ("search_p50_ms", "batch_ms_per_query", "bytes")}
    return {
        "d": d,
        "reduced": reduced,
        "gamma": args.gamma,
        "query_encoding": encoding,
        "rows": rows,
        "speedup_full_over_reduced": ratios,
    }


def query_encoding(encoder: TransformerEncoder, texts: list[str]) -> dict[str, Any]:
    """One query's encoding (mean pooling) p50 ms: eager fp32 / bf16 autocast, and each traced variant alone;
    min cosine of each against eager fp32; and which trace the encoder itself chose (it times both)."""
    import torch

    ids = [encoder.tokenizer([t], truncation=True, max_length=encoder.max_length, return_tensors="pt") for t in texts]

    def eager(bf16: bool) -> Any:
        def run(tokens: Any) -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return encoder.model(**tokens).last_hidden_state[0].mean(0).float()

        return run

    def traced(bf16: bool) -> Any:
        chosen = encoder._trace(bf16_options=(bf16,))
        if not chosen:
            return None  # this trace disagreed with the eager model
        module = chosen[0]

        def run(tokens: Any) -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return module(tokens["input_ids"])[1][0].mean(0).float()

        return run

    variants = {"eager_fp32": eager(False), "eager_bf16": eager(True)}
    variants |= {"traced_fp32": traced(False), "traced_bf16": traced(True)}
    out: dict[str, Any] = {}
    reference = None
    with torch.inference_mode():
        for name, run in variants.items():
            if run is None:
                out[name] = {"p50_ms": float("nan"), "min_cos_vs_eager_fp32": float("nan")}
                continue
            for tokens in ids[:5]:
                run(tokens)
            times, vectors = [], []
            for tokens in ids:
                start = time.perf_counter()
                vectors.append(run(tokens))
                times.append((time.perf_counter() - start) * 1000)
            stacked = torch.stack(vectors)
            reference = stacked if reference is None else reference
            cos = torch.nn.functional.cosine_similarity(stacked, reference, dim=1).min().item()
            out[name] = {"p50_ms": benchlib.percentiles(times)["p50"], "min_cos_vs_eager_fp32": cos}
    for text in texts[:3]:  # the encoder's own choice, made on its TRACE_AFTER-th single text
        encoder.encode([text])
    out["encoder_chose"] = "bf16" if encoder._traced and encoder._traced[1] else "fp32" if encoder._traced else "eager"
    return out


def faiss_exact(vectors: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index.search(q, 10)


def tune_knob(index: Any, kind: str, q: np.ndarray, truth: np.ndarray) -> dict[str, Any]:
    """The smallest efSearch / nprobe that reaches recall@10 >= 0.95 against exact search in the same space."""
    if kind == "flat":
        return {"knob": "-", "recall@10_same_space": 1.0}
    name = "efSearch" if kind == "hnsw" else "nprobe"
    values = (
        (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
        if kind == "hnsw"
        else (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    )
    for value in values:
        set_search_params(index, **({"ef_search": value} if kind == "hnsw" else {"nprobe": value}))
        r = knn_recall(index.search(q, 10)[1], truth)
        if r >= 0.95:
            break
    return {"knob": f"{name}={value}", "recall@10_same_space": r}


def timings(index: Any, q: np.ndarray, args: argparse.Namespace, flat: np.ndarray | None) -> dict[str, Any]:
    """Batch and single-query search. Flat batches as Searcher runs them: FlatScan, whose first batch picks
    numpy's or FAISS's path (FAISS's own batch rate is reported beside it)."""
    faiss_batch = benchlib.median(benchlib.repeat(lambda: index.search(q, 10), runs=args.runs))
    batch = faiss_batch
    out: dict[str, Any] = {}
    if flat is not None:
        scan = FlatScan(flat)
        scan.search(q, 10)  # settles its batch path
        batch = benchlib.median(benchlib.repeat(lambda: scan.search(q, 10), runs=args.runs))
        out |= {"batch_path": scan.batch_path, "faiss_batch_qps": len(q) / faiss_batch}
    singles = q[: 100 if args.quick else len(q)]
    one = _single_times(lambda v: index.search(v[None, :], 10), singles)
    out |= {"batch_qps": len(q) / batch, "batch_ms_per_query": batch * 1000 / len(q)}
    out |= {"search_p50_ms": one["p50"], "search_p99_ms": one["p99"]}
    if flat is not None:
        sliced = _single_times(lambda v: scan.search(v[None, :], 10), singles)
        out |= {"sliced_p50_ms": sliced["p50"], "sliced_p99_ms": sliced["p99"]}
        out["faiss_scan_GBps"] = flat.nbytes / (one["p50"] / 1000) / 1e9
        out["sliced_scan_GBps"] = flat.nbytes / (sliced["p50"] / 1000) / 1e9
    return out


def end_to_end(
    encoder: Any, transform: Any, index: Any, texts: list[str], args: argparse.Namespace, flat: np.ndarray | None
) -> dict[str, float]:
    """One query at a time: encode + transform + search, the way `retrieval search` answers."""

    scan = FlatScan(flat) if flat is not None else None

    def answer(text: str) -> None:
        v = transform.transform(encoder.encode([text]))
        if scan is not None:
            scan.search(v, 10)
        else:
            index.search(v, 10)

    for text in texts[:5]:
        answer(text)
    times = []
    for text in texts[: 50 if args.quick else 150]:
        start = time.perf_counter()
        answer(text)
        times.append((time.perf_counter() - start) * 1000)
    p = benchlib.percentiles(times)
    return {"e2e_p50_ms": p["p50"], "e2e_p99_ms": p["p99"]}


def _single_times(fn: Any, queries: np.ndarray) -> dict[str, float]:
    for v in queries[:10]:
        fn(v)
    times = []
    for v in queries:
        start = time.perf_counter()
        fn(v)
        times.append((time.perf_counter() - start) * 1000)
    return benchlib.percentiles(times)


COLUMNS = [
    ("kind", "index"),
    ("dim", "dims"),
    ("knob", "knob"),
    ("build_s", "build s"),
    ("bytes", "bytes"),
    ("batch_qps", "batch QPS"),
    ("batch_path", "flat batch path"),
    ("faiss_batch_qps", "FAISS batch QPS"),
    ("search_p50_ms", "1-query p50 ms"),
    ("search_p99_ms", "p99 ms"),
    ("sliced_p50_ms", "sliced scan p50 ms"),
    ("faiss_scan_GBps", "FAISS nq=1 GB/s"),
    ("sliced_scan_GBps", "sliced scan GB/s"),
    ("e2e_p50_ms", "end-to-end p50 ms"),
    ("e2e_p99_ms", "e2e p99 ms"),
    ("recall@10_same_space", "recall@10 (same space)"),
    ("recall@10_vs_exact_full", "recall@10 vs exact full-d"),
]


def markdown(report: dict[str, Any]) -> str:
    lines = ["Machine:", benchlib.machine_md(report["machine"]), "", f"Command: `{report['command']}`", ""]
    for model, res in report["models"].items():
        lines += [f"### {model}: {report['n']:,} documents, {res['d']} -> {res['reduced']} (gamma {res['gamma']})", ""]
        enc = res["query_encoding"]
        lines += ["One query encoded (mean pooling, p50 ms; min cosine vs eager fp32):", ""]
        lines += [
            "| eager fp32 | eager bf16 | traced fp32 | traced bf16 | the encoder chose |",
            "|---|---|---|---|---|",
        ]
        cells = [f"{enc[v]['p50_ms']:.2f} ({enc[v]['min_cos_vs_eager_fp32']:.5f})" for v in ENCODINGS]
        lines += ["| " + " | ".join([*cells, f"traced {enc['encoder_chose']}"]) + " |", ""]
        lines.append(benchlib.md_table(res["rows"], COLUMNS))
        lines += ["", "| index | full/reduced: single-query p50 | batch time per query | bytes |", "|---|---|---|---|"]
        for kind, r in res["speedup_full_over_reduced"].items():
            lines.append(f"| {kind} | {r['search_p50_ms']:.2f}x | {r['batch_ms_per_query']:.2f}x | {r['bytes']:.2f}x |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
