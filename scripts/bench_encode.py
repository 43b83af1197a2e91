"""Encoding throughput: retrieval's TransformerEncoder vs sentence-transformers' encode, same texts, one run.

Variants (``VARIANTS``): sentence-transformers' ``encode`` (which sorts by character length itself); ours as the
library runs it, fp32 and bf16; and the levers measured against ours bf16 (autocast instead of a bf16 model, eager
attention instead of SDPA, no shape buckets, token-budget batches), on short sentences (STS-B test) and passages
(SciFact title + text). sentence-transformers and ours bf16 are swept over batch sizes and torch thread counts, the
other variants run at batch 32. Cells are interleaved round-robin, in a fresh random order each repeat, so
background load hits every variant alike; texts/s is the median over repeats. Quality is the minimum cosine, over
every text and every pooling (mean, cls, first-last-avg), against ours fp32 with unbucketed batches of 32.

A roofline puts the rates in the machine's terms: the model's FLOPs per text (from its config and each text's
token count) turn texts/s into GFLOP/s, compared with the CPU's dense fp32 and bf16 matrix-multiply rates
measured in the same run (torch.matmul, 2048 x 2048, all threads).

A memory phase then runs an encoder as a server holds it, in a fresh process, on random batches of 1-32 texts of
1-200 words for ``--memory-seconds``, with and without shape buckets, and samples its RSS.

    python scripts/bench_encode.py            # full run (~20 min on 2 cores)
    python scripts/bench_encode.py --quick    # 200 texts, smoke run
    python scripts/bench_encode.py --precision fp32   # a CPU without native bf16: ours fp32 swept, no bf16 levers

``--precision fp32`` sweeps ours fp32 against sentence-transformers instead of ours bf16 and leaves out the bf16
levers: where the CPU has no bf16 instructions (no ``avx512_bf16`` / AMX), torch emulates bf16 products, which is
slow enough to take the run for hours, and ``precision auto`` picks fp32 there anyway. Needs sentence-transformers
(``pip install sentence-transformers``; not a dependency of the project).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

from retrieval import runtime  # noqa: E402  (no torch: tune_process runs before torch loads)

DATA = benchlib.REPO.parent / "shared" / "data"  # --data overrides
POOLINGS = ("mean", "cls", "first-last-avg")
# What each variant is: the library's own paths, and the levers measured against them (not adopted unless they win).
VARIANTS = {
    "st_fp32": "sentence-transformers encode (fp32; sorts by characters itself)",
    "ours_fp32": "ours, fp32, length-sorted, shape-bucketed (precision fp32)",
    "ours_fp32_unsorted": "ours, fp32, batches in input order",
    "ours_bf16": "ours, whole model cast to bf16, length-sorted, shape-bucketed, chunked attention where it times "
    "faster",
    "ours_int8": "ours, int8 linear layers (retrieval.encode.int8: oneDNN int8 matmul, SmoothQuant factors, "
    "activations per tensor and per token in the down projection), length-sorted, shape-bucketed (precision int8)",
    "lever_bf16_sdpa_attention": "ours_bf16 with the model's own fused SDPA attention kernel instead of chunked",
    "lever_bf16_autocast": "fp32 weights under torch.autocast(bf16) (the previous bf16 path)",
    "lever_bf16_eager_attention": "ours_bf16 with transformers' eager attention instead of SDPA",
    "lever_bf16_unbucketed": "ours_bf16, each batch padded to its own longest row (any shape)",
    "lever_tokens_unbounded": "ours (the run's precision) without a token budget: batch-size rows whatever their "
    "length",
    "lever_tokens2048": "ours (the run's precision), a 2,048-token budget per batch instead of TOKEN_BUDGET",
    "lever_tokens16384": "ours (the run's precision), a 16,384-token budget per batch instead of TOKEN_BUDGET",
}
# The vectors every variant is compared with: fp32, sorted, each batch padded to its own longest row, batch 32.
REFERENCE = "fp32, length-sorted, unbucketed, batch 32"


def load_texts(kind: str, n: int, seed: int) -> list[str]:
    if kind == "sentences":
        t = pq.read_table(DATA / "sts" / "stsb-test.parquet", columns=["sentence1", "sentence2"]).to_pydict()
        texts = list(dict.fromkeys(t["sentence1"] + t["sentence2"]))  # unique, first-seen order
        return texts[:n]
    t = pq.read_table(DATA / "scifact" / "corpus.parquet", columns=["title", "text"]).to_pydict()
    docs = [f"{a} {b}".strip() for a, b in zip(t["title"], t["text"], strict=True)]
    rows = np.sort(np.random.default_rng(seed).choice(len(docs), size=min(n, len(docs)), replace=False))
    return [docs[i] for i in rows]


def autocast_encoder(base: type) -> type:
    """The encoder's previous bf16 path: fp32 weights under ``torch.autocast``, which casts them on every call."""

    class Autocast(base):  # type: ignore[misc, valid-type]
        def _forward(self, batch: object, want_hidden: bool) -> object:
            import torch

            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(**batch, output_hidden_states=want_hidden)

    return Autocast


class Runner:
    """Encoders loaded once; ``run(variant, texts, batch_size, poolings)`` -> pooling -> (n, d) float32."""

    def __init__(self, model: str, precision: str = "bf16"):
        from sentence_transformers import SentenceTransformer

        from retrieval.encode.models import resolve_model
        from retrieval.encode.transformer import TransformerEncoder

        folder = resolve_model(model)
        if folder is None:
            raise SystemExit(f"model {model!r} is not installed locally")
        self.folder = folder

        def load(
            cls: type = TransformerEncoder, precision: str = "bf16", bucketed: bool = True, budget: object = ...
        ) -> TransformerEncoder:
            enc = cls(str(folder), precision=precision)
            enc.bucketed = bucketed
            if budget is not ...:
                enc.token_budget = budget
            return enc

        self.encoders = {
            "ours_fp32": load(precision="fp32"),
            "ours_fp32_unsorted": load(precision="fp32"),
            "reference": load(precision="fp32", bucketed=False),
            "ours_bf16": load(),
            "ours_int8": load(precision="int8"),
            "lever_bf16_autocast": load(autocast_encoder(TransformerEncoder)),
            "lever_bf16_eager_attention": load(),
            "lever_bf16_sdpa_attention": load(),
            "lever_bf16_unbucketed": load(bucketed=False),
            "lever_tokens_unbounded": load(precision=precision, budget=None),
            "lever_tokens2048": load(precision=precision, budget=2048),
            "lever_tokens16384": load(precision=precision, budget=16384),
        }
        self.encoders["lever_bf16_eager_attention"].model.set_attn_implementation("eager")
        self.encoders["lever_bf16_sdpa_attention"].chunked_attention = False
        self.fp32 = self.encoders["ours_fp32"]
        self.st = SentenceTransformer(str(folder), device="cpu")
        assert self.st.max_seq_length == self.fp32.max_length, (self.st.max_seq_length, self.fp32.max_length)

    def run(
        self, variant: str, texts: list[str], batch_size: int, poolings: tuple[str, ...] = ("mean",)
    ) -> dict[str, np.ndarray]:
        if variant == "st_fp32":
            return {"mean": self.st.encode(texts, batch_size=batch_size, show_progress_bar=False)}
        enc = self.encoders[variant]
        enc.batch_size = batch_size
        if variant == "ours_fp32_unsorted":
            # No length sorting without touching the library: hand the encoder one batch at a time, in input
            # order, so it can only "sort" within a batch (which changes nothing: each batch pads to its own max).
            parts = [enc.encode_poolings(texts[i : i + batch_size], poolings) for i in range(0, len(texts), batch_size)]
            return {p: np.concatenate([part[p] for part in parts]) for p in poolings}
        return enc.encode_poolings(texts, poolings)

    def padding(self, variant: str, texts: list[str], batch_size: int) -> float | None:
        """Padded tokens over real tokens in the batches this variant forms (1.0: no padding at all)."""
        if variant == "st_fp32":
            return None
        enc = self.encoders[variant]
        lengths = [len(x) for x in enc.tokenizer(texts, truncation=True, max_length=enc.max_length)["input_ids"]]
        if variant == "ours_fp32_unsorted":
            chunks = [range(i, min(i + batch_size, len(texts))) for i in range(0, len(texts), batch_size)]
            padded = sum(len(c) * max(lengths[i] for i in c) for c in chunks)
        else:
            enc.batch_size = batch_size
            padded = sum(len(rows) * width for rows, width in enc.batches(lengths))
        return padded / sum(lengths)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a.astype(np.float64) * b, axis=1)


def cells(batch_sizes: list[int], threads: list[int], ours: str = "ours_bf16") -> list[tuple[str, int, int]]:
    """(variant, threads, batch) to time: sentence-transformers and ``ours`` over every batch size at the most
    threads and at batch 32 at the other thread counts; every other variant at batch 32, most threads (the bf16
    ones only when ``ours`` is bf16)."""
    top = max(threads)
    ref_batch = 32 if 32 in batch_sizes else batch_sizes[0]
    swept = ("st_fp32", ours)
    # bf16 only where ours is bf16 or int8 (int8 against bf16 on a bf16 CPU); the bf16 levers only where ours is
    # bf16, the token budget's levers in the run's precision
    others = [
        v
        for v in VARIANTS
        if v not in swept
        and ("bf16" not in v or ours == "ours_bf16" or (ours == "ours_int8" and v == "ours_bf16"))
        and (not v.startswith("lever_bf16") or ours == "ours_bf16")
    ]
    out = [(v, top, b) for v in swept for b in batch_sizes]
    out += [(v, t, ref_batch) for v in swept for t in threads if t != top]
    out += [(v, top, ref_batch) for v in others]
    return out


def bench_dataset(
    runner: Runner, name: str, texts: list[str], args: argparse.Namespace
) -> tuple[list[dict], dict[str, object]]:
    import torch

    grid = cells(args.batch_sizes, args.threads, f"ours_{args.precision}")
    if not bf16_native():  # emulated bf16 would take the run for hours
        grid = [c for c in grid if "bf16" not in c[0]]
    top = max(args.threads)
    ref_batch = 32 if 32 in args.batch_sizes else args.batch_sizes[0]
    n_tokens = [
        len(x) for x in runner.fp32.tokenizer(texts, truncation=True, max_length=runner.fp32.max_length)["input_ids"]
    ]
    print(f"\n[{name}] {len(texts)} texts, tokens/text mean {np.mean(n_tokens):.1f}, max {max(n_tokens)}", flush=True)
    gflop_per_text = sum(model_flops(runner.fp32.model.config, n) for n in n_tokens) / len(texts) / 1e9
    torch.set_num_threads(top)
    # Quality, untimed: every pooling of every variant (ST: its own mean pooling) against the fp32 reference.
    reference = runner.run("reference", texts, ref_batch, POOLINGS)
    quality: dict[tuple[str, int], dict[str, float]] = {}
    for v, b in dict.fromkeys((v, b) for v, _, b in grid):
        got = runner.run(v, texts, b, POOLINGS if v != "st_fp32" else ("mean",))
        quality[(v, b)] = {p: float(cosines(got[p], reference[p]).min()) for p in got}
    # The vectors bucketing must not change: padding is masked, so only summation order differs.
    bucketing = {}
    pairs = [("fp32", "ours_fp32", "reference"), ("bf16", "ours_bf16", "lever_bf16_unbucketed")]
    for precision, bucketed, unbucketed in pairs[: 2 if args.precision == "bf16" else 1]:
        x, y = (runner.run(v, texts, ref_batch, POOLINGS) for v in (bucketed, unbucketed))
        bucketing[precision] = min(float(cosines(x[p], y[p]).min()) for p in POOLINGS)
    print(f"  bucketed vs unbucketed, min cosine over poolings: {bucketing}", flush=True)
    times: dict[tuple[str, int, int], list[float]] = {}
    for t in sorted({t for _, t, _ in grid}):  # warm every variant at every thread count
        torch.set_num_threads(t)
        for v in dict.fromkeys(v for v, _, _ in grid):
            runner.run(v, texts[:64], 32)
    order = np.random.default_rng(args.seed)
    for rep in range(args.repeats):
        # round-robin over every cell, in a fresh order each repeat, so drifting background load hits all alike
        for i in order.permutation(len(grid)):
            v, t, b = grid[i]
            torch.set_num_threads(t)
            start = time.perf_counter()
            runner.run(v, texts, b)
            times.setdefault((v, t, b), []).append(time.perf_counter() - start)
        print(f"  repeat {rep + 1}/{args.repeats} done, load {os.getloadavg()[0]:.1f}", flush=True)
    torch.set_num_threads(top)
    rows = []
    st_at = {(t, b): len(texts) / benchlib.median(times[("st_fp32", t, b)]) for v, t, b in grid if v == "st_fp32"}
    for (v, t, b), ts in times.items():
        rate = len(texts) / benchlib.median(ts)
        q = quality[(v, b)]
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
                "padded_over_real_tokens": runner.padding(v, texts, b),
                "vs_st_same_cell": rate / st_at[(t, b)] if (t, b) in st_at else None,
                "cos_min": min(q.values()),
                "cos_min_by_pooling": q,
            }
        )
    for r in sorted(rows, key=lambda r: (r["threads"], r["batch_size"], r["variant"])):
        same = f"x{r['vs_st_same_cell']:.2f} vs ST" if r["vs_st_same_cell"] else " " * 11
        print(
            f"  {r['variant']:28s} thr={r['threads']} bs={r['batch_size']:3d}  {r['texts_per_s']:8.1f} texts/s  "
            f"{r['gflops']:5.0f} GFLOP/s  {same}  cos min {r['cos_min']:.5f}",
            flush=True,
        )
    return rows, {"dataset": name, "bucketed_vs_unbucketed_cos_min": bucketing}


def quality_checks(runner: Runner, args: argparse.Namespace) -> list[dict]:
    """Retrieval and similarity quality per precision, untimed, against ours fp32: SciFact nDCG@10 (test queries,
    raw mean-pooled cosine, exact ranking over ``--scifact-docs`` documents: the relevant ones first, then a seeded
    sample) and STS-B test Spearman (cosine against the gold score). Target: within 0.5% of fp32."""
    from retrieval.metrics import ndcg_at_k

    sts = pq.read_table(DATA / "sts" / "stsb-test.parquet", columns=["sentence1", "sentence2", "score"]).to_pydict()
    if args.sts_pairs:
        sts = {key: values[: args.sts_pairs] for key, values in sts.items()}
    corpus = pq.read_table(DATA / "scifact" / "corpus.parquet").to_pydict()
    queries = pq.read_table(DATA / "scifact" / "queries-test.parquet").to_pydict()
    qrels: dict[str, dict[str, int]] = {}
    raw = pq.read_table(DATA / "scifact" / "qrels-test.parquet").to_pydict()
    for q, d, g in zip(raw["query_id"], raw["doc_id"], raw["score"], strict=True):
        qrels.setdefault(str(q), {})[str(d)] = int(g)
    ids = [str(i) for i in corpus[next(c for c in ("doc_id", "id", "_id") if c in corpus)]]
    relevant = {d for rels in qrels.values() for d in rels}
    order = [i for i, d in enumerate(ids) if d in relevant]
    rest = [i for i, d in enumerate(ids) if d not in relevant]
    rest = list(np.random.default_rng(args.seed).permutation(rest))
    keep = sorted(order + rest[: max(0, args.scifact_docs - len(order))] if args.scifact_docs else range(len(ids)))
    docs = [f"{corpus['title'][i]} {corpus['text'][i]}".strip() for i in keep]
    doc_ids = [ids[i] for i in keep]
    asked = [(str(q), t) for q, t in zip(queries["query_id"], queries["text"], strict=True) if str(q) in qrels]
    variants = ["ours_fp32", "ours_int8"] + (["ours_bf16"] if bf16_native() else [])
    out = []
    for v in variants:
        enc = runner.encoders[v]
        enc.batch_size = 32
        start = time.perf_counter()
        a, b = enc.encode(sts["sentence1"]), enc.encode(sts["sentence2"])
        spearman = _spearman(cosines(a, b), np.asarray(sts["score"], dtype=np.float64))
        d = enc.encode(docs)
        qv = enc.encode([t for _, t in asked])
        scores = (qv / np.linalg.norm(qv, axis=1, keepdims=True)) @ (d / np.linalg.norm(d, axis=1, keepdims=True)).T
        top = np.argsort(-scores, axis=1)[:, :10]
        ndcg = float(
            np.mean(
                [ndcg_at_k([doc_ids[j] for j in row], qrels[q], 10) for (q, _), row in zip(asked, top, strict=True)]
            )
        )
        out.append(
            {"variant": v, "scifact_ndcg10": ndcg, "stsb_spearman": spearman, "seconds": time.perf_counter() - start}
        )
        print(
            f"  quality {v}: SciFact nDCG@10 {ndcg:.4f} ({len(docs)} docs), STS-B Spearman {spearman:.4f}", flush=True
        )
    for r in out:
        r["ndcg_vs_fp32"] = r["scifact_ndcg10"] / out[0]["scifact_ndcg10"] - 1
        r["spearman_vs_fp32"] = r["stsb_spearman"] / out[0]["stsb_spearman"] - 1
        r["within_half_percent"] = abs(r["ndcg_vs_fp32"]) <= 0.005 and abs(r["spearman_vs_fp32"]) <= 0.005
    return out


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    import pandas as pd

    return float(pd.Series(x).rank().corr(pd.Series(y).rank()))


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


def bar(variant: str, min_cos: float) -> float:
    """The min cosine to fp32 a variant must reach to count: ``min_cos``; int8's own bar (INT8_MIN_COSINE) for int8."""
    from retrieval.encode.precision import INT8_MIN_COSINE

    return INT8_MIN_COSINE if variant.endswith("int8") else min_cos


def bf16_native() -> bool:
    """Whether bf16 runs natively in this run: the CPU has it and oneDNN's instruction set is not capped (a CPU
    without bf16 emulated by ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI`` would time bf16 emulated, for hours)."""
    from retrieval.encode.precision import cpu_supports_bf16

    capped = os.environ.get(benchlib.ISA_CAP_ENV, "").upper()
    return cpu_supports_bf16() and capped in ("", "ALL", "AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX10_1_512_AMX")


def summarise(rows: list[dict], min_cos: float, default_batch: int, ours: str = "ours_bf16") -> list[dict]:
    """Per dataset: sentence-transformers at batch 32 and at its best cell against ours (the library's own paths,
    not the levers) at its default batch and at its best batch, quality-checked on every pooling."""
    out = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in rows if r["dataset"] == name]
        top = max(r["threads"] for r in mine)
        st = [r for r in mine if r["variant"] == "st_fp32"]  # ST's best over every cell, threads included
        st_default = next((r for r in st if r["batch_size"] == 32 and r["threads"] == top), st[0])
        st_best = max(st, key=lambda r: r["texts_per_s"])
        mine_ours = [r for r in mine if r["variant"].startswith("ours_") and r["cos_min"] >= bar(r["variant"], min_cos)]
        best = max(mine_ours, key=lambda r: r["texts_per_s"]) if mine_ours else None
        default = next(
            (r for r in mine_ours if (r["variant"], r["threads"], r["batch_size"]) == (ours, top, default_batch)),
            None,
        )
        out.append(
            {
                "dataset": name,
                "st_default_texts_per_s": st_default["texts_per_s"],
                "st_best_texts_per_s": st_best["texts_per_s"],
                "st_best": f"bs={st_best['batch_size']} thr={st_best['threads']}",
                "st_best_gflops": st_best["gflops"],
                "ours_default_texts_per_s": default["texts_per_s"] if default else None,
                "ours_default_cos_min": default["cos_min"] if default else None,
                "ours_default_vs_st_best": default["texts_per_s"] / st_best["texts_per_s"] if default else None,
                "ours_best": f"{best['variant']} bs={best['batch_size']} thr={best['threads']}" if best else None,
                "ours_best_texts_per_s": best["texts_per_s"] if best else None,
                "ours_best_cos_min": best["cos_min"] if best else None,
                "ours_best_gflops": best["gflops"] if best else None,
                "speedup_vs_st_default": best["texts_per_s"] / st_default["texts_per_s"] if best else None,
                "speedup_vs_st_best": best["texts_per_s"] / st_best["texts_per_s"] if best else None,
                "target_3x_met": bool(best and best["texts_per_s"] >= 3 * st_best["texts_per_s"]),
            }
        )
    return out


def memory_worker(bucketed: bool, seconds: float, seed: int, model: str, precision: str = "bf16") -> dict[str, object]:
    """One encoder, as a long-lived server holds it, fed batches of 1-32 texts of 1-200 words for ``seconds``;
    RSS sampled every few seconds. Runs in its own process (``--memory-worker``) so the RSS is its own."""
    from retrieval.encode.transformer import TransformerEncoder

    words = " ".join(load_texts("passages", 2000, seed)).split()
    rng = np.random.default_rng(seed)
    # bf16, what precision auto picks on this CPU when it is quiet: pinned, since auto's timing under load picked
    # fp32 for one run and bf16 for the other (the bf16 copy alone is ~50 MiB), which hid what bucketing does.
    enc = TransformerEncoder(model, precision=precision)
    enc.bucketed = bucketed
    shapes: set[tuple[int, ...]] = set()
    forward = enc._forward

    def spy(batch: dict, want_hidden: bool) -> object:
        shapes.add(tuple(batch["input_ids"].shape))
        return forward(batch, want_hidden)

    enc._forward = spy  # type: ignore[method-assign]

    def texts(n: int) -> list[str]:
        out = []
        for _ in range(n):
            k = int(rng.integers(1, 201))
            start = int(rng.integers(0, len(words) - k))
            out.append(" ".join(words[start : start + k]))
        return out

    enc.warm_up()
    rss_start = benchlib.current_rss_mib()
    samples, calls, n_texts = [(0.0, 0, rss_start, 0)], 0, 0
    start = last = time.perf_counter()
    while time.perf_counter() - start < seconds:
        n = int(rng.integers(1, 33))
        enc.encode(texts(n))
        calls, n_texts = calls + 1, n_texts + n
        if time.perf_counter() - last >= 5:
            last = time.perf_counter()
            samples.append((round(last - start, 1), calls, benchlib.current_rss_mib(), len(shapes)))
    elapsed = time.perf_counter() - start
    samples.append((round(elapsed, 1), calls, benchlib.current_rss_mib(), len(shapes)))
    half = [rss for t, _, rss, _ in samples if t >= elapsed / 2]
    return {
        "variant": "bucketed" if bucketed else "unbucketed",
        "precision_used": enc.info().precision_used,
        "seconds": elapsed,
        "calls": calls,
        "texts": n_texts,
        "texts_per_s": n_texts / elapsed,
        "batch_shapes_seen": len(shapes),
        "rss_start_mib": rss_start,
        "rss_end_mib": samples[-1][2],
        "rss_peak_mib": benchlib.peak_rss_mib(),
        "growth": samples[-1][2] / rss_start - 1,
        "growth_second_half": half[-1] / half[0] - 1,
        "samples": [dict(zip(("t", "calls", "rss_mib", "shapes"), s, strict=True)) for s in samples],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }


def bench_memory(args: argparse.Namespace) -> list[dict]:
    """``memory_worker`` for bucketed and unbucketed batches, each in a fresh process, one after the other."""
    out = []
    for variant in ("unbucketed", "bucketed"):
        print(f"\n[memory] {variant}: {args.memory_seconds:.0f} s of random batches, load {os.getloadavg()[0]:.1f}")
        command = [sys.executable, __file__, "--memory-worker", variant, "--memory-seconds", str(args.memory_seconds)]
        command += ["--model", args.model, "--seed", str(args.seed), "--precision", args.precision]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"  {result['calls']} calls, {result['texts_per_s']:.0f} texts/s, {result['batch_shapes_seen']} shapes, "
            f"RSS {result['rss_start_mib']:.0f} -> {result['rss_end_mib']:.0f} MiB ({result['growth']:+.1%}; "
            f"second half {result['growth_second_half']:+.1%})",
            flush=True,
        )
        out.append(result)
    return out


def plot(rows: list[dict], memory: list[dict], path: Path, ours: str = "ours_bf16") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(2, len(names) + 1, figsize=(6 * (len(names) + 1), 8), squeeze=False)
    for col, name in enumerate(names):
        mine = [r for r in rows if r["dataset"] == name]
        top = max(r["threads"] for r in mine)
        ref = 32 if any(r["batch_size"] == 32 for r in mine) else min(r["batch_size"] for r in mine)
        ax = axes[0][col]
        cells = [r for r in mine if r["threads"] == top and r["batch_size"] == ref]
        cells.sort(key=lambda r: r["texts_per_s"])
        ax.barh([r["variant"] for r in cells], [r["texts_per_s"] for r in cells])
        ax.set_xlabel(f"texts/s (batch {ref}, {top} threads)")
        ax.set_title(name)
        ax = axes[1][col]
        for v in ("st_fp32", ours):
            sweep = sorted(
                (r for r in mine if r["variant"] == v and r["threads"] == top), key=lambda r: r["batch_size"]
            )
            ax.plot([r["batch_size"] for r in sweep], [r["texts_per_s"] for r in sweep], "o-", label=v)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"batch size ({top} threads)")
        ax.set_ylabel("texts/s")
        ax.legend(fontsize=8)
    ax = axes[0][-1]
    for m in memory:
        ax.plot([s["t"] for s in m["samples"]], [s["rss_mib"] for s in m["samples"]], label=m["variant"])
    ax.set_xlabel("seconds of random batches (1-32 texts of 1-200 words)")
    ax.set_ylabel("RSS MiB")
    ax.set_title("encoder memory")
    if memory:
        ax.legend(fontsize=8)
    axes[1][-1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    global DATA
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
        help="comma list, swept for sentence-transformers and ours bf16 (default: 16,32,64,128)",
    )
    p.add_argument(
        "--threads",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2],
        help="torch thread counts; batch sizes are swept at the largest, batch 32 at the others",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is reported")
    p.add_argument("--min-cos", type=float, default=0.999, help="quality bar for the headline (default: %(default)s)")
    p.add_argument(
        "--memory-seconds", type=float, default=180, help="seconds of random batches per memory run (0: skip)"
    )
    p.add_argument("--memory-worker", choices=("bucketed", "unbucketed"), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="200 texts each, batch 32 at all threads only, 1 repeat")
    p.add_argument(
        "--precision",
        choices=("bf16", "fp32", "int8"),
        default="bf16",
        help="ours swept against sentence-transformers (default: %(default)s; fp32 where the CPU has no bf16)",
    )
    p.add_argument("--data", type=Path, default=DATA, help="the shared evaluation data (default: ../shared/data)")
    p.add_argument("--sts-pairs", type=int, default=0, help="quality check: STS-B test pairs (0: all 1,379)")
    p.add_argument(
        "--scifact-docs",
        type=int,
        default=0,
        help="quality check: SciFact documents encoded (the test queries' relevant ones first; 0: all)",
    )
    p.add_argument("--out", type=Path, default=None, help="results root (default: results/)")
    p.add_argument(
        "--untuned",
        action="store_true",
        help="skip retrieval.tune_process (the OpenMP spin and glibc allocator settings the command line applies)",
    )
    args = p.parse_args()
    DATA = args.data
    benchlib.hold_bench_lock()  # timed: never beside another benchmark
    # as `retrieval index` runs: sentence-transformers shares this process, so its cells run under the same settings
    process = {} if args.untuned else runtime.tune_process()
    if args.memory_worker:
        bucketed = args.memory_worker == "bucketed"
        result = memory_worker(bucketed, args.memory_seconds, args.seed, args.model, args.precision)
        print(json.dumps(result))
        return
    if args.quick:
        args.sentences, args.passages, args.batch_sizes, args.repeats = 200, 200, [32], 1
        args.memory_seconds = min(args.memory_seconds, 20)
    args.threads = [t for t in args.threads if t <= (os.cpu_count() or 1)] or [1]
    if args.quick:
        args.threads = [max(args.threads)]

    import torch

    from retrieval.encode.spec import EncoderSpec

    default_batch = EncoderSpec().batch_size
    if args.precision == "int8":
        from retrieval.encode import int8

        if int8.onednn_available(torch) and int8.onednn_saturates(torch):  # refused by the encoder: say so first
            raise SystemExit(f"{int8.SATURATES_MESSAGE} (scripts/probe_int8_range.py measures what it would give)")
    torch.set_num_threads(max(args.threads))
    info = benchlib.machine(torch_too=True)
    benchlib.print_machine(info)
    runner = Runner(args.model, args.precision)
    # bf16's rate only where ours runs bf16: emulated, one 2048 x 2048 product takes about a minute
    gemm = {dtype: gemm_gflops(dtype) for dtype in ("float32", "bfloat16")[: 2 if bf16_native() else 1]}
    rates = ", ".join(f"{dtype} {rate:.0f} GFLOP/s" for dtype, rate in gemm.items())
    print(f"dense matmul, {max(args.threads)} threads: {rates}")
    peak = "bfloat16" if args.precision == "bf16" else "float32"  # the rate ours runs at (int8: against fp32)
    rows: list[dict] = []
    checks: list[dict] = []
    datasets = {
        "sentences (STS-B test)": load_texts("sentences", args.sentences, args.seed),
        "passages (SciFact)": load_texts("passages", args.passages, args.seed),
    }
    for name, texts in datasets.items():
        got, check = bench_dataset(runner, name, texts, args)
        rows += got
        checks.append(check)
    summary = summarise(rows, args.min_cos, default_batch, f"ours_{args.precision}")
    print("\n[quality] SciFact nDCG@10 and STS-B Spearman per precision (untimed)", flush=True)
    quality = quality_checks(runner, args)
    memory = bench_memory(args) if args.memory_seconds > 0 else []
    info["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]

    out = benchlib.out_dir("encode", args.out)
    stem = ("bench_encode_quick" if args.quick else "bench_encode") + (
        "" if args.precision == "bf16" else f"_{args.precision}"
    )
    if args.precision == "int8" and not bf16_native():  # int8 against fp32 alone: kept beside the bf16 CPU's run
        stem += "_no_bf16"
    if os.environ.get(benchlib.ISA_CAP_ENV):  # a CPU emulated by capping oneDNN's instruction set
        stem += "_isa_" + os.environ[benchlib.ISA_CAP_ENV].lower()
    if args.untuned:
        stem += "_untuned"
    data = {
        "command": benchlib.command_line(),
        "machine": info,
        "model": args.model,
        "model_folder": str(runner.folder),
        "max_length": runner.fp32.max_length,
        "library_default_batch_size": default_batch,
        "reference": f"{REFERENCE}, {max(args.threads)} threads",
        "variants": VARIANTS,
        "settings": {
            k: (os.path.relpath(v, benchlib.REPO) if isinstance(v, Path) else v) for k, v in vars(args).items()
        },
        "summary": summary,
        "bucketing_check": checks,
        "quality": quality,
        "onednn_max_cpu_isa": os.environ.get(benchlib.ISA_CAP_ENV),
        "tune_process": process,
        "gemm_gflops": gemm,
        "memory": memory,
        "rows": rows,
    }
    benchlib.write_json(out / f"{stem}.json", data)
    plot(rows, memory, out / f"{stem}.png", f"ours_{args.precision}")
    cols = [
        ("dataset", "texts"),
        ("variant", "variant"),
        ("threads", "threads"),
        ("batch_size", "batch"),
        ("texts_per_s", "texts/s"),
        ("gflops", "GFLOP/s"),
        ("vs_st_same_cell", "x ST (same cell)"),
        ("padded_over_real_tokens", "padded / real tokens"),
        ("cos_min", "min cos vs fp32 (all poolings)"),
    ]
    scols = [
        ("dataset", "texts"),
        ("st_default_texts_per_s", "ST bs32 texts/s"),
        ("st_best_texts_per_s", "ST best texts/s"),
        ("st_best", "ST best cell"),
        ("ours_default_texts_per_s", f"ours {args.precision} bs{default_batch} texts/s"),
        ("ours_default_vs_st_best", "x ST best"),
        ("ours_best", f"ours best (cos >= {args.min_cos})"),
        ("ours_best_texts_per_s", "texts/s"),
        ("ours_best_cos_min", "min cos"),
        ("speedup_vs_st_best", "x ST best"),
        ("target_3x_met", ">= 3x ST best"),
    ]
    roofline = [
        {
            "dataset": r["dataset"],
            "st": r["st_best_gflops"],
            "ours": r["ours_best_gflops"],
            "fp32": gemm["float32"],
            "bf16": gemm.get("bfloat16"),
            "share": (r["ours_best_gflops"] or 0) / gemm[peak],
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
        ("share", f"ours / {peak} matmul"),
        ("need", "3x ST best needs GFLOP/s"),
    ]
    bcols = [("dataset", "texts"), ("fp32", "fp32: bucketed vs not"), ("bf16", "bf16: bucketed vs not")]
    bucket_rows = [{"dataset": c["dataset"], **c["bucketed_vs_unbucketed_cos_min"]} for c in checks]
    mcols = [
        ("variant", "batches"),
        ("precision_used", "precision"),
        ("seconds", "seconds"),
        ("calls", "encode calls"),
        ("texts_per_s", "texts/s"),
        ("batch_shapes_seen", "distinct (rows, length) shapes"),
        ("rss_start_mib", "RSS start MiB"),
        ("rss_end_mib", "RSS end MiB"),
        ("growth", "growth"),
        ("growth_second_half", "growth, second half"),
    ]
    qcols = [
        ("variant", "variant"),
        ("scifact_ndcg10", "SciFact nDCG@10"),
        ("ndcg_vs_fp32", "vs fp32"),
        ("stsb_spearman", "STS-B Spearman"),
        ("spearman_vs_fp32", "vs fp32"),
        ("within_half_percent", "within 0.5%"),
    ]
    ordered = sorted(rows, key=lambda r: (r["dataset"], -r["threads"], r["batch_size"], r["variant"]))
    md = "\n\n".join(
        [
            f"# Encoding throughput: {args.model}\n\n`{data['command']}`",
            benchlib.machine_md(info)
            + f"\n- Load average at end: {info['loadavg_at_end']}"
            + (
                f"\n- **Emulated CPU**: oneDNN capped at `ONEDNN_MAX_CPU_ISA={os.environ[benchlib.ISA_CAP_ENV]}` "
                "(torch's matrix products; tokenisation and numpy are not capped): a CPU without native bf16 or AMX"
                if os.environ.get(benchlib.ISA_CAP_ENV)
                else ""
            )
            + "\n- Process settings (`retrieval.tune_process`, both sides): "
            + (", ".join(f"`{k}={v}`" for k, v in process.items()) or "none (`--untuned`, or set by the caller)"),
            "## Summary (target: >= 3x sentence-transformers with min cosine >= 0.999 on every pooling)",
            benchlib.md_table(summary, scols),
            "## Roofline (model FLOPs per text x texts/s, against the CPU's dense matmul rate)",
            benchlib.md_table(roofline, rcols),
            "## Variants\n\n" + "\n".join(f"- `{k}`: {v}" for k, v in VARIANTS.items()),
            f"## All cells (median of {args.repeats} interleaved runs; cosine vs {data['reference']})",
            benchlib.md_table(ordered, cols),
            "## Bucketed shapes change no vector (min cosine over all texts and poolings, batch 32)",
            benchlib.md_table(bucket_rows, bcols),
            "## Quality per precision (target: int8 within 0.5% of fp32)\n\nSciFact test queries over "
            + (
                f"{args.scifact_docs} documents (the relevant ones and a seeded sample)"
                if args.scifact_docs
                else "the whole corpus"
            )
            + ", raw mean-pooled cosine, exact ranking; STS-B test: Spearman of cosine against the gold score.",
            benchlib.md_table(quality, qcols),
            f"## Memory of a long-lived encoder (random batches of 1-32 texts of 1-200 words; {args.precision})",
            benchlib.md_table(memory, mcols) if memory else "(skipped)",
        ]
    )
    benchlib.write_md(out / f"{stem}.md", md)
    print("\n" + benchlib.md_table(summary, scols))
    print("\n" + benchlib.md_table(roofline, rcols))
    if memory:
        print("\n" + benchlib.md_table(memory, mcols))
    print(f"\nwrote {out / stem}.json, .md, .png")


if __name__ == "__main__":
    main()
