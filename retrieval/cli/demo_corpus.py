"""The demo corpus: paragraphs of the Python standard library's docstrings, read from source (no download)."""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from retrieval import files

DEMO_QUERIES = (
    "how do I parse command line arguments",
    "compress data with gzip",
    "read and write CSV files",
    "wait for a subprocess to finish with a timeout",
)
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "__pycache__"}


def docstring_paragraphs(stdlib: Path | None = None, min_words: int = 8) -> Iterator[tuple[str, str, str]]:
    """(id, title, paragraph) for every docstring paragraph of at least ``min_words`` words, in a stable order."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for name, node in documented(tree, module):
            doc = ast.get_docstring(node, clean=True) or ""
            for number, paragraph in enumerate(p for p in doc.split("\n\n") if len(p.split()) >= min_words):
                yield f"{name}#{number}", name, " ".join(paragraph.split())


Documented = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def documented(tree: ast.Module, module: str) -> Iterator[tuple[str, Documented]]:
    """(qualified name, node) of a module, its classes and functions, and the classes' methods."""
    yield module, tree
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield f"{module}.{node.name}", node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        yield f"{module}.{node.name}.{sub.name}", sub


def write_demo_corpus(path: Path, limit: int | None = None) -> int:
    """Write the corpus as parquet (columns id, title, text); returns the number of rows."""
    rows = []
    seen: set[str] = set()
    for doc_id, title, text in docstring_paragraphs():
        if doc_id in seen:  # a name defined twice in one module (e.g. under `if sys.platform`)
            continue
        seen.add(doc_id)
        rows.append((doc_id, title, text))
        if limit is not None and len(rows) >= limit:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(zip(*rows, strict=True))
    table = pa.table({"id": columns[0], "title": columns[1], "text": columns[2]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    files.write_atomic(path, sink.getvalue().to_pybytes())  # an interrupted demo never leaves half a corpus
    return table.num_rows
