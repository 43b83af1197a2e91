"""Pass 1 on a Ray cluster: the corpus's windows checked and encoded by Ray Data workers, merged on the driver.

A build with ``engine=RayEngine(...)`` is an ordinary build (``build.build_index``) whose two corpus passes run
on Ray; the fit, the index, the manifest and the publish stay on the driver, unchanged:

    driver: Corpus(spec)                 files, row groups and windows from the parquet footers (no rows read)
    Ray:    check_units (tasks)          each task reads a range of windows and runs Corpus.check on each;
                                         returns its Tally and 64-bit hashes of its ids
    driver: Tally.add in window order -> Corpus.conclude (the same verdicts and messages as a local build);
            duplicate ids: hashes sorted, any equal pair looked up again by its ids (a collision is no duplicate)
    Ray:    EncodeWindows (actor pool)   the encoder loaded once per actor; per window: Ingest -> a stash part
                                         written under the window's own name (part-00042: a retried task rewrites
                                         the same files), returned as metadata only: the Part record and the
                                         part's float64 moments (n, mean, m2)
    driver: Ingest.adopt, in window order as the windows before complete: registers the parts, merges the
            moments (RunningMoments.merge: exact), so the stash is the one a local build of the same windows
            writes and a killed build resumes from its last registered window, with either engine

Ray does not keep row order; nothing here depends on it. A window (``Corpus`` cuts them from the files' own row
numbers) is both a stash part and the unit a retry or a resume repeats. The workers read their windows from the
files themselves (pyarrow, through ``Corpus``) rather than through ``ray.data.read_parquet``, which does not say
where in its file a row was: it could not cut the local build's windows, number rows by their source position or
give ``<file>:<row>`` ids, and the makeup of its blocks depends on arrival. So the corpus, like the output
folder the workers write the stash into, must be on a filesystem every node sees. Ray Data schedules the tasks
and restarts dead actors (retrying their task); there is no scheduler or queue of our own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retrieval import errors
from retrieval.corpus import Corpus, CorpusReport, Tally, repeated_values
from retrieval.encode.spec import Encoder, EncoderInfo, EncoderSpec
from retrieval.errors import ConfigError, RetrievalError
from retrieval.index import add_rows, deserialize, load_index, merge, mergeable, save_index, serialize
from retrieval.ingest import Ingest
from retrieval.moments import RunningMoments
from retrieval.raylocal import LOCAL_RAY_ENV, init_local, keep_sigterm_handler, on_loopback, ray_output_to_stderr
from retrieval.stash import BLOCK_ROWS, Part, Titles, VectorStash
from retrieval.whitening import RawTransform, Whitening

log = logging.getLogger(__name__)

CPUS_PER_WORKER = 0.5  # Ray CPUs reserved per encoding actor; a whole CPU each left no CPU for other tasks on a
# 2-CPU cluster and the pipeline hung (ray-project/ray#44687). Each actor runs torch with one thread either way.
JOIN_TIMEOUT_S = 5.0  # a cluster address that does not accept a connection within this is refused
TASKS_PER_WORKER = 4  # windows are grouped into about this many tasks per worker, for an even finish
MAX_TASK_WINDOWS = 16  # ... and at most this many windows per task (what a retry repeats)
CHECK_TASK_ROWS = 65536  # rows per window when validating (as Corpus.validate reads) ...
CHECK_TASK_WINDOWS = 64  # ... and windows per validation task (reading ids and texts is cheap)
FILL_ROWS = 100_000_000  # IVF indexes of at least this many rows are filled in shards on Ray, then merged. Adding
# assigns each row to its nearest list: N x nlist x k multiply-adds, at ~44 G/s per core here
# (results/scale: 1M rows, 4,000 lists, k = 256 in 11.6 s on 2 cores). At 100M rows, nlist = 4 sqrt(N) = 40,000 and
# k = 256 that is ~6 min on one 64-core node, and shards across nodes bring it to about a minute of compute plus
# the shards' I/O; at 1B rows, ~3 h to minutes. Below 100M the gain is seconds, and on one machine FAISS's own
# threads already use every core (docs/scale.md).
OBJECT_STORE_BYTES = 512 << 20  # a local cluster's object store: only metadata passes through it


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide pass 1 runs on Ray.

    ``address`` None starts a local Ray for the build (or uses the one this process already started);
    ``"auto"``, ``"host:port"`` or ``"ray://host:port"`` joins a running cluster, whose nodes must have retrieval
    and the model installed and see the output folder (the workers write the stash parts there).
    ``workers`` None means one per CPU of the cluster. An IVF index of ``fill_rows`` rows or more is filled in
    one shard per worker, in parallel, and the shards merged (FAISS ``merge_from``).
    """

    address: str | None = None
    workers: int | None = None
    cpus_per_worker: float = CPUS_PER_WORKER
    fill_rows: int = FILL_ROWS

    def check(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"`workers` must be at least 1 (got {self.workers})", "workers")
        if not 0 < self.cpus_per_worker <= 1024:
            raise ConfigError(f"`cpus_per_worker` must be positive (got {self.cpus_per_worker})", "cpus_per_worker")
        if self.address is not None and not self.address.strip():
            raise ConfigError("`address` is empty; leave it out for a local Ray, or give auto or host:port", "address")


@dataclass
class PassStats:
    """Where the time of the last encoding pass went: what ``scripts/bench_distributed.py`` reports."""

    workers: int = 0
    windows: int = 0
    rows: int = 0
    wall_s: float = 0.0  # on the driver: from submitting the pass to adopting its last window
    first_window_s: float = 0.0  # ... to the first window's arrival (actors started, model loaded, one window)
    actor_init_s: dict[str, float] = dataclasses.field(default_factory=dict)  # per worker: making its encoder
    read_s: float = 0.0  # summed over windows, in the workers: reading the window from parquet
    encode_s: float = 0.0  # ... encoding it, writing its part, taking its moments
    adopt_s: float = 0.0  # on the driver: registering parts, merging moments
    returned_bytes: int = 0  # metadata the workers returned (mostly m2: 8 d^2 bytes per window)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RayEngine:
    """Runs a build's corpus passes on Ray Data (see the module docstring); pass it to ``build_index``.

    ``encoder`` tells each worker how to make its own encoder: an ``EncoderSpec`` (precision "auto" is settled
    once, on the driver, so every worker encodes alike) or any picklable zero-argument callable returning an
    Encoder. Every worker's encoder must describe itself as the driver's does, or the build stops.
    Use it as a context manager: a Ray started for it is shut down on exit (a cluster it joined is only left).
    """

    def __init__(self, encoder: EncoderSpec | Callable[[], Encoder], options: RayOptions = RayOptions()):
        options.check()
        self.encoder, self.options = encoder, options
        self._started: Path | None = None  # the temporary folder of a Ray this engine started
        self._joined = False
        self._saved_context: dict[str, Any] = {}
        self._saved_level = logging.NOTSET
        self._saved_printer: Callable[..., None] | None = None
        self.stats = PassStats()
        self.filled_shards = 0  # shards the last fill merged (0: the local loop filled the index)

    def __enter__(self) -> RayEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- the cluster --------------------------------------------------------------------------------------
    def _ray(self) -> Any:
        """The ``ray`` module, connected: a local Ray started, a cluster joined, or the one already running."""
        try:
            import ray
            import ray.data
        except ImportError as err:
            raise ConfigError(
                "`engine` ray needs Ray installed: pip install 'retrieval[ray]' (or 'ray[data]>=2.60,<2.61')",
                "engine",
            ) from err
        if self._saved_printer is None:  # before ray.init, which binds the printer of workers' lines
            self._saved_printer = ray_output_to_stderr()
        if not ray.is_initialized():
            with keep_sigterm_handler():
                if self.options.address:
                    self._join(ray, self.options.address)
                else:
                    self._start_local(ray)
        if not self._saved_context:  # progress is the caller's to show (the CLI draws its own bars)
            context = ray.data.DataContext.get_current()
            quiet = {"enable_progress_bars": False, "print_on_execution_start": False}
            self._saved_context = {key: getattr(context, key) for key in quiet}
            for key, value in quiet.items():
                setattr(context, key, value)
            # Ray Data's own notices (executions started and finished, bars disabled) only when we log details
            ray_data = logging.getLogger("ray.data")
            self._saved_level = ray_data.level
            if not log.isEnabledFor(logging.INFO):
                ray_data.setLevel(logging.ERROR)
        return ray

    def _join(self, ray: Any, address: str) -> None:
        """Join the cluster at ``address``, or fail in one line: Ray raised a ConnectionError (a traceback) for
        "auto" with no cluster running, and for a host:port where nothing listens it retried for minutes."""
        where = address.removeprefix("ray://")
        host, _, port = where.rpartition(":")
        if address != "auto" and host and port.isdigit():
            try:
                socket.create_connection((host, int(port)), timeout=JOIN_TIMEOUT_S).close()
            except OSError as err:
                raise RetrievalError(
                    f"no Ray cluster answers at {address} ({err.strerror or err}); start one there (`ray start "
                    "--head`) or leave out `address` for a local Ray"
                ) from err
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as err:
            said = str(err).splitlines()[0].rstrip(".") if str(err) else type(err).__name__
            raise RetrievalError(
                f"cannot join a Ray cluster at {address} ({said}); start one (`ray start --head`) or leave out "
                "`address` for a local Ray"
            ) from err
        self._joined = True

    def _start_local(self, ray: Any) -> None:
        """A private single-machine Ray: every listener on loopback, its files in a short temporary folder."""
        for key, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)  # inherited by Ray's processes
        # Unix socket paths are limited to ~107 bytes: the session folder must sit under a short path.
        short = tempfile.gettempdir() if len(tempfile.gettempdir()) <= 32 else "/tmp"
        self._started = Path(tempfile.mkdtemp(prefix="ray-", dir=short))
        with on_loopback():
            init_local(
                ray,
                num_cpus=os.cpu_count() or 1,
                include_dashboard=False,
                object_store_memory=OBJECT_STORE_BYTES,
                _temp_dir=str(self._started),
                logging_level=logging.WARNING,
            )

    def close(self) -> None:
        """Shut down the Ray this engine started (or leave the cluster it joined); a Ray started by the caller
        is left running."""
        if self._saved_context:
            import ray.data

            context = ray.data.DataContext.get_current()
            for key, value in self._saved_context.items():
                setattr(context, key, value)
            self._saved_context = {}
            logging.getLogger("ray.data").setLevel(self._saved_level)
        try:
            if self._started is None and not self._joined:
                return
            import ray

            with keep_sigterm_handler():  # Ray's shutdown resets the process's SIGTERM to the default: a kill
                ray.shutdown()  # between it and the command's end was a silent death, not `error: terminated`
            if self._started is not None:
                shutil.rmtree(self._started, ignore_errors=True)
            self._started, self._joined = None, False
        finally:  # after the shutdown, which prints what it still holds
            if self._saved_printer is not None:
                from ray._private import worker

                worker.print_to_stdstream = self._saved_printer
                self._saved_printer = None

    def connect(self) -> None:
        """Start (or join) Ray now rather than at the first pass (to time it apart, or fail early)."""
        self._ray()

    def workers(self) -> int:
        """``workers``, or one per CPU of the cluster; more than its CPUs can hold is refused on a Ray started
        here (the pool would wait for actors that never start) and a warning on a cluster that may grow."""
        cpus = float(self._ray().cluster_resources().get("CPU", 1))
        if self.options.workers is None:
            return max(1, int(cpus))
        need = self.options.workers * self.options.cpus_per_worker
        if need > cpus:
            message = (
                f"{self.options.workers} `workers` of {self.options.cpus_per_worker:g} CPU need {need:g} CPUs; "
                f"this Ray has {cpus:g}"
            )
            if self._started is not None:
                raise ConfigError(message + ": ask for fewer", "workers")
            log.warning("%s: the pool waits until the cluster grows", message)
        return self.options.workers

    # ----- validation ---------------------------------------------------------------------------------------
    def validate(self, source: Corpus) -> CorpusReport:
        """``Corpus.validate`` with the reading and checking done by Ray tasks, one range of windows each."""
        if source.precomputed:
            raise ConfigError(
                "precomputed vectors need no encoding: build them with the local `engine`, which only reads them",
                "engine",
            )
        ray = self._ray()
        windows = source.windows(CHECK_TASK_ROWS)
        units = plan(0, windows, self.workers(), CHECK_TASK_WINDOWS)
        hashes = source.id_column is not None  # row-number ids are unique by construction
        found = _run(ray, units, _check_units, fn_args=(source, None if not hashes else ()))
        found.sort(key=lambda row: int(row["start"]))
        tally = Tally()
        for row in found:
            tally.add(Tally(**json.loads(row["tally"])))
        if hashes:
            suspects = repeated_values(np.concatenate([np.frombuffer(row["hashes"], dtype=np.uint64) for row in found]))
            if len(suspects):  # equal hashes: look at the ids themselves
                again = _run(ray, units, _check_units, fn_args=(source, tuple(int(h) for h in suspects)))
                _refuse_duplicates(source, [json.loads(row["ids"]) for row in again])
        return source.conclude(tally)

    # ----- encoding -----------------------------------------------------------------------------------------
    def ingest(self, source: Corpus, ingest: Ingest, skip: int, window_rows: int) -> None:
        """Encode windows ``skip`` onwards on an actor pool; hand their parts and moments to ``ingest.adopt`` in
        window order, each as soon as the windows before it are in (see the module docstring)."""
        ray = self._ray()
        if ingest.encoder is None:
            raise ConfigError("the Ray `engine` encodes texts: it needs an encoder", "engine")
        stash, windows, workers = ingest.stash, source.windows(window_rows), self.workers()
        units = plan(skip, windows, workers, MAX_TASK_WINDOWS)
        if not units:
            return
        make = self._worker_encoder(ingest.encoder)
        expected = _vector_identity(ingest.encoder.info())
        state = {**stash.state, "parts": []}  # what a worker needs to write parts: dim, dtype, poolings
        log.info("encoding %d windows of %d rows on %d Ray workers", windows - skip, window_rows, workers)
        dataset = ray.data.from_items([{"start": a, "stop": b} for a, b in units], override_num_blocks=len(units))
        dataset = dataset.map_batches(
            EncodeWindows,
            fn_constructor_args=(source, make, str(stash.root), state, ingest.pooling, window_rows),
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=1),
            num_cpus=self.options.cpus_per_worker,
        )
        arrived: dict[int, dict[str, Any]] = {}
        following = skip  # the next window to adopt
        stats = self.stats = PassStats(workers=workers)
        began = time.perf_counter()
        for row in _rows(dataset):
            _raise_if_failed(row)
            stats.first_window_s = stats.first_window_s or time.perf_counter() - began
            window = int(row["window"])
            if window < following or window in arrived:  # a retried task's second answer: already counted
                log.info("window %d arrived twice; keeping the first", window)
                continue
            if _vector_identity(EncoderInfo.from_dict(json.loads(row["encoder"]))) != expected:
                raise ConfigError(
                    f"a Ray worker's encoder differs from this machine's ({row['encoder']}); install the same "
                    "model and retrieval version on every node",
                    "engine",
                )
            arrived[window] = row
            ready = []
            while following in arrived:
                ready.append(arrived.pop(following))
                following += 1
            if ready:
                adopting = time.perf_counter()
                parts = [Part.from_dict(json.loads(r["part"])) for r in ready]
                _check_visible(stash, parts)
                ingest.adopt(parts, [_moments(r, stash.dim) for r in ready])
                stats.adopt_s += time.perf_counter() - adopting
            stats.windows += 1
            stats.rows += int(row["n"])
            stats.actor_init_s[row["worker"]] = float(row["init_s"])
            stats.read_s += float(row["read_s"])
            stats.encode_s += float(row["encode_s"])
            stats.returned_bytes += 8 * (stash.dim**2 + stash.dim) + len(row["part"]) + len(row["encoder"])
        if following != windows:
            raise RuntimeError(f"Ray returned windows up to {following} of {windows}; the build is incomplete")
        stats.wall_s = time.perf_counter() - began
        log.info(
            "Ray pass: %d rows in %.1f s on %d workers (first window after %.1f s; workers busy %.0f%%)",
            stats.rows,
            stats.wall_s,
            workers,
            stats.first_window_s,
            100 * (stats.read_s + stats.encode_s) / max(stats.wall_s * workers, 1e-9),
        )

    # ----- pass 2 -------------------------------------------------------------------------------------------
    def fill(self, index: Any, stash: VectorStash, transform: Whitening | RawTransform, pooling: str | None) -> Any:
        """A trained, empty IVF index of ``fill_rows`` rows or more filled on Ray: one shard of consecutive rows
        per worker, each added to a copy of the trained index by a task and written beside the stash, then merged
        here in row order with FAISS's ``merge_from`` (ids offset by the rows before: the one-shot build's ids).
        None (the local loop fills it) for smaller indexes, one worker, or kinds that cannot merge (HNSW, Flat
        without ids, Refine)."""
        n = len(stash)
        if n < self.options.fill_rows or not mergeable(index):
            return None
        ray, shards = self._ray(), min(self.workers(), n)
        if shards < 2:
            return None
        folder = stash.root.parent / ".shards"  # inside the build's work directory; removed below
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        try:
            bounds = [n * k // shards for k in range(shards + 1)]
            items = [{"shard": k, "start": bounds[k], "stop": bounds[k + 1]} for k in range(shards)]
            dataset = ray.data.from_items(items, override_num_blocks=shards).map_batches(
                _fill_shard,
                fn_args=(str(stash.root), transform, pooling, serialize(index), str(folder)),
                batch_size=1,
                batch_format="numpy",
            )
            done = sorted(_rows(dataset), key=lambda row: int(row["shard"]))
            merged = deserialize(serialize(index))  # an owned copy (a downcast is not)
            for row in done:
                merge(merged, load_index(Path(row["path"])))  # shard-local ids 0.. become rows start..
            if merged.ntotal != n:
                raise RuntimeError(f"the merged shards hold {merged.ntotal} rows, not {n}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.filled_shards = shards
        log.info("filled %d rows in %d shards on Ray and merged them", n, shards)
        return merged

    def _worker_encoder(self, driver: Encoder) -> Callable[[], Encoder]:
        """What each worker calls to make its encoder; precision "auto" settled here, once for all workers."""
        if not isinstance(self.encoder, EncoderSpec):
            return self.encoder
        spec = self.encoder
        if spec.precision == "auto":
            settle = getattr(driver, "settle_precision", None)
            if settle is not None:
                settle()  # times fp32 against bf16 on this CPU, unless a build already settled it
            spec = dataclasses.replace(spec, precision=driver.info().precision_used or "fp32")
        return spec.load


class EncodeWindows:
    """A Ray Data actor: makes its encoder once, then encodes whole windows into stash parts of their own names
    and returns one row of metadata per window (never the vectors), with its timings."""

    def __init__(
        self,
        source: Corpus,
        make_encoder: Callable[[], Encoder],
        stash_root: str,
        stash_state: dict[str, Any],
        pooling: str,
        window_rows: int,
    ):
        started = time.perf_counter()
        self.source, self.pooling, self.window_rows = source, pooling, window_rows
        self.stash = VectorStash(Path(stash_root), stash_state)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.failed: RetrievalError | None = None
        try:
            self.encoder = make_encoder()
            self.info = json.dumps(self.encoder.info().to_dict())
        except RetrievalError as err:  # no model on this node, say: told to the driver with the first task
            self.failed = err
        self.init_s = time.perf_counter() - started

    def __call__(self, units: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows: list[dict[str, Any]] = []
        try:
            if self.failed is not None:
                raise self.failed
            for start, stop in zip(units["start"], units["stop"], strict=True):
                batches = iter(self.source.batches(self.window_rows, int(start), int(stop)))
                for window in range(int(start), int(stop)):
                    began = time.perf_counter()
                    batch = next(batches)
                    read = time.perf_counter()
                    ingest = Ingest(self.stash, self.encoder, self.pooling, len(batch), write=self._writer(window))
                    ingest(batch)
                    timings = {"read_s": read - began, "encode_s": time.perf_counter() - read}
                    rows.append(_window_row(window, ingest, self.info) | self._timings(timings))
        except RetrievalError as err:  # the user's error, returned as data: the driver raises it as itself
            rows.append(_error_row(err, self.stash.dim) | self._timings({"read_s": 0.0, "encode_s": 0.0}))
        return _columns(rows)

    def _timings(self, seconds: dict[str, float]) -> dict[str, Any]:
        return {"worker": self.worker, "init_s": self.init_s, **seconds}

    def _writer(self, window: int) -> Callable[..., Part]:
        def write(vectors: dict[str, np.ndarray], ids: Any, texts: Any, *, titles: Titles = None) -> Part:
            return self.stash.write_part(f"part-{window:05d}", vectors, ids, texts, titles=titles)

        return write


def _window_row(window: int, ingest: Ingest, info: str) -> dict[str, Any]:
    (part,) = ingest.parts
    m = ingest.moments
    return {
        "window": window,
        "part": json.dumps(part.to_dict()),
        "n": m.n,
        "shift": m.shift,
        "offset": m.offset,
        "m2": m.m2,
        "encoder": info,
        "error": "",
    }


def _error_row(err: RetrievalError, dim: int) -> dict[str, Any]:
    return {
        "window": -1,
        "part": "",
        "n": 0,
        "shift": np.zeros(dim),
        "offset": np.zeros(dim),
        "m2": np.zeros((dim, dim)),
        "encoder": "",
        "error": _error(err),
    }


def _error(err: RetrievalError) -> str:
    """A user's error as data (what a worker returns), for ``_raise_if_failed`` on the driver."""
    return json.dumps({"type": type(err).__name__, "message": str(err), "param": getattr(err, "param", None)})


def _columns(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for key in ("window", "n"):
        out[key] = np.array([r[key] for r in rows], dtype=np.int64)
    for key in ("init_s", "read_s", "encode_s"):
        out[key] = np.array([r[key] for r in rows], dtype=np.float64)
    for key in ("part", "encoder", "error", "worker"):
        out[key] = np.array([r[key] for r in rows], dtype=object)
    for key in ("shift", "offset", "m2"):
        out[key] = np.stack([np.asarray(r[key], dtype=np.float64) for r in rows])
    return out


def _check_units(units: dict[str, np.ndarray], source: Corpus, look_for: tuple[int, ...] | None) -> dict[str, Any]:
    """A validation task: check windows ``start`` to ``stop`` of CHECK_TASK_ROWS rows.

    ``look_for`` None: return the tally (and no hashes); empty: the tally and every id's hash; a set of hashes:
    the ids that have them (the second look at suspected duplicates)."""
    out: dict[str, list[Any]] = {"start": [], "tally": [], "hashes": [], "ids": [], "error": []}
    wanted = set(look_for or ())
    for start, stop in zip(units["start"], units["stop"], strict=True):
        tally, hashes, ids = Tally(), [], []
        try:
            for window_ids, window in source.check_windows(CHECK_TASK_ROWS, int(start), int(stop)):
                tally.add(window)
                if look_for is not None:
                    window_hashes = [id_hash(i) for i in window_ids]
                    hashes += window_hashes
                    ids += [i for i, h in zip(window_ids, window_hashes, strict=True) if h in wanted]
            error = ""
        except RetrievalError as err:
            error = _error(err)
        out["start"].append(int(start))
        out["tally"].append(json.dumps(dataclasses.asdict(tally)))
        out["hashes"].append(np.array(hashes if not wanted else [], dtype=np.uint64).tobytes())
        out["ids"].append(json.dumps(ids))
        out["error"].append(error)
    return {key: np.array(value, dtype=object if key != "start" else np.int64) for key, value in out.items()}


def _fill_shard(
    items: dict[str, np.ndarray],
    root: str,
    transform: Whitening | RawTransform,
    pooling: str | None,
    empty: Any,
    folder: str,
) -> dict[str, np.ndarray]:
    """A fill task: stash rows ``start`` to ``stop`` transformed and added to a copy of the trained index, saved."""
    stash = VectorStash.open(Path(root))
    paths = []
    for shard, start, stop in zip(items["shard"], items["start"], items["stop"], strict=True):
        index = deserialize(empty)
        for first in range(int(start), int(stop), BLOCK_ROWS):
            rows = np.arange(first, min(first + BLOCK_ROWS, int(stop)))
            add_rows(index, transform, stash.read_rows(rows, pooling, keep=False))  # a pass: maps dropped
        paths.append(str(Path(folder) / f"shard-{int(shard):05d}.faiss"))
        save_index(index, Path(paths[-1]))
    return {"shard": items["shard"], "path": np.array(paths, dtype=object)}


def id_hash(id_: str) -> int:
    """A 64-bit hash of an id: what the driver holds per row to find duplicates (8 bytes, not the string)."""
    return int.from_bytes(hashlib.blake2b(id_.encode(), digest_size=8).digest(), "little")


def _refuse_duplicates(source: Corpus, found: list[list[str]]) -> None:
    seen: set[str] = set()
    for ids in found:  # in window order
        for i in ids:
            if i in seen:
                raise source.duplicate(i)
            seen.add(i)
    log.info("%d ids share a 64-bit hash with another id (a collision, not a duplicate)", len(seen))


def plan(start: int, stop: int, workers: int, most: int) -> list[tuple[int, int]]:
    """Windows ``start`` to ``stop`` in consecutive ranges, one per task: about TASKS_PER_WORKER per worker so
    they finish together, and never more than ``most`` windows (what a retried task repeats)."""
    count = stop - start
    if count <= 0:
        return []
    size = max(1, min(most, count // (TASKS_PER_WORKER * workers)))
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


def _run(ray: Any, units: list[tuple[int, int]], fn: Callable[..., Any], fn_args: tuple[Any, ...]) -> list[Any]:
    """Every output row of ``fn`` mapped over the window ranges by Ray tasks; a user's error is raised here."""
    dataset = ray.data.from_items([{"start": a, "stop": b} for a, b in units], override_num_blocks=len(units))
    dataset = dataset.map_batches(fn, fn_args=fn_args, batch_size=1, batch_format="numpy")
    rows = list(_rows(dataset))
    for row in rows:
        _raise_if_failed(row)
    return rows


def _rows(dataset: Any) -> Iterator[dict[str, Any]]:
    """The dataset's rows as they complete; stopping early stops the execution."""
    rows = dataset.iter_rows()
    try:
        yield from rows
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()


def _raise_if_failed(row: dict[str, Any]) -> None:
    if row["error"]:
        error = json.loads(row["error"])
        kind = getattr(errors, error["type"], RetrievalError)
        if issubclass(kind, ConfigError):
            raise kind(error["message"], error["param"])
        raise kind(error["message"])


def _moments(row: dict[str, Any], dim: int) -> RunningMoments:
    return RunningMoments.of(row["n"], row["shift"], row["offset"], row["m2"]) if row["n"] else RunningMoments(dim)


def _vector_identity(info: EncoderInfo) -> tuple[Any, ...]:
    """What of an encoder decides its vectors: model (weights), pooling, max length, dimension, precision run."""
    return (
        info.kind,
        info.dim,
        info.weights_sha256 or (info.model, info.revision),
        info.pooling,
        info.max_length,
        info.precision_used,
    )


def _check_visible(stash: VectorStash, parts: list[Part]) -> None:
    """A part a worker wrote must be on this machine's disk too (a cluster's nodes share the output folder)."""
    for part in parts:
        for name in part.names:
            if not (stash.root / name).is_file():
                raise ConfigError(
                    f"a Ray worker wrote {name} where this machine cannot see it: on a cluster, put the index "
                    f"(`out`, now under {stash.root.parent.parent}) on a filesystem every node shares",
                    "out",
                )
