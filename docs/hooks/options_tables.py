"""MkDocs hook: the option tables, generated at build time from the dataclass fields that declare the options.

A page line ``<!-- options: retrieval.serve.service:ServeOptions -->`` becomes that spec's table
(``retrieval.options.markdown_table``): each documented field's flag, type, default and help, the very text
``--help`` and the service's /info show, so the page cannot drift from them.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

MARKER = re.compile(r"^<!-- options: ([\w.]+):(\w+) -->$", re.MULTILINE)


def tables(markdown: str) -> str:
    """``markdown`` with each options marker replaced by its spec's table."""
    from retrieval.options import markdown_table

    def table(match: re.Match[str]) -> str:
        return markdown_table(getattr(importlib.import_module(match.group(1)), match.group(2))).rstrip("\n")

    return MARKER.sub(table, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return tables(markdown)
