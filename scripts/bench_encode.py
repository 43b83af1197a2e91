"""Encoding throughput: retrieval's TransformerEncoder vs sentence-transformers' encode, same texts, one run.

Variants: ours fp32 with batches in input order ("unsorted"), ours fp32 length-sorted, ours bf16 length-sorted,
and ``SentenceTransformer(folder).encode`` (which sorts by character length itself), over batch sizes and torch
thread counts, on short sentences (STS-B test) and passages (SciFact title + text). Cells are interleaved
round-robin across repeats so background load hits every variant alike; texts/s is the median over repeats.
Quality is the cosine of each variant's vectors against ours fp32 sorted (batch 32, all threads).

A roofline puts the rates in the machine's terms: the model's FLOPs per text (from its config and each text's
token count) turn texts/s into GFLOP/s, compared with this machine's dense fp32 and bf16 matrix-multiply rates
measured in the same run (torch.matmul, 2048 x 2048, all threads).

    python scripts/bench_encode.py            # full run (~10 min on 2 cores)
    python scripts/bench_encode.py --quick    # 200 texts, smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

DATA = benchlib.REPO.parent / "shared" / "data"
VARIANTS = ("st_fp32", "ours_fp32_unsorted", "ours_fp32_sorted", "ours_bf16_sorted")
REFERENCE = "ours_fp32_sorted"


def load_texts(kind: str, n: int, seed: int) -> list[str]:
    if kind == "sentences":
        t = pq.read_table(DATA / "sts" / "stsb-test.parquet", columns=["sentence1", "sentence2"]).to_pydict()
        texts = list(dict.fromkeys(t["sentence1"] + t["sentence2"]))  # unique, first-seen order
        return texts[:n]
    t = pq.read_table(DATA / "scifact" / "corpus.parquet", columns=["title", "text"]).to_pydict()
    docs = [f"{a} {b}".strip() for a, b in zip(t["title"], t["text"], strict=True)]
    rows = np.sort(np.random.default_rng(seed).choice(len(docs), size=min(n, len(docs)), replace=False))
    return [docs[i] for i in rows]


class Runner:
    """Encoders loaded once; ``run(variant, texts, batch_size)`` -> (n, d) float32."""

    def __init__(self, model: str):
        from sentence_transformers import SentenceTransformer

        from retrieval.encoder import TransformerEncoder, resolve_model

        folder = resolve_model(model)
        if folder is None:
            raise SystemExit(f"model {model!r} is not installed locally")
        self.folder = folder
        self.fp32 = TransformerEncoder(str(folder), precision="fp32")
        self.bf16 = TransformerEncoder(str(folder), precision="bf16")
        self.st = SentenceTransformer(str(folder), device="cpu")
        assert self.st.max_seq_length == self.fp32.max_length, (self.st.max_seq_length, self.fp32.max_length)

    def run(self, variant: str, texts: list[str], batch_size: int) -> np.ndarray:
        if variant == "st_fp32":
            return self.st.encode(texts, batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True)
        enc = self.bf16 if variant == "ours_bf16_sorted" else self.fp32
        enc.batch_size = batch_size
        if variant == "ours_fp32_unsorted":
            # No length sorting without touching the library: hand the encoder one batch at a time, in input
            # order, so it can only "sort" within a batch (which changes nothing: each batch pads to its own max).
            parts = [enc.encode(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
            return np.concatenate(parts) if parts else np.empty((0, enc.dim), np.float32)
        return enc.encode(texts)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a.astype(np.float64) * b, axis=1)


def cells(batch_sizes: list[int], threads: list[int]) -> list[tuple[int, int]]:
    """(threads, batch) pairs: every batch size at the most threads, plus batch 32 at the other counts."""
    top = max(threads)
    out = [(top, b) for b in batch_sizes]
    ref_batch = 32 if 32 in batch_sizes else batch_sizes[0]
    out += [(t, ref_batch) for t in threads if t != top]
    return out


def bench_dataset(runner: Runner, name: str, texts: list[str], args: argparse.Namespace) -> list[dict]:
    import torch

    grid = cells(args.batch_sizes, args.threads)
    top = max(args.threads)
    ref_batch = 32 if 32 in args.batch_sizes else args.batch_sizes[0]
    n_tokens = [
        len(x) for x in runner.fp32.tokenizer(texts, truncation=True, max_length=runner.fp32.max_length)["input_ids"]
    ]
    print(f"\n[{name}] {len(texts)} texts, tokens/text mean {np.mean(n_tokens):.1f}, max {max(n_tokens)}", flush=True)
    gflop_per_text = sum(model_flops(runner.fp32.model.config, n) for n in n_tokens) / len(texts) / 1e9
    torch.set_num_threads(top)
    reference = runner.run(REFERENCE, texts, ref_batch)
    times: dict[tuple[str, int, int], list[float]] = {}
    quality: dict[tuple[str, int, int], tuple[float, float]] = {}
    for t in sorted({t for t, _ in grid}):  # warm every variant at every thread count
        torch.set_num_threads(t)
        for v in VARIANTS:
            runner.run(v, texts[:64], 32)
    for rep in range(args.repeats):
        for t, b in grid:
            torch.set_num_threads(t)
            for v in VARIANTS:
                start = time.perf_counter()
                out = runner.run(v, texts, b)
                times.setdefault((v, t, b), []).append(time.perf_counter() - start)
                if rep == 0:
                    cos = cosines(out, reference)
                    quality[(v, t, b)] = (float(cos.min()), float(cos.mean()))
        print(f"  repeat {rep + 1}/{args.repeats} done", flush=True)
    torch.set_num_threads(top)
    rows = []
    st_at = {(t, b): len(texts) / benchlib.median(times[("st_fp32", t, b)]) for t, b in grid}
    for (v, t, b), ts in times.items():
        rate = len(texts) / benchlib.median(ts)
        rows.append(
            {
                "dataset": name,
                "variant": v,
                "threads": t,
                "batch_size": b,
                "texts": len(texts),
                "seconds_median": benchlib.median(ts),
                "seconds_all": ts,
                "texts_per_s": rate,
                "gflops": rate * gflop_per_text,
                "vs_st_same_cell": rate / st_at[(t, b)],
                "cos_min": quality[(v, t, b)][0],
                "cos_mean": quality[(v, t, b)][1],
            }
        )
    for r in sorted(rows, key=lambda r: (r["threads"], r["batch_size"], r["variant"])):
        print(
            f"  {r['variant']:20s} thr={r['threads']} bs={r['batch_size']:3d}  {r['texts_per_s']:8.1f} texts/s  "
            f"x{r['vs_st_same_cell']:.2f} vs ST  cos min {r['cos_min']:.5f} mean {r['cos_mean']:.6f}",
            flush=True,
        )
    return rows


def model_flops(config: object, n: int) -> float:
    """Multiply-add FLOPs of one forward pass over ``n`` tokens of a BERT-style encoder (projections, feed-forward,
    attention scores and mixing; embeddings, norms and softmax are negligible)."""
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers  # type: ignore[attr-defined]
    return layers * (2 * n * (4 * h * h + 2 * h * f) + 4 * n * n * h)


def gemm_gflops(dtype_name: str, size: int = 2048, repeats: int = 5) -> float:
    """This machine's dense matrix-multiply rate in ``dtype`` at the current torch thread count (best of runs)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e9


def summarise(rows: list[dict], min_cos: float) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in rows if r["dataset"] == name]
        top = max(r["threads"] for r in mine)
        st = [r for r in mine if r["variant"] == "st_fp32"]  # ST's best over every cell, threads included
        st_default = next((r for r in st if r["batch_size"] == 32 and r["threads"] == top), st[0])
        st_best = max(st, key=lambda r: r["texts_per_s"])
        ok = [r for r in mine if r["variant"] != "st_fp32" and r["cos_min"] >= min_cos]
        best = max(ok, key=lambda r: r["texts_per_s"]) if ok else None
        any_best = max((r for r in mine if r["variant"] != "st_fp32"), key=lambda r: r["texts_per_s"])
        out.append(
            {
                "dataset": name,
                "st_default_texts_per_s": st_default["texts_per_s"],
                "st_best_texts_per_s": st_best["texts_per_s"],
                "st_best_batch": st_best["batch_size"],
                "ours_best_ok": f"{best['variant']} bs={best['batch_size']}" if best else None,
                "ours_best_ok_texts_per_s": best["texts_per_s"] if best else None,
                "ours_best_ok_cos_min": best["cos_min"] if best else None,
                "ours_best_ok_gflops": best["gflops"] if best else None,
                "st_best_gflops": st_best["gflops"],
                "speedup_vs_st_default": best["texts_per_s"] / st_default["texts_per_s"] if best else None,
                "speedup_vs_st_best": best["texts_per_s"] / st_best["texts_per_s"] if best else None,
                "ours_fastest_any": f"{any_best['variant']} bs={any_best['batch_size']}",
                "ours_fastest_any_texts_per_s": any_best["texts_per_s"],
                "ours_fastest_any_cos_min": any_best["cos_min"],
                "fastest_any_vs_st_best": any_best["texts_per_s"] / st_best["texts_per_s"],
                "target_3x_met": bool(best and best["texts_per_s"] >= 3 * st_best["texts_per_s"]),
            }
        )
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        mine = [r for r in rows if r["dataset"] == name]
        top = max(r["threads"] for r in mine)
        batches = sorted({r["batch_size"] for r in mine if r["threads"] == top})
        width = 0.8 / len(VARIANTS)
        for i, v in enumerate(VARIANTS):
            ys = [
                next(r["texts_per_s"] for r in mine if (r["variant"], r["threads"], r["batch_size"]) == (v, top, b))
                for b in batches
            ]
            ax.bar(np.arange(len(batches)) + i * width, ys, width, label=v)
        ax.set_xticks(np.arange(len(batches)) + 0.4 - width / 2, [str(b) for b in batches])
        ax.set_xlabel(f"batch size ({top} torch threads)")
        ax.set_ylabel("texts/s")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="model name or local folder (default: %(default)s)")
    p.add_argument("--sentences", type=int, default=1000, help="STS-B test sentences (default: %(default)s)")
    p.add_argument(
        "--passages", type=int, default=300, help="SciFact passages, fixed seeded sample (default: %(default)s)"
    )
    p.add_argument(
        "--batch-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16, 32, 64, 128],
        help="comma list (default: 16,32,64,128)",
    )
    p.add_argument(
        "--threads",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2],
        help="torch thread counts; batch sizes are swept at the largest, batch 32 at the others",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is reported")
    p.add_argument("--min-cos", type=float, default=0.999, help="quality bar for the headline (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="200 texts each, batch 32 at all threads only, 1 repeat")
    p.add_argument("--out", type=Path, default=None, help="results root (default: results/)")
    args = p.parse_args()
    if args.quick:
        args.sentences, args.passages, args.batch_sizes, args.repeats = 200, 200, [32], 1
    args.threads = [t for t in args.threads if t <= (os.cpu_count() or 1)] or [1]
    if args.quick:
        args.threads = [max(args.threads)]

    import torch

    torch.set_num_threads(max(args.threads))
    info = benchlib.machine(torch_too=True)
    benchlib.print_machine(info)
    runner = Runner(args.model)
    gemm = {dtype: gemm_gflops(dtype) for dtype in ("float32", "bfloat16")}
    print(f"dense matmul, {max(args.threads)} threads: fp32 {gemm['float32']:.0f} GFLOP/s, bf16 {gemm['bfloat16']:.0f}")
    rows: list[dict] = []
    datasets = {
        "sentences (STS-B test)": load_texts("sentences", args.sentences, args.seed),
        "passages (SciFact)": load_texts("passages", args.passages, args.seed),
    }
    for name, texts in datasets.items():
        rows += bench_dataset(runner, name, texts, args)
    summary = summarise(rows, args.min_cos)

    out = benchlib.out_dir("encode", args.out)
    stem = "bench_encode_quick" if args.quick else "bench_encode"
    data = {
        "command": benchlib.command_line(),
        "machine": info,
        "model": args.model,
        "model_folder": str(runner.folder),
        "max_length": runner.fp32.max_length,
        "reference": f"{REFERENCE}, batch 32, {max(args.threads)} threads",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": summary,
        "gemm_gflops": gemm,
        "rows": rows,
    }
    benchlib.write_json(out / f"{stem}.json", data)
    plot(rows, out / f"{stem}.png")
    cols = [
        ("dataset", "texts"),
        ("variant", "variant"),
        ("threads", "threads"),
        ("batch_size", "batch"),
        ("texts_per_s", "texts/s"),
        ("vs_st_same_cell", "x ST (same cell)"),
        ("cos_min", "min cos vs fp32"),
        ("cos_mean", "mean cos"),
    ]
    scols = [
        ("dataset", "texts"),
        ("st_default_texts_per_s", "ST bs32 texts/s"),
        ("st_best_texts_per_s", "ST best texts/s"),
        ("ours_best_ok", f"ours best (cos >= {args.min_cos})"),
        ("ours_best_ok_texts_per_s", "texts/s"),
        ("ours_best_ok_cos_min", "min cos"),
        ("speedup_vs_st_default", "x ST bs32"),
        ("speedup_vs_st_best", "x ST best"),
        ("target_3x_met", ">= 3x ST best"),
    ]
    roofline = [
        {
            "dataset": r["dataset"],
            "st": r["st_best_gflops"],
            "ours": r["ours_best_ok_gflops"],
            "fp32": gemm["float32"],
            "bf16": gemm["bfloat16"],
            "share": (r["ours_best_ok_gflops"] or 0) / gemm["float32"],
            "need": 3 * r["st_best_gflops"],
        }
        for r in summary
    ]
    rcols = [
        ("dataset", "texts"),
        ("st", "ST best GFLOP/s"),
        ("ours", "ours best GFLOP/s"),
        ("fp32", "fp32 matmul GFLOP/s"),
        ("bf16", "bf16 matmul GFLOP/s"),
        ("share", "ours / fp32 matmul"),
        ("need", "3x ST best needs GFLOP/s"),
    ]
    ordered = sorted(rows, key=lambda r: (r["dataset"], -r["threads"], r["batch_size"], r["variant"]))
    md = "\n\n".join(
        [
            f"# Encoding throughput: {args.model}\n\n`{data['command']}`",
            benchlib.machine_md(info),
            "## Summary (target: >= 3x sentence-transformers with min cosine >= 0.999)",
            benchlib.md_table(summary, scols),
            "## Roofline (model FLOPs per text x texts/s, against this machine's dense matmul rate)",
            benchlib.md_table(roofline, rcols),
            f"## All cells (median of {args.repeats} interleaved runs; cosine vs {data['reference']})",
            benchlib.md_table(ordered, cols),
        ]
    )
    (out / f"{stem}.md").write_text(md + "\n")
    print("\n" + benchlib.md_table(summary, scols))
    print("\n" + benchlib.md_table(roofline, rcols))
    print(f"\nwrote {out / stem}.json, .md, .png")


if __name__ == "__main__":
    main()
