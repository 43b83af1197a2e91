"""MkDocs hook: the Python API page names the public API as ``retrieval.NAME``, wherever NAME is defined.

``docs/api.md`` writes ``::: retrieval.Searcher``; the line is pointed at the module that defines the name,
found by reading the package's source (nothing imported), so the page follows the code when a class moves
between modules, and does not depend on how the package re-exports it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

DIRECTIVE = re.compile(r"^::: retrieval\.(?P<name>[A-Za-z_][A-Za-z0-9_]*)$", re.M)


def _defined(package: Path) -> dict[str, str]:
    """Top-level class and function names -> the dotted module that defines them."""
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
                found.setdefault(node.name, module)
    return found


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != "api.md":
        return markdown
    package = Path(config["config_file_path"]).resolve().parent / "retrieval"
    defined = _defined(package)

    def where(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in defined:
            raise PluginError(f"docs/api.md documents retrieval.{name}, which the package does not define")
        return f"::: {defined[name]}.{name}"

    return DIRECTIVE.sub(where, markdown)
