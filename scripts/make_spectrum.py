"""Million-row vector corpora with the spectrum of real MiniLM embeddings, for the filtered-search and codes benchmarks.

Encoding a million real passages takes hours on two cores (``scripts/make_realscale.py`` does it when there is
time). This makes rows that keep what approximate search and compressed codes react to, at the cost of a few
minutes: the real documents of every IR set in ../shared/data (SciFact, CISI, CACM, NPL: 21,276 passages) and
their queries are encoded once by all-MiniLM-L6-v2; each of the N rows is then one real document vector plus
Gaussian noise drawn with the covariance of the real vectors (scaled by ``--noise``), so the rows have the real
mean and, up to a factor 1 + noise², the real covariance spectrum, and sit in clumps around real documents as
real near-duplicates and paraphrases do. Queries are the real encoded queries of the same sets (never noised).
Every figure made from these rows says so: they are NOT real-text rows.

    python scripts/make_spectrum.py encode --out DIR      # DIR/docs.npy, DIR/queries.npy (takes the bench lock)
    python scripts/make_spectrum.py encode --out DIR --vectors-from 'indexes/bench/codes/{set}-all-minilm-l6-v2'
        # the documents' vectors read from raw MiniLM indexes of the sets (``bench_codes.py`` builds them):
        # only the queries are encoded (or, with --queries-from indexes/bench, read from basket.py's cache)
    python scripts/make_spectrum.py sample --out DIR --rows 1000000
        # DIR/rows-1000000.parquet: id, vector (384 float32), bucket (int32, uniform 0-999: filters of known share)

DIR is scratch (e.g. under the temporary folder), never the repository.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETS = ("scifact", "cisi", "cacm", "npl")
BLOCK = 100_000


def texts(data: Path) -> tuple[list[str], list[str]]:
    """(documents, queries) of every set: title + " " + text as BEIR does; every query file of the set."""
    docs: list[str] = []
    queries: list[str] = []
    for name in SETS:
        corpus = pq.read_table(data / name / "corpus.parquet", columns=["title", "text"]).to_pydict()
        docs += [f"{t} {x}".strip() for t, x in zip(corpus["title"], corpus["text"], strict=True)]
        for path in sorted((data / name).glob("queries-*.parquet")):
            queries += pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return docs, queries


def stashed(pattern: str) -> np.ndarray:
    """Every set's document vectors from the stash of a raw index of it (``pattern`` with ``{set}``)."""
    from retrieval.indexdir import IndexDir

    blocks = []
    for name in SETS:
        directory = IndexDir(Path(pattern.format(set=name)))
        manifest = directory.manifest()
        if manifest.transform.kind != "raw" or manifest.encoder.model != "all-MiniLM-L6-v2":
            raise SystemExit(f"{directory.path} is not a raw all-MiniLM-L6-v2 index")
        blocks += list(directory.stash().iter_blocks(pooling=manifest.transform.pooling))
    return np.concatenate(blocks).astype(np.float32)


def cached_queries(folder: Path, queries: list[str], model: str) -> np.ndarray:
    """Every set's queries' mean-pooled vectors from ``basket.encode_cached``'s files in ``folder``, checked
    against the texts."""
    blocks, texts = [], []
    for name in SETS:
        for split in ("test", "train"):
            path = folder / f"{name}-queries-{split}-{model.lower()}.npz"
            if path.is_file():
                with np.load(path, allow_pickle=False) as data:
                    blocks.append(data["mean"].astype(np.float32))
                    texts += list(data["texts"])
    if texts != queries:
        raise SystemExit(f"the cached queries in {folder} are not the sets' queries, in order")
    return np.concatenate(blocks)


def encode(args: argparse.Namespace) -> None:
    from retrieval.encode.transformer import TransformerEncoder

    docs, queries = texts(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    work: list[tuple[str, list[str]]] = [("queries", queries)]
    if args.vectors_from:  # read, not encoded: no lock needed
        vectors = stashed(args.vectors_from)
        assert len(vectors) == len(docs), f"the stashes hold {len(vectors)} rows, the sets {len(docs)}"
        np.save(args.out / "docs.npy", vectors)
    else:
        work.append(("docs", docs))
    if args.queries_from:  # the queries' vectors cached by scripts/basket.py (mean pooling): nothing to encode
        np.save(args.out / "queries.npy", cached_queries(args.queries_from, queries, args.model))
        work = [item for item in work if item[0] != "queries"]
    if not work:
        return
    benchlib.hold_bench_lock()
    encoder = TransformerEncoder(args.model)
    for name, batch in work:
        start = time.perf_counter()
        vectors = encoder.encode(batch)
        np.save(args.out / f"{name}.npy", vectors.astype(np.float32))
        print(f"{name}: {len(batch)} texts in {time.perf_counter() - start:.0f} s", flush=True)


def sample(args: argparse.Namespace) -> None:
    real = np.load(args.out / "docs.npy").astype(np.float64)
    rng = np.random.default_rng(args.seed)
    mean = real.mean(axis=0)
    factor = np.linalg.cholesky(np.cov(real, rowvar=False) + 1e-9 * np.eye(real.shape[1]))
    d = real.shape[1]
    path = args.out / f"rows-{args.rows}.parquet"
    schema = pa.schema(
        [("id", pa.string()), ("vector", pa.list_(pa.float32(), d)), ("bucket", pa.int32()), ("source", pa.int32())]
    )
    with pq.ParquetWriter(path, schema) as writer:
        for first in range(0, args.rows, BLOCK):
            n = min(BLOCK, args.rows - first)
            source = rng.integers(0, len(real), n)
            noise = rng.standard_normal((n, d)) @ factor.T
            vectors = (real[source] + args.noise * noise).astype(np.float32)
            columns = {
                "id": pa.array([str(i) for i in range(first, first + n)]),
                "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), d),
                "bucket": pa.array(rng.integers(0, 1000, n), pa.int32()),
                "source": pa.array(source, pa.int32()),
            }
            writer.write_table(pa.table(columns, schema=schema))
    print(f"{path}: {args.rows} rows around {len(real)} real vectors (mean norm {np.linalg.norm(mean):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("encode", "sample"))
    parser.add_argument("--out", type=Path, required=True, help="scratch folder for the vectors")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data", help="the shared IR sets")
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--vectors-from", help="raw MiniLM indexes of the sets, a pattern with {set}")
    parser.add_argument("--queries-from", type=Path, help="a folder of scripts/basket.py's cached query vectors")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--noise", type=float, default=0.5, help="noise scale, in units of the real covariance")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    encode(args) if args.part == "encode" else sample(args)


if __name__ == "__main__":
    main()
