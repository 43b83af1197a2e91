"""Options and arguments more than one command takes, and the library's defaults they show."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from retrieval.build import BuildOptions
from retrieval.encode.spec import EncoderSpec
from retrieval.fusion import FusionSpec
from retrieval.index import IndexSpec
from retrieval.manifest import RESCORE_DEPTH
from retrieval.options import described
from retrieval.search import SearchParams
from retrieval.whitening import TransformSpec

F = TypeVar("F", bound=Callable[..., Any])

TextOption = Annotated[str, typer.Option(help="Column with the document text.")]
IdOption = Annotated[
    str | None,
    typer.Option(
        help="Column with document ids \\[default: id if present, else row numbers; <file>:<row> for a folder or glob]."
    ),
]
TitleOption = Annotated[str | None, typer.Option(help="Column prepended to the text, as BEIR does.")]
SkipEmptyOption = Annotated[bool, typer.Option(help="Leave out rows with null or empty text instead of failing.")]
CorpusArg = Annotated[
    Path,
    typer.Argument(
        help="Parquet file with one document per row, a folder of parquet files, a glob in quotes "
        "('data/part-*.parquet'), or a .npy array of vectors."
    ),
]
DefaultTransform, DefaultIndex, DefaultEncoder, DefaultBuild = (
    TransformSpec(),
    IndexSpec(),
    EncoderSpec(),
    BuildOptions(),
)
DefaultSearch = SearchParams()

IndexOption = Annotated[Path | None, typer.Option("--index", help="Index directory \\[default: the last built].")]
EfOption = Annotated[int | None, typer.Option("--ef-search", "--ef", help="HNSW search beam width.")]
NprobeOption = Annotated[int | None, typer.Option(help="IVF lists probed.")]
RescoreOption = Annotated[
    int | None,
    typer.Option(
        help="Re-rank this many candidates at full dimension from the stash; 0: off "
        f"\\[default: the index's: {RESCORE_DEPTH} when it kept its stash and has fewer dims than the encoder "
        "or lossy FAISS codes (PCA, PQ, SQ8), else off]."
    ),
]


AS_BUILT = "\\[default: as the index was built]"
IndexDirArg = Annotated[Path, typer.Argument(help="Index directory to change in place (atomically).", file_okay=False)]
IndexArg = Annotated[Path, typer.Argument(help="Index directory.", exists=True, file_okay=False)]


def adds_search_options(command: F) -> F:
    """``mode`` and ``where`` (SearchParams' fields), ``--fusion`` and ``--fusion-weight`` (FusionSpec's ``method``
    and ``weight``, defaulting to the index's): the options of a command that searches, taken as ``**options``
    and turned into SearchParams by ``search_params``."""
    command = adds_options(FusionSpec, keep="the index's")(command)
    return adds_options(SearchParams)(command)


def search_params(directory: Path | None, options: dict[str, Any], **knobs: Any) -> SearchParams:
    """The search parameters of the CLI's options (``adds_search_options``), every value checked (the fusion
    starts from the index's)."""
    from retrieval.filters import parse

    mode, where, fusion, weight = (options[name] for name in ("mode", "where", "method", "weight"))

    spec = None
    if fusion is not None or weight is not None:
        recorded = FusionSpec()
        if directory is not None:
            from retrieval.indexdir import IndexDir

            recorded = IndexDir(directory).manifest().fusing
        spec = replace(recorded, method=fusion or recorded.method, weight=recorded.weight if weight is None else weight)
    where_filter = parse(where) if where is not None else None
    params = SearchParams(mode=mode, fusion=spec, where=where_filter, rerank=options.get("rerank"), **knobs)
    params.check()
    return params


def adds_options(
    spec: type,
    *,
    only: Sequence[str] | None = None,
    keep: str | None = None,
) -> Callable[[F], F]:
    """Give a command one option per documented field of ``spec`` (``retrieval.options``): the field's name,
    type, default and help, declared once there. The command takes them as ``**options``. Fields marked
    ``cli=False`` are left out; ``only`` picks (and orders) some; a field's ``cli_type`` and ``cli_default``
    stand for its own where the command line reads it otherwise; ``keep``: every default is None, meaning this
    (``keep``: a command that changes an index keeps its value)."""
    hints = typing.get_type_hints(spec)
    chosen = {item.name: item for item in described(spec) if item.metadata.get("cli", True)}
    names = list(only) if only is not None else list(chosen)

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)  # the typer options inside Annotated, as objects
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = []
        for name in names:
            item = chosen[name]
            kind = item.metadata.get("cli_type", hints[name])
            default = item.default  # cli_default where it has one
            text = item.help
            if keep is not None:
                kind, default, text = kind | None, None, f"{text} \\[default: {keep}]"
            elif "default_help" in item.metadata:
                text = f"{text} \\[default: {item.metadata['default_help']}]"
            decls = item.metadata.get("flag_decls", ())
            option = typer.Option(*decls, help=text, show_default=keep is None and "default_help" not in item.metadata)
            annotation = Annotated[kind, option]  # type: ignore[valid-type]  # the field's type, read at run time
            added.append(
                inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            )
        command.__signature__ = signature.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
        return command

    return decorate


def fields_of(spec: type, options: dict[str, Any]) -> dict[str, Any]:
    """The options a command received (``adds_options``) that are fields of ``spec``."""
    names = {field.name for field in dataclasses.fields(spec)}
    return {name: value for name, value in options.items() if name in names}
