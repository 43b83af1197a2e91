"""Builds on Ray: the same index as a local build, from a folder of parquet files, through a killed worker and a
killed driver; the workers' checks give the local verdicts.

One local Ray (2 CPUs, every listener on 127.0.0.1, its own temporary folder) serves the whole module and is shut
down at its end (never ``ray stop``: that would kill every Ray on the machine). Encoders defined here and in
conftest reach the workers by value (cloudpickle), since the workers cannot import test modules.

Run as a script, this file is a build driver the resume test kills (``python tests/test_distributed.py ...``).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import conftest
import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FakeEncoder
from typer.testing import CliRunner

from retrieval import files

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from retrieval.build import BuildOptions, build_index, window_rows  # noqa: E402
from retrieval.cli.app import app  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.distributed import RayEngine, RayOptions, plan  # noqa: E402
from retrieval.encode.spec import EncoderSpec  # noqa: E402
from retrieval.errors import ConfigError, CorpusError, ModelError  # noqa: E402
from retrieval.filters import parse  # noqa: E402
from retrieval.index import IndexSpec  # noqa: E402
from retrieval.indexdir import STASH, IndexDir  # noqa: E402
from retrieval.raylocal import LOCAL_RAY_ENV, init_local, on_loopback  # noqa: E402
from retrieval.search import Searcher, SearchParams  # noqa: E402
from retrieval.stash import VectorStash  # noqa: E402
from retrieval.whitening import TransformSpec  # noqa: E402

HERE = Path(__file__).resolve()
SIZES = (130, 0, 57, 213)  # rows per file: uneven, one empty, none a multiple of WINDOW
WINDOW = 32  # rows per window (stash part): 5 + 0 + 2 + 7 = 14 windows
SPEC = TransformSpec(dim=8, gamma=1.0)
QUERIES = ["document number 7 about topic 0", "topic 3", "whitening vectors search"]

for module in (conftest, sys.modules[__name__]):
    ray.cloudpickle.register_pickle_by_value(module)


# ----- encoders the workers make ------------------------------------------------------------------------------
class LoggingEncoder(FakeEncoder):
    """FakeEncoder that sleeps per batch and appends "pid rows" per batch to a log file."""

    def __init__(self, log: Path, sleep: float = 0.0):
        super().__init__()
        self.log, self.sleep = log, sleep

    def encode(self, texts):  # type: ignore[no-untyped-def]
        time.sleep(self.sleep)
        with open(self.log, "a") as fh:
            fh.write(f"{os.getpid()} {len(texts)}\n")
        return super().encode(texts)


class DyingEncoder(LoggingEncoder):
    """LoggingEncoder whose process is SIGKILLed the first time it meets ``text`` (``marker`` records that)."""

    def __init__(self, log: Path, marker: Path, text: str):
        super().__init__(log)
        self.marker, self.text = marker, text

    def encode(self, texts):  # type: ignore[no-untyped-def]
        if self.text in texts and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().encode(texts)


class NoModelHere(FakeEncoder):
    """An encoder that cannot load on the workers (a node without the model)."""

    def __init__(self) -> None:
        raise ModelError("cannot load model 'fake' offline or from the hub: install it on every node")


class Make:
    """A picklable zero-argument factory: what a RayEngine gives each worker."""

    def __init__(self, cls: type, *args: object):
        self.cls, self.args = cls, args

    def __call__(self) -> FakeEncoder:
        return self.cls(*self.args)


def logged_rows(log: Path) -> int:
    return sum(int(line.split()[1]) for line in log.read_text().split("\n") if line) if log.exists() else 0


# ----- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray for this module; yields its address. Workers inherit PYTHONPATH, so they import this
    checkout's retrieval."""
    folder = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Unix socket paths
    saved = {key: os.environ.get(key) for key in LOCAL_RAY_ENV}
    os.environ.update(LOCAL_RAY_ENV)
    with on_loopback():  # ray was imported above: the variable alone would not keep it on 127.0.0.1
        context = init_local(
            ray,
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=256 << 20,
            _temp_dir=str(folder),
            log_to_driver=False,
        )
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def split_corpus(folder: Path, sizes: tuple[int, ...] = SIZES) -> Path:
    """Files part-0.parquet... of ``sizes`` rows (row groups of 20), ids doc0... numbered on across files, and a
    title column (read only where a test names it)."""
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for n, rows in enumerate(sizes):
        table = pa.table(
            {
                "id": pa.array([f"doc{i}" for i in range(start, start + rows)], pa.string()),
                "text": pa.array([f"document number {i} about topic {i % 7}" for i in range(start, start + rows)]),
                "title": pa.array([f"Title {i}" for i in range(start, start + rows)]),
            }
        )
        pq.write_table(table, folder / f"part-{n}.parquet", row_group_size=20)
        start += rows
    return folder


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return split_corpus(tmp_path / "corpus")


def local_build(corpus: Path, out: Path, encoder=None, title=None, **kwargs) -> None:  # type: ignore[no-untyped-def]
    options = BuildOptions(window_rows=WINDOW, **kwargs)
    build_index(CorpusSpec(corpus, title_column=title), encoder or FakeEncoder(), out, SPEC, options=options)


def ray_build(corpus: Path, out: Path, make, encoder=None, title=None, **kwargs) -> None:  # type: ignore[no-untyped-def]
    options = BuildOptions(window_rows=WINDOW, **kwargs)
    spec = CorpusSpec(corpus, title_column=title)
    with RayEngine(make, RayOptions(workers=2)) as engine:
        build_index(spec, encoder or FakeEncoder(), out, SPEC, options=options, engine=engine)


def assert_same_index(a: Path, b: Path, encoder, vectors_atol: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    """Same ids in the same rows, the same moments, kernel and stored vectors, the same search results."""
    da, db = IndexDir(a), IndexDir(b)
    assert da.docs().ids == db.docs().ids
    assert da.docs().titles(range(sum(SIZES))) == db.docs().titles(range(sum(SIZES)))
    ma, mb = da.moments(), db.moments()
    assert ma.n == mb.n == sum(SIZES)
    # The same float32 vectors folded in the same window order (the workers' per-part moments merged with
    # Chan's update on the driver) give identical float64 moments; a resumed build folds its first parts in one
    # block, which moves the last bits: 1e-12 of the largest entry bounds both. Encoders that differ by float32
    # rounding (torch with 1 thread per worker, 2 here) get ``vectors_atol`` per coordinate instead.
    for x, y in ((ma.mean, mb.mean), (ma.m2, mb.m2)):
        scale = np.abs(x).max()
        tolerance = 1e-12 * scale if not vectors_atol else vectors_atol * (ma.n if x.ndim == 2 else 1) * scale
        np.testing.assert_allclose(x, y, rtol=0, atol=tolerance)
    ka, kb = da.transform().kernel, db.transform().kernel  # type: ignore[union-attr]
    np.testing.assert_allclose(ka, kb, rtol=1e-6, atol=max(vectors_atol, 1e-9) * np.abs(ka).max())
    assert [p.docs for p in da.stash().parts] == [p.docs for p in db.stash().parts]
    sa, sb = Searcher.load(a, encoder=encoder), Searcher.load(b, encoder=encoder)
    for query in QUERIES:
        ha, hb = sa.search(query, SearchParams(k=5)), sb.search(query, SearchParams(k=5))
        assert [h.id for h in ha] == [h.id for h in hb]
        np.testing.assert_allclose([h.score for h in ha], [h.score for h in hb], atol=1e-4)  # float32 search
    IndexDir(b).verify(sb.manifest, "full")
    # the lexical part: term counts gathered on the driver (from adopted parts) in window order, byte for byte
    lexical = [{n: r["sha256"] for n, r in s.manifest.files.items() if n.startswith("lexical/")} for s in (sa, sb)]
    assert lexical[0] and lexical[0] == lexical[1]


# ----- tests --------------------------------------------------------------------------------------------------
def test_ray_windows_grow_with_the_corpus() -> None:
    assert window_rows(0) == window_rows(5183) == window_rows(1_000_000) == 512
    assert window_rows(10_000_000) == 8192 and window_rows(100_000_000) == window_rows(10**9) == 65536


def test_plan_covers_every_window_once() -> None:
    assert plan(0, 0, 2, 16) == []
    assert plan(3, 14, 2, 16) == [(a, a + 1) for a in range(3, 14)]  # 11 windows for 2 workers: one each
    ranges = plan(0, 1000, 2, 16)
    assert ranges[0] == (0, 16) and ranges[-1] == (992, 1000) and len(ranges) == 63
    assert plan(0, 100, 5, 16) == [(a, a + 5) for a in range(0, 100, 5)]  # ~4 tasks per worker


@pytest.mark.ray
def test_ray_build_of_a_folder_equals_the_local_build(cluster: str, folder: Path, tmp_path: Path) -> None:
    local_build(folder, tmp_path / "local", title="title")
    ray_build(folder, tmp_path / "ray", FakeEncoder, title="title")
    assert_same_index(tmp_path / "local", tmp_path / "ray", FakeEncoder())
    assert IndexDir(tmp_path / "ray").docs().titles([0, sum(SIZES) - 1]) == ["Title 0", f"Title {sum(SIZES) - 1}"]
    assert not files.work_dir(tmp_path / "ray").exists()
    assert ray.is_initialized()  # the engine left the caller's Ray running


@pytest.mark.ray
def test_a_ray_build_keeps_the_columns_a_local_build_keeps(cluster: str, folder: Path, tmp_path: Path) -> None:
    """``--columns`` with the Ray engine: the driver reads the kept columns of every window (the workers return
    stash parts, not metadata), so filters see the same typed rows as in a local build."""
    for path in sorted(folder.glob("*.parquet")):  # a typed column beside the texts, with nulls and empty rows
        table = pq.read_table(path)
        years = pa.array([None if i % 11 == 0 else 1990 + i % 30 for i in range(table.num_rows)], pa.int16())
        pq.write_table(table.append_column("year", years), path, row_group_size=20)
    spec = CorpusSpec(folder, columns=("year",))
    options = BuildOptions(window_rows=WINDOW)
    build_index(spec, FakeEncoder(), tmp_path / "local", SPEC, options=options)
    with RayEngine(FakeEncoder, RayOptions(workers=2)) as engine:
        build_index(spec, FakeEncoder(), tmp_path / "ray", SPEC, options=options, engine=engine)
    local, distributed = (Searcher.load(tmp_path / name, encoder=FakeEncoder()) for name in ("local", "ray"))
    assert distributed.manifest.columns == local.manifest.columns == {"year": "int16"}
    assert distributed.loaded.columns.equals(local.loaded.columns)
    assert distributed.loaded.columns.num_rows == sum(SIZES)
    where = parse("year >= 2010 or year is null")
    for query in QUERIES:
        ha, hb = (s.search(query, SearchParams(k=5, mode="dense", where=where)) for s in (local, distributed))
        assert [h.id for h in ha] == [h.id for h in hb] and len(ha) == 5


@pytest.mark.ray
@pytest.mark.parametrize("codes", [None, "sq4", "binary"])
def test_a_large_ivf_index_is_filled_in_shards_and_merged(
    cluster: str, folder: Path, tmp_path: Path, codes: str | None
) -> None:
    ivf = IndexSpec("ivf", nlist=8, codes=codes)
    build_index(CorpusSpec(folder), FakeEncoder(), tmp_path / "local", SPEC, ivf, BuildOptions(window_rows=WINDOW))
    with RayEngine(FakeEncoder, RayOptions(workers=2, fill_rows=0)) as engine:  # "large": any size
        options = BuildOptions(window_rows=WINDOW)
        build_index(CorpusSpec(folder), FakeEncoder(), tmp_path / "ray", SPEC, ivf, options, engine=engine)
    assert engine.filled_shards == 2
    assert_same_index(tmp_path / "local", tmp_path / "ray", FakeEncoder())
    a, b = (IndexDir(tmp_path / d).faiss_index() for d in ("local", "ray"))
    if codes == "binary":  # the raw decoder's per-row scalars, merged in row order as the lists are
        assert a.decoder is not None and b.scalars is not None and a.scalars.shape == (a.ntotal, 2)
        np.testing.assert_array_equal(a.scalars, b.scalars)
    a, b = (getattr(x, "binary", x) for x in (a, b))  # a binary index's lists are its FAISS binary IVF's
    for number in range(8):  # every inverted list holds the same rows, in the same order
        size = a.invlists.list_size(number)
        assert size == b.invlists.list_size(number)
        ids = [faiss.rev_swig_ptr(x.invlists.get_ids(number), size).copy() for x in (a, b)]
        np.testing.assert_array_equal(*ids)
    assert not (files.work_dir(tmp_path / "ray") / ".shards").exists() and not (tmp_path / "ray" / ".shards").exists()


@pytest.mark.ray
def test_a_killed_worker_is_replaced_and_its_task_retried(cluster: str, folder: Path, tmp_path: Path) -> None:
    log, marker = tmp_path / "rows.log", tmp_path / "killed"
    victim = "document number 200 about topic 4"  # in window 7 (part-3.parquet's first window)
    ray_build(folder, tmp_path / "ray", Make(DyingEncoder, log, marker, victim))
    assert marker.exists()  # a worker died in the middle of the build
    pids = {line.split()[0] for line in log.read_text().split("\n") if line}
    assert len(pids) >= 3  # two workers, and the one that replaced the dead
    assert logged_rows(log) == sum(SIZES)  # each row encoded once: the dead worker's window by its replacement
    stash = VectorStash.open(tmp_path / "ray" / STASH)
    ids = stash.ids()
    assert sorted(ids) == sorted(f"doc{i}" for i in range(sum(SIZES)))  # every row exactly once
    local_build(folder, tmp_path / "local")
    assert_same_index(tmp_path / "local", tmp_path / "ray", FakeEncoder())


@pytest.mark.ray
@pytest.mark.process
def test_a_killed_driver_resumes_from_its_registered_parts(cluster: str, folder: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "ray", tmp_path / "rows.log"
    command = [sys.executable, str(HERE), str(folder), str(out), "--address", cluster, "--log", str(log)]
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stash_json = files.work_dir(out) / STASH / "stash.json"
    deadline = time.monotonic() + 60
    while parts(stash_json) < 3:
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, "the driver never registered 3 parts"
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    dead = {int(line.split()[0]) for line in log.read_text().split("\n") if line}
    wait_gone(dead)  # Ray ends a dead driver's workers; none may still write while we resume
    done = parts(stash_json)
    assert 3 <= done < 14
    stashed = len(VectorStash.open(stash_json.parent))
    log.unlink()

    ray_build(folder, out, Make(LoggingEncoder, log), resume=True)
    assert logged_rows(log) == sum(SIZES) - stashed  # registered parts were not encoded again
    local_build(folder, tmp_path / "local")
    assert_same_index(tmp_path / "local", out, FakeEncoder())


@pytest.mark.ray
def test_workers_give_the_local_verdicts_on_bad_input(
    cluster: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = split_corpus(tmp_path / "c", (40, 30))
    pq.write_table(pa.table({"id": ["doc5"], "text": ["again"]}), folder / "part-7.parquet")
    engine = RayEngine(FakeEncoder, RayOptions(workers=2))  # joins this module's Ray; ``close`` leaves it
    with pytest.raises(
        CorpusError, match=r"duplicate id 'doc5' in column 'id' \(in part-0.parquet and part-7.parquet\)"
    ):
        build_index(CorpusSpec(folder), FakeEncoder(), tmp_path / "out", SPEC, engine=engine)
    texts = [f"text {i}" for i in range(6)]
    texts[2] = texts[4] = " "
    pq.write_table(pa.table({"id": [f"e{i}" for i in range(6)], "text": texts}), folder / "part-7.parquet")
    with pytest.raises(CorpusError, match=r"^2 of 76 rows have null or empty text \(first ids: e2, e4\)"):
        build_index(CorpusSpec(folder), FakeEncoder(), tmp_path / "out", SPEC, engine=engine)
    pq.write_table(pa.table({"id": ["x", None], "text": ["a", "b"]}), folder / "part-7.parquet")
    with pytest.raises(CorpusError, match=r"column 'id' of .*part-7\.parquet has null ids"):
        build_index(CorpusSpec(folder), FakeEncoder(), tmp_path / "out", SPEC, engine=engine)
    split_corpus(folder, (40, 30))
    (folder / "part-7.parquet").unlink()
    with RayEngine(NoModelHere, RayOptions(workers=2)) as no_model:
        with pytest.raises(ModelError, match="install it on every node"):
            build_index(CorpusSpec(folder), FakeEncoder(), tmp_path / "out", SPEC, engine=no_model)
    too_wide = RayEngine(FakeEncoder, RayOptions(workers=3, cpus_per_worker=1))
    with caplog.at_level(logging.WARNING, logger="retrieval.distributed"):
        assert too_wide.workers() == 3  # refused on a Ray the engine starts; on one it joins, the cluster may grow
    assert "3 `workers` of 1 CPU need 3 CPUs; this Ray has 2" in caplog.text
    np.save(tmp_path / "v.npy", np.ones((4, 3), dtype=np.float32))
    with pytest.raises(ConfigError, match="precomputed vectors need no encoding"):
        build_index(CorpusSpec(tmp_path / "v.npy"), None, tmp_path / "out", SPEC, engine=engine)
    assert not (tmp_path / "out").exists() and not files.work_dir(tmp_path / "out").exists()
    engine.close()
    assert ray.is_initialized()


@pytest.mark.ray
@pytest.mark.process
def test_cli_starts_its_own_ray_and_stops_it(folder: Path, tmp_path: Path, tiny_bert: Path) -> None:
    """``retrieval index FOLDER --engine ray`` in a fresh process: a private local Ray, gone when it is done."""
    out = tmp_path / "ray"
    args = ["index", str(folder), "--out", str(out), "--model", str(tiny_bert), "--precision", "fp32"]
    args += ["--dim", str(SPEC.dim), "--gamma", str(SPEC.gamma)]
    short = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # the CLI's Ray puts its session folder here
    env = {**os.environ, "TMPDIR": str(short), "RETRIEVAL_INDEX_ROOT": str(tmp_path / "indexes")}
    command = [sys.executable, "-m", "retrieval", *args, "--engine", "ray", "--workers", "2"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"built {out}: 400 rows" in result.stderr
    assert not list(short.iterdir())  # Ray's session folder removed ...
    assert not processes_mentioning(str(short))  # ... and none of its processes left
    short.rmdir()

    encoder = EncoderSpec(str(tiny_bert), precision="fp32").load()
    build_index(CorpusSpec(folder), encoder, tmp_path / "local", SPEC)  # 1 window per file at either window size
    # torch runs 1 thread per worker and 2 in this process: vectors agree to float32 rounding, not bit for bit
    assert_same_index(tmp_path / "local", out, encoder, vectors_atol=1e-5)
    local, ray_built = (IndexDir(d).manifest().encoder for d in (tmp_path / "local", out))
    assert ray_built == local
    refused = CliRunner().invoke(app, [*args, "--workers", "2"])
    assert refused.exit_code == 1 and "--workers are for --engine ray" in refused.output


class SlowRay:
    """Stands in for the ``ray`` module: its first ``timeouts`` starts fail as Ray's do on a loaded machine."""

    def __init__(self, timeouts: int, message: str = "The current node timed out during startup."):
        self.timeouts, self.message = timeouts, message
        self.calls: list[str] = []

    def init(self, **options: object) -> dict[str, object]:
        self.calls.append("init")
        if self.calls.count("init") <= self.timeouts:
            raise Exception(self.message)  # what Ray's node.py raises
        return options

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_a_local_ray_that_starts_too_slowly_is_started_once_more() -> None:
    slow = SlowRay(timeouts=1)
    assert init_local(slow, num_cpus=2) == {"num_cpus": 2}
    assert slow.calls == ["init", "shutdown", "init"]
    with pytest.raises(Exception, match="timed out during startup"):  # twice: the error is the caller's
        init_local(SlowRay(timeouts=2))
    other = SlowRay(timeouts=1, message="object store too small")
    with pytest.raises(Exception, match="object store"):  # any other failure is not retried
        init_local(other)
    assert other.calls == ["init"]


def test_precision_auto_is_settled_once_on_the_driver(tiny_bert: Path) -> None:
    spec = EncoderSpec(str(tiny_bert))  # precision "auto"
    driver = spec.load()
    make = RayEngine(spec)._worker_encoder(driver)
    used = driver.info().precision_used
    assert used in ("fp32", "bf16")
    worker = make()
    assert worker.info().precision == used and worker.info().precision_used == used


# ----- helpers ------------------------------------------------------------------------------------------------
def parts(stash_json: Path) -> int:
    try:
        return len(VectorStash.open(stash_json.parent).parts)
    except Exception:  # not yet written, or mid-rename: not ready
        return 0


LOOPBACK_CHILD = """
import json, sys
import ray  # imported first, as a program using the library may have: RAY_* variables set later change nothing
from retrieval.distributed import RayEngine, RayOptions
from retrieval.encode.spec import EncoderSpec
engine = RayEngine(EncoderSpec("unused"), RayOptions())
engine.connect()
print(json.dumps({"folder": str(engine._started)}), flush=True)
sys.stdin.readline()
engine.close()
"""


SIGTERM_CHILD = """
import os, signal, sys, time
from retrieval.cli.shell import sigterm_exits
from retrieval.distributed import RayEngine, RayOptions
from retrieval.encode.spec import EncoderSpec
from retrieval.errors import Terminated
with sigterm_exits():
    with RayEngine(EncoderSpec("unused"), RayOptions()) as engine:
        engine.connect()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        except Terminated:
            print("terminated", flush=True)
    try:  # Ray's shutdown (leaving the engine) reset SIGTERM to the default beneath Python: a silent death
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    except Terminated:
        print("terminated after shutdown", flush=True)
"""


@pytest.mark.ray
@pytest.mark.process
def test_sigterm_after_ray_started_still_reaches_the_cli_handler(tmp_path: Path) -> None:
    """ray.init replaced the CLI's SIGTERM handler with Ray's: a SIGTERM during a Ray build aborted the
    process with a C++ stack dump (exit -6) instead of `error: terminated`, exit 143, parts kept for --resume;
    after ray.shutdown one killed the process silently."""
    short = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(short), "PYTHONPATH": str(conftest.ROOT)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", SIGTERM_CHILD], capture_output=True, text=True, env=env, timeout=120
        )
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert (done.returncode, done.stdout) == (0, "terminated\nterminated after shutdown\n"), done.stderr[-2000:]


def test_keeping_the_sigterm_handler_is_a_no_op_off_the_main_thread() -> None:
    """Signal handlers belong to the main thread: a RayEngine opened from another thread (a library caller)
    must not fail with "signal only works in main thread"."""
    from retrieval.distributed import keep_sigterm_handler

    errors: list[BaseException] = []

    def body() -> None:
        try:
            with keep_sigterm_handler():
                pass
        except BaseException as err:  # noqa: BLE001 - recorded for the assertion
            errors.append(err)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    assert errors == []


def listening_addresses(pids: set[int]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local addresses of the TCP sockets that the processes ``pids`` listen on (/proc/net/tcp and tcp6)."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state 0A: LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])  # 32-bit words in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(ipaddress.ip_address(words))
    return found


@pytest.mark.ray
@pytest.mark.process
def test_a_local_ray_listens_on_loopback_only_even_when_ray_was_imported_first(tmp_path: Path) -> None:
    """Ray's GCS, raylet and workers take tasks from whoever reaches them: a private Ray must not listen on the
    machine's external address. Ray fixes that choice when it is imported, so the library must set it for the
    start itself; a caller that imported ray first got every listener on all interfaces."""
    short = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(short), "PYTHONPATH": str(conftest.ROOT)}
    for key in LOCAL_RAY_ENV:
        env.pop(key, None)
    child = subprocess.Popen(
        [sys.executable, "-c", LOOPBACK_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        folder = json.loads(child.stdout.readline())["folder"]
        addresses = listening_addresses({child.pid, *processes_mentioning(folder)})
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        shutil.rmtree(short, ignore_errors=True)
    assert len(addresses) >= 3  # the GCS, the raylet, the driver (at least)
    mapped = [getattr(a, "ipv4_mapped", None) or a for a in addresses]  # ::ffff:127.0.0.1 is 127.0.0.1
    outside = [a for a in mapped if not a.is_loopback]
    assert not outside, f"listening beyond loopback: {outside}"


def processes_mentioning(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (Ray's processes name their session folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def wait_gone(pids: set[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"worker {pid} of the killed driver is still running")


def main(argv: list[str]) -> int:
    """The driver the resume test kills: a Ray build joined to the test's cluster, with a slow logging encoder."""
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--address", required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args(argv)
    options = BuildOptions(window_rows=WINDOW)
    with RayEngine(Make(LoggingEncoder, args.log, 0.3), RayOptions(address=args.address, workers=2)) as engine:
        build_index(CorpusSpec(args.corpus), FakeEncoder(), args.out, SPEC, options=options, engine=engine)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def test_joining_a_cluster_that_is_not_there_fails_in_one_line() -> None:
    """`--address host:port` where nothing listens retried for minutes, and `--address auto` with no cluster
    raised Ray's ConnectionError as a traceback; both are one line now (a stand-in for ray: no cluster needed)."""
    import socket

    from retrieval.errors import RetrievalError

    class NoCluster:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def init(self, address: str, **_: object) -> None:
            self.calls.append(address)
            raise ConnectionError("Could not find any running Ray instance.\nPlease specify ...")

    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        engine, stub = RayEngine(FakeEncoder, RayOptions()), NoCluster()
        started = time.monotonic()
        with pytest.raises(RetrievalError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
            engine._join(stub, f"127.0.0.1:{port}")
        assert time.monotonic() - started < 10 and stub.calls == []  # refused before Ray retries anything
    with pytest.raises(RetrievalError, match=r"cannot join a Ray cluster at auto \(Could not find any running Ray"):
        engine._join(stub, "auto")
    assert stub.calls == ["auto"] and not engine._joined


# What Ray prints on the driver: a worker's own output, and the raylet's notice of a worker that died.
RAY_OUTPUT_SCRIPT = """
import os, sys, time
import ray
from retrieval.distributed import RayEngine, RayOptions

@ray.remote(max_retries=0)
def speak():
    print("a worker's own output", flush=True)
    return 1

@ray.remote(max_retries=0)
def die():
    os._exit(1)

with RayEngine(lambda: None, RayOptions(workers=1)) as engine:
    engine.connect()
    ray.get(speak.remote())
    try:
        ray.get(die.remote())
    except Exception:
        pass
    time.sleep(4)  # Ray's log monitor and error listener forward the lines within a second or two
print("built", flush=True)
"""


@pytest.mark.ray
@pytest.mark.process
def test_rays_own_output_goes_to_standard_error(tmp_path: Path) -> None:
    """A build on Ray printed Ray's "worker died" lines (and workers' output), with ANSI colours, on standard
    output ahead of the `built ...` line a script reads: only the command's own output belongs there."""
    env = {**os.environ, "PYTHONPATH": str(conftest.ROOT), "TMPDIR": "/tmp"}
    done = subprocess.run(
        [sys.executable, "-c", RAY_OUTPUT_SCRIPT], capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "built\n", done.stdout
    assert "a worker's own output" in done.stderr and "worker died" in done.stderr.lower()
