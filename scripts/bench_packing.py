"""Packed rows vs padded batches: what packing short texts several to a row saves the encoder, on real text.

Batches of real queries (SciFact test claims and STS-B test sentences: what the server's engine encodes) and a
corpus of short real sentences (STS-B train), all-MiniLM-L6-v2, four ways in the same run, in a fresh random order
each repeat: packed (the default: rows of up to ``shapes.PACK_TOKENS`` tokens, and for many short texts narrower
rows, ``shapes.pack_widths``), packed in rows of ``PACK_TOKENS`` only (``encoder.pack_widths = ()``: the layout
before the narrower rows), padded (``encoder.packing = False``: length-sorted batches, each padded to a length
bucket of its longest text), and one text at a time (the traced single-text path a lone query takes). Reported:
milliseconds per text, median over repeats, and the largest difference between the packed and the padded vectors.

    python scripts/bench_packing.py                   # results/packing/bench_packing.{json,md}
    python scripts/bench_packing.py --repeats 5 --precision fp32
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI python scripts/bench_packing.py --precision int8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

DATA = benchlib.REPO.parent / "shared" / "data"


def queries() -> list[str]:
    scifact = pq.read_table(DATA / "scifact" / "queries-test.parquet").column("text").to_pylist()
    sts = pq.read_table(DATA / "sts" / "stsb-test.parquet").column("sentence1").to_pylist()
    return [q for q in scifact + sts if q and q.strip()]


def sentences(n: int) -> list[str]:
    texts = pq.read_table(DATA / "sts" / "stsb-train.parquet").column("sentence1").to_pylist()
    return [t for t in texts if t and t.strip()][:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--batch-sizes", default="4,16,32")
    ap.add_argument("--sentences", type=int, default=1024, help="STS-B train sentences encoded as one corpus call")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark
    import torch

    from retrieval.encode.shapes import PACK_TOKENS, PACK_WIDTH_TOKENS, PACK_WIDTHS
    from retrieval.encode.spec import EncoderSpec

    torch.set_num_threads(args.threads)
    info = benchlib.machine()
    encoder = EncoderSpec(args.model, precision=args.precision).load()
    encoder.warm_up()
    pool = queries()
    rng = np.random.default_rng(args.seed)

    def timed(texts: list[str], way: str) -> tuple[float, np.ndarray]:
        encoder.packing = way != "padded"
        encoder.pack_widths = () if way == "packed_256" else PACK_WIDTHS
        start = time.perf_counter()
        if way == "singles":
            vectors = np.concatenate([encoder.encode([text]) for text in texts])
        else:
            vectors = encoder.encode(texts)
        seconds = time.perf_counter() - start
        encoder.packing, encoder.pack_widths = True, PACK_WIDTHS
        return seconds * 1000 / len(texts), vectors

    cases = [(f"{b} queries", b) for b in (int(x) for x in args.batch_sizes.split(","))]
    cases.append((f"{args.sentences} STS-B sentences", 0))
    rows = []
    for label, size in cases:
        ways = ["packed", "packed_256", "padded", "singles"] if size else ["packed", "packed_256", "padded"]
        ms: dict[str, list[float]] = {way: [] for way in ways}
        diff = 0.0
        for _ in range(args.repeats if size else max(1, args.repeats // 3)):
            texts = [pool[i] for i in rng.integers(len(pool), size=size)] if size else sentences(args.sentences)
            got = {}
            for way in rng.permutation(ways):
                cost, got[way] = timed(texts, str(way))
                ms[str(way)].append(cost)
            diff = max(diff, float(np.abs(got["packed"] - got["padded"]).max()))
        row = {"case": label, **{f"{w}_ms": statistics.median(v) for w, v in ms.items() if v}, "max_abs_diff": diff}
        row["padded_over_packed"] = row["padded_ms"] / row["packed_ms"]
        row["packed_256_over_packed"] = row["packed_256_ms"] / row["packed_ms"]
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    report = {
        **benchlib.provenance(),
        "machine": info,
        "model": args.model,
        "precision_used": encoder.info().precision_used,
        "threads": args.threads,
        "pack_tokens": PACK_TOKENS,
        "pack_widths": list(PACK_WIDTHS),
        "pack_width_tokens": PACK_WIDTH_TOKENS,
        "rows": rows,
    }
    out = args.out or benchlib.out_dir("packing")
    out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(out / "bench_packing.json", report)
    table = benchlib.md_table(
        rows,
        [
            ("case", "texts"),
            ("packed_ms", "packed ms/text"),
            ("packed_256_ms", f"rows of {PACK_TOKENS} only ms/text"),
            ("padded_ms", "padded ms/text"),
            ("singles_ms", "one at a time ms/text"),
            ("packed_256_over_packed", f"rows of {PACK_TOKENS} only / packed"),
            ("padded_over_packed", "padded / packed"),
            ("max_abs_diff", "max |packed - padded|"),
        ],
    )
    text = (
        f"# Packed rows vs padded batches\n\n{args.model}, {report['precision_used']}, {args.threads} torch "
        f"thread(s); packed rows of up to {PACK_TOKENS} tokens, and of {', '.join(map(str, PACK_WIDTHS))} for "
        f"widths with at least {PACK_WIDTH_TOKENS} tokens of texts.\n\n{table}\n\n{benchlib.provenance_md(report)}\n"
    )
    benchlib.write_md(out / "bench_packing.md", text)
    print(text)


if __name__ == "__main__":
    main()
