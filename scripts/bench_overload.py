"""Backpressure and the OpenAI dialect under load: `retrieval serve` with all-MiniLM-L6-v2 on 127.0.0.1.

Two measurements, each against its own server process, with closed-loop clients (each sends its next request when
the last is answered; one text per request), raw HTTP/1.1 keep-alive over asyncio streams on uvloop:

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


def server_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far, from /proc (0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_timing(value: str) -> dict[str, float]:
    """``Server-Timing: app;dur=1.2, queue;dur=0.3`` -> {"app": 1.2, "queue": 0.3} (ms)."""
    out = {}
    for part in value.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ms = np.asarray(values)
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "mean": float(ms.mean())}


async def closed_loop(
    url: str,
    path: str,
    bodies: Any,
    clients: int,
    seconds: float,
    seed: int,
    timeout: float = 30.0,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """``clients`` closed-loop clients POSTing ``bodies(rng)`` to ``path`` for ``seconds``, each on its own
    HTTP/1.1 keep-alive connection, written and read as raw bytes over asyncio streams: the generator shares the
    server's cores, so it is kept as light as a client can be, and its CPU share is reported. A 429 or 503
    is honoured: the client waits its Retry-After before the next request. For each accepted request the
    answer's Server-Timing splits its time into the server app's (of which queued for the engine and in the
    engine) and what came before the app (the server's event loop, the network, this generator's own loop).
    The generator's and the server's CPU seconds over the run, and this loop's lag (a 10 ms sleep's overshoot),
    say how much of the machine the clients themselves took."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    latencies: list[float] = []
    parts: dict[str, list[float]] = {"before_app": [], "app": [], "queue": [], "engine": [], "app_other": []}
    statuses: dict[str, int] = {}
    missing_retry_after: dict[str, int] = {}
    lags: list[float] = []
    deadline = time.perf_counter() + seconds
    prefix = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n").encode()

    def count(status: str) -> None:
        statuses[status] = statuses.get(status, 0) + 1

    async def client(rng: random.Random) -> None:
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        while time.perf_counter() < deadline:
            body = json.dumps(bodies(rng)).encode()
            request = prefix + b"Content-Length: %d\r\n\r\n" % len(body) + body
            retry = 0.0
            start = time.perf_counter()
            try:
                async with asyncio.timeout(timeout):
                    if writer is None:
                        reader, writer = await asyncio.open_connection(host, int(port))
                    assert reader is not None
                    writer.write(request)
                    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                    headers = {}
                    for line in head[1:]:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                    await reader.readexactly(int(headers.get("content-length", "0")))
                elapsed = time.perf_counter() - start
                status = head[0].split(" ", 2)[1]
                if headers.get("connection", "").lower() == "close":
                    writer.close()
                    reader = writer = None
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as err:
                count(type(err).__name__)
                if writer is not None:
                    writer.close()
                reader = writer = None
                continue
            count(status)
            if status == "200":
                latencies.append(elapsed)
                timing = server_timing(headers.get("server-timing", ""))
                total = elapsed * 1000
                app = timing.get("app", 0.0)
                queue, engine = timing.get("queue", 0.0), timing.get("engine", 0.0)
                parts["before_app"].append(total - app)
                parts["app"].append(app)
                parts["queue"].append(queue)
                parts["engine"].append(engine)
                parts["app_other"].append(app - queue - engine)
            elif status in ("429", "503"):
                given = headers.get("retry-after")
                if given is None:
                    missing_retry_after[status] = missing_retry_after.get(status, 0) + 1
                retry = float(given or 1)
            if retry:
                await asyncio.sleep(min(retry, max(0.0, deadline - time.perf_counter())))
        if writer is not None:
            writer.close()

    async def lag_probe() -> None:
        while time.perf_counter() < deadline:
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append((time.perf_counter() - before - 0.01) * 1000)

    cpu0, server0 = time.process_time(), server_cpu_seconds(server_pid) if server_pid else 0.0
    started = time.perf_counter()
    await asyncio.gather(lag_probe(), *(client(random.Random(seed + i)) for i in range(clients)))
    elapsed = time.perf_counter() - started
    cores = os.cpu_count() or 1
    generator_cpu = time.process_time() - cpu0
    server_cpu = (server_cpu_seconds(server_pid) - server0) if server_pid else None
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
        "where_ms": {name: spread(values) for name, values in parts.items()},  # accepted requests only
        "generator_loop_lag_ms": spread(lags),
        "generator_cpu_share": generator_cpu / (elapsed * cores),  # of all the machine's cores
        "server_cpu_share": None if server_cpu is None else server_cpu / (elapsed * cores),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }


def run(coroutine: Any) -> Any:
    """``asyncio.run`` on uvloop when it is installed (a lighter generator), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


def embeddings(index: Path, queries: list[str], seconds: float, log: Path) -> dict[str, Any]:
    server = Server(index, log, "--watch-interval", "0")
    try:
        server.wait_ready()
        model = server.get_json("/v1/models")["data"][0]["id"]

        def body(rng: random.Random) -> dict[str, Any]:
            return {"model": model, "input": [rng.choice(queries)]}

        rows = []
        for clients in (1, 16):
            run(closed_loop(server.url, "/v1/embeddings", body, clients, 3.0, seed=999))  # warm-up
            loadavg = [round(x, 2) for x in os.getloadavg()]
            pid = server.proc.pid
            row = run(closed_loop(server.url, "/v1/embeddings", body, clients, seconds, seed=clients, server_pid=pid))
            rows.append({**row, "loadavg_start": loadavg})
            print(json.dumps(rows[-1]), file=sys.stderr)
        return {"model": model, "rows": rows, "speedup": rows[1]["ok_per_s"] / rows[0]["ok_per_s"]}
    finally:
        server.stop()


def overload(index: Path, queries: list[str], seconds: float, log: Path, budget: float | None) -> dict[str, Any]:
    options = ["--watch-interval", "0"] + ([] if budget is None else ["--max-queue-ms", str(budget)])
    server = Server(index, log, *options)
    try:
        server.wait_ready()

        def body(rng: random.Random) -> dict[str, Any]:
            return {"query": rng.choice(queries), "k": 10}

        run(closed_loop(server.url, "/search", body, 16, 3.0, seed=999))  # warm-up
        loadavg = [round(x, 2) for x in os.getloadavg()]
        pid = server.proc.pid
        row = run(closed_loop(server.url, "/search", body, CLIENTS_SEARCH, seconds, seed=0, server_pid=pid))
        info = server.get_json("/info")["server"]
        return {
            **row,
            "loadavg_start": loadavg,
            "limits": info["limits"],
            "batching": info["batching"],
            "admission": info["admission"],
        }
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
    ap.add_argument("--max-queue-ms", type=float, help="the server's admission budget (default: its own default)")
    args = ap.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark
    out = benchlib.out_dir(args.out)
    log = Path(tempfile.mkdtemp(prefix="bench-overload-")) / "server.log"  # the servers' output, if one fails
    machine = benchlib.machine(torch_too=False)
    index = args.index or build(args.work, args.rows, args.data)
    queries = load_queries(args.data)
    embed = embeddings(index, queries, args.embed_seconds, log)
    load = overload(index, queries, args.seconds, log, args.max_queue_ms)
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
        f"POST /search, {CLIENTS_SEARCH} clients for {load['seconds']} s: statuses {load['statuses']}; refused "
        f"by the server {load['admission']['refused']} (edge: before the body was read; late: after waiting "
        f"longer than {load['admission']['max_queue_ms']:g} ms); {load['ok_per_s']:.0f} answered a second.",
        "",
        "Where the time of an accepted request went (ms; the parts' percentiles do not add up to the total's):",
        "",
        benchlib.md_table(
            [{"part": "total (client)", "p50": load["p50_ms"], "p99": load["p99_ms"]}]
            + [{"part": part, **spread} for part, spread in load["where_ms"].items()],
            [("part", "part"), ("p50", "p50"), ("p99", "p99"), ("mean", "mean")],
        ),
        "",
        "before_app: the client's measure less the app's (the server's event loop before the request reached the "
        "app, the network, the generator's own loop); app: the server app's time, of which queue (waiting for the "
        "engine) and engine (its batch), app_other the rest (parsing, validation, the answer's JSON).",
        "",
        f"CPU share of the machine's {benchlib.cpu()['cores']} cores over the {CLIENTS_SEARCH}-client run: the "
        f"load generator {load['generator_cpu_share']:.1%} (its loop's lag p99 "
        f"{load['generator_loop_lag_ms']['p99']:.1f} ms), the server {load['server_cpu_share']:.1%}; the rest "
        "was idle or other processes'.",
    ]
    benchlib.write_md(out / "overload.md", "\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
