"""Process tuning: the environment the OpenMP runtimes and oneDNN read once, when torch or FAISS loads. Nothing here
runs on import; the command line and the server call ``tune_process`` first thing, and a library user who wants
the same settings makes that one call before importing torch or FAISS."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

# torch (the encoder) and FAISS (the search) each bring an OpenMP runtime, and both want the same cores. After a
# parallel region libgomp spins 300,000 times by default (~15 ms) before its threads sleep, so a query's scan
# right after its encoding ran at half speed against torch's spinning threads. A short spin keeps both fast
# (flat 100k x 384 encode + scan: 16.6 -> 11 ms p50; batch encoding unchanged within noise).
GOMP_SPINCOUNT = "20000"
# oneDNN (torch's bf16 matrix products) and torch's ideep layer over it each keep an LRU cache of primitives keyed
# by the input's shape (and thread count), 1,024 entries each by default, ~0.5-1 MB an entry with MiniLM. A server
# meets a new shape for every query length and batch width, so its heap grew for the whole load test (flat index,
# bf16 CPU: RssAnon +62%, 523 -> 849 MiB) without serving faster. 64 entries each kept it to +12.5% at the same
# QPS (scripts/bench_serve.py). Builds see a few dozen shapes and keep the default.
ONEDNN_CACHE_ENTRIES = 64
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
# glibc serves an allocation above its mmap threshold (128 KiB at start, raised as large blocks are freed) with a
# fresh mapping, and hands the heap's top back to the kernel once 128 KiB of it is free: every batch's activation
# tensors (MB each) then arrive as new pages, and the first write to each page faults. Int8 layers, whose
# quantising passes write several such tensors per layer, spent more on those faults than on their arithmetic.
# A fixed 32 MiB threshold (the most glibc accepts) and a 256 MiB trim keep them on the heap for reuse: MiniLM,
# oneDNN capped at AVX512_CORE_VNNI, 2 threads, separate processes: int8 STS-B sentences +10%, SciFact passages
# +25%, bf16 sentences +12%, fp32 within noise; peak RSS unchanged within 5%. A 64 MiB trim kept half the gain.
# (Where a process has run long before it times anything, glibc's own threshold has risen and the two are within
# noise: scripts/bench_encode.py against --untuned, docs/benchmarks/encode.md.)
# Set with mallopt (glibc reads MALLOC_*_ only at start) and exported, so that worker processes start the same way.
# Not for a server: its request threads each get an arena of their own, and each arena may keep up to the trim
# threshold of freed memory; that cost has not been measured against its gain there.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": (-3, 32 << 20), "MALLOC_TRIM_THRESHOLD_": (-1, 256 << 20)}


def tune_process(serving: bool = False) -> dict[str, str]:
    """Set the process-wide variables this package is tuned for, unless the environment already sets them (a
    value the user set wins): ``GOMP_SPINCOUNT``, and oneDNN's cache sizes when ``serving``. Each is read once,
    when its library loads, so each is set only before then (GOMP_SPINCOUNT before torch and FAISS, the caches
    before torch); too late, it is left alone and logged. Unless ``serving``, on glibc, also the allocator's mmap
    and trim thresholds (``MALLOC_SETTINGS``), at any time, unless the user tunes malloc. Returns what was set."""
    wanted: dict[str, str] = {} if serving else _tune_allocator()
    if _not_loaded("torch", "faiss", what="the OpenMP spin"):
        wanted["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
    if serving and _not_loaded("torch", what="oneDNN's primitive caches"):
        wanted |= dict.fromkeys(ONEDNN_CACHE_VARIABLES, str(ONEDNN_CACHE_ENTRIES))
    set_now = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(set_now)
    return set_now


def _tune_allocator() -> dict[str, str]:
    """glibc's thresholds set in this process by ``mallopt``; the names and values of the variables that set them
    at start (for the environment of child processes), or {} where the user set one or the C library is not glibc."""
    tuned = any(name.startswith("MALLOC_") for name in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", "")
    if tuned or not _glibc():
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    set_now = {name: str(value) for name, (option, value) in MALLOC_SETTINGS.items() if mallopt(option, value) == 1}
    log.info("glibc allocator: %s", set_now)
    return set_now


def _glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # not a POSIX confstr, or no such name (macOS, Windows, musl)
        return False


def _not_loaded(*modules: str, what: str) -> bool:
    loaded = [name for name in modules if name in sys.modules]
    if loaded:
        log.info("%s imported already: %s keep their settings", " and ".join(loaded), what)
    return not loaded
