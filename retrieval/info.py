"""What an index directory holds, summarised for people (``retrieval info``) and as JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from retrieval.manifest import MOMENTS_NAME, TRANSFORM_NAME, Manifest
from retrieval.update import describe_drift, drift
from retrieval.whitening import Whitening, load_transform


def describe_index(directory: Path, verify: bool = False) -> dict[str, Any]:
    """``{"summary": {...human-readable...}, "manifest": {...}, "spectrum": {...}}``."""
    directory = Path(directory)
    manifest = Manifest.load(directory)
    if verify:
        manifest.verify(directory)
    transform = load_transform(directory / TRANSFORM_NAME)
    enc, t, idx = manifest.encoder, manifest.transform, manifest.index
    sizes = {name: rec["bytes"] for name, rec in manifest.files.items()}
    summary: dict[str, Any] = {
        "model": enc.get("model") or f"precomputed vectors ({enc.get('column')})",
        "pooling": enc.get("pooling", "-"),
        "max length": enc.get("max_length", "-"),
        "precision": enc.get("precision", "-"),
        "transform": t["kind"],
        "dims": f"{t['d']} -> {t['k']}",
        "rows (N)": f"{manifest.n:,}",
        "index": f"{idx['type']} ({idx['factory']}) {_params(idx['faiss'])}".strip(),
        "corpus": manifest.corpus.get("path"),
        "stash": "none"
        if not manifest.stash
        else f"{manifest.stash['rows']:,} rows, {manifest.stash['dtype']}, "
        f"poolings {', '.join(manifest.stash['poolings'])}",
        "size on disk": _sizes(sizes),
        "built": f"{manifest.created} with retrieval {manifest.versions.get('retrieval')}",
        "time": ", ".join(f"{k} {v:.1f}s" for k, v in manifest.timings.items()),
    }
    spectrum: dict[str, Any] = {}
    if isinstance(transform, Whitening):
        lam = transform.eigenvalues
        spectrum = spectrum_summary(lam, transform.dim_out)
        summary["gamma / epsilon"] = f"{transform.gamma} / {transform.epsilon:g}"
        summary["explained variance"] = f"{transform.explained_variance:.2%} in the top {transform.dim_out}"
        summary["spectrum"] = (
            f"lambda_1 {lam[0]:.4g}, lambda_k {lam[transform.dim_out - 1]:.4g}, lambda_d {lam[-1]:.3g}; "
            f"half the variance in {spectrum['dims_for_50pct']} dims, 90% in {spectrum['dims_for_90pct']}"
        )
    kernel_drift = drift(directory) if (directory / MOMENTS_NAME).is_file() else {}
    if kernel_drift:
        summary["kernel drift"] = describe_drift(kernel_drift)
    return {"summary": summary, "manifest": manifest.__dict__, "spectrum": spectrum, "drift": kernel_drift}


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


def _params(faiss_info: dict[str, Any]) -> str:
    keys = [k for k in ("M", "efConstruction", "efSearch", "nlist", "nprobe") if k in faiss_info]
    return " ".join(f"{k}={faiss_info[k]}" for k in keys)


def _sizes(sizes: dict[str, int]) -> str:
    total = sum(sizes.values())
    stash = sum(v for k, v in sizes.items() if k.startswith("vectors/"))
    parts = [f"{total / 1e6:.1f} MB in all"] + [
        f"{name} {size / 1e6:.1f} MB" for name, size in sizes.items() if not name.startswith("vectors/")
    ]
    if stash:
        parts.append(f"stash {stash / 1e6:.1f} MB")
    return "; ".join(parts)
