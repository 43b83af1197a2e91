"""The real-text index behind the scale, memory and one-shot benchmarks: split the corpus, then encode it once.

``split`` reads the real-text corpus (``scripts/make_corpus.py``: 1.13M English passages, id/title/text/source)
and writes, under ``--data``:

    queries.parquet     held-out rows (never indexed): the scale benchmark's queries, encoded by the same model
    extra.parquet       more held-out rows: what the memory benchmark's ``add`` adds
    chunk-NN.parquet    the rest, in corpus order (sources interleaved, so every prefix is a mix), in blocks of
    chunk-NN-P.parquet  100k rows; a block that begins a directory (``--starts``) stays whole, the others are cut
                        into 25k pieces (an ``add`` is atomic: stopping one loses its piece)

``encode`` runs the ordinary CLI on them, one process per step, each under ``/usr/bin/time -v`` (its own peak
RSS): ``retrieval index chunk-00 --resume`` into ``realtext/``, a hard-linked snapshot of it as
``realtext-100k/``, then ``retrieval add realtext chunk-NN-P`` for the next pieces, until ``--until`` rows or
the ``--chunks`` range ends. On a busy machine one process per core encodes faster than one process with two
threads (OpenMP's barriers wait for a descheduled thread), so a second directory encodes the later blocks at
the same time. Every step is appended to ``encode-log-NAME.json`` (rows, seconds, rows/s, peak RSS, load
average). It stops between steps, so each directory is always a complete index; run it again to continue.
``join`` then builds one index directory over both, ``joined/``, replaying their stashed vectors (``Replay``).

    python scripts/make_realscale.py split                  # 1M rows to index: blocks 00-04 and 05-09
    nice -n 10 python scripts/make_realscale.py encode --chunks chunk-00:chunk-05 &
    nice -n 10 python scripts/make_realscale.py encode --chunks chunk-05:chunk-10 --name realtext-b &
    python scripts/make_realscale.py join realtext realtext-b
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "indexes" / "bench" / "realtext.parquet"
DATA = REPO / "indexes" / "realscale"
CHUNK, PIECE = 100_000, 25_000
QUERIES, EXTRA = 1_000, 4_096
COLUMNS = ["id", "title", "text", "source"]


def split(corpus: Path, data: Path, starts: Sequence[int], seed: int = 0) -> None:
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
        block = rest.slice(start, CHUNK)
        if number in starts:  # a directory's first step: one resumable ``index``
            pq.write_table(block, data / f"chunk-{number:02d}.parquet", row_group_size=16_384)
            continue
        for piece, offset in enumerate(range(0, block.num_rows, PIECE)):  # ``add`` steps: atomic, not resumable
            pq.write_table(block.slice(offset, PIECE), data / f"chunk-{number:02d}-{piece}.parquet")
    info = {"corpus": str(corpus), "rows": n, "queries": QUERIES, "extra": EXTRA, "indexable": rest.num_rows}
    info |= {"chunk_rows": CHUNK, "piece_rows": PIECE, "starts": list(starts), "seed": seed}
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


def encode(data: Path, until: int, threads: int, name: str, chunks_range: str) -> None:
    first, _, stop = chunks_range.partition(":")
    chunks = [c for c in sorted(data.glob("chunk-*.parquet")) if c.stem >= first and (not stop or c.stem < stop)]
    target, snapshot = data / name, data / f"{name}-100k"
    log_path = data / f"encode-log-{name}.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else []
    env = benchlib.retrieval_env(HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads))
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


class Replay:
    """An ``Encoder`` that returns the vectors a model already produced for these texts: it reads the encoded
    directories' stashes in row order, one part at a time, and checks every text it is asked for against the
    text stashed with the vector. Its identity is theirs (the same model, pooling and max length)."""

    def __init__(self, directories: Sequence[Path]):
        from retrieval.encode.spec import EncoderInfo
        from retrieval.indexdir import IndexDir

        manifests = [IndexDir(d).manifest() for d in directories]
        if any(m.encoder != manifests[0].encoder for m in manifests):
            raise SystemExit(f"{[str(d) for d in directories]} were not encoded alike")
        self._info: EncoderInfo = manifests[0].encoder
        self._rows = self._stream([IndexDir(d).stash() for d in directories])
        self._vectors = np.zeros((0, self._info.dim), dtype=np.float32)
        self._texts: list[str] = []

    @staticmethod
    def _stream(stashes: Sequence[Any]) -> Iterator[tuple[np.ndarray, list[str]]]:
        for stash in stashes:
            whole_parts = max(part.rows for part in stash.parts)  # one block per part, beside its docs
            for vectors, docs in zip(stash.iter_blocks(whole_parts), stash.iter_docs(), strict=True):
                yield vectors, docs.column("text").to_pylist()

    @property
    def dim(self) -> int:
        return self._info.dim

    def info(self) -> Any:
        return self._info

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        while len(self._texts) < len(texts):
            vectors, stored = next(self._rows)
            self._vectors = np.concatenate([self._vectors, vectors])
            self._texts += stored
        if list(texts) != self._texts[: len(texts)]:
            raise SystemExit("the texts to encode are not the stashed texts, in order")
        n = len(texts)
        out, self._vectors, self._texts = self._vectors[:n], self._vectors[n:], self._texts[n:]
        return out


def join(data: Path, names: Sequence[str]) -> None:
    """``joined/``: one text index over several encoded directories, built by the library's own ``build_index``
    (default transform, flat) from their rows' ids and texts, with a ``Replay`` encoder: nothing is encoded
    twice, and the result is an ordinary index of that model (text queries, ``add``, ``tune``, ``eval ir``)."""
    from retrieval.build import BuildOptions, build_index
    from retrieval.corpus import CorpusSpec
    from retrieval.indexdir import IndexDir

    directories = [data / name for name in names]
    corpus, writer = data / "joined.parquet", None
    for directory in directories:  # ids and texts only (the texts as encoded: title already prepended)
        for docs in IndexDir(directory).stash().iter_docs():
            writer = writer or pq.ParquetWriter(corpus, docs.schema)
            writer.write_table(docs)
    assert writer is not None
    writer.close()
    start = time.perf_counter()
    manifest = build_index(
        CorpusSpec(corpus, id_column="id"), Replay(directories), data / "joined", options=BuildOptions(overwrite=True)
    )
    entry = {"command": "index (replayed vectors)", "rows": manifest.n, "sources": list(names)}
    entry |= {"seconds": time.perf_counter() - start, "peak_rss_mib": peak_rss_mib()}
    (data / "join-log.json").write_text(json.dumps(entry, indent=1) + "\n")
    print(json.dumps(entry))


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["split", "encode", "join"])
    ap.add_argument("names", nargs="*", help="join: the encoded directories under --data, in row order")
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--until", type=int, default=1_000_000, help="stop once the index holds this many rows")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 wins on a busy 2-core machine)")
    ap.add_argument("--name", default="realtext", help="index directory under --data (default: %(default)s)")
    ap.add_argument(
        "--chunks", default="chunk-00:chunk-05", help="FIRST:STOP chunk names (default: %(default)s; STOP excluded)"
    )
    ap.add_argument("--starts", default="0,5", help="split: 100k blocks that begin a directory, kept whole")
    args = ap.parse_args()
    if args.step == "split":
        split(args.corpus, args.data, [int(x) for x in args.starts.split(",")])
    elif args.step == "encode":
        encode(args.data, args.until, args.threads, args.name, args.chunks)
    else:
        join(args.data, args.names)


if __name__ == "__main__":
    main()
