"""Peak RSS of every command that reads or writes an index, at N rows and at 10 N: does memory grow with N?

Each command runs as its own ``python -m retrieval ...`` process under ``/usr/bin/time -v`` (its maximum
resident set size is its own), on a hard-linked copy of a real-text index directory (``make_realscale.py``), for
each checkout given with ``--code`` (so the code before a change can be measured the same way):

    index     a new index of the directory's rows from their stashed vectors (a vectors column: the build
              without the encoder, whose memory does not depend on N)
    add       ``extra.parquet``'s first rows, encoded and added
    refit     to 128 dims
    tune      raw and one whitening (k 128, gamma 0.25) on pseudo-queries
    eval ir   the same pseudo-queries
    search    one query, one-shot

Pseudo-queries: the titles of rows every directory holds (the first chunk), each with its own row as the one
relevant document: what matters here is memory, not quality. The FAISS index (flat, 384 dims: 1.5 KiB a row)
and the stash (the same again, on disk) are listed beside the peaks: the target is a peak that grows with the
index alone, never with the stash or with N x queries.

    python scripts/bench_memory.py --index indexes/realscale/realtext-100k --index indexes/realscale/joined \\
        --code . --code /tmp/scale-before

Sizes that could not be encoded in time: ``--vectors-from DIR --rows 100000,1000000`` builds indexes of
precomputed vectors (``.npy``) from DIR's stashed real vectors, the rows beyond DIR's count being its rows again
plus a little noise (memory does not depend on the values), and measures the commands that take vectors
(index, add of ``--add-rows`` rows, refit):

    python scripts/bench_memory.py --vectors-from indexes/bench/serve-flat --rows 100000,1000000 \\
        --commands add --code . --code /tmp/before --out results/realtext
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

DATA = benchlib.REPO / "indexes" / "realscale"
COMMANDS = ("index", "add", "refit", "tune", "eval ir", "search")
QUERY = "how do I configure a static address for a network interface"


def peak_rss(command: list[str], code: Path) -> dict[str, Any]:
    """Run ``python -m retrieval *command`` from ``code`` under /usr/bin/time -v: wall seconds, peak RSS MiB."""
    env = {**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["RETRIEVAL_INDEX_ROOT"] = "/tmp/bench-memory-root"  # never the user's default index
    start = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-v", sys.executable, "-m", "retrieval", *command],
        env=env,
        cwd=code,  # python -m puts the working directory first on sys.path
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"retrieval {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    assert match, done.stderr[-2000:]
    return {"seconds": seconds, "peak_rss_mib": int(match.group(1)) / 1024}


def vectors_corpus(directory: Path, out: Path) -> Path:
    """The directory's rows as (id, text, vec) parquet, written one stash part at a time."""
    if out.is_file():
        return out
    from retrieval.indexdir import IndexDir

    stash, writer = IndexDir(directory).stash(), None
    whole_parts = max(part.rows for part in stash.parts)
    for vectors, docs in zip(stash.iter_blocks(whole_parts), stash.iter_docs(), strict=True):
        vec = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])
        table = pa.table({"id": docs["id"], "text": docs["text"], "vec": vec})
        writer = writer or pq.ParquetWriter(out.with_suffix(".tmp"), table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()
    out.with_suffix(".tmp").rename(out)
    return out


def pseudo_queries(chunk: Path, work: Path, n: int) -> tuple[Path, Path]:
    """``n`` rows' titles as queries, each row its query's one relevant document."""
    table = pq.read_table(chunk, columns=["id", "title"])
    rows = [i for i, title in enumerate(table.column("title").to_pylist()) if title and len(title.split()) >= 3]
    picked = table.take(np.random.default_rng(0).choice(rows, size=n, replace=False))
    ids = picked.column("id").to_pylist()
    queries, qrels = work / "pseudo-queries.parquet", work / "pseudo-qrels.parquet"
    pq.write_table(pa.table({"query_id": [f"q-{i}" for i in ids], "text": picked.column("title")}), queries)
    pq.write_table(pa.table({"query_id": [f"q-{i}" for i in ids], "doc_id": ids, "score": [1] * n}), qrels)
    return queries, qrels


def vector_indexes(source: Path, sizes: list[int], add_rows: int, work: Path) -> list[Path]:
    """An index of precomputed vectors per size (raw, flat, with a stash), built from ``source``'s stash, plus
    ``extra.npy`` (``add_rows`` rows that no index holds) for ``add``."""
    from retrieval.indexdir import IndexDir

    real = np.concatenate(list(IndexDir(source).stash().iter_blocks())).astype(np.float32)
    rng = np.random.default_rng(0)

    def rows(n: int, noisy_from: int) -> np.ndarray:
        picked = real[np.arange(n) % len(real)]
        noise = rng.standard_normal(picked.shape, dtype=np.float32)
        noise[:noisy_from] = 0
        picked += 0.05 * noise
        return picked / np.linalg.norm(picked, axis=1, keepdims=True)

    np.save(work / "extra.npy", rows(add_rows, 0))
    built = []
    for n in sizes:
        out = work / f"vectors-index-{n}"
        if not (work / f"vectors-{n}.npy").is_file():
            np.save(work / f"vectors-{n}.npy", rows(n, len(real)))
        if not (out / "manifest.json").is_file():
            peak_rss(["index", str(work / f"vectors-{n}.npy"), "--out", str(out), "--overwrite"], benchlib.REPO)
        built.append(out)
    return built


def measure(directory: Path, code: Path, label: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from retrieval.indexdir import IndexDir

    manifest = IndexDir(directory).manifest()
    n, copy = manifest.n, work / f"copy-{manifest.n}"
    if manifest.encoder.encodes_text:
        argvs = text_commands(directory, copy, args, work)
    else:
        argvs = vector_commands(n, copy, work)
    sizes = {"index_mib": manifest.files["index.faiss"]["bytes"] / 2**20}
    sizes["stash_mib"] = (manifest.stash.bytes if manifest.stash else 0) / 2**20
    results = []
    for command in [c for c in args.commands if c in argvs]:  # an index of vectors takes no text queries
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(directory, copy, copy_function=os.link)  # writers publish new files: the source is safe
        print(f"   {label} N={n:,}: {command} ...", end="", flush=True)
        result = peak_rss(argvs[command], code)
        print(f" {result['peak_rss_mib']:,.0f} MiB, {result['seconds']:.0f} s", flush=True)
        results.append({"code": label, "n": n, "command": command, **sizes, **result})
    shutil.rmtree(copy, ignore_errors=True)
    shutil.rmtree(work / "built", ignore_errors=True)
    return results


def text_commands(directory: Path, copy: Path, args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """Each command's arguments on a copy of a text index: pseudo-queries for tune and eval, extra rows for add."""
    from retrieval.indexdir import IndexDir

    queries, qrels = pseudo_queries(args.chunk, work, args.queries)
    extra = work / "extra.parquet"
    pq.write_table(pq.read_table(args.extra).slice(0, args.add_rows), extra)
    argvs = {
        "add": ["add", str(copy), str(extra), "--id-column", "id", "--title-column", "title"],
        "refit": ["refit", str(copy), "--dim", "128"],
        "tune": ["tune", str(copy), "--queries", str(queries), "--qrels", str(qrels), "--dims", "128"]
        + ["--gammas", "0.25"],
        "eval ir": ["eval", "ir", str(copy), "--queries", str(queries), "--qrels", str(qrels)],
        "search": ["search", QUERY, "--index", str(copy), "-k", "10", "--json"],
    }
    if "index" in args.commands:  # the directory's rows as a parquet of vectors: written only when needed
        corpus = vectors_corpus(directory, work / f"vectors-{IndexDir(directory).manifest().n}.parquet")
        argvs["index"] = ["index", str(corpus), "--vectors-column", "vec", "--id-column", "id"]
        argvs["index"] += ["--out", str(work / "built"), "--overwrite"]
    return argvs


def vector_commands(n: int, copy: Path, work: Path) -> dict[str, list[str]]:
    """The commands that take precomputed vectors, on a copy of an index of them (``vector_indexes``)."""
    return {
        "index": ["index", str(work / f"vectors-{n}.npy"), "--out", str(work / "built"), "--overwrite"],
        "add": ["add", str(copy), str(work / "extra.npy")],
        "refit": ["refit", str(copy), "--dim", "128"],
    }


def table(results: list[dict[str, Any]]) -> str:
    sizes = sorted({r["n"] for r in results})
    codes = list(dict.fromkeys(r["code"] for r in results))
    peak = {(r["command"], r["n"], r["code"]): r["peak_rss_mib"] for r in results}
    columns = [(f"{c}@{n}", f"{c}, N = {n:,}") for n in sizes for c in codes]
    rows = []
    for command in dict.fromkeys(r["command"] for r in results):
        row: dict[str, Any] = {"command": command}
        row |= {f"{c}@{n}": peak.get((command, n, c)) for n in sizes for c in codes}
        if len(sizes) > 1:
            for c in codes:
                low, high = peak.get((command, sizes[0], c)), peak.get((command, sizes[-1], c))
                if low is not None and high is not None:
                    row[f"growth {c}"] = (high - low) / ((sizes[-1] - sizes[0]) / 1000)
        rows.append(row)
    growth = [(f"growth {c}", f"{c}: MiB per 1,000 rows") for c in codes] if len(sizes) > 1 else []
    index = {n: next(r["index_mib"] for r in results if r["n"] == n) for n in sizes}
    stash = {n: next(r["stash_mib"] for r in results if r["n"] == n) for n in sizes}
    reference = {"command": "(FAISS index file; stash on disk)"}
    reference |= {f"{c}@{n}": f"{index[n]:,.0f}; {stash[n]:,.0f}" for n in sizes for c in codes}
    if len(sizes) > 1:
        per = (index[sizes[-1]] - index[sizes[0]]) / ((sizes[-1] - sizes[0]) / 1000)
        reference |= {f"growth {c}": per for c in codes}
    return benchlib.md_table([*rows, reference], [("command", "peak RSS, MiB"), *columns, *growth])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    ap.add_argument("--index", type=Path, action="append", default=[], help="index directories (repeatable)")
    ap.add_argument("--vectors-from", type=Path, default=None, help="build vector indexes from this one's stash")
    ap.add_argument("--rows", default="100000,1000000", help="their sizes (with --vectors-from)")
    ap.add_argument("--code", type=Path, action="append", default=None, help="checkouts to run (default: this one)")
    ap.add_argument("--label", action="append", default=None, help="a name per --code (default: its folder)")
    ap.add_argument("--commands", default=",".join(COMMANDS), help="subset (default: %(default)s)")
    ap.add_argument("--chunk", type=Path, default=DATA / "chunk-00.parquet", help="rows every index holds")
    ap.add_argument("--extra", type=Path, default=DATA / "extra.parquet", help="rows for add (not indexed)")
    ap.add_argument("--add-rows", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=1000, help="pseudo-queries for tune and eval ir")
    ap.add_argument("--work", type=Path, default=Path("/tmp/retrieval-bench-memory"), help="scratch, not the repo")
    ap.add_argument("--out", type=Path, default=None, help="results root (default: results/)")
    args = ap.parse_args()
    args.commands = [c.strip() for c in args.commands.split(",")]
    codes = [c.resolve() for c in (args.code or [benchlib.REPO])]
    labels = args.label or [c.name for c in codes]
    info = benchlib.machine()
    benchlib.print_machine(info)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.vectors_from is not None:
        sizes = [int(n) for n in args.rows.split(",")]
        args.index += vector_indexes(args.vectors_from, sizes, args.add_rows, args.work)
    if not args.index:
        ap.error("give --index, or --vectors-from")
    results = []
    for directory in args.index:
        for code, label in zip(codes, labels, strict=True):
            results += measure(directory, code, label, args, args.work)
    out = benchlib.out_dir("memory", args.out)
    data = {
        "command": benchlib.command_line(),
        "machine": info,
        "codes": dict(zip(labels, map(str, codes), strict=True)),
    }
    benchlib.write_json(out / "bench_memory.json", data | {"results": results})
    md = "\n\n".join(
        [
            f"# Peak RSS per command (each its own process, /usr/bin/time -v)\n\n`{data['command']}`",
            benchlib.machine_md(info),
            table(results),
        ]
    )
    benchlib.write_md(out / "bench_memory.md", md)
    print("\n" + md)


if __name__ == "__main__":
    main()
