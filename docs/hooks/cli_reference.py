"""MkDocs hook: the command-line reference page (cli.md), generated at build time from the typer app itself.

It walks the click command tree that typer builds from ``retrieval.cli``'s ``app`` (the object that
``retrieval --help`` renders) and takes each parameter's help record, the very line ``--help`` prints, so the
page cannot drift from the help: every command, argument and option with its default and help text. It works
whether ``retrieval.cli`` is a module or a package that exports ``app``.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

PAGE = "cli.md"
# The trailing "[default: ...]" / "[required]" of a help record (rich escapes a bracket in the text as "\[").
TAIL = re.compile(r"\s*(?<!\\)\[(default: .*|required)\]\s*$")


def _app() -> Any:
    """The typer app: ``retrieval.cli.app``, whether that names the object or a submodule that holds it."""
    module = importlib.import_module("retrieval.cli")
    app = getattr(module, "app", None)
    if app is None:  # a package that does not import its submodule `app` itself
        app = importlib.import_module("retrieval.cli.app")
    if isinstance(app, types.ModuleType):
        app = app.app
    return app


def _context_class(cmd: Any) -> Any:
    """click's Context from the module that defines the command's classes (typer may ship its own click)."""
    for klass in type(cmd).__mro__:
        context = getattr(sys.modules.get(klass.__module__), "Context", None)
        if context is not None:
            return context
    raise RuntimeError(f"no click Context found for {type(cmd)!r}")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("\\[", "[").replace("|", "\\|")


def _record(param: Any, ctx: Any) -> tuple[str, str, str]:
    """(the parameter as --help shows it, its default or "required", its help) from --help's own record."""
    record = param.get_help_record(ctx)
    if record is None:
        return "", "", ""
    flags, text = record
    tail = ""
    match = TAIL.search(text)
    if match:
        tail, text = match.group(1).removeprefix("default: "), text[: match.start()]
    inline = re.search(r"\s*\\\[default: (.*)\]\.?\s*$", text)  # a default written into the help itself
    if inline and not tail:
        tail, text = inline.group(1), text[: inline.start()]
    return flags, tail, text


def _render(cmd: Any, path: list[str], ctx: Any, out: list[str]) -> None:
    name = " ".join(path)
    out.append(f"{'#' * min(len(path) + 1, 4)} {name}\n")
    help_text = (cmd.help or cmd.short_help or "").split("\f")[0].strip()
    if help_text:
        out.append(help_text + "\n")
    out.append(f"```\n{name} {' '.join(cmd.collect_usage_pieces(ctx))}\n```\n")
    params = [p for p in cmd.get_params(ctx) if not getattr(p, "hidden", False) and p.name != "help"]
    if params:
        out.append("| argument or option | default | description |\n|---|---|---|")
        for p in params:
            flags, default, text = _record(p, ctx)
            if flags:
                out.append(f"| `{_cell(flags)}` | {_cell(default)} | {_cell(text)} |")
        out.append("")
    if hasattr(cmd, "list_commands"):
        for sub_name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, sub_name)
            if sub is not None and not getattr(sub, "hidden", False):
                _render(sub, [*path, sub_name], type(ctx)(sub, info_name=sub_name, parent=ctx), out)


def reference() -> str:
    """The whole page, as markdown."""
    import typer

    root = typer.main.get_command(_app())
    ctx = _context_class(root)(root, info_name="retrieval")
    out = [
        "# Command line\n",
        "Generated from the command-line program itself when this site is built: the commands, options, defaults",
        "and help texts of `retrieval --help` and `retrieval COMMAND --help`. Errors are one line on stderr",
        "starting `error:`, with exit status 1 (2 for usage errors, 130 on Ctrl-C, 143 on SIGTERM).\n",
    ]
    _render(root, ["retrieval"], ctx, out)
    return "\n".join(out) + "\n"


def on_files(files: Files, config: Any) -> Files:
    root = str(Path(config["config_file_path"]).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)  # document the checkout being built, not another installed copy
    files.append(File.generated(config, PAGE, content=reference()))
    return files
