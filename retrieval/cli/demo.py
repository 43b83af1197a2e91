"""``demo``: index the standard library's docstrings (built here, no download) and search them."""

from __future__ import annotations

from typing import Annotated

import typer

from retrieval import files
from retrieval.build import BuildOptions
from retrieval.cli import home
from retrieval.cli.build import run_build
from retrieval.cli.search import search_one
from retrieval.cli.shell import err, user_errors
from retrieval.corpus import CorpusSpec
from retrieval.encode.models import model_dim
from retrieval.encode.spec import EncoderSpec
from retrieval.errors import ConfigError, Interrupted
from retrieval.index import IndexSpec
from retrieval.search import SearchParams
from retrieval.whitening import TransformSpec


@user_errors
def demo(
    dim: Annotated[int, typer.Option(help="Output dimension.")] = 128,
    k: Annotated[int, typer.Option("-k", help="Hits per query.")] = 3,
) -> None:
    """Index the Python standard library's docstrings (built here, no download) and run a few searches."""
    from retrieval.cli.demo_corpus import DEMO_QUERIES, write_demo_corpus

    encoder, transform, params = EncoderSpec(), TransformSpec(dim=dim), SearchParams(k=k)
    transform.check(model_dim(encoder.model))  # before the demo corpus is written
    params.check()
    corpus = home.index_root() / "stdlib-docs.parquet"
    with files.output_errors(corpus):
        rows = write_demo_corpus(corpus)
    err.print(f"wrote {rows:,} docstring paragraphs of this Python's standard library to {corpus}", markup=False)
    target = home.default_out(corpus)
    spec = CorpusSpec(corpus, title_column="title")
    # An interrupted demo's encoded parts are picked up again: its corpus is the same, whenever it is written.
    resume = files.work_dir(files.resolved(target)).exists()
    try:
        run_build(spec, encoder, target, transform, IndexSpec(), BuildOptions(overwrite=True, resume=resume))
    except ConfigError as refused:  # another Python's stdlib, or another encoder: that build is not this one
        if not (resume and refused.param == "resume"):
            raise
        run_build(spec, encoder, target, transform, IndexSpec(), BuildOptions(overwrite=True))
    except Interrupted as stop:  # its message names `index --resume`, which the demo does by itself
        word = "terminated" if stop.exit_code == 143 else "interrupted"
        again = Interrupted(f"{word}: rerun `retrieval demo` to continue")
        again.exit_code = stop.exit_code
        raise again from None
    for query in DEMO_QUERIES:
        search_one(query, target, params)
