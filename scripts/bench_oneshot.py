"""One-shot CLI search: wall time from process start to printed hits, at N documents (flat index).

Builds (once, under --work) an N-row flat index from synthetic anisotropic 384-d vectors through the CLI of the
code under test, then grafts the encoder record of a tiny all-MiniLM-L6-v2 index built by the same code onto its
manifest, so `retrieval search "text"` encodes a real query with MiniLM and searches N rows. Each timed run is a
fresh `python -m retrieval search ...` process (imports, manifest, verification, model load, encode, search,
print), after one untimed warm-up run that fills the page cache. The code under test is whatever --code points
at (default: this checkout), so an older commit's worktree can be timed the same way.

    python scripts/bench_oneshot.py --n 1000000                       # this checkout
    python scripts/bench_oneshot.py --n 1000000 --code /path/to/old --label before
    python scripts/bench_oneshot.py --index indexes/realscale/realtext-100k   # an existing (real-text) index
    python scripts/bench_oneshot.py --n 1000000 --precision bf16 --label bf16  # the record of a bf16-encoded index

``--precision`` is what the tiny MiniLM index is built with, so the grafted record says the corpus was encoded in
fp32 or bf16 (``auto`` lets this CPU decide, as a user's build would); queries of both go through numpy_bert.

Besides wall time, each run's CPU time (user + system, from the children's rusage) is reported: on a shared
machine it moves less with the load than the wall time does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

DIM = 384
QUERY = "vitamin D deficiency increases the risk of fractures"


def cli(code: Path, *args: str, timeout: float = 7200) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1", "RETRIEVAL_INDEX_ROOT": "/tmp/oneshot-root"}
    return subprocess.run(  # cwd: `python -m` puts the current directory first on sys.path
        [sys.executable, "-m", "retrieval", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=code
    )


def vectors(path: Path, n: int) -> Path:
    """N anisotropic rows (a common mean and a decaying spectrum, like sentence embeddings), written in blocks."""
    if path.is_file():
        return path
    rng = np.random.default_rng(0)
    scales = np.linspace(1.0, 0.05, DIM)
    mean = rng.normal(size=DIM) * 0.3
    out = np.lib.format.open_memmap(path.with_suffix(".tmp.npy"), mode="w+", dtype=np.float32, shape=(n, DIM))
    for start in range(0, n, 65536):
        stop = min(n, start + 65536)
        out[start:stop] = mean + rng.standard_normal((stop - start, DIM), dtype=np.float32) * scales
    out.flush()
    del out
    path.with_suffix(".tmp.npy").rename(path)
    return path


def build(code: Path, work: Path, n: int, precision: str = "auto") -> Path:
    """The N-row index, with the encoder record of a tiny MiniLM index built by the same code."""
    index = work / f"flat-{n}"
    if (index / "manifest.json").is_file():
        return index
    source = vectors(work / f"vectors-{n}.npy", n)
    done = cli(code, "index", str(source), "--out", str(index), "--no-keep-vectors", "--overwrite")
    if done.returncode:
        raise SystemExit(f"building the {n}-row index failed: {done.stderr.strip()}")
    tiny_corpus = work / "tiny.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"a sentence about topic {i}" for i in range(50)]}), tiny_corpus)
    tiny = work / f"tiny-{abs(hash(str(code)))}"
    done = cli(code, "index", str(tiny_corpus), "--out", str(tiny), "--overwrite", "--precision", precision)
    if done.returncode:
        raise SystemExit(f"building the tiny MiniLM index failed: {done.stderr.strip()}")
    manifest = json.loads((index / "manifest.json").read_text())
    manifest["encoder"] = json.loads((tiny / "manifest.json").read_text())["encoder"]
    if "checksum" in manifest:  # manifests carry their own checksum (schema 2): seal the graft as the library does
        content = {key: value for key, value in manifest.items() if key != "checksum"}
        manifest["checksum"] = hashlib.sha256(
            json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
    (index / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="documents in the flat index")
    ap.add_argument("--index", type=Path, default=None, help="search this index directory instead (e.g. real text)")
    ap.add_argument("--code", type=Path, default=benchlib.REPO, help="checkout whose `retrieval` is timed")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="of the grafted encoder")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/retrieval-oneshot"), help="scratch, not in the repo")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark
    info = benchlib.machine()
    work = args.work / args.label.replace(" ", "-")
    work.mkdir(parents=True, exist_ok=True)
    index = args.index.resolve() if args.index else build(args.code, work, args.n, args.precision)
    n = json.loads((index / "manifest.json").read_text())["index"]["ntotal"]
    command = ["search", QUERY, "--index", str(index), "-k", "5"]
    warm = cli(args.code, *command)
    if warm.returncode:
        raise SystemExit(f"search failed: {warm.stderr.strip()}")
    seconds, cpu = [], []
    load = [round(x, 2) for x in os.getloadavg()]
    for _ in range(args.runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = cli(args.code, *command)
        seconds.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)  # user + system
        assert done.returncode == 0, done.stderr
    size = sum(p.stat().st_size for p in index.iterdir() if p.is_file())
    report = {
        "command": benchlib.command_line(),
        "machine": info,
        "label": args.label,
        "code": str(args.code),
        "index": str(index),
        "n": n,
        "encoder_precision": json.loads((index / "manifest.json").read_text())["encoder"].get("precision_used"),
        "index_bytes": size,
        "runs_s": seconds,
        "median_s": statistics.median(seconds),
        "cpu_s": cpu,
        "median_cpu_s": statistics.median(cpu),
        "loadavg_at_start": load,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    out = args.out or benchlib.out_dir("oneshot")
    out.mkdir(parents=True, exist_ok=True)
    name = f"oneshot-{n}-{args.label.replace(' ', '-')}"
    benchlib.write_json(out / f"{name}.json", report)
    line = (
        f"| {args.label} | {n:,} | {size / 2**30:.2f} GiB | {report['median_s']:.2f} s | "
        f"{report['median_cpu_s']:.2f} s | {', '.join(f'{s:.2f}' for s in seconds)} | {load[0]} |"
    )
    header = (
        "| code | N | index on disk | median wall | median CPU | runs (s) | load |\n|---|---|---|---|---|---|---|\n"
    )
    benchlib.write_md(out / f"{name}.md", header + line)
    print(line)


if __name__ == "__main__":
    main()
