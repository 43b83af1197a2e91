"""The public API: what ``from retrieval import ...`` offers, and that importing the package does nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import retrieval
from retrieval import runtime, timing

# What the extras (and torch, installed apart) bring: a module needing one of them is left out where it is absent
# (the Python 3.10 run has none of them).
OPTIONAL_DEPENDENCIES = {
    "torch",
    "transformers",
    "fastapi",
    "fastapi_offline",
    "uvicorn",
    "starlette",
    "pydantic",
    "ray",
    "matplotlib",
    "langchain_core",
    "openai",
}

PUBLIC = [
    "BuildOptions",
    "CorpusSpec",
    "Encoder",
    "EncoderInfo",
    "EncoderSpec",
    "Hit",
    "IndexSpec",
    "Manifest",
    "RetrievalError",
    "SearchParams",
    "Searcher",
    "TransformSpec",
    "add",
    "build_index",
    "calibrate_index",
    "describe_index",
    "refit",
    "remove",
    "tune_process",
]


def run(code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_the_public_api_is_listed_importable_and_documented() -> None:
    assert sorted(retrieval.__all__) == PUBLIC
    for name in PUBLIC:
        value = getattr(retrieval, name)
        assert (value.__doc__ or "").strip(), f"{name} has no docstring"
    assert set(PUBLIC) <= set(dir(retrieval))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        retrieval.nothing_here  # noqa: B018


@pytest.mark.process
def test_importing_retrieval_loads_nothing_heavy_and_star_imports_the_api() -> None:
    code = (
        "import sys, json, retrieval\n"
        "heavy = sorted(m for m in ('torch', 'faiss', 'pyarrow', 'transformers', 'numpy') if m in sys.modules)\n"
        "ns = {}\n"
        "exec('from retrieval import *', ns)\n"
        "print(json.dumps([heavy, sorted(n for n in ns if not n.startswith('__'))]))"
    )
    heavy, star = json.loads(run(code))
    assert heavy == [] and star == PUBLIC


@pytest.mark.process
def test_importing_the_package_and_its_modules_leaves_the_environment_alone() -> None:
    """Process tuning is an opt-in call (``tune_process``): it was done on import, for every library user."""
    code = (
        "import os, json, pkgutil, importlib\n"
        f"OPTIONAL = {OPTIONAL_DEPENDENCIES!r}\n"
        "before = dict(os.environ)\n"
        "import retrieval\n"
        "for m in pkgutil.walk_packages(retrieval.__path__, 'retrieval.', onerror=lambda name: None):\n"
        "    if m.name != 'retrieval.__main__':\n"
        "        try:\n"
        "            importlib.import_module(m.name)\n"
        "        except ModuleNotFoundError as err:  # an extra's module, its extra not installed\n"
        "            assert err.name.split('.')[0] in OPTIONAL, err\n"
        "from retrieval import *\n"
        "after = dict(os.environ)\n"
        "changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}\n"
        "print(json.dumps({k: after.get(k) for k in changed}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", *runtime.ONEDNN_CACHE_VARIABLES)}
    assert json.loads(run(code, env)) == {}


@pytest.mark.process
def test_tune_process_shortens_the_openmp_spin_unless_the_user_set_it() -> None:
    """torch's and FAISS's OpenMP threads must not spin ~15 ms after each region while the other one works."""
    code = "import os, retrieval; retrieval.tune_process(); print(os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert run(code, env) == "20000"
    assert run(code, env | {"GOMP_SPINCOUNT": "7"}) == "7"


def test_tune_process_for_serving_caps_onednn_caches_and_is_too_late_after_torch(monkeypatch) -> None:
    for variable in ("GOMP_SPINCOUNT", *runtime.ONEDNN_CACHE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")  # the user's
    monkeypatch.setitem(sys.modules, "torch", object())
    assert runtime.tune_process(serving=True) == {}  # torch is imported: nothing it reads is set any more
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.delitem(sys.modules, "faiss", raising=False)
    assert runtime.tune_process(serving=True) == {"GOMP_SPINCOUNT": "20000", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"


# In a fresh process: is a first 16 MiB block mapped apart (bit 2 of its chunk header, the size_t before the
# pointer), and is the heap's top handed back to the kernel (the program break lowered) once 64 MiB of it is free?
ALLOCATOR = """
import ctypes, json, os, sys, retrieval
set_now = retrieval.tune_process(serving=sys.argv[1] == "serve") if sys.argv[1] != "default" else {}
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
block = libc.malloc(16 << 20)
mapped = bool(ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 2)
libc.free(block)
blocks = [libc.malloc(64 << 10) for _ in range(1024)]
top = libc.sbrk(0)
for block in reversed(blocks):
    libc.free(block)
print(json.dumps([mapped, top - libc.sbrk(0) > 32 << 20, set_now]))
"""


@pytest.mark.process
@pytest.mark.skipif(not runtime._glibc(), reason="glibc's allocator")
def test_tune_process_keeps_batch_sized_blocks_on_the_heap_unless_the_user_tuned_malloc() -> None:
    """A batch's activations (MB) freshly mapped for every tensor cost more in page faults than int8's arithmetic."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def allocator(*args: str, **variables: str) -> list:
        out = subprocess.run(
            [sys.executable, "-c", ALLOCATOR, *args], env=env | variables, capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout)

    # glibc's defaults map the block apart (whether the top is trimmed then depends on what else the heap holds)
    assert allocator("default")[0::2] == [True, {}]
    mapped, trimmed, set_now = allocator("tune")
    assert (mapped, trimmed) == (False, False)  # on the heap, and 64 MiB of free top kept below the 256 MiB trim
    assert set_now["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20) and set_now["MALLOC_TRIM_THRESHOLD_"] == str(256 << 20)
    for args, variables in (
        (["tune"], {"MALLOC_ARENA_MAX": "2"}),
        (["tune"], {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}),
        (["serve"], {}),
    ):
        mapped, _, set_now = allocator(*args, **variables)  # the user's allocator settings win; a server keeps glibc's
        assert mapped and not any(name.startswith("MALLOC_") for name in set_now), (args, variables)


@pytest.mark.process
def test_the_command_line_tunes_the_process_before_it_imports_the_cli() -> None:
    code = (
        "import os, sys\n"
        "sys.argv = ['retrieval', '--version']\n"
        "from retrieval.__main__ import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert run(code, env).splitlines()[-1] == "20000"


# ----- the timing policy -----------------------------------------------------------------------------------------
def test_a_deterministic_policy_times_nothing_and_takes_each_default(monkeypatch) -> None:
    ran = []
    ways = {"a": lambda: ran.append("a"), "b": lambda: ran.append("b")}
    monkeypatch.setenv(timing.DETERMINISTIC_ENV, "1")
    assert timing.policy() == timing.Policy(timed=False)
    assert timing.policy().fastest("scan", ways, default="b", rounds=3) == "b" and ran == []
    monkeypatch.delenv(timing.DETERMINISTIC_ENV)
    assert timing.policy().timed and timing.policy().fastest("scan", ways, default="b", rounds=1) in ("a", "b")
    assert ran == ["a", "b"]


def test_an_injected_policy_answers_for_its_sites_whatever_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(timing.DETERMINISTIC_ENV, "1")
    with timing.use(timing.Policy(answers={"scan": "numpy"})):
        assert timing.policy().fastest("scan", {}, default="faiss", rounds=1) == "numpy"
        assert timing.policy().fixed("attention", "sdpa") is None  # timed: only the sites it names are fixed
    assert timing.policy() == timing.Policy(timed=False)
