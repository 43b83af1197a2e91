"""docs/reliability.md is the page scripts/reliability_table.py writes from the reliability tests' registry."""

from __future__ import annotations

import importlib.util

from conftest import ROOT
from reliability import CASES


def test_the_docs_page_is_this_registry() -> None:
    spec = importlib.util.spec_from_file_location("reliability_table", ROOT / "scripts" / "reliability_table.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = script.page()
    assert (ROOT / "docs" / "reliability.md").read_text() == page, "regenerate: python scripts/reliability_table.py"
    assert len(CASES) >= 40
    assert all(f"| {case.tried} |" in page for case in CASES.values())
