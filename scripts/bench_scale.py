"""Flat / HNSW / IVF over real sentence embeddings, at full and reduced dims, built and searched by the library.

The data is an index directory of real text with its stash (``scripts/make_realscale.py``: all-MiniLM-L6-v2
mean-pooled vectors of English passages), and held-out rows of the same corpus as queries, encoded here by the
directory's own encoder (title + text, as the corpus rows were). Nothing of the corpus is encoded again:

1. Builds, one process each (its peak RSS is its own VmHWM): a hard-linked copy of the directory, then
   ``update.refit`` to the transform (``TransformSpec(dim=k)``, the library's gamma) and index kind: the
   library's fit and ``build.fill_index`` (train on a sample, add the stash block by block), timed per stage.
2. Exact top-10 neighbours of every query, streamed over the stash with ``scan.TopK``: in raw cosine at full
   dimension (the truth re-scoring aims at) and in each built index's own space (the truth its knob is tuned on).
3. Searches, one process per index: a ``Searcher`` over the directory (the index memory-mapped, as every reader
   loads it). HNSW's efSearch / IVF's nprobe: the smallest on a grid reaching recall@10 >= 0.95 in the index's
   own space; there, batch QPS, single-query p50/p99 (``search_raw``, one query at a time), and recall@10
   against the full-dimension raw truth with and without re-scoring (``SearchParams(rescore=R)``: the top R of
   the index re-ranked by raw cosine from the stash).

Timed steps (builds, searches) each hold ``--lock`` while they run, so they never overlap another benchmark;
the rest (query encoding, exact neighbours) runs without it. Every step's result is kept under ``--work``, so a
run that stops resumes where it stopped, and ``--only flat:128`` (re)runs one index.

    python scripts/bench_scale.py --index indexes/realscale/joined --queries indexes/realscale/queries.parquet
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

K = 10
RECALL_TARGET = 0.95
EF_GRID = [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
IVF_KINDS = ("ivf", "ivf-sq8", "ivf-fp16", "ivf-hnsw")
NPROBE_GRID = [1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128, 192, 256, 384, 512, 768, 1024]


@contextlib.contextmanager
def locked(path: Path | None) -> Iterator[None]:
    """Hold the benchmark lock (flock, as ``flock(1)`` takes it) while a timed step runs."""
    if path is None:
        yield
        return
    with benchlib.bench_lock(path):
        yield


def job_name(kind: str, dim: int, nlist: int | None = None) -> str:
    """A build's name under --work; IVF builds with --ivf-nlist carry it (the default's builds keep theirs)."""
    return f"{kind}-{dim}" + (f"-nlist{nlist}" if kind in IVF_KINDS and nlist else "")


def run_worker(step: str, cfg: dict[str, Any], work: Path, lock: Path | None) -> dict[str, Any]:
    """One step in its own process (peak RSS its own), under the lock; its JSON result is kept under ``work``."""
    out = work / f"{step}-{cfg['name']}.json"
    cfg_path = work / f"cfg-{step}-{cfg['name']}.json"
    # reused only for the same configuration: a search's truths change with the run's dims ("full" is its largest)
    if out.is_file() and cfg_path.is_file() and json.loads(cfg_path.read_text()) == cfg:
        return json.loads(out.read_text())
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(benchlib.REPO)}
    with locked(lock):
        load = os.getloadavg()
        done = subprocess.run([sys.executable, __file__, "--worker", step, str(cfg_path), str(out)], env=env)
    if done.returncode:
        raise SystemExit(f"{step} {cfg['name']} failed (exit {done.returncode})")
    result = json.loads(out.read_text()) | {"loadavg_start": [round(x, 2) for x in load]}
    out.write_text(json.dumps(result, default=benchlib._json_default))
    return result


def check_inputs(work: Path, index: Path, queries: Path) -> None:
    """``work``'s kept results belong to one index version and one queries file: refuse to mix them with another's
    (a directory name alone, e.g. ``joined``, says nothing of its size or version)."""
    from retrieval.files import sha256
    from retrieval.indexdir import IndexDir

    manifest = IndexDir(index).manifest()
    inputs = {"index": str(index.resolve()), "n": manifest.n, "created": manifest.created}
    inputs |= {"generation": manifest.generation, "queries_sha256": sha256(queries)}
    record = work / "inputs.json"
    if record.is_file() and json.loads(record.read_text()) != inputs:
        raise SystemExit(f"{work} holds results for other inputs ({record}): delete it or give another --work")
    record.write_text(json.dumps(inputs, indent=1) + "\n")


# ----- 1. builds ---------------------------------------------------------------------------------------------
def build_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    from retrieval.index import IndexSpec, describe, load_index
    from retrieval.update import refit
    from retrieval.whitening import TransformSpec

    target = Path(cfg["dir"])
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(cfg["base"], target, copy_function=os.link)  # refit publishes new files; the base is untouched
    start = time.perf_counter()
    manifest = refit(target, TransformSpec(dim=cfg["dim"]), IndexSpec(**cfg["spec"]))
    wall = time.perf_counter() - start
    peak = benchlib.peak_rss_mib()
    index_bytes = (target / "index.faiss").stat().st_size
    return {
        "kind": cfg["kind"],
        "dim": cfg["dim"],
        "n": manifest.n,
        "spec": cfg["spec"],
        "faiss": describe(load_index(target / "index.faiss", mmap=True)),
        "stages_s": manifest.timings,
        "build_s": manifest.timings.get("fit", 0.0) + manifest.timings.get("index", 0.0),
        "refit_wall_s": wall,
        "peak_rss_mib": peak,
        "index_bytes": index_bytes,
    }


# ----- 2. queries and exact neighbours ----------------------------------------------------------------------
def encode_queries(index: Path, queries: Path, work: Path) -> np.ndarray:
    """The held-out rows as the corpus rows were encoded (title + text), by the index's own encoder."""
    path = work / "queries.npy"
    if path.is_file():
        return np.load(path)
    import pyarrow.parquet as pq

    from retrieval.encode.transformer import from_info
    from retrieval.indexdir import IndexDir

    table = pq.read_table(queries)
    titles, texts = table.column("title").to_pylist(), table.column("text").to_pylist()
    encoder = from_info(IndexDir(index).manifest().encoder)
    vectors = encoder.encode([f"{h or ''} {t}".strip() for h, t in zip(titles, texts, strict=True)])
    np.save(path, vectors)
    return vectors


def exact_neighbours(index: Path, raw_queries: np.ndarray, spaces: dict[str, Path], work: Path) -> dict[str, str]:
    """Exact top-K rows per query in raw cosine ("raw") and in each built directory's transformed space, in one
    streamed pass over the stash (``scan.TopK``: one block of scores at a time)."""
    from retrieval.indexdir import IndexDir
    from retrieval.scan import TopK
    from retrieval.whitening import l2_normalize

    paths = {name: work / f"truth-{name}.npy" for name in ["raw", *spaces]}
    if all(p.is_file() for p in paths.values()):
        return {name: str(p) for name, p in paths.items()}
    transforms = {name: IndexDir(d).transform() for name, d in spaces.items()}
    queries = {"raw": l2_normalize(raw_queries)} | {n: t.transform(raw_queries) for n, t in transforms.items()}
    tops = {name: TopK(len(raw_queries), K) for name in paths}
    start, first = time.perf_counter(), 0
    for block in IndexDir(index).stash().iter_blocks():
        for name, top in tops.items():
            rows = l2_normalize(block) if name == "raw" else transforms[name].transform(block)
            top.push(queries[name] @ rows.T, first)
        first += block.shape[0]
    for name, top in tops.items():
        np.save(paths[name], top.result()[1])
    print(f"exact neighbours in {len(paths)} spaces over {first:,} rows: {time.perf_counter() - start:.0f} s")
    return {name: str(p) for name, p in paths.items()}


# ----- 3. searches -------------------------------------------------------------------------------------------
def search_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    from retrieval.indexdir import load
    from retrieval.metrics import knn_recall
    from retrieval.search import Searcher, SearchParams

    searcher = Searcher(load(cfg["dir"], "quick"), encoder=None)  # query vectors are given: no encoder
    raw = np.load(cfg["queries"])
    same, full, truth = (np.load(cfg[key]) for key in ("truth_same", "truth_full", "truth_raw"))
    kind = cfg["kind"]

    def batch(params: SearchParams) -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        _, rows = searcher.search_raw(raw, params)
        return time.perf_counter() - start, rows

    curve: list[dict[str, Any]] = []
    knob: dict[str, int] = {}
    if kind == "hnsw" or kind in IVF_KINDS:
        name, grid = ("ef_search", EF_GRID) if kind == "hnsw" else ("nprobe", NPROBE_GRID)
        if kind in IVF_KINDS:
            grid = [g for g in grid if g <= searcher.manifest.index.faiss["nlist"]]
        for value in grid:
            params = SearchParams(k=K, rescore=0, **{name: value})  # the index alone, not its default re-scoring
            batch(params)  # warm: pages of the map, FAISS's buffers
            seconds, rows = batch(params)
            point = {name: value, "recall_same": knn_recall(rows, same, K), "recall_raw": knn_recall(rows, truth, K)}
            curve.append(point | {"batch_ms_per_query": 1000 * seconds / len(raw)})
            knob = {name: value}
            if point["recall_same"] >= RECALL_TARGET:
                break
    params = SearchParams(k=K, rescore=0, **knob)
    batch(params)
    runs = [batch(params) for _ in range(3)]
    rows = runs[0][1]
    singles = np.arange(cfg["singles"]) % len(raw)

    def single_ms(params: SearchParams) -> tuple[float, float]:
        for i in singles[: max(5, len(singles) // 10)]:  # warm-up
            searcher.search_raw(raw[i : i + 1], params)
        times = []
        for i in singles:
            start = time.perf_counter()
            searcher.search_raw(raw[i : i + 1], params)
            times.append(1000 * (time.perf_counter() - start))
        return float(np.percentile(times, 50)), float(np.percentile(times, 99))

    p50, p99 = single_ms(params)
    rescored = []
    for depth in cfg["rescore"]:
        with_rescore = SearchParams(k=K, rescore=depth, **knob)
        _, found = searcher.search_raw(raw, with_rescore)
        r50, _ = single_ms(with_rescore)
        rescored.append({"rescore": depth, "recall_raw": knn_recall(found, truth, K), "single_p50_ms": r50})
    status = {
        line.split(":")[0]: int(line.split()[1]) / 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith(("VmHWM", "RssAnon", "RssFile"))
    }
    n, dim = searcher.index.ntotal, searcher.transform.dim_out
    return {
        "kind": kind,
        "dim": dim,
        "n": n,
        "knob": knob,
        "tuning": curve,
        "recall_same": knn_recall(rows, same, K),
        "recall_raw": knn_recall(rows, truth, K),
        "recall_full": knn_recall(rows, full, K),
        "rescored": rescored,
        "batch_queries": len(raw),
        "batch_qps": len(raw) / benchlib.median([s for s, _ in runs]),
        "single_queries": len(singles),
        "single_p50_ms": p50,
        "single_p99_ms": p99,
        "scan_gb_per_s": n * dim * 4 / (p50 / 1000) / 1e9 if kind == "flat" else None,
        "search_peak_rss_mib": status.get("VmHWM"),
        "search_rss_anon_mib": status.get("RssAnon"),
        "search_rss_file_mib": status.get("RssFile"),
    }


# ----- report ------------------------------------------------------------------------------------------------
def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in results:
        if r["tuning"]:
            knob = next(iter(r["knob"]))
            xs = [c["batch_ms_per_query"] for c in r["tuning"]]
            ax.plot(
                xs, [c["recall_same"] for c in r["tuning"]], marker="o", ms=3, label=f"{r['kind']} {r['dim']}d ({knob})"
            )
        else:
            ax.scatter([1000 / r["batch_qps"]], [r["recall_same"]], marker="s", label=f"flat {r['dim']}d")
    ax.axhline(RECALL_TARGET, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("batch search, ms per query (2 threads, shared machine)")
    ax.set_ylabel("recall@10 vs exact in the index's own space")
    ax.set_title(f"{results[0]['n']:,} real MiniLM vectors (real text), {results[0]['batch_queries']} held-out queries")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(
    builds: list[dict[str, Any]], searches: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, Any]
) -> None:
    rows = []
    for b, s in zip(builds, searches, strict=True):
        row = b | s | {"index_mib": b["index_bytes"] / 2**20}
        row["knob_text"] = ", ".join(f"{k}={v}" for k, v in s["knob"].items()) or "exact"
        for r in s["rescored"]:
            row[f"rescore_{r['rescore']}_recall_raw"] = r["recall_raw"]
            row[f"rescore_{r['rescore']}_p50_ms"] = r["single_p50_ms"]
        rows.append(row)
    n = rows[0]["n"]
    d = json.loads((args.index / "manifest.json").read_text())["encoder"]["dim"]  # raw truth: the encoder's dims
    top = max(r["dim"] for r in rows)  # the largest transform run: "exact whitened" truth
    data = {"command": benchlib.command_line(), "machine": info, "index": str(args.index), "results": rows}
    out = benchlib.out_dir("scale", args.out)
    benchlib.write_json(out / "bench_scale.json", data)
    plot(rows, out / "bench_scale.png")
    rescore_cols = [(f"rescore_{r}_recall_raw", f"R@10 vs raw {d}, re-score {r}") for r in args.rescore]
    rescore_cols += [(f"rescore_{r}_p50_ms", f"p50 ms, re-score {r}") for r in args.rescore]
    md = "\n\n".join(
        [
            f"# Scale: {n:,} real MiniLM vectors, flat / HNSW / IVF at full and reduced dims\n\n`{data['command']}`",
            benchlib.machine_md(info),
            f"Index: `{args.index}` (real text: `{Path(corpus_of(args.index)).name}`); "
            f"{rows[0]['batch_queries']} held-out queries from the same corpus. Transform: the library's gamma at "
            f"each k (k = {d}: no reduction, so the raw vectors, as `--dim {d}` builds). HNSW: M={args.hnsw_m}, "
            f"efConstruction={args.hnsw_ef_construction}. IVF: "
            + (f"nlist={args.ivf_nlist}" if args.ivf_nlist else "the library's default nlist (~4 sqrt(N))")
            + ", 50 training rows per list.",
            f"## Search (knob: the smallest reaching recall@10 >= {RECALL_TARGET} in the index's own space)",
            benchlib.md_table(
                rows,
                [
                    ("kind", "index"),
                    ("dim", "dims"),
                    ("knob_text", "knob"),
                    ("recall_same", "R@10 own space"),
                    ("recall_raw", f"R@10 vs raw {d}"),
                    ("single_p50_ms", "1-query p50 ms"),
                    ("single_p99_ms", "p99 ms"),
                    ("batch_qps", "batch QPS"),
                    ("scan_gb_per_s", "flat scan GB/s"),
                ],
            ),
            f"## Reduced vs full: recall@10 against exact raw-cosine neighbours at {d} dims, with re-scoring",
            benchlib.md_table(
                rows,
                [
                    ("kind", "index"),
                    ("dim", "dims"),
                    ("recall_full", f"R@10 vs exact {'raw' if top == d else 'whitened'} {top}"),
                    ("recall_raw", f"R@10 vs raw {d}, no re-score"),
                    *rescore_cols,
                ],
            ),
            "## Builds (each its own process: `update.refit` of a hard-linked copy; build = fit + index stages)",
            benchlib.md_table(
                rows,
                [
                    ("kind", "index"),
                    ("dim", "dims"),
                    ("build_s", "build s"),
                    ("refit_wall_s", "refit wall s (verify, fit, index, write)"),
                    ("index_mib", "index MiB"),
                    ("peak_rss_mib", "build peak RSS MiB"),
                    ("search_peak_rss_mib", "search peak RSS MiB"),
                    ("search_rss_file_mib", "of which mapped files MiB"),
                ],
            ),
            "Load average when each timed step started (1/5/15 min): "
            + "; ".join(f"{r['kind']} {r['dim']}: build {r['build_load']}, search {r['search_load']}" for r in rows)
            + ". Build times include numpy's eigh (the fit), which took 0.1-6 s for the same 384 x 384 matrix "
            "on this shared machine (OpenBLAS threads waiting for each other): the index stage is the steady part.",
        ]
    )
    benchlib.write_md(out / "bench_scale.md", md)
    print("\n" + md)
    print(f"\nwrote {out}/bench_scale.json, .md, .png")


def corpus_of(directory: Path) -> str:
    from retrieval.indexdir import IndexDir

    return IndexDir(directory).manifest().corpus.path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    ap.add_argument("--index", type=Path, help="a text index directory with its stash")
    ap.add_argument("--queries", type=Path, help="held-out rows (title, text) of the same corpus")
    ap.add_argument("--dims", default="384,256,128", help="k of each transform (default: %(default)s)")
    kinds_help = "index kinds: flat, hnsw, ivf, ivf-sq8 (IVF lists of 8-bit codes), ivf-fp16 (of 16-bit floats), "
    kinds_help += "ivf-hnsw (IVF lists found by an HNSW over the centroids) (default: %(default)s)"
    ap.add_argument("--kinds", default="flat,hnsw,ivf", help=kinds_help)
    ap.add_argument("--only", default=None, help="comma-separated kind:dim to (re)run, e.g. hnsw:128")
    ap.add_argument("--hnsw-m", type=int, default=32)
    ap.add_argument("--hnsw-ef-construction", type=int, default=64)
    ap.add_argument("--ivf-nlist", type=int, default=None, help="IVF lists (default: the library's, ~4 sqrt(N))")
    ap.add_argument("--rescore", default="20,100", help="re-scoring depths (default: %(default)s)")
    ap.add_argument("--singles", type=int, default=1000, help="single queries timed per index (flat: a fifth)")
    ap.add_argument(
        "--lock", type=Path, default=benchlib.lock_path(), help="held by each timed step (default: %(default)s)"
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/retrieval-bench-scale"), help="scratch, not the repo")
    ap.add_argument("--out", type=Path, default=None, help="results root (default: results/)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        step, cfg_path, out = args.worker
        cfg = json.loads(Path(cfg_path).read_text())
        result = build_worker(cfg) if step == "build" else search_worker(cfg)
        Path(out).write_text(json.dumps(result, default=benchlib._json_default))
        return
    if args.index is None or args.queries is None:
        ap.error("--index and --queries are required")
    args.rescore = [int(x) for x in args.rescore.split(",") if x]
    info = benchlib.machine()
    benchlib.print_machine(info)
    work = args.work / args.index.resolve().name
    work.mkdir(parents=True, exist_ok=True)
    check_inputs(work, args.index, args.queries)
    jobs = [(kind, int(dim)) for kind in args.kinds.split(",") for dim in args.dims.split(",")]
    if args.only:
        for kind, dim in (item.split(":") for item in args.only.split(",")):
            for step in ("build", "search"):
                (work / f"{step}-{job_name(kind, int(dim), args.ivf_nlist)}.json").unlink(missing_ok=True)
    specs = {"flat": {"kind": "flat"}, "ivf": {"kind": "ivf", "nlist": args.ivf_nlist}}
    specs["hnsw"] = {"kind": "hnsw", "m": args.hnsw_m, "ef_construction": args.hnsw_ef_construction}
    from retrieval.index import IndexSpec
    from retrieval.indexdir import IndexDir

    lists = args.ivf_nlist or IndexSpec("ivf").nlist_for(IndexDir(args.index).manifest().n)
    specs["ivf-sq8"] = {"kind": f"IVF{lists},SQ8"}  # the same lists, codes of 1 byte per dimension
    specs["ivf-fp16"] = {"kind": f"IVF{lists},SQfp16"}  # the same lists, 16-bit floats: half the bytes read
    specs["ivf-hnsw"] = {"kind": f"IVF{lists}_HNSW32,Flat"}  # the same lists, found by an HNSW over the centroids
    builds = []
    for kind, dim in jobs:
        name = job_name(kind, dim, args.ivf_nlist)
        cfg = {"name": name, "kind": kind, "dim": dim, "spec": specs[kind], "base": str(args.index)}
        cfg["dir"] = str(work / name)
        print(f"== build {name}", flush=True)
        builds.append(run_worker("build", cfg, work, args.lock))
        b = builds[-1]
        print(f"   {b['build_s']:.1f} s {b['stages_s']}, peak RSS {b['peak_rss_mib']:,.0f} MiB", flush=True)
    raw_queries = encode_queries(args.index, args.queries, work)
    spaces = {f"w{d}": work / job_name(k, d, args.ivf_nlist) for k, d in jobs}  # a directory per transform
    truth = exact_neighbours(args.index, raw_queries, spaces, work)
    full = f"w{max(d for _, d in jobs)}"
    searches = []
    for (kind, dim), b in zip(jobs, builds, strict=True):
        name = job_name(kind, dim, args.ivf_nlist)
        cfg = {"name": name, "kind": kind, "dir": str(work / name), "queries": str(work / "queries.npy")}
        cfg |= {"truth_same": truth[f"w{dim}"], "truth_full": truth[full], "truth_raw": truth["raw"]}
        cfg["rescore"] = args.rescore
        cfg["singles"] = max(50, args.singles // 5) if kind == "flat" else args.singles
        print(f"== search {name}", flush=True)
        searches.append(run_worker("search", cfg, work, args.lock))
        s = searches[-1]
        b["build_load"], b["search_load"] = b.get("loadavg_start"), s.get("loadavg_start")
        print(
            f"   {s['knob'] or 'exact'}: R@10 own {s['recall_same']:.3f}, vs raw {s['recall_raw']:.3f}; "
            f"p50 {s['single_p50_ms']:.3f} ms; {s['batch_qps']:,.0f} QPS; rescored {s['rescored']}",
            flush=True,
        )
    report(builds, searches, args, info)


if __name__ == "__main__":
    main()
