"""MkDocs hook: the Python API page names the public API as ``retrieval.NAME``, wherever NAME is defined.

``docs/api.md`` writes ``::: retrieval.Searcher``. Where the package re-exports the name (``__all__`` of
``retrieval/__init__.py``), mkdocstrings documents it there; otherwise the line is pointed at the module that
defines it, found by reading the package's source (nothing imported), so the page follows the code when a
class moves between modules.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

DIRECTIVE = re.compile(r"^::: retrieval\.(?P<name>[A-Za-z_][A-Za-z0-9_]*)$", re.M)


def _exported(package: Path) -> set[str]:
    tree = ast.parse((package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {ast.literal_eval(elt) for elt in getattr(node.value, "elts", [])}
    return set()


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
    exported, defined = _exported(package), _defined(package)

    def where(match: re.Match[str]) -> str:
        name = match.group("name")
        if name in exported:
            return match.group(0)
        if name not in defined:
            raise PluginError(f"docs/api.md documents retrieval.{name}, which the package does not define")
        return f"::: {defined[name]}.{name}"

    return DIRECTIVE.sub(where, markdown)
