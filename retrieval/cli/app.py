"""The command line: the typer app, its global options, and its commands registered from one module per group.

Each command parses its options, calls the library and renders what it returns. Every default comes from the
library's specs (``TransformSpec``, ``IndexSpec``, ``EncoderSpec``, ``BuildOptions``, ``SearchParams``,
``ServeOptions``), and every value is checked there too: the library names a bad parameter, the CLI renders it
as its flag. Text from users and documents is never read as rich markup.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.logging import RichHandler

from retrieval.cli import build, demo, evaluate, search, serve, tuning
from retrieval.cli.shell import err


class _OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a wrong type, a missing argument) as one line on stderr, like every other error."""

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, standalone_mode: bool = True, **kw: Any
    ) -> Any:
        try:
            code = super().main(args, prog_name, standalone_mode=False, **kw)
        except typer.Abort:
            print("error: aborted", file=sys.stderr)
            code = 1
        except typer.TyperException as exc:  # typer's own click: usage errors, bad values, missing arguments
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            print(f"error: {' '.join(message.split())} (see --help)", file=sys.stderr)
            code = getattr(exc, "exit_code", 2)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # while a command's arguments are parsed (inside a command, ``user_errors``)
            print("error: interrupted", file=sys.stderr)
            raise typer.Exit(130) from None


app = typer.Typer(
    cls=_OneLineErrors,
    help="Whitened dense retrieval: build a FAISS index from a parquet corpus, then search it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for command in (
    build.index,
    search.search,
    search.info,
    build.add,
    build.remove,
    build.refit,
    tuning.calibrate,
    demo.demo,
):
    app.command()(command)
app.add_typer(evaluate.eval_app, name="eval")
app.command()(tuning.tune)
app.command()(serve.serve)


def _print_version(given: bool) -> None:
    if given:
        from retrieval import __version__

        print(f"retrieval {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress details.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    # On a terminal, rich's columns; into a file or a pipe (a service's log), one plain line per record: rich
    # would break a long line (a path) at 80 columns, and a line broken in two cannot be searched for.
    handler: logging.Handler
    if err.is_terminal:
        handler = RichHandler(console=err, show_time=False, show_path=False, markup=False)
        layout = "%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        layout = "%(levelname)-8s %(message)s"
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format=layout, handlers=[handler], force=True
    )


def run() -> None:
    for stream in (sys.stdout, sys.stderr):  # a terminal or pipe that is not UTF-8 (PYTHONIOENCODING=ascii, a
        if hasattr(stream, "reconfigure"):  # latin-1 locale): a hit in Chinese crashed the table; now escaped
            stream.reconfigure(errors="backslashreplace")
    app(prog_name="retrieval")


if __name__ == "__main__":  # pragma: no cover
    run()
