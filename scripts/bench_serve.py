"""Load test of `retrieval serve` on 127.0.0.1: throughput, latency percentiles, errors and server memory at 1, 4,
16 and 64 concurrent clients (flat and HNSW indexes of 100k real documents, all-MiniLM-L6-v2, 384 -> 128); then
16 clients while `retrieval add` publishes new documents twice. Also the measurements behind the service's
defaults: torch x FAISS threads, engine workers, micro-batch size B x wait T, and how much of the GIL tokenising
holds.

Each phase starts its own server process (`python -m retrieval serve ... --port <free>`), waits for /ready, runs
an asyncio + aiohttp load generator for a fixed time (every client sends one request at a time: a closed loop),
and kills the server at the end. Nothing is sent anywhere but 127.0.0.1; every loop is bounded in time.

    python scripts/bench_serve.py --phases build                     # the indexes, once (cached in --work)
    python scripts/bench_serve.py --phases gil,threads,batching,workers
    python scripts/bench_serve.py --phases load,reload
    python scripts/bench_serve.py --phases report                    # merges the phases' JSON: md + png
    python scripts/bench_serve.py --phases load --kinds flat --code ../old-checkout --out results/serve/before
    # int8 indexes of their own, on a CPU without bf16 (emulated: oneDNN capped below bf16)
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI python scripts/bench_serve.py --precision int8 \
        --phases build,load,reload,report --out results/serve/load-int8-vnni-no-bf16

Queries are real: SciFact test claims and STS-B test sentences. Results go to results/serve/. The script holds the
benchmark lock (``benchlib.bench_lock``) while it runs, so no other benchmark times anything beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
import pyarrow.parquet as pq

DATA = benchlib.REPO.parent / "shared" / "data"
CLIENTS = (1, 4, 16, 64)
RSS_FIELDS = {"rss": "VmRSS", "anon": "RssAnon", "file": "RssFile"}
CODE = benchlib.REPO  # the checkout whose `retrieval serve` runs (--code: an older one, for a before/after)
PHASES = ("build", "gil", "threads", "batching", "workers", "load", "reload", "report")


# ----- the server process ------------------------------------------------------------------------------------
class Server:
    """`python -m retrieval serve` on a free loopback port; ``stop`` sends SIGTERM, then kills if it must."""

    def __init__(self, index: Path, log: Path, *options: str):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        command = [sys.executable, "-m", "retrieval", "serve", str(index), "--port", str(self.port), *options]
        env = {**os.environ, "PYTHONPATH": str(CODE)}
        self.log = log
        with log.open("ab") as out:
            out.write(f"\n$ {' '.join(command)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(command, cwd=CODE, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready in {timeout}s; see {self.log}")

    def rss_mib(self, field: str = "VmRSS") -> float:
        """Resident memory: ``VmRSS`` (all of it), ``RssAnon`` (the process's own heap) or ``RssFile`` (pages of
        memory-mapped files: the index, the stash that re-scoring reads, the docs; page cache the kernel may drop)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def get_json(self, path: str) -> Any:
        import urllib.request

        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def metrics(self) -> dict[str, float]:
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


# ----- the load generator ------------------------------------------------------------------------------------
def load_queries() -> list[str]:
    scifact = pq.read_table(DATA / "scifact" / "queries-test.parquet").column("text").to_pylist()
    sts = pq.read_table(DATA / "sts" / "stsb-test.parquet").column("sentence1").to_pylist()
    return [q for q in scifact + sts if q and q.strip()]


async def _clients(
    url: str, queries: list[str], clients: int, seconds: float, k: int, seed: int, until: Any = None
) -> dict[str, Any]:
    """Closed-loop clients for ``seconds``; with ``until``, on past that until ``until()`` is true (at most 10 min).
    A refused request (429, 503) counts as an error, and its client waits the answer's Retry-After first."""
    import aiohttp

    latencies: list[float] = []
    statuses: dict[str, int] = {}
    began = time.perf_counter()
    deadline = began + seconds

    async def extend() -> None:
        nonlocal deadline
        while until is not None and time.perf_counter() < began + 600:
            if time.perf_counter() >= deadline - 0.5:
                if until():
                    return
                deadline += 1.0
            await asyncio.sleep(0.1)

    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)

    async def client(session: aiohttp.ClientSession, rng: random.Random) -> None:
        while time.perf_counter() < deadline:
            body = {"query": rng.choice(queries), "k": k}
            start = time.perf_counter()
            retry = 0.0
            try:
                async with session.post(url + "/search", json=body) as response:
                    await response.read()
                    status = str(response.status)
                    if response.status in (429, 503):  # as HTTP clients do: wait the Retry-After the refusal gives
                        retry = float(response.headers.get("Retry-After") or 1)
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                status = type(err).__name__
            latencies.append(time.perf_counter() - start) if status == "200" else None
            statuses[status] = statuses.get(status, 0) + 1
            if retry:  # a refused client retrying at once makes thousands of requests a second on the same cores
                await asyncio.sleep(min(retry, max(0.0, deadline - time.perf_counter())))

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        watcher = asyncio.create_task(extend())
        await asyncio.gather(*(client(session, random.Random(seed + i)) for i in range(clients)))
        watcher.cancel()
        elapsed = time.perf_counter() - started
    ok = statuses.get("200", 0)
    ms = np.asarray(latencies) * 1000
    return {
        "clients": clients,
        "seconds": round(elapsed, 2),
        "requests": sum(statuses.values()),
        "ok": ok,
        "errors": sum(statuses.values()) - ok,
        "statuses": statuses,
        "qps": ok / elapsed,
        "p50_ms": float(np.percentile(ms, 50)) if ok else None,
        "p95_ms": float(np.percentile(ms, 95)) if ok else None,
        "p99_ms": float(np.percentile(ms, 99)) if ok else None,
        "max_ms": float(ms.max()) if ok else None,
    }


def drive(
    server: Server, queries: list[str], clients: int, seconds: float, warmup: float = 2.0, until: Any = None
) -> dict[str, Any]:
    """A short unrecorded warm-up at this concurrency, then ``seconds`` of closed-loop clients."""
    if warmup:
        asyncio.run(_clients(server.url, queries, clients, warmup, 10, seed=999))
    before = server.metrics()
    result = asyncio.run(_clients(server.url, queries, clients, seconds, 10, seed=clients, until=until))
    after = server.metrics()
    batches = after.get("retrieval_batch_size_count", 0) - before.get("retrieval_batch_size_count", 0)
    queried = after.get("retrieval_batch_size_sum", 0) - before.get("retrieval_batch_size_sum", 0)
    result["mean_batch"] = queried / batches if batches else None
    result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return result


# ----- phases ------------------------------------------------------------------------------------------------
def sample_corpus(args: argparse.Namespace, n: int = 100_000, added: int = 1_000, seed: int = 0) -> None:
    """The served corpus and the two corpora the reload phase adds: disjoint seeded samples of the real-text
    corpus (``--source``, written by scripts/make_corpus.py), made once unless they exist."""
    adds = [args.work / "serve-add-1.parquet", args.work / "serve-add-2.parquet"]
    if args.corpus.is_file() and all(p.is_file() for p in adds):
        return
    if not args.source.is_file():
        raise SystemExit(f"{args.source} is missing: make it with `python scripts/make_corpus.py` first")
    table = pq.read_table(args.source, columns=["id", "title", "text"])
    rows = np.random.default_rng(seed).choice(table.num_rows, n + 2 * added, replace=False)
    args.work.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.take(np.sort(rows[:n])), args.corpus)
    for i, path in enumerate(adds):
        pq.write_table(table.take(np.sort(rows[n + i * added : n + (i + 1) * added])), path)


def index_dir(args: argparse.Namespace, kind: str) -> Path:
    """The index directory of ``kind`` (flat, hnsw, reload) for ``--precision``: the library's default precision
    in ``serve-KIND``, another in ``serve-KIND-PRECISION``."""
    return args.work / (f"serve-{kind}" if args.precision == "auto" else f"serve-{kind}-{args.precision}")


def build(args: argparse.Namespace) -> dict[str, Any]:
    """The flat index (encoded once) and an HNSW index refitted from its stash (no re-encoding)."""
    flat, hnsw = index_dir(args, "flat"), index_dir(args, "hnsw")
    sample_corpus(args)
    run = [sys.executable, "-m", "retrieval"]
    env = benchlib.retrieval_env()
    timings = {}
    if not (flat / "manifest.json").is_file():
        start = time.perf_counter()
        subprocess.run(
            [*run, "index", str(args.corpus), "--id-column", "id", "--title-column", "title"]
            + ["--dim", "128", "--precision", args.precision, "--out", str(flat)],
            check=True,
            env=env,
        )
        timings["flat_s"] = time.perf_counter() - start
    if not (hnsw / "manifest.json").is_file():
        start = time.perf_counter()
        tmp = hnsw.with_name(hnsw.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(flat, tmp)
        subprocess.run([*run, "refit", str(tmp), "--index-type", "hnsw"], check=True, env=env)
        tmp.rename(hnsw)
        timings["hnsw_s"] = time.perf_counter() - start
    return {"flat": os.path.relpath(flat, benchlib.REPO), "hnsw": os.path.relpath(hnsw, benchlib.REPO), **timings}


def gil(args: argparse.Namespace) -> dict[str, Any]:
    """How much a pure-Python thread (the event loop, in the server) is slowed by each stage of a batch running
    in another thread: tokenising holds the GIL; the forward pass and FAISS release it."""
    from retrieval.search import Searcher, SearchParams
    from retrieval.serve.service import set_torch_threads

    set_torch_threads(1)
    searcher = Searcher.load(index_dir(args, "flat"), verify="none")
    searcher.warm_up()
    encoder: Any = searcher.encoder
    batch = load_queries()[:32]
    raw = searcher.encode(batch)

    def tokenise() -> None:
        encoder.tokenizer(batch, truncation=True, max_length=encoder.max_length)

    stages = {
        "tokenise 32": tokenise,
        "encode 32 (tokenise + forward)": lambda: searcher.encode(batch),
        "search 32 (transform + FAISS + hits)": lambda: searcher.search_vectors(raw, SearchParams(k=10)),
    }
    seconds = {name: float(np.median(benchlib.repeat(fn, runs=15, warmup=2))) for name, fn in stages.items()}

    def ticks(duration: float) -> float:
        n, end = 0, time.perf_counter() + duration
        while time.perf_counter() < end:
            n += 1
        return n / duration

    alone = float(np.median([ticks(1.0) for _ in range(3)]))
    slowdown = {}
    for name, fn in stages.items():
        stop = threading.Event()

        def loop(fn: Any = fn, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                fn()

        worker = threading.Thread(target=loop)
        worker.start()
        time.sleep(0.2)
        rate = float(np.median([ticks(1.0) for _ in range(3)]))
        stop.set()
        worker.join()
        slowdown[name] = rate / alone
    return {
        "batch": len(batch),
        "stage_ms": {k: v * 1000 for k, v in seconds.items()},
        "tokenise_share_of_encode": seconds["tokenise 32"] / seconds["encode 32 (tokenise + forward)"],
        "python_thread_speed_while_running": slowdown,
        "torch_threads": 1,
    }


def sweep(args: argparse.Namespace, configs: list[dict[str, Any]], log: Path) -> list[dict[str, Any]]:
    queries = load_queries()
    rows = []
    for config in configs:
        options = [f"--{key.replace('_', '-')}={value}" for key, value in config["server"].items()]
        server = Server(index_dir(args, args.sweep_kind), log, "--watch-interval", "0", *options)
        try:
            server.wait_ready()
            for clients in config["clients"]:
                result = drive(server, queries, clients, args.sweep_seconds)
                rows.append({"kind": args.sweep_kind, **config["server"], **result})
                print(json.dumps(rows[-1]), file=sys.stderr)
        finally:
            server.stop()
    return rows


def threads(args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """torch threads 1, 2 and auto (the engine measures), FAISS threads 1 and 2."""
    configs = [
        {"server": {"torch_threads": t, "faiss_threads": f}, "clients": [1, 16]}
        for t, f in ((1, 1), (2, 1), ("auto", 1), (1, 2))
    ]
    return {"seconds_each": args.sweep_seconds, "hogs": args.hogs, "rows": sweep(args, configs, log)}


class Hogs:
    """``n`` busy-looping processes at normal priority while a phase runs: the shared machine's other jobs,
    reproducibly. Stopped (killed) on leaving, whatever happened."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Hogs:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def batching(args: argparse.Namespace, log: Path) -> dict[str, Any]:
    one = {"torch_threads": 1}  # what the table says it measured: one torch thread, whatever the default
    configs = [{"server": {"max_batch": b, "max_wait_ms": 0, **one}, "clients": [16, 64]} for b in (1, 8, 32, 64)]
    configs += [{"server": {"max_batch": 32, "max_wait_ms": t, **one}, "clients": [1, 16]} for t in (2, 10)]
    return {"seconds_each": args.sweep_seconds, "rows": sweep(args, configs, log)}


def workers(args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """Engine workers (batches processed at once), each with one torch and one FAISS thread (torch threads auto,
    the default, takes one worker only)."""
    configs = [{"server": {"engine_workers": w, "torch_threads": 1}, "clients": [1, 16]} for w in (1, 2)]
    return {"seconds_each": args.sweep_seconds, "rows": sweep(args, configs, log)}


def load(args: argparse.Namespace, log: Path) -> dict[str, Any]:
    queries = load_queries()
    out: dict[str, Any] = {"seconds_each": args.seconds, "kinds": {}}
    for kind in args.kinds.split(","):
        server = Server(index_dir(args, kind), log, "--watch-interval", "0")
        try:
            server.wait_ready()
            rss_start, anon_start = server.rss_mib(), server.rss_mib("RssAnon")
            rows = []
            for clients in args.clients:
                before = server.rss_mib()
                result = drive(server, queries, clients, args.seconds)
                after = {f"{name}_end_mib": server.rss_mib(field) for name, field in RSS_FIELDS.items()}
                rows.append({"kind": kind, **result, "rss_start_mib": before, **after})
                print(json.dumps(rows[-1]), file=sys.stderr)
            info = server.get_json("/info")
            out["kinds"][kind] = {
                "rows": rows,
                "rss_start_mib": rss_start,
                "rss_end_mib": server.rss_mib(),
                "anon_start_mib": anon_start,
                "anon_end_mib": server.rss_mib("RssAnon"),
                "index": {
                    k: info["index"][k]
                    for k in ("n", "d", "dim", "index_kind", "factory", "model", "precision", "default_mode")
                },
                "server": info["server"]["batching"] | info["server"]["threads"],
            }
        finally:
            out["kinds"].setdefault(kind, {})["exit_code"] = server.stop()
    return out


def reload(args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """16 clients while `retrieval add` publishes twice (at 10 s and 30 s, or when the first is done): at least
    ``seconds``, and on until the server serves the second publish plus 5 s; then added documents are looked up."""
    index = index_dir(args, "reload")
    shutil.rmtree(index, ignore_errors=True)
    shutil.copytree(index_dir(args, "flat"), index)
    adds = [args.work / "serve-add-1.parquet", args.work / "serve-add-2.parquet"]
    queries = load_queries()
    server = Server(index, log, "--watch-interval", "1")
    events: list[dict[str, Any]] = []
    try:
        server.wait_ready()
        first = server.get_json("/ready")["generation"]  # the copied index's own (a refit or add made it > 1)
        rss_start = server.rss_mib()
        env = {**os.environ, "PYTHONPATH": str(benchlib.REPO)}

        def publisher() -> None:
            start = time.perf_counter()
            for i, corpus in enumerate(adds):
                time.sleep(max(0.0, start + 10 + 20 * i - time.perf_counter()))  # at 10 s and 30 s
                begun = time.perf_counter() - start
                done = subprocess.run(
                    [sys.executable, "-m", "retrieval", "add", str(index), str(corpus), "--id-column", "id"]
                    + ["--title-column", "title"],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                events.append(
                    {
                        "add": corpus.name,
                        "started_s": begun,
                        "ended_s": time.perf_counter() - start,
                        "rc": done.returncode,
                    }
                )
                if done.returncode:
                    events[-1]["stderr"] = done.stderr[-2000:]

        thread = threading.Thread(target=publisher)
        thread.start()
        served: dict[str, float] = {}

        def second_publish_served() -> bool:
            if len(events) < len(adds):
                return False
            if server.get_json("/ready").get("generation") != first + len(adds):
                return False
            served.setdefault("at", time.monotonic())
            return time.monotonic() - served["at"] >= 5.0

        result = drive(server, queries, 16, args.seconds, warmup=0, until=second_publish_served)
        thread.join(600)
        deadline = time.monotonic() + 60
        while server.get_json("/ready").get("generation") != first + len(adds) and time.monotonic() < deadline:
            time.sleep(0.5)
        info = server.get_json("/info")
        found = found_after(server, adds)
        return {
            "clients": 16,
            **result,
            "publishes": events,
            "generation_before": first,
            "generation_after": info["index"]["generation"],
            "n_after": info["index"]["n"],
            "loads": info["server"]["loads"],
            "last_reload_error": info["server"]["last_reload_error"],
            "found": found,
            "rss_start_mib": rss_start,
            "rss_end_mib": server.rss_mib(),
        }
    finally:
        server.stop()


def found_after(server: Server, adds: list[Path], per_file: int = 100) -> dict[str, Any]:
    """Each added document's own text as a query: is it the top hit, or in the top 10 (near-duplicates may
    outrank it)?"""
    import urllib.request

    top1 = top10 = total = 0
    for corpus in adds:
        table = pq.read_table(corpus).slice(0, per_file)
        ids, titles, texts = (table.column(c).to_pylist() for c in ("id", "title", "text"))
        for doc_id, title, text in zip(ids, titles, texts, strict=True):
            query = (f"{title}\n\n{text}" if title else text)[:2000]
            body = json.dumps({"query": query, "k": 10}).encode()
            request = urllib.request.Request(
                server.url + "/search", body, {"Content-Type": "application/json"}, method="POST"
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                hits = json.loads(response.read())["results"][0]["hits"]
            got = [h["id"] for h in hits]
            top1 += bool(got) and got[0] == doc_id
            top10 += doc_id in got
            total += 1
    return {"queries": total, "top1": top1 / total, "top10": top10 / total}


# ----- report ------------------------------------------------------------------------------------------------
def report(out: Path) -> None:
    parts = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("phase-*.json"))}
    merged = {name.removeprefix("phase-"): part for name, part in parts.items()}
    benchlib.write_json(out / "bench_serve.json", merged)
    lines = ["# `retrieval serve` under load", ""]
    if "load" in merged:
        load_part = merged["load"]["result"]
        lines += [
            f"Command: `{merged['load']['command']}`; machine: {merged['load']['machine']['cpu']}, "
            f"{merged['load']['machine']['cores']} cores; load average at start "
            f"{merged['load']['machine']['loadavg_at_start']}, at end {merged['load']['loadavg_at_end']}.",
            "",
        ]
        for kind, part in load_part["kinds"].items():
            served = part.get("index") or {}
            if served:
                lines += [
                    f"- {kind}: {served['n']:,} documents, {served['d']} -> {served['dim']} dims, encoder "
                    f"{served['model']} in {served['precision']}, searches in {served['default_mode']} mode"
                ]
        lines += [""]
        rows = [row for kind in load_part["kinds"].values() for row in kind.get("rows", [])]
        lines += [
            benchlib.md_table(
                rows,
                [
                    ("kind", "index"),
                    ("clients", "clients"),
                    ("qps", "QPS"),
                    ("p50_ms", "p50 ms"),
                    ("p95_ms", "p95 ms"),
                    ("p99_ms", "p99 ms"),
                    ("errors", "errors"),
                    ("mean_batch", "mean batch"),
                    ("rss_start_mib", "RSS start MiB"),
                    ("rss_end_mib", "RSS end MiB"),
                    ("anon_end_mib", "of it anon MiB"),
                    ("file_end_mib", "of it mapped files MiB"),
                    ("loadavg", "load avg"),
                ],
            ),
            "",
        ]
        lines += [
            "## Targets",
            "",
            benchlib.md_table(targets(merged), [("target", "target"), ("measured", "measured"), ("met", "met")]),
            "",
        ]
    if "reload" in merged:
        r = merged["reload"]["result"]
        published = ", ".join(
            "{} at {:.0f}-{:.0f} s".format(e["add"], e["started_s"], e["ended_s"]) for e in r["publishes"]
        )
        lines += [
            "## Reload under load",
            "",
            f"16 clients for {r['seconds']} s while `retrieval add` published twice ({published}): "
            f"{r['ok']} requests answered, {r['errors']} errors, {r['qps']:.0f} QPS, p50 {r['p50_ms']:.1f} ms, "
            f"p99 {r['p99_ms']:.1f} ms; generation after {r['generation_after']}, {r['n_after']:,} documents; "
            f"added documents found by their own text: top-1 {r['found']['top1']:.1%}, top-10 "
            f"{r['found']['top10']:.1%} ({r['found']['queries']} queried).",
            "",
        ]
    latency = [("clients", "clients"), ("qps", "QPS"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms")]
    sweeps = {  # rows from before --sweep-kind have no "kind": they served the flat index
        "threads": (
            "torch x FAISS threads (B 32, T 0; torch auto: the engine measures)",
            [("kind", "index"), ("torch_threads", "torch"), ("faiss_threads", "FAISS"), *latency, ("max_ms", "max ms")],
        ),
        "workers": (
            "Engine workers (B 32, T 0, 1 torch and 1 FAISS thread each)",
            [("kind", "index"), ("engine_workers", "workers"), *latency, ("mean_batch", "mean batch")],
        ),
        "batching": (
            "Micro-batch size B x wait T (1 torch thread, 1 FAISS thread)",
            [("kind", "index"), ("max_batch", "B"), ("max_wait_ms", "T ms"), *latency, ("mean_batch", "mean batch")],
        ),
    }
    for phase, (title, columns) in sweeps.items():
        if phase in merged:
            table = benchlib.md_table(
                merged[phase]["result"]["rows"], [*columns, ("errors", "errors"), ("loadavg", "load avg")]
            )
            hogs = merged[phase]["result"].get("hogs")
            beside = f" ({hogs} busy processes beside the server)" if hogs else ""
            lines += [f"## {title}{beside}", "", table, ""]
    if "gil" in merged:
        g = merged["gil"]["result"]
        lines += [
            "## The GIL",
            "",
            f"One batch of {g['batch']} real queries, 1 torch thread: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in g["stage_ms"].items())
            + f"; tokenising is {g['tokenise_share_of_encode']:.0%} of encoding. Speed of a pure-Python thread "
            "(the event loop) while each stage runs in a loop in another thread: "
            + ", ".join(f"{k} {v:.0%}" for k, v in g["python_thread_speed_while_running"].items())
            + ".",
            "",
        ]
    benchlib.write_md(out / "bench_serve.md", "\n".join(lines))
    print("\n".join(lines))
    plot(merged, out / "bench_serve.png")


def targets(merged: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    kinds = merged["load"]["result"]["kinds"]
    for kind, part in kinds.items():
        by = {row["clients"]: row for row in part.get("rows", [])}
        if 1 in by and 16 in by:
            ratio = by[16]["qps"] / by[1]["qps"]
            rows.append(
                {
                    "target": f"{kind}: QPS at 16 clients >= 3x 1 client",
                    "measured": f"{ratio:.2f}x ({by[16]['qps']:.0f} vs {by[1]['qps']:.0f})",
                    "met": ratio >= 3,
                }
            )
            rows.append(
                {
                    "target": f"{kind}: p99 at 16 clients <= 100 ms",
                    "measured": f"{by[16]['p99_ms']:.1f} ms",
                    "met": by[16]["p99_ms"] <= 100,
                }
            )
        if 64 in by:
            rows.append(
                {
                    "target": f"{kind}: 64 clients, zero errors",
                    "measured": f"{by[64]['errors']} errors in {by[64]['requests']:,}",
                    "met": by[64]["errors"] == 0,
                }
            )
        growth = part["rss_end_mib"] / part["rss_start_mib"] - 1
        measured = f"{growth:+.1%} ({part['rss_start_mib']:.0f} -> {part['rss_end_mib']:.0f} MiB)"
        if "anon_start_mib" in part:
            anon = part["anon_end_mib"] / part["anon_start_mib"] - 1
            measured += (
                f"; of it the process's own memory (RssAnon) {anon:+.1%} ({part['anon_start_mib']:.0f} -> "
                f"{part['anon_end_mib']:.0f} MiB), the rest pages of mapped files"
            )
        rows.append({"target": f"{kind}: RSS growth < 10% over the run", "measured": measured, "met": growth < 0.10})
    if "reload" in merged:
        r = merged["reload"]["result"]
        rows.append(
            {
                "target": "zero errors across two reloads (16 clients)",
                "measured": f"{r['errors']} errors in {r['requests']:,}; generation {r['generation_after']}",
                "met": r["errors"] == 0 and r["generation_after"] == r.get("generation_before", 1) + 2,
            }
        )
        rows.append(
            {
                "target": "new documents found after",
                "measured": f"top-10 {r['found']['top10']:.0%}, top-1 {r['found']['top1']:.0%}",
                "met": r["found"]["top10"] >= 0.99,
            }
        )
    return rows


def plot(merged: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if "load" not in merged:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, part in merged["load"]["result"]["kinds"].items():
        rows = part.get("rows", [])
        x = [r["clients"] for r in rows]
        left.plot(x, [r["qps"] for r in rows], marker="o", label=kind)
        right.plot(x, [r["p99_ms"] for r in rows], marker="o", label=f"{kind} p99")
        right.plot(x, [r["p50_ms"] for r in rows], marker=".", linestyle="--", label=f"{kind} p50")
    right.axhline(100, color="grey", linestyle=":", label="p99 target (16 clients)")
    for ax, label in ((left, "requests/s"), (right, "latency ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
    left.set_title("throughput (100k docs, MiniLM 384 -> 128)")
    right.set_title("latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--corpus", type=Path, default=benchlib.REPO / "indexes" / "bench" / "serve-100k.parquet")
    ap.add_argument("--work", type=Path, default=benchlib.REPO / "indexes" / "bench")
    ap.add_argument(
        "--source",
        type=Path,
        default=benchlib.REPO / "indexes" / "bench" / "realtext.parquet",
        help="the real-text corpus the served 100k and the added documents are sampled from (scripts/make_corpus.py)",
    )
    ap.add_argument("--seconds", type=float, default=60.0, help="each load level and the reload phase")
    ap.add_argument("--sweep-seconds", type=float, default=12.0, help="each threads / batching configuration")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--kinds", default="flat,hnsw", help="indexes the load phase serves")
    ap.add_argument(
        "--clients",
        type=lambda text: [int(n) for n in text.split(",")],
        default=list(CLIENTS),
        help="the load phase's concurrency levels (default 1,4,16,64; the targets need 1, 16 and 64)",
    )
    ap.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "fp32", "bf16", "int8"),
        help="the served indexes' encoder precision (`retrieval index --precision`); not auto: indexes of their own",
    )
    ap.add_argument("--sweep-kind", default="flat", choices=("flat", "hnsw"), help="index the sweeps serve")
    ap.add_argument("--code", type=Path, default=None, help="run this checkout's server (default: this one)")
    ap.add_argument("--hogs", type=int, default=0, help="busy processes competing for the cores during each phase")
    args = ap.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark
    if args.code is not None:
        global CODE
        CODE = args.code.resolve()
    out = args.out or benchlib.out_dir("serve")
    out.mkdir(parents=True, exist_ok=True)
    log = out / "raw" / "server.log"
    log.parent.mkdir(exist_ok=True)
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    for phase in phases:
        if phase == "report":
            report(out)
            continue
        info = benchlib.machine(torch_too=False)
        print(f"== {phase} (load average {info['loadavg_at_start']})", file=sys.stderr)
        runner = {
            "build": lambda: build(args),
            "gil": lambda: gil(args),
            "threads": lambda: threads(args, log),
            "batching": lambda: batching(args, log),
            "workers": lambda: workers(args, log),
            "load": lambda: load(args, log),
            "reload": lambda: reload(args, log),
        }[phase]
        with Hogs(args.hogs):
            result = runner()
        part = {
            "command": benchlib.command_line(),
            "machine": info,
            "result": result,
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        }
        benchlib.write_json(out / f"phase-{phase}.json", part)


if __name__ == "__main__":
    main()
