"""Distributed indexing: texts/s of a build on the local engine vs on Ray, on one machine, MiniLM on SciFact.

Every build runs in a child process of its own (a fresh interpreter; for Ray a fresh local cluster started by
the engine, as ``retrieval index --engine ray`` does), so its wall time is everything a user waits for and its
memory is its own: the parent samples the PSS of the child's whole process tree (for Ray: driver, GCS, raylet,
agents and workers) every 0.25 s. Variants, interleaved round-robin so background load hits each alike:

    local-2048   the local engine, its default windows of 2,048 rows (one process, torch on every core)
    ray-512      the Ray engine: 2 actors x 0.5 CPU x 1 torch thread, windows of 512 rows
    local-512    the local engine with Ray's windows of 512 rows (isolates the window size)

Precision is fixed for the whole run (``--precision``; by default bf16 on a CPU with native bf16, else fp32) so a
timing decision under load cannot flip one run to the other; a CPU without native bf16 would only emulate it.
Where Ray's extra time goes comes from the engine's own PassStats: cluster start, the validation pass as Ray
tasks, actor start (import torch, load the model), the workers' busy time per window, the tail, adopt
(registering parts and merging moments on the driver) and the metadata returned (mostly m2, 8 d^2 bytes/window).

    python scripts/bench_distributed.py                                # full run (~10 min on 2 idle cores)
    python scripts/bench_distributed.py --rows 600 --repeats 1         # smoke run

It holds the benchmark lock (``benchlib.bench_lock``) while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

from retrieval.encode.precision import cpu_supports_bf16  # noqa: E402

HERE = Path(__file__).resolve()
SCIFACT = benchlib.REPO.parent / "shared" / "data" / "scifact" / "corpus.parquet"
VARIANTS = {"local-2048": ("local", 2048), "ray-512": ("ray", 512), "local-512": ("local", 512)}
MODEL = "all-MiniLM-L6-v2"
WORKERS = 2


# ----- memory of a process tree -----------------------------------------------------------------------------
def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc/*/stat parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def tree_pss_mib(root: int) -> float:
    """Proportional set size of the tree: shared pages (torch's libraries in every worker) counted once."""
    total = 0
    for pid in descendants(root):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total / 1024


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process itself has used (not its children's)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PeakPss(threading.Thread):
    """Samples a process tree until stopped: the peak of its PSS, and each process's CPU seconds as last seen
    (Ray's processes are not all waited for by the child, so rusage of children would miss them)."""

    def __init__(self, pid: int, every: float = 0.25):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak = pid, every, 0.0
        self.cpu: dict[int, float] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, tree_pss_mib(self.pid))
            for pid in descendants(self.pid):
                seconds = cpu_seconds(pid)
                if seconds is not None:
                    self.cpu[pid] = max(seconds, self.cpu.get(pid, 0.0))
            self._stop_event.wait(self.every)

    def stop(self) -> float:
        self._stop_event.set()
        self.join()
        return self.peak


# ----- one build, in a child process --------------------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    """Build the corpus once with one engine and print a JSON report on the last line of stdout."""
    import torch

    from retrieval.build import BuildOptions, build_index
    from retrieval.corpus import CorpusSpec
    from retrieval.distributed import RayEngine, RayOptions
    from retrieval.encode.spec import EncoderSpec
    from retrieval.whitening import TransformSpec

    engine_name, window = VARIANTS[args.child]
    corpus = CorpusSpec(args.corpus, id_column="doc_id", title_column="title")
    spec = EncoderSpec(MODEL, precision=args.precision)
    options = BuildOptions(window_rows=window, overwrite=True)
    report: dict[str, Any] = {"variant": args.child, "engine": engine_name, "window_rows": window}
    began = time.perf_counter()
    encoder = spec.load()
    report["driver_model_load_s"] = time.perf_counter() - began
    engine = None
    if engine_name == "ray":
        engine = RayEngine(spec, RayOptions(workers=WORKERS))
        started = time.perf_counter()
        engine.connect()  # starts the local Ray
        report["ray_start_s"] = time.perf_counter() - started
        report["ray_idle_pss_mib"] = tree_pss_mib(os.getpid())
    manifest = build_index(corpus, encoder, args.out, TransformSpec(dim=128), options=options, engine=engine)
    if engine is not None:
        stopping = time.perf_counter()
        report["stats"] = engine.stats.to_dict()
        engine.close()
        report["ray_shutdown_s"] = time.perf_counter() - stopping
    report["wall_s"] = time.perf_counter() - began
    report["rows"] = manifest.n
    report["timings"] = manifest.timings
    report["precision_used"] = manifest.encoder.precision_used
    report["driver_torch_threads"] = torch.get_num_threads()
    print(json.dumps(report))


def run_child(variant: str, corpus: Path, out: Path, precision: str) -> dict[str, Any]:
    env = {**os.environ, "TMPDIR": "/tmp"}
    command = [sys.executable, str(HERE), "--child", variant, "--corpus", str(corpus), "--out", str(out)]
    command += ["--precision", precision]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = PeakPss(process.pid)
    sampler.start()
    stdout, stderr = process.communicate()
    peak = sampler.stop()
    if process.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{stderr[-3000:]}")
    report = json.loads(stdout.strip().splitlines()[-1])
    report["peak_pss_mib"] = peak
    # CPU seconds of every process of the tree (Ray's cluster processes and workers included), as last sampled:
    # less sensitive to other work on the machine than wall time, which counts only the cores we were given
    report["cpu_s"] = sum(sampler.cpu.values())
    return report


# ----- the comparison -----------------------------------------------------------------------------------------
def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: medians over repeats."""
    rows = []
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        if not mine:
            continue

        def med(f: Any, mine: list[dict[str, Any]] = mine) -> float:
            return benchlib.median([f(r) for r in mine])

        row: dict[str, Any] = {
            "variant": variant,
            "runs": len(mine),
            "rows": mine[0]["rows"],
            "wall_s": med(lambda r: r["wall_s"]),
            "encode_s": med(lambda r: r["timings"]["encode"]),
            "validate_s": med(lambda r: r["timings"]["validate"]),
            "peak_pss_mib": med(lambda r: r["peak_pss_mib"]),
            "cpu_s": med(lambda r: r["cpu_s"]),
        }
        row["texts_per_cpu_s"] = row["rows"] / row["cpu_s"]
        row["texts_per_s"] = row["rows"] / row["wall_s"]
        row["encode_texts_per_s"] = row["rows"] / row["encode_s"]
        if "stats" in mine[0]:
            s = [r["stats"] for r in mine]
            row["ray_start_s"] = med(lambda r: r["ray_start_s"])
            row["ray_shutdown_s"] = med(lambda r: r["ray_shutdown_s"])
            row["ray_idle_pss_mib"] = med(lambda r: r["ray_idle_pss_mib"])
            row["actor_init_s"] = benchlib.median([max(x["actor_init_s"].values()) for x in s])
            row["first_window_s"] = benchlib.median([x["first_window_s"] for x in s])
            busy = [(x["read_s"] + x["encode_s"]) / x["workers"] for x in s]
            row["busy_s"] = benchlib.median(busy)  # per worker
            row["busy_texts_per_s"] = row["rows"] / row["busy_s"]
            row["read_s"] = benchlib.median([x["read_s"] for x in s])
            row["adopt_s"] = benchlib.median([x["adopt_s"] for x in s])
            row["returned_mib"] = benchlib.median([x["returned_bytes"] / 2**20 for x in s])
            row["pass_wall_s"] = benchlib.median([x["wall_s"] for x in s])
        rows.append(row)
    return rows


def overheads(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ray's extra seconds over local-2048, by where they go."""
    by = {r["variant"]: r for r in rows}
    if "ray-512" not in by or "local-2048" not in by:
        return {}
    ray, local = by["ray-512"], by["local-2048"]
    extra = {
        "ray start (ray.init, local cluster)": ray["ray_start_s"],
        "validation as Ray tasks, minus local validation": ray["validate_s"] - local["validate_s"],
        "actor start (import torch, load MiniLM), slowest actor": ray["actor_init_s"],
        "encoding: workers busy, minus the local encode stage": ray["busy_s"] - local["encode_s"],
        "tail, scheduling, adopt (the rest of the encode stage)": ray["encode_s"] - ray["busy_s"] - ray["actor_init_s"],
        "ray shutdown": ray["ray_shutdown_s"],
    }
    extra["total (wall difference)"] = ray["wall_s"] - local["wall_s"]
    extra["unaccounted (fit, index, write, noise)"] = extra["total (wall difference)"] - sum(
        v for k, v in extra.items() if k != "total (wall difference)"
    )
    return extra


def write_results(report: dict[str, Any], folder: Path) -> None:
    benchlib.write_json(folder / "bench_distributed.json", report)
    (folder / "bench_distributed.partial.json").unlink(missing_ok=True)
    rows = report["summary"]
    by = {r["variant"]: r for r in rows}
    lines = [
        "# Distributed indexing: local engine vs Ray",
        "",
        f"`{report['command']}`",
        "",
        f"{report['corpus_rows']:,} SciFact passages (title + text), {MODEL} "
        f"({report.get('precision', 'bf16')}, mean pooling), dim 128, flat; "
        f"{report['repeats']} run(s) per variant interleaved, medians. Machine: {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores; load average {report['machine']['loadavg_at_start']} at start, "
        f"{report['loadavg_at_end']} at end (other work shared the cores).",
        "",
        benchlib.md_table(
            rows,
            [
                ("variant", "variant"),
                ("wall_s", "wall s (model load to exit)"),
                ("texts_per_s", "texts/s end to end"),
                ("encode_s", "encode stage s"),
                ("encode_texts_per_s", "texts/s encode stage"),
                ("busy_texts_per_s", "texts/s while encoding"),
                ("cpu_s", "CPU s (process tree)"),
                ("texts_per_cpu_s", "texts per CPU s"),
                ("peak_pss_mib", "peak PSS MiB (process tree)"),
            ],
        ),
        "",
    ]
    if "ray-512" in by and "local-2048" in by:
        ray, local = by["ray-512"], by["local-2048"]
        lines += [
            f"* **Ray / local throughput**: end to end {ray['texts_per_s'] / local['texts_per_s']:.1%}, encode "
            f"stage {ray['encode_texts_per_s'] / local['encode_texts_per_s']:.1%}, while encoding "
            f"{ray['busy_texts_per_s'] / local['encode_texts_per_s']:.1%}, per CPU second "
            f"{ray['texts_per_cpu_s'] / local['texts_per_cpu_s']:.1%} (target: within 15%, i.e. >= 85%).",
            f"* **Ray start-up**: {ray['ray_start_s']:.1f} s; idle local cluster {ray['ray_idle_pss_mib']:,.0f} MiB "
            f"PSS (driver with MiniLM included); peak {ray['peak_pss_mib']:,.0f} MiB vs local "
            f"{local['peak_pss_mib']:,.0f} MiB: **+{ray['peak_pss_mib'] - local['peak_pss_mib']:,.0f} MiB**.",
            f"* **Returned through the object store**: {ray['returned_mib']:.1f} MiB of metadata (no vectors); "
            f"adopting it on the driver took {ray['adopt_s']:.2f} s.",
            "",
            "Where Ray's extra seconds go (vs local-2048):",
            "",
            "| where | seconds |",
            "|---|---|",
            *[f"| {k} | {v:+.1f} |" for k, v in report["overheads"].items()],
            "",
        ]
    benchlib.write_md(folder / "bench_distributed.md", "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, default=SCIFACT, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help="Use only the first ROWS passages (smoke runs).")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="bf16" if cpu_supports_bf16() else "fp32",
        help="Encoder precision of every run [default: bf16 where the CPU has it natively, else fp32].",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--results", type=Path, default=benchlib.RESULTS / "distributed")
    args = parser.parse_args()
    benchlib.hold_bench_lock()  # timed: never beside another benchmark
    if args.child:
        child(args)
        return
    info = benchlib.machine(torch_too=True)
    benchlib.print_machine(info)
    work = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    try:
        corpus = SCIFACT
        if args.rows:
            corpus = work / "corpus.parquet"
            pq.write_table(pq.read_table(SCIFACT).slice(0, args.rows), corpus)
        rows = pq.read_metadata(corpus).num_rows
        runs: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            for variant in args.variants.split(","):
                report = run_child(variant, corpus, work / variant, args.precision)
                print(
                    f"run {repeat + 1} {variant}: {report['wall_s']:.1f} s, {rows / report['wall_s']:.1f} texts/s, "
                    f"peak PSS {report['peak_pss_mib']:,.0f} MiB",
                    flush=True,
                )
                runs.append(report)
                save(args, info, rows, runs, final=False)  # a run cut short still leaves what it measured
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save(args, info, rows, runs, final=True)


def save(args: argparse.Namespace, info: dict[str, Any], rows: int, runs: list[dict[str, Any]], final: bool) -> None:
    summary = summarise(runs)
    command = benchlib.command_line()
    report = {
        "command": command,
        "complete": final,
        "machine": info,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "corpus_rows": rows,
        "repeats": args.repeats,
        "precision": args.precision,
        "workers": WORKERS,
        "runs": runs,
        "summary": summary,
        "overheads": overheads(summary),
    }
    folder = benchlib.out_dir(args.results.name, args.results.parent)
    if final:
        write_results(report, folder)
    else:
        benchlib.write_json(folder / "bench_distributed.partial.json", report)


if __name__ == "__main__":
    main()
