"""MkDocs hook: publish results/ (the benchmarks' JSON, markdown and plots) beside the pages, as static files.

The benchmark pages link to them as ``../results/...`` (they are copied, not rendered), so a link to a result
that does not exist fails ``mkdocs build --strict`` like any other broken link. A page line
``<!-- result: results/DIR/FILE.md -->`` is replaced by that file, as the benchmark wrote it, in a collapsed block:
the page's tables come from results/ at build time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files


class _Static(File):
    """A result file copied as it is: a results/*.md is data to download, not a page of the site."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False


def on_files(files: Files, config: Any) -> Files:
    root = Path(config["config_file_path"]).resolve().parent
    results = root / "results"
    for path in sorted(p for p in results.rglob("*") if p.is_file()):
        if path.suffix not in {".json", ".md", ".png"}:
            continue
        uri = path.relative_to(root).as_posix()
        files.append(_Static(uri, str(root), config["site_dir"], config["use_directory_urls"]))
    return files


MARKER = re.compile(r"^<!-- result: (?P<path>\S+) -->$", re.M)


def _embed(match: re.Match[str], root: Path) -> str:
    """A result's markdown, as the benchmark wrote it, in a collapsed block (its headings two levels down)."""
    rel = match.group("path")
    path = root / rel
    if not path.is_file():
        raise PluginError(f"a benchmark page embeds {rel}, which does not exist")
    text = re.sub(r"^(#{1,4}) ", r"\1## ", path.read_text(), flags=re.M)
    body = "\n".join(("    " + line) if line.strip() else "" for line in text.splitlines())
    return f'??? note "The whole result: `{rel}`"\n\n{body}\n'


def on_nav(nav: Any, config: Any, files: Files) -> Any:
    """A benchmark page that mkdocs.yml's nav does not list yet still appears under Benchmarks."""
    section = next((item for item in nav.items if getattr(item, "title", None) == "Benchmarks"), None)
    if section is None:
        return nav
    listed = {id(page) for page in nav.pages}
    for file in files.documentation_pages():
        page = file.page
        if file.src_uri.startswith("benchmarks/") and page is not None and id(page) not in listed:
            page.parent = section
            section.children.append(page)
    return nav


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    root = Path(config["config_file_path"]).resolve().parent
    return MARKER.sub(lambda m: _embed(m, root), markdown)
