"""What an index directory holds, summarised for people (``retrieval info``, the service's /info) and as JSON.

Reads the manifest, the transform and the moments only: no FAISS, no encoder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ConfigError, render
from retrieval.index import IndexSpec
from retrieval.indexdir import IndexDir, Verify
from retrieval.manifest import IndexRecord, Manifest, RescoreRecord, depth_key
from retrieval.moments import RunningMoments
from retrieval.whitening import RawTransform, Whitening, kernel_drift


def describe_index(directory: Path, verify: Verify = "none") -> dict[str, Any]:
    """``{"summary": {...human-readable...}, "manifest": {...}, "spectrum": {...}, "drift": {...}}``."""
    index_dir = IndexDir(directory)
    manifest = index_dir.manifest()
    index_dir.verify(manifest, verify)
    report = describe(manifest, index_dir.transform(), index_dir.moments)
    return {"summary": report["summary"], "manifest": manifest.to_dict(), **report}


def describe(
    manifest: Manifest, transform: Whitening | RawTransform, moments: Callable[[], RunningMoments | None]
) -> dict[str, Any]:
    """``{"summary", "spectrum", "drift"}`` of one version (``moments``, read only for a whitening: that
    version's moments, or None when they cannot be had, and then no drift is shown)."""
    report: dict[str, Any] = {"summary": summary(manifest, transform), "spectrum": {}, "drift": {}}
    if isinstance(transform, Whitening):
        report["spectrum"] = spectrum_summary(transform.eigenvalues, transform.dim_out)
        now = moments()
        if now is not None:
            try:
                drift = kernel_drift(transform, now)
            except ConfigError as undefined:  # the index still searches; info says why there is no figure
                report["summary"]["kernel drift"] = "not measured: " + render(
                    undefined, lambda p: "--" + p.replace("_", "-")
                )
            else:
                report["drift"] = drift.to_dict()
                report["summary"]["kernel drift"] = drift.describe()
    return report


def _lexical(manifest: Manifest) -> str:
    """The BM25 part and how hybrid searches fuse, in one line ("none" for a dense-only index)."""
    lexical = manifest.lexical
    if lexical is None:
        return "none (dense search only)"
    spec, fusion = lexical.spec, manifest.fusing
    fused = f"rrf k={fusion.rrf_k}" if fusion.method == "rrf" else f"convex, dense weight {fusion.weight:g}"
    return (
        f"BM25 k1 {spec.k1:g} b {spec.b:g}, {lexical.terms:,} terms, stop words {spec.stopwords}, stemmer "
        f"{spec.stemmer}; hybrid by {fused}, {fusion.depth} candidates a side"
    )


def summary(manifest: Manifest, transform: Whitening | RawTransform) -> dict[str, Any]:
    """The human-readable lines of ``retrieval info`` (model, pooling, d -> k, gamma, N, index, sizes, ...)."""
    enc, t, idx = manifest.encoder, manifest.transform, manifest.index
    sizes: dict[str, int] = {}
    for name, record in manifest.files.items():  # the lexical part's files as one entry
        part = "lexical" if name.startswith("lexical/") else name
        sizes[part] = sizes.get(part, 0) + record["bytes"]
    stash = manifest.stash
    lines: dict[str, Any] = {
        "model": enc.model or f"precomputed vectors ({enc.column})",
        "pooling": enc.pooling or "-",
        "max length": enc.max_length or "-",
        "precision": f"{enc.precision} (ran {enc.precision_used})" if enc.precision_used else enc.precision,
        "transform": t.kind,
        "dims": f"{t.d} -> {t.dim}",
        "rows (N)": f"{manifest.n:,}",
        "index": f"{idx.kind} ({idx.factory}) {_params(idx.faiss)}".strip(),
        **({"codes": _codes(idx.spec, t.dim, idx.faiss.get("scalar_bytes", 0))} if idx.spec.code else {}),
        "search default": _search_default(idx),
        **({"lists": lists_line(idx.faiss)} if "empty_lists" in idx.faiss else {}),
        "corpus": manifest.corpus.path,
        "stash": "none" if not stash else f"{stash.rows:,} rows, {stash.dtype}, poolings {', '.join(stash.poolings)}",
        "re-scoring": _rescoring(manifest),
        "lexical": _lexical(manifest),
        **({"columns": ", ".join(f"{n} ({t})" for n, t in manifest.columns.items())} if manifest.columns else {}),
        "size on disk": _sizes(sizes, stash.bytes if stash else 0),
        "built": f"{manifest.created} with retrieval {manifest.versions.get('retrieval')}",
        "version": f"{manifest.generation} (published {manifest.updated})",
        "time": ", ".join(f"{k} {v:.1f}s" for k, v in manifest.timings.items()),
    }
    if isinstance(transform, Whitening):
        lam = transform.eigenvalues
        spectrum = spectrum_summary(lam, transform.dim_out)
        lines["gamma / epsilon"] = f"{transform.gamma} / {transform.epsilon:g}"
        lines["centring"] = "x - mean" if transform.center else "none (the kernel is fitted on the second moment)"
        lines["explained variance"] = f"{transform.explained_variance:.2%} in the top {transform.dim_out}" + (
            "" if transform.center else " (of the second moment: the kernel is uncentred)"
        )
        lines["spectrum"] = (
            f"lambda_1 {lam[0]:.4g}, lambda_k {lam[transform.dim_out - 1]:.4g}, lambda_d {lam[-1]:.3g}; "
            f"half the variance in {spectrum['dims_for_50pct']} dims, 90% in {spectrum['dims_for_90pct']}"
        )
    return lines


def _codes(spec: IndexSpec, k: int, scalars: int = 0) -> str:
    """What the index keeps of each vector: ``fp16 (256 bytes a vector)``, ``binary (16 bytes a vector, itq
    rotation, Hamming distance, top 400 re-ranked asymmetrically)``; ``scalars``: a binary index's bytes a row for
    its raw decoder (``codes.RawDecoder``), 0 without one."""
    line = f"{spec.code} ({spec.bytes_per_vector(k, scalars):g} bytes a vector"
    if not spec.binary:
        return line + ")"
    line += f": {k // 8} of bits, {scalars} of scalars" if scalars else ""
    how = "by whitened and estimated raw cosine" if scalars else "asymmetrically"
    rerank = f", top {spec.rerank_used} re-ranked {how}" if spec.rerank_used else ""
    return line + f", {spec.rotation_used} rotation, Hamming distance{rerank})"


def lists_line(faiss_info: dict[str, Any]) -> str:
    """How the rows fill an IVF index's lists, and what to do when most are empty (rows removed since the lists
    were trained): the knob probes lists, so empty ones cost searches time and recall."""
    nlist, empty = faiss_info["nlist"], faiss_info["empty_lists"]
    line = f"{nlist:,}, {empty:,} empty, the largest {faiss_info['largest_list']:,} rows, imbalance"
    line += f" {faiss_info['imbalance']:.2f} (1: even)"
    if empty * 2 > nlist:
        line += "; most lists are empty: `retrieval refit` trains lists for the rows there are now"
    return line


def _rescoring(manifest: Manifest) -> str:
    rescore = manifest.rescoring
    if not rescore.depth:
        if manifest.stash is None:
            return "off by default (no stash)"
        if not RescoreRecord.default(
            manifest.transform, manifest.stash, manifest.index.factory, depth_key(manifest.index)
        ).depth:
            return "off by default (the index keeps every dimension)"
        # a depth of 0 recorded for an index that loses information: chosen, or written by an older version
        return "off by default, as this index records (`search --rescore N` re-scores)"
    scorer = "raw cosine" if not rescore.scorer.whiten else f"a full-rank transform, gamma {rescore.scorer.gamma}"
    return f"top {rescore.depth} by {scorer} of the stashed vectors, by default"


def spectrum_summary(eigenvalues: np.ndarray, k: int) -> dict[str, Any]:
    lam = np.asarray(eigenvalues, dtype=np.float64)
    total = float(lam.sum()) or 1.0
    cumulative = np.cumsum(lam) / total
    return {
        "top": lam[:10].tolist(),
        "lambda_k": float(lam[k - 1]),
        "lambda_min": float(lam[-1]),
        "explained_at_k": float(cumulative[k - 1]),
        "dims_for_50pct": int(np.searchsorted(cumulative, 0.5) + 1),
        "dims_for_90pct": int(np.searchsorted(cumulative, 0.9) + 1),
        "dims_for_99pct": int(np.searchsorted(cumulative, 0.99) + 1),
    }


def _search_default(index: IndexRecord) -> str:
    """Each default knob, and where it came from."""
    if not index.search:
        return "exact (no knob)"
    knobs = ", ".join(f"{name} {value}" for name, value in sorted(index.search.items()))
    cal = index.calibration
    if cal is None:
        return f"{knobs}, as built (`retrieval calibrate --queries` measures what your queries need)"
    outcome = f"target {cal.target:g}" if cal.reached else f"short of the target {cal.target:g}: this index's best"
    return (
        f"{knobs}: measured on {cal.queries} queries ({cal.source}){_grown(cal.rows, index.ntotal)}, recall@10 "
        f"{cal.recall:.3f} {cal.measured_as} ({outcome}); search --ef / --nprobe overrides it"
    )


def _grown(then: int, now: int) -> str:
    """Where the index has grown (``add``) since its knob was measured: both sizes, and how to measure again."""
    if not then or now <= then:
        return f" at {then:,} rows" if then else ""
    return f" at {then:,} rows (now {now:,}: `retrieval calibrate` again re-measures)"


def _params(faiss_info: dict[str, Any]) -> str:
    keys = [k for k in ("M", "efConstruction", "efSearch", "nlist", "nprobe") if k in faiss_info]
    return " ".join(f"{k}={faiss_info[k]}" for k in keys)


def _sizes(sizes: dict[str, int], stash_bytes: int) -> str:
    parts = [f"{(sum(sizes.values()) + stash_bytes) / 1e6:.1f} MB in all"]
    parts += [f"{name} {size / 1e6:.1f} MB" for name, size in sizes.items() if not name.startswith("vectors/")]
    return "; ".join(parts + ([f"stash {stash_bytes / 1e6:.1f} MB"] if stash_bytes else []))
