"""The real-text index behind the scale, memory and one-shot benchmarks: split the corpus, then encode it once.

``split`` reads the real-text corpus (``scripts/make_corpus.py``: 1.13M English passages, id/title/text/source)
and writes, under ``--data``:

    queries.parquet   held-out rows (never indexed): the scale benchmark's queries, encoded by the same model
    extra.parquet     more held-out rows: what the memory benchmark's ``add`` adds
    chunk-NN.parquet  the rest, in corpus order (sources interleaved, so every prefix is a mix), CHUNK rows each

``encode`` runs the ordinary CLI on them, one process per step, each under ``/usr/bin/time -v`` (its own peak
RSS): ``retrieval index chunk-00`` into ``realtext/``, a hard-linked snapshot of it as ``realtext-100k/``,
then ``retrieval add realtext chunk-NN`` for the next chunks, until ``--until`` rows or the chunks run out.
On a busy machine one process per core encodes faster than one process with two threads (OpenMP's barriers
wait for a descheduled thread): ``--name realtext-b --first-chunk 6`` encodes the later chunks into a second
directory at the same time, and the scale benchmark reads both stashes. Every step is appended to
``encode-log-NAME.json`` (rows, seconds, rows/s, peak RSS, load average), which the
README's encoding rate and the memory table of ``index``/``add`` come from. It stops between steps, so the
directory is always a complete index; run it again to continue.

    python scripts/make_realscale.py split
    nice -n 10 python scripts/make_realscale.py encode --until 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "indexes" / "realtext.parquet"
DATA = REPO / "indexes" / "realscale"
CHUNK = 100_000
QUERIES, EXTRA = 1_000, 4_096
COLUMNS = ["id", "title", "text", "source"]


def split(corpus: Path, data: Path, seed: int = 0) -> None:
    table = pq.read_table(corpus, columns=COLUMNS)
    n = table.num_rows
    rng = np.random.default_rng(seed)
    held = rng.choice(n, QUERIES + EXTRA, replace=False)
    queries, extra = np.sort(held[:QUERIES]), np.sort(held[QUERIES:])
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    data.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.take(queries), data / "queries.parquet")
    pq.write_table(table.take(extra), data / "extra.parquet")
    rest = table.filter(pa.array(keep))
    for number, start in enumerate(range(0, rest.num_rows, CHUNK)):
        pq.write_table(rest.slice(start, CHUNK), data / f"chunk-{number:02d}.parquet", row_group_size=16_384)
    info = {"corpus": str(corpus), "rows": n, "queries": QUERIES, "extra": EXTRA, "indexable": rest.num_rows}
    info |= {"chunk_rows": CHUNK, "chunks": -(-rest.num_rows // CHUNK), "seed": seed}
    (data / "split.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))


def timed(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run ``command`` under /usr/bin/time -v: its wall seconds and its own peak RSS (MiB)."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    assert peak, done.stderr[-2000:]
    return {"seconds": seconds, "peak_rss_mib": int(peak.group(1)) / 1024}


def rows_in(directory: Path) -> int:
    manifest = directory / "manifest.json"
    return json.loads(manifest.read_text())["index"]["ntotal"] if manifest.is_file() else 0


def encode(data: Path, until: int, threads: int, name: str, first_chunk: int) -> None:
    chunks = sorted(data.glob("chunk-*.parquet"))[first_chunk:]
    target, snapshot = data / name, data / f"{name}-100k"
    log_path = data / f"encode-log-{name}.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else []
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    columns = ["--id-column", "id", "--title-column", "title"]
    retrieval = [sys.executable, "-m", "retrieval"]
    done = {entry["chunk"] for entry in log}
    for chunk in chunks:
        if chunk.name in done:
            continue
        before = rows_in(target)
        if before >= until:
            break
        if before == 0:
            command = [*retrieval, "index", str(chunk), "--out", str(target), "--resume"]
            verb = "index"
        else:
            command, verb = [*retrieval, "add", str(target), str(chunk)], "add"
        load = os.getloadavg()[0]
        result = timed(command + columns, env)
        after = rows_in(target)
        entry = {"chunk": chunk.name, "command": verb, "rows_before": before, "rows_after": after}
        entry |= result | {"rows_per_s": (after - before) / result["seconds"], "threads": threads}
        entry |= {"loadavg_start": load, "loadavg_end": os.getloadavg()[0]}
        log.append(entry)
        log_path.write_text(json.dumps(log, indent=1) + "\n")
        print(json.dumps(entry), flush=True)
        if verb == "index" and not snapshot.exists():  # the 100k index, hard-linked: later adds never touch it
            shutil.copytree(target, snapshot, copy_function=os.link)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["split", "encode"])
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--until", type=int, default=1_000_000, help="stop once the index holds this many rows")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 wins on a busy 2-core machine)")
    ap.add_argument("--name", default="realtext", help="index directory under --data (default: %(default)s)")
    ap.add_argument(
        "--first-chunk", type=int, default=0, help="start here: a second directory encodes later chunks in parallel"
    )
    args = ap.parse_args()
    if args.step == "split":
        split(args.corpus, args.data)
    else:
        encode(args.data, args.until, args.threads, args.name, args.first_chunk)


if __name__ == "__main__":
    main()
