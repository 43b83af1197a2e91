"""The long contract run before a release: schemathesis against a live `retrieval serve` on 127.0.0.1.

The test suite runs the same checks in-process with a fake encoder and a few examples per operation
(tests/test_api_contract.py); this script serves a real index with the real model and lets schemathesis generate
many more requests (`--max-examples` per operation, every check, a fixed seed), then writes what it found:

    python scripts/api_contract.py                      # builds a small index of the demo corpus first
    python scripts/api_contract.py --index indexes/my-index --max-examples 2000

Results: results/api-contract/contract.{json,md}. The server binds 127.0.0.1 on a free port and is stopped when
the run ends (or fails).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib

ANNOUNCED = re.compile(r"http://127\.0\.0\.1:(\d+)")


def build_demo_index(folder: Path, rows: int) -> Path:
    """A small index of the demo corpus (the standard library's docstrings), built by the CLI as a user would,
    keeping the title as a metadata column for filters."""
    from retrieval.cli.demo_corpus import write_demo_corpus

    corpus = folder / "corpus.parquet"
    write_demo_corpus(corpus, limit=rows)
    index = folder / "index"
    subprocess.run(
        # the title kept as a metadata column: the document then states the filter grammar over it
        [sys.executable, "-m", "retrieval", "index", str(corpus), "--out", str(index), "--dim", "64"]
        + ["--columns", "title"],
        check=True,
        env=benchlib.retrieval_env(),
    )
    return index


def start_server(index: Path, api_key: str, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`retrieval serve` on 127.0.0.1 and a free port; returns the process and the port it announced."""
    out = log.open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "retrieval", "serve", str(index), "--host", "127.0.0.1", "--port", "0"],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=benchlib.retrieval_env(RETRIEVAL_API_KEY=api_key),
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = ANNOUNCED.search(log.read_text(errors="replace"))
        if found:
            return server, int(found.group(1))
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}; its log: {log}")
        time.sleep(0.2)
    server.terminate()
    raise SystemExit(f"the server did not announce a port in 300 s; its log: {log}")


def wait_ready(port: int, api_key: str) -> None:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/ready", headers={"Authorization": f"Bearer {api_key}"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready in 300 s")


def run_schemathesis(port: int, api_key: str, max_examples: int, seed: int, report: Path) -> tuple[int, str]:
    command = [
        shutil.which("schemathesis") or "schemathesis",
        "run",
        f"http://127.0.0.1:{port}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--header",
        f"Authorization: Bearer {api_key}",
        "--report",
        "junit",
        "--report-junit-path",
        str(report),
        "--generation-database",
        "none",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=Path, help="an index directory to serve (default: build a demo index)")
    parser.add_argument("--index-label", help="what the results say the --index is (default: its path)")
    parser.add_argument("--rows", type=int, default=2000, help="rows of the demo corpus to index (default 2000)")
    parser.add_argument("--max-examples", type=int, default=2000, help="examples per operation (default 2000)")
    parser.add_argument("--seed", type=int, default=20261128)
    parser.add_argument("--out", default="api-contract", help="folder under results/ (default api-contract)")
    args = parser.parse_args()
    if shutil.which("schemathesis") is None:
        raise SystemExit("schemathesis is not installed: pip install -e '.[dev]'")

    out = benchlib.out_dir(args.out)
    api_key = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="api-contract-") as scratch:
        work = Path(scratch)
        index = args.index or build_demo_index(work, args.rows)
        server, port = start_server(index, api_key, work / "server.log")
        try:
            wait_ready(port, api_key)
            started = time.monotonic()
            code, output = run_schemathesis(port, api_key, args.max_examples, args.seed, work / "junit.xml")
            seconds = time.monotonic() - started
            junit = (work / "junit.xml").read_text() if (work / "junit.xml").exists() else ""
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    failures = junit.count("<failure")
    # the last lines of schemathesis' report, without the temporary JUnit file's path
    summary = [line for line in output.strip().splitlines()[-40:] if "JUnit:" not in line]
    record = {
        "index": (args.index_label or str(index))
        if args.index
        else f"demo corpus, {args.rows} rows, --dim 64 --columns title",
        "max_examples": args.max_examples,
        "seed": args.seed,
        "exit_code": code,
        "operations_failed": failures,
        "seconds": round(seconds, 1),
        "schemathesis_summary": summary,
    }
    benchlib.write_json(out / "contract.json", record)
    table = benchlib.md_table(
        [record],
        [("index", "index served"), ("max_examples", "examples / operation"), ("operations_failed", "failed")]
        + [("seconds", "s")],
    )
    benchlib.write_md(
        out / "contract.md",
        f"# API contract (schemathesis, all checks)\n\n`{benchlib.command_line()}`\n\n{table}\n\n"
        + "```\n"
        + "\n".join(summary)
        + "\n```",
    )
    print(json.dumps({k: v for k, v in record.items() if k != "schemathesis_summary"}))
    print("\n".join(summary))
    sys.exit(0 if code == 0 else 1)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
