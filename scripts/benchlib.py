"""Shared helpers for the benchmark scripts: the machine, the benchmark lock, timing, peak RSS, JSON + tables.

Every result a script writes through ``write_json`` / ``write_md`` carries its provenance, recorded here and
never typed by hand: the CPU (model, cores, bf16 / VNNI / AMX from the kernel's flags), the git revision and
whether the work tree had uncommitted changes, the load average when the script started and when it wrote, and
the exact command line.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.progress import Timer

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
# The load average when the script started (this module is imported first thing): recorded with every result.
LOADAVG_AT_START = [round(x, 2) for x in os.getloadavg()]
# Benchmarks that time something hold this lock, so two never overlap (one file, named by this variable).
LOCK_ENV = "RETRIEVAL_BENCH_LOCK"
ISA_CAP_ENV = "ONEDNN_MAX_CPU_ISA"  # caps oneDNN's instruction set: how a CPU without bf16 (or AMX) is emulated
# Set while a process holds that lock, so the processes it starts (a script's own workers) do not wait for it.
_HELD_ENV = "RETRIEVAL_BENCH_LOCK_HELD"


# ----- the machine ------------------------------------------------------------------------------------------
# Where benchmarks' `retrieval index` runs record the "last built" index: never the user's own `indexes/`, which a
# bare `retrieval search` would then send to a benchmark's scratch index.
SCRATCH_INDEX_ROOT = str(Path(tempfile.gettempdir()) / "retrieval-bench-root")


def retrieval_env(**extra: str) -> dict[str, str]:
    """The environment for a `python -m retrieval` a benchmark starts: this checkout, the scratch index root."""
    return {**os.environ, "PYTHONPATH": str(REPO), "RETRIEVAL_INDEX_ROOT": SCRATCH_INDEX_ROOT, **extra}


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line of /proc/cpuinfo (None where there is none: not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def _all_cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def _cpu_flags() -> list[str]:
    flags = _all_cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "fma")
    return [f for f in wanted if f in flags]


def cpu() -> dict[str, Any]:
    """What the CPU can do for this project: native bf16 (encoding), VNNI and AMX (int8 / bf16 matrix units)."""
    flags = _all_cpu_flags()
    return {
        "model": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "bf16": bool({"avx512_bf16", "amx_bf16"} & flags),
        "vnni": bool({"avx512_vnni", "avx_vnni"} & flags),
        "amx": bool({"amx_tile", "amx_bf16", "amx_int8"} & flags),
        # oneDNN (torch's bf16 and int8 products) held below the CPU's instruction set: another CPU emulated
        "onednn_isa_cap": os.environ.get(ISA_CAP_ENV) or None,
    }


def git_revision() -> dict[str, Any]:
    """The checkout's commit and whether tracked files differ from it (None: not a git checkout, or no git)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    revision = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if revision else None
    return {"revision": revision, "dirty": None if status is None else bool(status)}


def exact_command() -> str:
    """The command line as it was typed: the interpreter's name, the script as given, every argument (after the
    oneDNN instruction-set cap, where one is set)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    argv[0] = Path(argv[0]).name  # "python3", not the interpreter's absolute path
    return _isa_prefix() + shlex.join(argv)


def _isa_prefix() -> str:
    cap = os.environ.get(ISA_CAP_ENV)
    return f"{ISA_CAP_ENV}={shlex.quote(cap)} " if cap else ""


def provenance() -> dict[str, Any]:
    """Recorded with every result: the CPU, the git revision, the load average at start and now, the command."""
    return {
        "cpu": cpu(),
        "git": git_revision(),
        "loadavg_at_start": LOADAVG_AT_START,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "command": exact_command(),
        "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def provenance_md(record: dict[str, Any]) -> str:
    c, g = record["cpu"], record["git"]
    yes = {True: "yes", False: "no", None: "unknown"}
    if g["revision"] is None:
        revision = "unknown (not a git checkout)"
    else:
        revision = f"`{g['revision'][:12]}`" + (", with uncommitted changes" if g["dirty"] else "")
    return "\n".join(
        [
            "## Provenance",
            "",
            f"- CPU: {c['model']}, {c['cores']} cores ({c['usable_cores']} usable); bf16: {yes[c['bf16']]}, "
            f"VNNI: {yes[c['vnni']]}, AMX: {yes[c['amx']]}"
            + (
                f"; oneDNN capped at {c['onednn_isa_cap']} (a CPU without what lies above it)"
                if c.get("onednn_isa_cap")
                else ""
            ),
            f"- Revision: {revision}",
            f"- Load average (1/5/15 min): {record['loadavg_at_start']} at start, {record['loadavg_at_end']} at end",
            f"- Command: `{record['command']}`",
        ]
    )


# ----- the benchmark lock -----------------------------------------------------------------------------------
def lock_path() -> Path:
    """``$RETRIEVAL_BENCH_LOCK``, else ``retrieval-bench.lock`` in the temporary folder."""
    return Path(os.environ.get(LOCK_ENV) or Path(tempfile.gettempdir()) / "retrieval-bench.lock")


def _lock_inherited(path: Path) -> bool:
    """Whether the lock is already this process's: a parent benchmark holds it for its workers, or the script runs
    under ``flock LOCKFILE python ...`` (which holds it on a descriptor the script inherits)."""
    if os.environ.get(_HELD_ENV) == str(path):
        return True
    try:
        target = os.stat(path)
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.fstat(int(fd))
        except (OSError, ValueError):
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


@contextmanager
def bench_lock(path: Path | None = None) -> Iterator[None]:
    """Hold the benchmark lock (an exclusive ``flock``, as ``flock(1)`` takes it) while timed work runs."""
    path = path or lock_path()
    if _lock_inherited(path):
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for the benchmark lock {path} (another benchmark holds it)", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        os.environ[_HELD_ENV] = str(path)
        try:
            yield
        finally:
            os.environ.pop(_HELD_ENV, None)
            fcntl.flock(handle, fcntl.LOCK_UN)


_HELD = ExitStack()


def hold_bench_lock() -> None:
    """Take the benchmark lock for the rest of this process (a timing script calls it once its arguments parse,
    so ``--help`` or a bad option never waits); the kernel releases it when the process ends."""
    _HELD.enter_context(bench_lock())


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
        "bf16": cpu()["bf16"],
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
    """A result as JSON, with its ``provenance`` (see the module's docstring) added."""
    record = {**data, "provenance": provenance()}
    path.write_text(json.dumps(record, indent=1, default=_json_default) + "\n")


def write_md(path: Path, text: str) -> None:
    """A result as markdown, its provenance as the last section."""
    path.write_text(text.rstrip("\n") + "\n\n" + provenance_md(provenance()) + "\n")


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
    """The command as a reader reruns it from the repository's root (the exact one is in the provenance)."""
    return _isa_prefix() + shlex.join(["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
