"""Shared helpers for the benchmark scripts: the machine, warm-up + repeated timing, peak RSS, JSON + tables."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.encode.precision import cpu_model
from retrieval.progress import Timer

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"


# ----- the machine ------------------------------------------------------------------------------------------
# Where benchmarks' `retrieval index` runs record the "last built" index: never the user's own `indexes/`, which a
# bare `retrieval search` would then send to a benchmark's scratch index.
SCRATCH_INDEX_ROOT = "/tmp/retrieval-bench-root"


def retrieval_env(**extra: str) -> dict[str, str]:
    """The environment for a `python -m retrieval` a benchmark starts: this checkout, the scratch index root."""
    return {**os.environ, "PYTHONPATH": str(REPO), "RETRIEVAL_INDEX_ROOT": SCRATCH_INDEX_ROOT, **extra}


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "fma")
                return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine(torch_too: bool = False) -> dict[str, Any]:
    """CPU model, cores, memory, BLAS in use, FAISS build, torch threads: what a reader needs to compare."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_flags": _cpu_flags(),
        "mem_gib": _mem_total_gib(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        # other work on the machine while the benchmark ran: ratios within one run stay comparable, absolutes less
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [
            {k: p.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer", "architecture")}
            for p in threadpool_info()
        ]
    except ImportError:
        cfg = np.show_config(mode="dicts") if hasattr(np, "show_config") else {}
        info["blas"] = (cfg or {}).get("Build Dependencies", {}).get("blas", "unknown")
    try:
        import faiss

        info["faiss"] = {
            "version": faiss.__version__,
            "compile_options": faiss.get_compile_options().strip(),
            "omp_threads": faiss.omp_get_max_threads(),
        }
    except ImportError:
        pass
    if torch_too:
        import torch

        info["torch"] = {"version": torch.__version__, "threads": torch.get_num_threads()}
        try:
            import transformers

            info["transformers"] = transformers.__version__
        except ImportError:
            pass
    return info


def print_machine(info: dict[str, Any]) -> None:
    blas = info.get("blas")
    if isinstance(blas, list):
        blas = ", ".join(f"{b['internal_api']} {b['version']} ({b['num_threads']} thr)" for b in blas)
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB, flags {' '.join(info['cpu_flags'])}")
    print(f"         python {info['python']}, numpy {info['numpy']}, BLAS: {blas}")
    if "faiss" in info:
        f = info["faiss"]
        print(f"         faiss {f['version']} [{f['compile_options']}], omp threads {f['omp_threads']}")
    if "torch" in info:
        print(f"         torch {info['torch']['version']}, threads {info['torch']['threads']}")
    sys.stdout.flush()


# ----- timing -----------------------------------------------------------------------------------------------
def repeat(fn: Callable[[], Any], runs: int = 5, warmup: int = 1) -> list[float]:
    """Wall seconds of ``runs`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def percentiles(xs: Sequence[float], qs: Sequence[float] = (50, 99)) -> dict[str, float]:
    arr = np.asarray(xs, dtype=np.float64)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}


class Stopwatch(Timer):
    """``with sw("stage"):`` accumulates wall seconds per stage (the library's build Timer, called directly)."""

    def __call__(self, name: str) -> Any:
        return self.stage(name)


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far: the kernel's high-water mark of its own memory map.

    Not ``getrusage().ru_maxrss``: a process started with fork + exec inherits its parent's peak there, so a
    small worker of a big parent would report the parent's size.
    """
    return _proc_status_mib("VmHWM")


def current_rss_mib() -> float:
    return _proc_status_mib("VmRSS")


def _proc_status_mib(field: str) -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    if field == "VmHWM":  # no /proc (macOS): getrusage, which reports bytes there
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return float("nan")


# ----- output -----------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "-"
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        if a >= 0.01:
            return f"{v:.3f}"
        return f"{v:.2e}"
    return str(v)


def md_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A markdown table; ``columns`` is (key, header) pairs."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def out_dir(name: str, root: Path | None = None) -> Path:
    path = (root or RESULTS) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o))


def machine_md(info: dict[str, Any]) -> str:
    blas = info.get("blas")
    if isinstance(blas, list):
        blas = ", ".join(f"{b['internal_api']} {b['version']} ({b['num_threads']} threads)" for b in blas)
    lines = [
        f"- CPU: {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB RAM, flags: {' '.join(info['cpu_flags'])}",
        f"- Python {info['python']}, numpy {info['numpy']}, BLAS: {blas}",
        f"- Load average at start (1/5/15 min): {info.get('loadavg_at_start')}; other jobs shared the machine",
    ]
    if "faiss" in info:
        f = info["faiss"]
        lines.append(f"- FAISS {f['version']} ({f['compile_options']}), OpenMP threads {f['omp_threads']}")
    if "torch" in info:
        lines.append(f"- torch {info['torch']['version']} ({info['torch']['threads']} threads)")
    return "\n".join(lines)


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
