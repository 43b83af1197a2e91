"""The real server process (`python -m retrieval serve`, the tiny BERT, 127.0.0.1 on a free port): it answers,
switches to a version that `retrieval add` publishes under continuous requests without failing one, and on
SIGTERM lets a slow request in flight finish before it exits. Every process is killed by its fixture."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, write_corpus

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from retrieval import update  # noqa: E402
from retrieval.build import build_index  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.encode.spec import EncoderSpec  # noqa: E402
from retrieval.whitening import TransformSpec  # noqa: E402

pytestmark = pytest.mark.process  # every test runs `retrieval serve` as a process of its own

SLOW = "a deliberately slow query"
# The real CLI, with the engine's encoder made slow for one query text: a request certain to be in flight.
SLOW_SERVER = (
    "import sys, time\n"
    "from retrieval.search import Searcher\n"
    "encode = Searcher.encode\n"
    "def slow(self, texts):\n"
    f"    if {SLOW!r} in texts:\n"
    "        time.sleep(2.0)\n"
    "    return encode(self, texts)\n"
    "Searcher.encode = slow\n"
    "from retrieval.cli.app import run\n"
    "run()\n"
)

# The same, with every load after the first made slow: a POST /reload certain to be loading at a signal.
SLOW_RELOAD_SERVER = SLOW_SERVER.replace(
    "from retrieval.cli.app import run\n",
    "from retrieval.serve.service import Service\n"
    "load = Service._load\n"
    "def slow_load(self):\n"
    "    if self._searcher is not None:\n"
    "        print('slow load', file=sys.stderr, flush=True)\n"
    "        time.sleep(2.0)\n"
    "    return load(self)\n"
    "Service._load = slow_load\n"
    "from retrieval.cli.app import run\n",
)


def get_or_drop(server: Server, path: str) -> None:
    """A client of a server that may quit under it: a dropped connection is an expected outcome."""
    try:
        server.get(path, timeout=30)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.url(path), timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def post(self, path: str, body: dict[str, Any], timeout: float = 10.0) -> tuple[int, Any]:
        request = urllib.request.Request(
            self.url(path), json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def stop(self, clients: Iterable[threading.Thread] = ()) -> None:
        """Kill the process if a test left it running, then wait for it and for the test's client threads."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for client in clients:
            client.join(30)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if self.get("/ready", timeout=2)[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout}s:\n{self.log.read_text()}")


def start(index: Path, tmp_path: Path, *options: str, code: str | None = None) -> Server:
    port = free_port()
    entry = ["-c", code] if code else ["-m", "retrieval"]
    command = [sys.executable, *entry, "serve", str(index), "--port", str(port), *options]
    log = tmp_path / f"server-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Server(proc, port, log)


@pytest.fixture(scope="module")
def tiny_index(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("served")
    corpus = write_corpus(root / "corpus.parquet", n=200)
    build_index(
        CorpusSpec(corpus), EncoderSpec(str(tiny_bert), precision="fp32").load(), root / "idx", TransformSpec(dim=8)
    )
    return root / "idx"


@pytest.fixture(scope="module")
def served(tiny_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """One real server process for this module (starting one costs seconds of imports): the slow-query variant
    of the CLI, watching a copy of the tiny index. The last test stops it with SIGTERM; the fixture kills it
    whatever happened."""
    import shutil

    tmp_path = tmp_path_factory.mktemp("serving")
    index = tmp_path / "idx"
    shutil.copytree(tiny_index, index)
    # No admission budget: the add below encodes on the same two cores, and a 429 for work queued past 50 ms is
    # the subject of the admission tests in test_server.py, not of this module (no request fails at a swap).
    server = start(index, tmp_path, "--watch-interval", "0.2", "--max-queue-ms", "0", code=SLOW_SERVER)
    try:
        server.wait_ready()
        yield server, index
    finally:
        server.stop()


def test_the_server_answers_then_follows_an_add_under_load(
    served: tuple[Server, Path], tiny_bert: Path, tmp_path: Path
) -> None:
    server, index = served
    status, body = server.get("/search?q=document%20number%203%20about%20topic%203&k=2")
    assert status == 200 and body["results"][0]["hits"][0]["id"] == "doc3"
    assert server.get("/info")[1]["index"]["n"] == 200

    texts = [f"whitening vectors cosine {i} {i + 3} search query model" for i in range(10)]
    more = write_corpus(tmp_path / "more.parquet", n=10, id=[f"new{i}" for i in range(10)], text=texts)
    statuses: list[int] = []
    stop = threading.Event()

    def hammer() -> None:
        deadline = time.monotonic() + 60  # bounded even if the test fails before it sets ``stop``
        while not stop.is_set() and time.monotonic() < deadline:
            statuses.append(server.post("/search", {"query": "topic 4 document", "k": 3})[0])

    clients = [threading.Thread(target=hammer) for _ in range(3)]
    for thread in clients:
        thread.start()
    try:
        # what `retrieval add` runs, in this process (a second process would import torch again)
        update.add(index, CorpusSpec(more), encoder=EncoderSpec(str(tiny_bert), precision="fp32").load())
        deadline = time.monotonic() + 30
        while server.get("/ready")[1].get("generation") != 2:
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.1)
        time.sleep(0.3)  # requests keep flowing across the swap
    finally:
        stop.set()
        for thread in clients:
            thread.join(30)
    assert len(statuses) > 10 and set(statuses) == {200}, statuses
    status, body = server.post("/search", {"queries": [texts[2], texts[7]], "k": 1})
    assert status == 200 and body["generation"] == 2
    assert [r["hits"][0]["id"] for r in body["results"]] == ["new2", "new7"]
    metrics = urllib.request.urlopen(server.url("/metrics"), timeout=10).read().decode()
    assert "retrieval_index_generation 2" in metrics and "retrieval_index_loads_ok 2" in metrics


def raw_request(server: Server, request: bytes, hold: float = 0.0) -> bytes:
    """Send ``request`` on a socket of its own: the whole response (headers, then Content-Length bytes, which may
    come in several reads); or, with ``hold``, nothing: the client closes after ``hold`` seconds."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        if hold:
            time.sleep(hold)
            return b""
        data = b""
        while True:
            head, sep, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE) if sep else None
            if length and len(body) >= int(length.group(1)):
                return data
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk


def metric_value(server: Server, line_start: str) -> float:
    text = urllib.request.urlopen(server.url("/metrics"), timeout=10).read().decode()
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start + " ")), 0.0)


def test_requests_of_clients_that_left_are_withdrawn(served: tuple[Server, Path]) -> None:
    """uvicorn tells the app when a client closes its connection: five requests queued behind a slow one, whose
    clients left, are never encoded (under overload such requests filled the queue with work for nobody), and
    are counted as 499."""
    server, _ = served
    encoded = metric_value(server, "retrieval_queries_total")
    slow = threading.Thread(target=lambda: server.get(f"/search?q={SLOW.replace(' ', '%20')}", timeout=30))
    slow.start()
    time.sleep(0.5)  # the engine is inside the slow query's 2 s encoding
    for i in range(5):
        raw_request(server, f"GET /search?q=gone%20{i} HTTP/1.1\r\nHost: t\r\n\r\n".encode(), hold=0.1)
    slow.join(30)
    assert server.get("/search?q=topic%204%20document")[0] == 200
    assert metric_value(server, "retrieval_queries_total") - encoded == 2  # the slow query and the last one
    assert metric_value(server, 'retrieval_requests_total{method="GET",route="/search",status="499"}') == 5


def test_a_websocket_upgrade_is_answered_as_http(served: tuple[Server, Path]) -> None:
    """There is no WebSocket route: uvicorn refused an upgrade with a bare 403; now the request is plain HTTP."""
    server, _ = served
    upgrade = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    key = b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    answer = raw_request(server, upgrade + key)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}'), answer


def test_an_http_1_1_request_without_host_is_refused(served: tuple[Server, Path]) -> None:
    """RFC 9112 3.2: a server MUST answer 400. uvicorn passed such a request on and it was answered; HTTP/1.0
    has no such rule."""
    server, _ = served
    answer = raw_request(server, b"GET /health HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400") and b'"code":"missing_host"' in answer, answer
    assert raw_request(server, b"GET /health HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200")
    assert raw_request(server, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n").startswith(b"HTTP/1.1 200")
    assert metric_value(server, 'retrieval_requests_total{method="GET",route="unmatched",status="400"}') >= 1


def test_oversized_headers_are_refused_with_431_by_the_real_server(served: tuple[Server, Path]) -> None:
    """A 200 KB header, or 5,000 headers, were answered 200 (uvicorn's httptools parser takes any amount)."""
    server, _ = served
    big = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    many = b"GET /health HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(5000)) + b"\r\n"
    for request in (big, many):
        answer = raw_request(server, request)
        assert answer.startswith(b"HTTP/1.1 431") and b'"code":"headers_too_large"' in answer, answer[:300]
    assert raw_request(server, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n").startswith(b"HTTP/1.1 200")


def test_a_normal_load_is_logged_at_info_and_no_library_warning_is_printed(served: tuple[Server, Path]) -> None:
    """Every normal load was logged at WARNING, so an operator's alerting on warnings fired at each start."""
    server, _ = served
    log = server.log.read_text()
    assert re.search(r"INFO +serving .* generation 1", log), log
    assert "WARNING  serving" not in log and "FutureWarning" not in log and "TracerWarning" not in log, log


def test_sigterm_lets_the_request_in_flight_finish(served: tuple[Server, Path]) -> None:
    """Last in this module: it stops the shared server."""
    server, _ = served
    result: dict[str, Any] = {}

    def slow_request() -> None:
        started = time.monotonic()
        result["response"] = server.get(f"/search?q={SLOW.replace(' ', '%20')}&k=2", timeout=30)
        result["seconds"] = time.monotonic() - started

    client = threading.Thread(target=slow_request)
    client.start()
    time.sleep(0.7)  # the request is inside its 2 s encoding now
    server.proc.send_signal(signal.SIGTERM)
    client.join(30)
    code = server.proc.wait(30)
    status, body = result["response"]
    assert status == 200 and len(body["results"][0]["hits"]) == 2
    assert result["seconds"] >= 1.5
    assert code == 0, code  # uvicorn re-raises the signal once it has shut down: a server's way to stop, exit 0
    log = server.log.read_text()
    assert "Traceback" not in log and "Waiting for application shutdown" in log and "error:" not in log


def test_sigterm_past_the_shutdown_timeout_answers_503_json(tiny_index: Path, tmp_path: Path) -> None:
    """A request still running when --shutdown-timeout runs out is cancelled by uvicorn: it got a plain-text 500
    and the log a traceback. Now the JSON 503 `shutting_down`, and the process still exits."""
    import shutil

    index = tmp_path / "idx"
    shutil.copytree(tiny_index, index)
    server = start(index, tmp_path, "--shutdown-timeout", "1", "--watch-interval", "0", code=SLOW_SERVER)
    try:
        server.wait_ready()
        result: dict[str, Any] = {}
        client = threading.Thread(
            target=lambda: result.update(response=server.get(f"/search?q={SLOW.replace(' ', '%20')}", timeout=30))
        )
        client.start()
        time.sleep(0.5)  # inside its 2 s encoding, which outlasts the 1 s timeout
        server.proc.send_signal(signal.SIGTERM)
        client.join(30)
        status, body = result["response"]
        assert status == 503 and body["error"]["code"] == "shutting_down", body
        assert server.proc.wait(30) == 0
        assert "Traceback" not in server.log.read_text()
    finally:
        server.stop()


def test_a_reload_loading_at_the_shutdown_timeout_answers_503_json(tiny_index: Path, tmp_path: Path) -> None:
    """POST /reload still loading when --shutdown-timeout ran out got uvicorn's plain-text 500 and a logged
    traceback; reloads queued behind it loaded one after another past the signal, and the exit took 9.5 s of a
    1 s timeout with ten of them. Now the one loading gets the JSON 503 `shutting_down`, and so do those
    waiting, without loading."""
    import shutil

    index = tmp_path / "idx"
    shutil.copytree(tiny_index, index)
    server = start(index, tmp_path, "--shutdown-timeout", "1", "--watch-interval", "0", code=SLOW_RELOAD_SERVER)
    try:
        server.wait_ready()
        os.utime(index)  # a new identity (its change time): a reload loads, slowly, rather than finding it served
        answers: list[tuple[int, Any]] = []
        clients = [
            threading.Thread(target=lambda: answers.append(server.post("/reload", {}, timeout=30))) for _ in range(4)
        ]
        for client in clients:
            client.start()
        time.sleep(0.5)  # one reload is inside its 2 s load; three wait for it
        server.proc.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(30)
        assert server.proc.wait(30) == 0
        assert [(status, body["error"]["code"]) for status, body in answers] == [(503, "shutting_down")] * 4, answers
        log = server.log.read_text()
        assert log.count("slow load") == 1 and "Traceback" not in log, log  # the waiting three loaded nothing
    finally:
        server.stop()


def test_a_second_ctrl_c_quits_at_once_without_a_traceback(tiny_index: Path, tmp_path: Path) -> None:
    """The second Ctrl-C is uvicorn's forced quit: it skips the app's shutdown, and the lifespan, cancelled as
    the loop closed, logged a CancelledError traceback. Now the lifespan ends too, without waiting for the
    engine's queue (a forced quit does not wait out a 300 s timeout)."""
    import shutil

    index = tmp_path / "idx"
    shutil.copytree(tiny_index, index)
    options = ("--shutdown-timeout", "300", "--watch-interval", "0", "--max-batch", "1")
    server = start(index, tmp_path, *options, code=SLOW_SERVER)
    clients: list[threading.Thread] = []
    try:
        server.wait_ready()
        slow = f"/search?q={SLOW.replace(' ', '%20')}"
        for _ in range(12):  # 24 s of queued work, one slow query a batch: a forced quit must not wait it out
            clients.append(threading.Thread(target=get_or_drop, args=(server, slow)))
            clients[-1].start()
        time.sleep(0.5)  # inside the first 2 s encoding
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(40) == 0
        assert time.monotonic() - signalled < 15.0  # neither the 300 s timeout nor the 24 s queue: it was forced
        log = server.log.read_text()
        assert "Traceback" not in log and "CancelledError" not in log, log
    finally:
        server.stop(clients)


def test_a_ctrl_c_after_the_server_finished_changes_nothing(tiny_index: Path, tmp_path: Path) -> None:
    """Once uvicorn has finished, the process still finishes the engine's running batch and spends a second
    in torch's exit hooks: a Ctrl-C there killed it by the signal (status 130) or printed an exit hook's
    KeyboardInterrupt traceback."""
    import shutil

    index = tmp_path / "idx"
    shutil.copytree(tiny_index, index)
    options = ("--watch-interval", "0", "--shutdown-timeout", "1", "--max-batch", "1")
    # an exit hook that says when teardown runs and lasts a second: the window a Ctrl-C must not disturb
    teardown = (
        "import atexit, sys, time\n"
        "atexit.register(lambda: (print('tearing down', file=sys.stderr, flush=True), time.sleep(1.0)))\n"
    )
    server = start(index, tmp_path, *options, code=teardown + SLOW_SERVER)
    clients: list[threading.Thread] = []
    try:
        server.wait_ready()
        slow = f"/search?q={SLOW.replace(' ', '%20')}"
        for _ in range(4):  # slow queries queued one to a batch: the engine is busy past the timeout
            clients.append(threading.Thread(target=server.get, args=(slow, 30.0)))
            clients[-1].start()
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while "tearing down" not in server.log.read_text():
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log.read_text()
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
        log = server.log.read_text()
        assert "Traceback" not in log and "Exception ignored" not in log, log
        assert log.count("Application shutdown complete") == 1, log
    finally:
        server.stop(clients)
