"""Compressed codes at a million rows: single-query p50 (query encoding excluded), recall@10, and what a loaded
index keeps resident, for the 48-byte configuration ``docs/benchmarks/codes.md`` recommends.

The configuration: whitened to 368 dims (``--dim 368``), binary codes (sign bits after ITQ, 46 bytes a row, and
the raw decoder's 2 bytes: 48), an int8 stash (``--stash-dtype int8``), in a binary IVF or HNSW index; searched in
each of CONFIGS: the stash's rows read through maps or by pread, Hamming candidates re-ranked or not (with the raw
decoder, as a search does, or by the whitened cosine alone), re-scoring depths.

    python scripts/bench_codes_scale.py build --corpus ROWS.parquet --work DIR [--kinds ivf hnsw]
    python scripts/bench_codes_scale.py run --work DIR --query-vectors Q.npy --truth ROWS.parquet [--kinds ...]

``build`` makes ``DIR/binary-KIND`` from a parquet file of ``vector`` rows (``make_spectrum.py sample``); nothing
is timed. ``run`` takes the benchmark lock and measures each index in a fresh process (``measure``), so that its
resident memory is its own: the process's resident set after importing numpy, FAISS and retrieval, after loading
the index (quick verification, as a one-shot search does), and after the queries; split into anonymous memory
(what the process allocated: the codes, FAISS's lists) and the index directory's memory-mapped files (the int8
stash and the docs, counted from ``/proc/self/smaps``: shared page cache, but resident in this process). Recall@10
is against exact raw cosine search over the same rows (``--truth``: an index of them with the raw transform and
a float32 stash). Writes ``results/codes-scale/codes-scale.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

KINDS = ("ivf", "hnsw")
QUERIES = 1000
# (stash reads, Hamming candidates re-ranked, candidates re-scored from the int8 stash, the raw decoder used); each
# index is measured in each, a fresh process apiece. The first is the configuration measured before the asymmetric
# re-rank and pread existed; the decoder left out is the re-rank by the whitened cosine alone.
CONFIGS = (
    ("map", 0, 400, False),
    ("pread", 0, 400, False),
    ("pread", 400, 100, False),
    ("pread", 400, 100, True),
    ("pread", 400, 50, True),
    ("pread", 200, 50, True),
)


def build(args: argparse.Namespace) -> None:
    from retrieval.build import BuildOptions, build_index
    from retrieval.corpus import CorpusSpec
    from retrieval.index import IndexSpec
    from retrieval.whitening import TransformSpec

    for kind in args.kinds:
        out = args.work / f"binary-{kind}"
        if (out / "manifest.json").is_file() and not args.rebuild:
            continue
        index = IndexSpec(kind=kind, codes="binary", ef_construction=args.ef_construction)
        if kind == "ivf":
            index = replace(index, nlist=args.nlist, train_size=args.train_size)
        options = BuildOptions(stash_dtype="int8", lexical=None, overwrite=True, resume=args.resume)
        corpus = CorpusSpec(args.corpus, vectors_column="vector")
        started = time.perf_counter()
        build_index(corpus, None, out, TransformSpec(dim=args.dim), index, options=options)
        print(f"{out}: built in {time.perf_counter() - started:.0f} s", flush=True)


def memory(directory: Path) -> dict[str, float]:
    """MiB resident now: the whole process, its anonymous memory, and the index directory's mapped files."""
    status = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            status[key] = int(value.split()[0]) / 1024
    mapped, current = 0.0, False
    inside = str(directory.resolve())
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and not head[0].endswith(":"):  # a mapping's first line: address range, ..., path
            current = len(head) >= 6 and head[5].startswith(inside)
        elif current and head[0] == "Rss:":
            mapped += int(head[1]) / 1024
    return {"process": status["VmRSS"], "anonymous": status["RssAnon"], "index files mapped": mapped}


def disk_read() -> int:
    """Bytes this process has had read from storage (``/proc/self/io``; page-cache hits are not counted): stash
    rows the page cache no longer held (a host that reclaims idle page cache evicts them between queries)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "read_bytes":
            return int(value)
    return 0


def measure(args: argparse.Namespace) -> None:
    """One index in this fresh process: memory at each step, p50 of single queries, the rows found."""
    import faiss  # noqa: F401  (imported before the first reading: its library is not the index)

    from retrieval.search import Searcher, SearchParams

    queries = np.load(args.query_vectors).astype(np.float32)
    before = memory(args.index)
    searcher = Searcher.load(args.index, verify="quick", stash_reads=args.stash_reads)
    if args.no_decoder:  # the re-rank by the whitened cosine alone
        searcher.index.decoder = None
    loaded = memory(args.index)
    params = SearchParams(k=10, mode="dense", rescore=args.rescore, rerank=args.rerank)
    # a served index's warm-up: maps opened; the docs made resident; a stash read by pread asked into the page
    # cache (its first reads otherwise went to the disk); a mapped one made resident when it fits the share
    searcher.warm_up()
    searcher.search_vectors(queries[:1], params)
    times, found = [], []
    read_before = disk_read()
    for query in queries:
        started = time.perf_counter()
        hits = searcher.search_vectors(query[None], params)[0]
        times.append(time.perf_counter() - started)
        found.append([h.row for h in hits] + [-1] * (10 - len(hits)))
    read_during = disk_read() - read_before
    after = memory(args.index)
    manifest = searcher.manifest
    result = {
        "index": manifest.index.factory,
        "rows": int(searcher.index.ntotal),
        "bytes per row": int(searcher.index.code_size) + (2 if searcher.index.decoder is not None else 0),
        "rescore": manifest.rescoring.depth if args.rescore is None else args.rescore,
        "rerank": searcher.index.rerank if args.rerank is None else args.rerank,
        "decoder": searcher.index.decoder is not None,
        "stash reads": args.stash_reads,
        "search": manifest.index.search,
        "p50 ms": float(np.median(times)) * 1e3,
        "p99 ms": float(np.percentile(times, 99)) * 1e3,
        "disk MiB read by the queries": read_during / 2**20,
        "memory MiB": {"imports": before, "loaded": loaded, "after queries": after},
        "found": found,
    }
    args.out.write_text(json.dumps(result))


def truth(source: Path, queries: np.ndarray, k: int = 10) -> np.ndarray:
    """Exact raw cosine top ``k`` over every row of ``source`` (an index directory's float32 stash, or the
    parquet file of ``vector`` rows the indexes were built from), a block at a time."""
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    best = np.full((len(q), k), -np.inf, dtype=np.float32)
    rows = np.full((len(q), k), -1, dtype=np.int64)
    first = 0
    for block in _blocks(source):
        scores = q @ (block / np.linalg.norm(block, axis=1, keepdims=True)).T
        scores = np.concatenate([best, scores], axis=1)
        ids = np.concatenate([rows, np.broadcast_to(np.arange(first, first + len(block)), (len(q), len(block)))], 1)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        best, rows = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
        first += len(block)
    return rows


def _blocks(source: Path) -> Any:
    if source.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(source).iter_batches(100_000, columns=["vector"]):
            column = batch.column(0)
            yield column.values.to_numpy().reshape(len(column), -1).astype(np.float32)
        return
    from retrieval.indexdir import IndexDir

    yield from IndexDir(source).stash().iter_blocks(100_000)


def run(args: argparse.Namespace) -> None:
    out = benchlib.out_dir("codes-scale")
    info = benchlib.machine()
    benchlib.print_machine(info)
    queries = np.load(args.query_vectors).astype(np.float32)
    queries = queries[np.sort(np.random.default_rng(0).choice(len(queries), min(QUERIES, len(queries)), False))]
    chosen = args.work / "queries.npy"
    np.save(chosen, queries)
    want = truth(args.truth, queries)  # minutes of products at 1M rows: before the lock, which covers the timing
    if not args.untimed:
        benchlib.hold_bench_lock()
    rows = []
    for kind, (reads, rerank, depth, decoder) in ((kind, config) for kind in args.kinds for config in CONFIGS):
        directory = args.work / f"binary-{kind}"
        result_path = args.work / f"measure-{kind}.json"
        command = [sys.executable, __file__, "measure", "--index", str(directory), "--query-vectors", str(chosen)]
        command += ["--stash-reads", reads, "--rerank", str(rerank), "--rescore", str(depth)]
        command += [] if decoder else ["--no-decoder"]
        subprocess.run([*command, "--out", str(result_path)], check=True, env=benchlib.retrieval_env())
        # ``measure`` reads no lock: under ``run``'s (held by this process) its times do not overlap others'
        result: dict[str, Any] = json.loads(result_path.read_text())
        found = np.array(result.pop("found"))
        recall = float(np.mean([len(set(f) & set(w)) / 10 for f, w in zip(found, want, strict=True)]))
        mem = result.pop("memory MiB")
        row = {"kind": kind, **result, "recall@10": recall}
        row |= {"RSS after imports": mem["imports"]["process"], "RSS loaded": mem["loaded"]["process"]}
        row |= {"RSS after queries": mem["after queries"]["process"]}
        row |= {"index RSS loaded": mem["loaded"]["process"] - mem["imports"]["process"]}
        row |= {"index anon after queries": mem["after queries"]["anonymous"] - mem["imports"]["anonymous"]}
        row |= {"index files mapped after queries": mem["after queries"]["index files mapped"]}
        row["memory"] = mem
        if args.untimed:  # recall and memory alone: times taken without the benchmark lock are not kept
            row.pop("p50 ms"), row.pop("p99 ms")
        rows.append(row)
        print({k: v for k, v in row.items() if k != "memory"}, flush=True)
    record = {"machine": info, "corpus": str(args.corpus_label), "queries": len(queries), "results": rows}
    name = args.name + ("-untimed" if args.untimed else "")
    benchlib.write_json(out / f"{name}.json", record)
    times = () if args.untimed else ("p50 ms", "p99 ms")
    columns = [(k, k) for k in ("kind", "index", "rows", "bytes per row", "stash reads", "rerank", "decoder")]
    columns += [("rescore", "rescore")]
    columns += [(k, k) for k in ("recall@10", *times, "disk MiB read by the queries")]
    columns += [(k, k) for k in ("RSS after imports", "RSS loaded", "index RSS loaded", "RSS after queries")]
    columns += [(k, k) for k in ("index anon after queries", "index files mapped after queries")]
    text = [
        f"# Binary codes at {rows[0]['rows']:,} rows: {args.corpus_label}; {len(queries)} single queries\n",
        "Memory in MiB; p50 / p99 of `Searcher.search_vectors` (query encoding excluded), one thread.\n",
        benchlib.md_table(rows, columns),
        "\n" + benchlib.machine_md(info),
    ]
    benchlib.write_md(out / f"{name}.md", "\n".join(text) + "\n")
    print("\n".join(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("build", "run", "measure"))
    parser.add_argument("--corpus", type=Path, help="build: a parquet file of vector rows")
    parser.add_argument("--corpus-label", default="", help="run: what the rows are, for the table")
    parser.add_argument("--work", type=Path, help="scratch folder of the indexes")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--ef-construction", type=int, default=200, help="build: HNSW")
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--resume", action="store_true", help="build: finish builds from their stashed parts")
    parser.add_argument("--nlist", type=int, help="build: IVF lists (default: the library's)")
    parser.add_argument("--train-size", type=int, help="build: IVF training rows (default: the library's)")
    parser.add_argument("--query-vectors", type=Path, help="a .npy of raw query vectors")
    parser.add_argument("--untimed", action="store_true", help="run: recall and memory only, without the lock")
    parser.add_argument(
        "--truth", type=Path, help="run: the rows' parquet file, or an index of them (raw transform, float32 stash)"
    )
    parser.add_argument("--index", type=Path, help="measure: the index directory")
    parser.add_argument("--stash-reads", default="map", choices=("map", "pread"), help="measure: how rows are read")
    parser.add_argument("--rerank", type=int, help="measure: Hamming candidates re-ranked asymmetrically")
    parser.add_argument("--no-decoder", action="store_true", help="measure: re-rank by the whitened cosine alone")
    parser.add_argument("--dim", type=int, default=368, help="build: the whitened dimensions (bits)")
    parser.add_argument("--rescore", type=int, help="measure: candidates re-scored from the stash")
    parser.add_argument("--out", type=Path, help="measure: where its JSON goes")
    parser.add_argument("--name", default="codes-scale", help="run: the result files' name in results/codes-scale")
    args = parser.parse_args()
    {"build": build, "run": run, "measure": measure}[args.part](args)


if __name__ == "__main__":
    main()
