"""Options and arguments more than one command takes, and the library's defaults they show."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from retrieval.build import BuildOptions
from retrieval.codes import ROTATIONS
from retrieval.encode.spec import EncoderSpec
from retrieval.fusion import METHODS, MODES, FusionSpec
from retrieval.index import CODES, IndexSpec
from retrieval.indexdir import RESCORE_DEPTH
from retrieval.search import SearchParams
from retrieval.whitening import TransformSpec

TextOption = Annotated[str, typer.Option(help="Column with the document text.")]
CODES_HELP = (
    f"What the index keeps of each vector: {', '.join(CODES)} (flat, hnsw, ivf; binary: 1 bit a dimension, "
    "Hamming distance, re-scored from the stash)"
)
CodesOption = Annotated[str | None, typer.Option(help=f"{CODES_HELP} \\[default: fp16 for ivf, else fp32].")]
RotationOption = Annotated[
    str | None,
    typer.Option(help=f"Binary codes: the rotation after the kernel, {', '.join(ROTATIONS)} \\[default: itq]."),
]
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

ModeOption = Annotated[
    str | None,
    typer.Option(help=f"{', '.join(MODES)} \\[default: hybrid where the index has a lexical part, else dense]."),
]
WhereOption = Annotated[
    str | None,
    typer.Option(
        help="Keep only rows matching this filter over the index's --columns, e.g. \"year >= 2020 and source = "
        "'pubmed'\" (=, !=, <, <=, >, >=, in (...), not in (...), is null, is not null; and, or, not, parentheses)."
    ),
]
FusionOption = Annotated[
    str | None, typer.Option(help=f"Hybrid: fuse by {' or '.join(METHODS)} \\[default: the index's].")
]
FusionWeightOption = Annotated[
    float | None, typer.Option(help="Hybrid: the dense side's weight, 0-1 \\[default: the index's].")
]


def search_params(
    directory: Path | None, mode: str | None, where: str | None, fusion: str | None, weight: float | None, **knobs: Any
) -> SearchParams:
    """The search parameters of the CLI's options, every value checked (``fusion`` starts from the index's)."""
    from retrieval.filters import parse

    spec = None
    if fusion is not None or weight is not None:
        recorded = FusionSpec()
        if directory is not None:
            from retrieval.indexdir import IndexDir

            recorded = IndexDir(directory).manifest().fusing
        spec = replace(recorded, method=fusion or recorded.method, weight=recorded.weight if weight is None else weight)
    params = SearchParams(mode=mode, fusion=spec, where=parse(where) if where is not None else None, **knobs)
    params.check()
    return params
