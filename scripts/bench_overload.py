"""Backpressure and the OpenAI dialect under load: `retrieval serve` with all-MiniLM-L6-v2 on 127.0.0.1.

Two measurements, each against its own server process, with closed-loop asyncio + aiohttp clients (each sends its
next request when the last is answered; one text per request):

1. /v1/embeddings throughput (texts/s) at 16 clients against 1 client (`--embed-seconds` each, after a warm-up).
2. 256 clients against POST /search for `--seconds`: every answer counted by status; a 429 or 503 must carry
   Retry-After (a client honours it: it waits that long before its next request), anything else that is not a
   200 is an error (5xx, connection reset, timeout); latency percentiles of the accepted (200) requests.

    python scripts/bench_overload.py                      # builds an index of 2,000 SciFact abstracts first
    python scripts/bench_overload.py --index indexes/my-index --seconds 60

Results: results/overload/overload.{json,md}. The index is cached under `--work` (indexes/bench by default). The
script holds the benchmark lock while it runs; servers bind 127.0.0.1 and are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
import pyarrow.parquet as pq
from bench_serve import DATA, Server

CLIENTS_SEARCH = 256


def load_queries(data: Path) -> list[str]:
    """Real queries: SciFact's test claims and STS-B's test sentences."""
    scifact = pq.read_table(data / "scifact" / "queries-test.parquet").column("text").to_pylist()
    sts = pq.read_table(data / "sts" / "stsb-test.parquet").column("sentence1").to_pylist()
    return [q for q in scifact + sts if q and q.strip()]


def build(work: Path, rows: int, data: Path) -> Path:
    """An index of the first ``rows`` SciFact abstracts (title + text), MiniLM 384 -> 128, built by the CLI."""
    index = work / f"overload-scifact-{rows}"
    if (index / "manifest.json").is_file():
        return index
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"overload-scifact-{rows}.parquet"
    table = pq.read_table(data / "scifact" / "corpus.parquet").slice(0, rows)
    pq.write_table(table.rename_columns(["id", "title", "text"]), corpus)
    command = [sys.executable, "-m", "retrieval", "index", str(corpus), "--id-column", "id", "--title-column"]
    command += ["title", "--dim", "128", "--out", str(index)]
    subprocess.run(command, check=True, env=benchlib.retrieval_env())
    return index


async def closed_loop(
    url: str, path: str, bodies: Any, clients: int, seconds: float, seed: int, timeout: float = 30.0
) -> dict[str, Any]:
    """``clients`` closed-loop clients POSTing ``bodies(rng)`` to ``path`` for ``seconds``."""
    import aiohttp

    latencies: list[float] = []
    statuses: dict[str, int] = {}
    missing_retry_after: dict[str, int] = {}
    deadline = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession, rng: random.Random) -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            retry = 0.0
            try:
                async with session.post(url + path, json=bodies(rng)) as response:
                    await response.read()
                    status = str(response.status)
                    if response.status in (429, 503):
                        given = response.headers.get("Retry-After")
                        if given is None:
                            missing_retry_after[status] = missing_retry_after.get(status, 0) + 1
                        retry = float(given or 1)
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                status = type(err).__name__
            if status == "200":
                latencies.append(time.perf_counter() - start)
            statuses[status] = statuses.get(status, 0) + 1
            if retry:
                await asyncio.sleep(min(retry, max(0.0, deadline - time.perf_counter())))

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session, random.Random(seed + i)) for i in range(clients)))
        elapsed = time.perf_counter() - started
    ok = statuses.get("200", 0)
    ms = np.asarray(latencies) * 1000
    refused = sum(n for s, n in statuses.items() if s in ("429", "503"))
    return {
        "clients": clients,
        "seconds": round(elapsed, 2),
        "requests": sum(statuses.values()),
        "ok": ok,
        "refused_with_retry_after": refused - sum(missing_retry_after.values()),
        "errors": sum(statuses.values()) - ok - refused + sum(missing_retry_after.values()),
        "statuses": statuses,
        "missing_retry_after": missing_retry_after,
        "ok_per_s": ok / elapsed,
        "p50_ms": float(np.percentile(ms, 50)) if ok else None,
        "p99_ms": float(np.percentile(ms, 99)) if ok else None,
        "max_ms": float(ms.max()) if ok else None,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }


def embeddings(index: Path, queries: list[str], seconds: float, log: Path) -> dict[str, Any]:
    server = Server(index, log, "--watch-interval", "0")
    try:
        server.wait_ready()
        model = server.get_json("/v1/models")["data"][0]["id"]

        def body(rng: random.Random) -> dict[str, Any]:
            return {"model": model, "input": [rng.choice(queries)]}

        rows = []
        for clients in (1, 16):
            asyncio.run(closed_loop(server.url, "/v1/embeddings", body, clients, 3.0, seed=999))  # warm-up
            loadavg = [round(x, 2) for x in os.getloadavg()]
            row = asyncio.run(closed_loop(server.url, "/v1/embeddings", body, clients, seconds, seed=clients))
            rows.append({**row, "loadavg_start": loadavg})
            print(json.dumps(rows[-1]), file=sys.stderr)
        return {"model": model, "rows": rows, "speedup": rows[1]["ok_per_s"] / rows[0]["ok_per_s"]}
    finally:
        server.stop()


def overload(index: Path, queries: list[str], seconds: float, log: Path) -> dict[str, Any]:
    server = Server(index, log, "--watch-interval", "0")
    try:
        server.wait_ready()

        def body(rng: random.Random) -> dict[str, Any]:
            return {"query": rng.choice(queries), "k": 10}

        asyncio.run(closed_loop(server.url, "/search", body, 16, 3.0, seed=999))  # warm-up
        loadavg = [round(x, 2) for x in os.getloadavg()]
        row = asyncio.run(closed_loop(server.url, "/search", body, CLIENTS_SEARCH, seconds, seed=0))
        info = server.get_json("/info")["server"]
        return {**row, "loadavg_start": loadavg, "limits": info["limits"], "batching": info["batching"]}
    finally:
        server.stop()


def targets(embed: dict[str, Any], load: dict[str, Any]) -> list[dict[str, Any]]:
    one, sixteen = embed["rows"]
    return [
        {
            "target": "/v1/embeddings: 16 clients >= 3x the throughput of 1",
            "measured": f"{embed['speedup']:.2f}x ({sixteen['ok_per_s']:.0f} vs {one['ok_per_s']:.0f} texts/s)",
            "met": embed["speedup"] >= 3,
        },
        {
            "target": f"{CLIENTS_SEARCH} clients: no error but 429/503 with Retry-After",
            "measured": f"{load['errors']} errors, {load['refused_with_retry_after']:,} refused with Retry-After, "
            f"{load['ok']:,} answered, of {load['requests']:,}",
            "met": load["errors"] == 0,
        },
        {
            "target": f"{CLIENTS_SEARCH} clients: p99 of accepted requests <= 250 ms",
            "measured": f"p99 {load['p99_ms']:.0f} ms (p50 {load['p50_ms']:.0f} ms, max {load['max_ms']:.0f} ms)",
            "met": load["p99_ms"] is not None and load["p99_ms"] <= 250,
        },
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=Path, help="an index to serve (default: 2,000 SciFact abstracts, built once)")
    ap.add_argument("--rows", type=int, default=2000, help="SciFact abstracts in the built index")
    ap.add_argument("--work", type=Path, default=benchlib.REPO / "indexes" / "bench")
    ap.add_argument("--data", type=Path, default=DATA, help="the evaluation data (default ../shared/data)")
    ap.add_argument("--seconds", type=float, default=60.0, help=f"the {CLIENTS_SEARCH}-client run")
    ap.add_argument("--embed-seconds", type=float, default=20.0, help="each /v1/embeddings level")
    ap.add_argument("--out", default="overload", help="folder under results/")
    args = ap.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark
    out = benchlib.out_dir(args.out)
    log = Path(tempfile.mkdtemp(prefix="bench-overload-")) / "server.log"  # the servers' output, if one fails
    machine = benchlib.machine(torch_too=False)
    index = args.index or build(args.work, args.rows, args.data)
    queries = load_queries(args.data)
    embed = embeddings(index, queries, args.embed_seconds, log)
    load = overload(index, queries, args.seconds, log)
    rows = targets(embed, load)
    shown = index.resolve().relative_to(benchlib.REPO) if index.resolve().is_relative_to(benchlib.REPO) else index
    record = {"machine": machine, "index": str(shown), "embeddings": embed, "overload": load, "targets": rows}
    benchlib.write_json(out / "overload.json", record)
    cpu = benchlib.cpu()
    text = [
        "# Backpressure and /v1/embeddings under load",
        "",
        f"`{benchlib.command_line()}`",
        "",
        f"CPU: {cpu['model']}, {cpu['cores']} cores (bf16 {cpu['bf16']}, VNNI {cpu['vnni']}, AMX {cpu['amx']}); "
        f"load average at start {machine['loadavg_at_start']}, after the embeddings runs "
        f"{embed['rows'][-1]['loadavg_end']}, after the {CLIENTS_SEARCH}-client run {load['loadavg_end']}.",
        "",
        benchlib.md_table(rows, [("target", "target"), ("measured", "measured"), ("met", "met")]),
        "",
        "/v1/embeddings, one text per request:",
        "",
        benchlib.md_table(
            embed["rows"],
            [("clients", "clients"), ("ok_per_s", "texts/s"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms")]
            + [("errors", "errors")],
        ),
        "",
        f"POST /search, {CLIENTS_SEARCH} clients for {load['seconds']} s: statuses {load['statuses']}.",
    ]
    benchlib.write_md(out / "overload.md", "\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
