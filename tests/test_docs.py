"""The documentation: the CLI reference is generated from the typer app, the README stays short and links to
pages that exist, and no tracked file speaks of how the project was built instead of what it is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cli_reference() -> Any:
    """docs/hooks/cli_reference.py (it imports mkdocs: the [docs] extra)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    import cli_reference

    return cli_reference


def _commands(cmd: object, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], object]]:
    found = [(path, cmd)]
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        found += _commands(sub, (*path, name))
    return found


def test_the_cli_reference_lists_every_command_and_option(cli_reference: Any) -> None:
    page = cli_reference.reference()
    for path, cmd in _commands(typer.main.get_command(cli_reference._app()), ("retrieval",)):
        assert f"\n{'#' * min(len(path) + 1, 4)} {' '.join(path)}\n" in page, path
        for param in cmd.params:  # type: ignore[attr-defined]
            if getattr(param, "hidden", False) or param.name == "help":
                continue
            for flag in [*param.opts, *param.secondary_opts]:
                shown = flag if param.param_type_name == "option" else param.name
                assert shown in page, (path, flag)


def test_the_cli_reference_takes_defaults_and_help_from_the_help_records(cli_reference: Any) -> None:
    page = cli_reference.reference()
    # the values --help shows: a default from the parameter, and one written into the help text
    assert re.search(r"\| `--max-queries <int>` \| 64 \| Queries in one request\. \|", page)
    assert re.search(r"\| `--dim <int>` \| the encoder's own, raw vectors \| Output dimension: whitens", page)


def test_the_readme_is_short_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target


PHASES = re.compile(r"\bstop ?[0-9]{1,3}\b|helper-[0-9]|/work/")


def test_no_tracked_file_outside_tests_names_work_phases_helpers_or_absolute_work_paths() -> None:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    offenders = []
    for name in listed.stdout.splitlines():
        path = ROOT / name
        if name.startswith("tests/") or not path.is_file() or path.suffix in {".png", ".parquet", ".npy"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        offenders += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if PHASES.search(line)]
    assert not offenders, offenders[:20]
