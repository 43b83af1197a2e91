"""Options and arguments more than one command takes, and the library's defaults they show."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from retrieval.build import BuildOptions
from retrieval.codes import ROTATIONS
from retrieval.encode.spec import EncoderSpec
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
