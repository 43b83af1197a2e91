"""scripts/benchlib.py: the provenance every benchmark result carries, and the lock that keeps timings apart."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402


def test_a_json_result_records_cpu_revision_load_and_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(benchlib.ISA_CAP_ENV, raising=False)
    path = tmp_path / "r.json"
    benchlib.write_json(path, {"rows": [1, 2]})
    record = json.loads(path.read_text())
    assert record["rows"] == [1, 2]
    prov = record["provenance"]
    assert set(prov["cpu"]) == {"model", "cores", "usable_cores", "bf16", "vnni", "amx", "onednn_isa_cap"}
    assert prov["cpu"]["onednn_isa_cap"] is None
    assert all(isinstance(prov["cpu"][k], bool) for k in ("bf16", "vnni", "amx"))
    assert prov["cpu"]["cores"] >= 1 and prov["cpu"]["model"]
    revision = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if revision.returncode == 0:  # a git checkout: the revision it measured, and whether it had changes
        assert prov["git"]["revision"] == revision.stdout.strip()
        assert isinstance(prov["git"]["dirty"], bool)
    assert len(prov["loadavg_at_start"]) == 3 and len(prov["loadavg_at_end"]) == 3
    # the command that ran (pytest's, or an xdist worker's), its interpreter by name, not by absolute path
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    assert prov["command"] == shlex.join([Path(argv[0]).name, *argv[1:]])
    assert not prov["command"].startswith("/")


def test_the_cpu_flags_decide_bf16_vnni_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = {"fma avx2": (False, False, False), "avx512_vnni avx512_bf16": (True, True, False)}
    flags["avx_vnni amx_tile amx_bf16 amx_int8"] = (True, True, True)
    for line, (bf16, vnni, amx) in flags.items():
        monkeypatch.setattr(benchlib, "_all_cpu_flags", lambda line=line: set(line.split()))
        got = benchlib.cpu()
        assert (got["bf16"], got["vnni"], got["amx"]) == (bf16, vnni, amx), line


def test_a_markdown_result_ends_with_its_provenance(tmp_path: Path) -> None:
    path = tmp_path / "r.md"
    benchlib.write_md(path, "# A table\n\n| a |\n|---|\n| 1 |\n")
    text = path.read_text()
    assert text.startswith("# A table\n\n| a |\n|---|\n| 1 |\n\n## Provenance\n")
    for field in ("- CPU: ", "bf16: ", "VNNI: ", "AMX: ", "- Revision: ", "- Load average", "- Command: `"):
        assert field in text, field


HOLD = """
import sys, time
sys.path.insert(0, {scripts!r})
import benchlib
with benchlib.bench_lock():
    print("held", flush=True)
    time.sleep({seconds})
"""


def _holder(tmp_path: Path, lock: Path, seconds: float) -> subprocess.Popen[str]:
    env = {"RETRIEVAL_BENCH_LOCK": str(lock), "PATH": "/usr/bin:/bin"}
    code = HOLD.format(scripts=str(ROOT / "scripts"), seconds=seconds)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_the_lock_is_named_by_the_environment_and_waits_for_its_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / "bench.lock"
    monkeypatch.setenv("RETRIEVAL_BENCH_LOCK", str(lock))
    assert benchlib.lock_path() == lock
    holder = _holder(tmp_path, lock, 1.5)
    start = time.monotonic()
    with benchlib.bench_lock():
        waited = time.monotonic() - start
    holder.wait(10)
    assert waited >= 0.8  # it waited for the holder (which held it ~1.5 s after saying so)


def test_the_default_lock_is_under_the_temporary_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RETRIEVAL_BENCH_LOCK", raising=False)
    assert benchlib.lock_path() == Path(tempfile.gettempdir()) / "retrieval-bench.lock"


def test_a_holders_own_workers_and_flock_1_do_not_deadlock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = tmp_path / "bench.lock"
    monkeypatch.setenv("RETRIEVAL_BENCH_LOCK", str(lock))
    worker = [sys.executable, "-c", HOLD.format(scripts=str(ROOT / "scripts"), seconds=0)]
    with benchlib.bench_lock():  # a script's worker process, started while the script holds the lock
        done = subprocess.run(worker, capture_output=True, text=True, timeout=20, env=dict(os.environ))
        assert done.stdout == "held\n"
    if shutil.which("flock") is None:
        pytest.skip("no flock(1) here")
    lock.touch()
    env = {"RETRIEVAL_BENCH_LOCK": str(lock), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["flock", str(lock), *worker], capture_output=True, text=True, timeout=20, env=env)
    assert done.stdout == "held\n"  # `flock LOCK python scripts/bench_x.py`: the script sees the lock is its own


def test_a_timing_script_takes_the_lock_after_its_arguments(tmp_path: Path) -> None:
    lock = tmp_path / "bench.lock"
    holder = _holder(tmp_path, lock, 30)
    try:
        env = {**os.environ, "RETRIEVAL_BENCH_LOCK": str(lock)}
        script = ROOT / "scripts" / "bench_packing.py"
        done = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60, env=env
        )
        assert done.returncode == 0 and "usage:" in done.stdout  # --help never waits for another benchmark
        code = f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import benchlib; benchlib.hold_bench_lock()"
        with pytest.raises(subprocess.TimeoutExpired):  # a run does
            subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=3, env=env)
    finally:
        holder.kill()
        holder.wait(10)


def test_the_openvino_probe_without_its_packages_says_how_to_set_them_up() -> None:
    """openvino and nncf are no dependencies of the project: the probe stops in one line naming the venv that
    holds them, before it reads data or takes the lock, and writes no result."""
    import importlib.util

    if importlib.util.find_spec("openvino") and importlib.util.find_spec("nncf"):
        pytest.skip("openvino and nncf are installed here")
    results = sorted((ROOT / "results" / "encode").glob("openvino*"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "probe_openvino.py"), "--out", "results/encode/openvino-test"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert (
        len(lines) == 1 and "openvino and nncf are needed" in lines[0] and ".venv-openvino/bin/pip install" in lines[0]
    )
    assert sorted((ROOT / "results" / "encode").glob("openvino*")) == results


def test_an_emulated_cpu_says_so_in_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN capped below the CPU's instruction set (how a CPU without bf16 is emulated): the cap is in the
    provenance, in its markdown, and in front of both commands, so a rerun emulates the same CPU."""
    monkeypatch.setenv(benchlib.ISA_CAP_ENV, "AVX512_CORE_VNNI")
    benchlib.write_json(tmp_path / "r.json", {})
    prov = json.loads((tmp_path / "r.json").read_text())["provenance"]
    assert prov["cpu"]["onednn_isa_cap"] == "AVX512_CORE_VNNI"
    assert prov["command"].startswith("ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI ")
    assert benchlib.command_line().startswith("ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI python ")
    benchlib.write_md(tmp_path / "r.md", "# A table\n")
    assert "oneDNN capped at AVX512_CORE_VNNI" in (tmp_path / "r.md").read_text()
