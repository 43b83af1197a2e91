"""Commands that write an index: ``index`` (build), ``add``, ``remove``, ``refit``."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from retrieval import files
from retrieval.build import BuildOptions, build_index, check_target, window_rows
from retrieval.cli import home
from retrieval.cli.options import (
    AS_BUILT,
    CorpusArg,
    DefaultEncoder,
    DefaultIndex,
    IdOption,
    IndexDirArg,
    SkipEmptyOption,
    TextOption,
    TitleOption,
    adds_options,
    fields_of,
)
from retrieval.cli.shell import choice, err, progress_bars, safe, sigterm_exits, summary_line, user_errors
from retrieval.corpus import Corpus, CorpusSpec
from retrieval.encode.models import model_dim
from retrieval.encode.spec import POOLINGS, PRECISIONS, EncoderSpec
from retrieval.errors import ConfigError, Interrupted
from retrieval.index import IndexSpec, check_buildable
from retrieval.lexical import LexicalSpec
from retrieval.manifest import Manifest
from retrieval.stash import DTYPES
from retrieval.whitening import TransformSpec

ENGINES = ("local", "ray")

if TYPE_CHECKING:
    from retrieval.distributed import RayOptions


@user_errors
@adds_options(CorpusSpec, only=["columns"])
@adds_options(BuildOptions)
@adds_options(IndexSpec)
@adds_options(TransformSpec)
def index(
    corpus: CorpusArg,
    no_whiten: Annotated[bool, typer.Option("--no-whiten", help="Raw baseline: L2-normalised encoder output.")] = False,
    model: Annotated[
        str, typer.Option(help="Local folder, installed offline model, or hub name.")
    ] = DefaultEncoder.model,
    pooling: Annotated[str, typer.Option(help=f"Token pooling: {', '.join(POOLINGS)}.")] = DefaultEncoder.pooling,
    extra_pooling: Annotated[
        list[str] | None, typer.Option(help="Also stash this pooling (repeatable), for `retrieval tune`.")
    ] = None,
    text_column: TextOption = "text",
    id_column: IdOption = None,
    title_column: TitleOption = None,
    vectors_column: Annotated[
        str | None, typer.Option(help="Column of precomputed embeddings (list of floats): skip encoding.")
    ] = None,
    skip_empty: SkipEmptyOption = False,
    max_length: Annotated[int | None, typer.Option(help="Tokens per text \\[default: the model's].")] = None,
    batch_size: Annotated[int, typer.Option(help="Texts per forward pass.")] = DefaultEncoder.batch_size,
    precision: Annotated[
        str,
        typer.Option(
            help=f"{', '.join(PRECISIONS)}: auto is fp32, or on a CPU with native bf16 the faster of the two on the "
            "first batch where bf16 agrees with fp32; int8: int8 linear layers (min cosine to fp32 >= 0.99), opt-in."
        ),
    ] = DefaultEncoder.precision,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Index directory \\[default: indexes/<stem>].")] = None,
    engine: Annotated[
        str, typer.Option(help="Where texts are encoded: local (this process) or ray (Ray Data workers).")
    ] = "local",
    address: Annotated[
        str | None,
        typer.Option(help="Ray: a running cluster (auto, host:port, ray://host:port) \\[default: start a local Ray]."),
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Ray: encoding workers \\[default: one per CPU].")] = None,
    **specs: Any,
) -> None:
    """Build a whitened FAISS index from a parquet corpus (a file, a folder or a glob) or a .npy of vectors."""
    from retrieval.distributed import RayOptions

    choice("pooling", pooling, POOLINGS)
    choice("precision", precision, PRECISIONS)
    if precision == "int8" and (vectors_column is not None or str(corpus).endswith(".npy")):
        raise ConfigError(
            "`precision` int8 is how text is encoded, and this corpus is precomputed vectors: leave `precision` unset",
            "precision",
        )
    choice("stash_dtype", specs["stash_dtype"], DTYPES)
    choice("engine", engine, ENGINES)
    if engine == "local" and (address is not None or workers is not None):
        raise ConfigError("`address` and `workers` are for `engine` ray", "engine")
    transform = TransformSpec(whiten=False if no_whiten else None, **fields_of(TransformSpec, specs))
    index_spec = IndexSpec(**fields_of(IndexSpec, specs))
    transform.check()  # every value checked before a model is loaded; dim against d once it is known
    index_spec.check()
    given = {
        name: specs[name] for name in ("nlist", "nprobe", "train_size", "codes", "rotation", "rerank")
    }  # None unless set
    given |= {  # the rest, unless changed
        name: specs[name]
        for name in ("m", "ef_construction", "ef_search")
        if specs[name] != getattr(DefaultIndex, name)
    }
    index_spec.check_given(given)
    kept = tuple(c.strip() for c in (specs["columns"] or "").split(",") if c.strip())
    build = fields_of(BuildOptions, specs) | {"lexical": LexicalSpec() if specs["lexical"] else None}
    run_build(
        CorpusSpec(corpus, text_column, id_column, title_column, vectors_column, skip_empty, kept),
        EncoderSpec(model, pooling, max_length, batch_size, precision),
        out_dir or home.default_out(corpus),
        transform,
        index_spec,
        BuildOptions(extra_poolings=tuple(extra_pooling or ()), **build),
        RayOptions(address, workers) if engine == "ray" else None,
    )


def run_build(
    spec: CorpusSpec,
    encoder_spec: EncoderSpec,
    target: Path,
    transform: TransformSpec,
    index_spec: IndexSpec,
    options: BuildOptions,
    ray_options: RayOptions | None = None,
) -> Manifest:
    """Check every value before a model is loaded, build with progress bars (pass 1 on Ray with ``ray_options``),
    make the index the default one and print its summary line. The windows are sized for the corpus."""
    from retrieval.distributed import RayEngine

    transform.check()
    index_spec.check()
    if ray_options is not None:
        ray_options.check()
    check_target(target, options.overwrite)
    source = Corpus(spec)  # the file(s) and their columns, before seconds go into loading a model
    d = source.vector_dim if source.precomputed else model_dim(encoder_spec.model)
    if not source.precomputed:
        transform.check(d)  # a local model's config knows d: refused now, not after a load
    if d is not None:
        # an index FAISS cannot build or train on this many rows (IVF lists, PQ codebooks) refused before the model
        # loads; the rows validation keeps can only be fewer, which the build checks again once it has counted them
        check_buildable(index_spec, transform.dim or d, source.num_rows)
    options = replace(options, window_rows=window_rows(source.num_rows, distributed=ray_options is not None))
    options.check()
    encoder = None if source.precomputed else encoder_spec.load()
    try:
        with ExitStack() as stack:
            stack.enter_context(sigterm_exits())  # the lock is released; a Ray started for the build is shut down
            ray = None if ray_options is None else stack.enter_context(RayEngine(encoder_spec, ray_options))
            update = stack.enter_context(progress_bars())
            manifest = build_index(spec, encoder, target, transform, index_spec, options, progress=update, engine=ray)
    except KeyboardInterrupt as stop:
        raise Interrupted.by(
            stop,
            ": the parts encoded so far are kept; rerun the same command with --resume to continue"
            if files.work_dir(files.resolved(target)).exists()
            else "; nothing was written",
        ) from None
    home.remember(target)
    err.print(summary_line(target, manifest, "built"), markup=False)
    return manifest


@user_errors
def add(
    index_dir: IndexDirArg,
    corpus: CorpusArg,
    text_column: Annotated[str | None, typer.Option(help=f"Column with the document text {AS_BUILT}.")] = None,
    id_column: Annotated[
        str | None, typer.Option(help=f"Column with document ids, '' for row numbers {AS_BUILT}.")
    ] = None,
    title_column: Annotated[
        str | None, typer.Option(help=f"Column prepended to the text, '' for none {AS_BUILT}.")
    ] = None,
    vectors_column: Annotated[str | None, typer.Option(help=f"Column of precomputed embeddings {AS_BUILT}.")] = None,
    skip_empty: Annotated[
        bool | None, typer.Option("--skip-empty/--no-skip-empty", help=f"Leave out empty texts {AS_BUILT}.")
    ] = None,
) -> None:
    """Encode new documents and add them to an index with its existing kernel (see `info` for drift)."""
    from retrieval.update import add as add_rows
    from retrieval.update import read_like_build

    spec = read_like_build(
        index_dir, corpus, text_column=text_column, id_column=id_column, title_column=title_column,
        vectors_column=vectors_column, skip_empty=skip_empty,
    )  # fmt: skip
    with sigterm_exits(), progress_bars() as update:
        manifest = add_rows(index_dir, spec, progress=update)
    rows = manifest.corpus.added[-1]["rows"]
    err.print(f"added {rows:,} rows to {safe(str(index_dir))}: now {manifest.n:,}", markup=False)


@user_errors
def remove(
    index_dir: IndexDirArg,
    ids: Annotated[list[str] | None, typer.Argument(help="Ids of the documents to remove.", show_default=False)] = None,
    ids_from: Annotated[
        Path | None,
        typer.Option(help="A file of ids to remove, one per line ('-': standard input).", dir_okay=False),
    ] = None,
    missing_ok: Annotated[
        bool, typer.Option("--missing-ok", help="Skip ids the index does not hold instead of refusing them all.")
    ] = False,
) -> None:
    """Remove documents by id, from the index and its stash, with its existing kernel: nothing is encoded."""
    from retrieval.update import remove as remove_rows

    wanted = [*(ids or []), *(read_ids(ids_from) if ids_from is not None else [])]
    if not wanted:
        raise ConfigError("no ids to remove: give them as arguments or with --ids-from FILE (one per line)", "ids")
    with sigterm_exits(), progress_bars() as update:
        manifest = remove_rows(index_dir, wanted, missing_ok=missing_ok, progress=update)
    if manifest is None:
        err.print(f"none of the {len(set(wanted)):,} ids is in {safe(str(index_dir))}: nothing changed", markup=False)
        return
    rows = manifest.corpus.removed[-1]["rows"]
    err.print(f"removed {rows:,} rows from {safe(str(index_dir))}: now {manifest.n:,}", markup=False)
    faiss_info = manifest.index.faiss
    if faiss_info.get("empty_lists", 0) * 2 > faiss_info.get("nlist", 0):
        from retrieval.info import lists_line

        err.print(f"IVF lists: {lists_line(faiss_info)}", markup=False)


def read_ids(path: Path) -> list[str]:
    """Ids from a text file (or standard input for ``-``), one per ``\n``-ended line (``\r\n`` too), without
    the spaces and tabs around them (an editor's or a copied column's; inside an id they stay); blank lines
    skipped; any other character belongs to the id (``\f``, U+2028 and U+0085 are not line ends here, as they
    are to ``str.splitlines``); a leading BOM is dropped."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text ({error.reason}); write one id per line", "ids_from") from None
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}", "ids_from") from None
    lines = (line.removesuffix("\r").strip(" \t") for line in text.split("\n"))
    return [line for line in lines if line]


@user_errors
@adds_options(IndexSpec, keep="keep")
@adds_options(TransformSpec, keep="keep")
def refit(
    index_dir: IndexDirArg,
    whiten: Annotated[
        bool | None, typer.Option("--whiten/--no-whiten", help="Whiten, or the raw baseline \\[default: keep].")
    ] = None,
    pooling: Annotated[str | None, typer.Option(help="Stashed pooling to fit on \\[default: keep].")] = None,
    **specs: Any,
) -> None:
    """Re-fit the kernel and rebuild the index from the stash, without re-encoding; unset options keep their values."""
    from retrieval.update import current, index_spec, transform_spec
    from retrieval.update import refit as refit_index

    choice("pooling", pooling, POOLINGS)
    generation = current(index_dir).generation  # first: the settings kept are read from this version or later
    transform = transform_spec(index_dir, whiten=whiten, pooling=pooling, **fields_of(TransformSpec, specs))
    spec = index_spec(index_dir, **fields_of(IndexSpec, specs))
    with sigterm_exits(), progress_bars() as update:
        manifest = refit_index(index_dir, transform, spec, progress=update, generation=generation)
    err.print(summary_line(index_dir, manifest, "refitted"), markup=False)
