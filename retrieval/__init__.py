"""retrieval: whitened dense retrieval over parquet corpora (BERT-whitening, Su et al. 2021) with FAISS.

The public API, importable from the top (each name is loaded when first used, so ``import retrieval`` stays cheap:
no torch, FAISS or pyarrow until a name needs them; and importing it changes nothing in the process)::

    from pathlib import Path

    from retrieval import CorpusSpec, EncoderSpec, Searcher, SearchParams, TransformSpec, build_index

    build_index(CorpusSpec(Path("docs.parquet")), EncoderSpec().load(), Path("indexes/docs"), TransformSpec(dim=128))
    hits = Searcher.load(Path("indexes/docs")).search("a question", SearchParams(k=5))

Building: ``build_index`` (with ``CorpusSpec``, ``EncoderSpec``, ``TransformSpec``, ``IndexSpec``,
``BuildOptions``), then ``add``, ``remove``, ``refit``, ``calibrate_index`` on the directory it wrote. Searching:
``Searcher`` and ``SearchParams``, which return ``Hit``s. ``describe_index`` says what a directory holds.
``tune_process`` applies the process settings the command line and the server use; ``timing.Policy`` (with
``timing.use``) controls the self-timed choices (``RETRIEVAL_DETERMINISTIC=1``: none timed). Every error a user
can fix is a ``RetrievalError``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    "build_index": "retrieval.build",
    "BuildOptions": "retrieval.build",
    "CorpusSpec": "retrieval.corpus",
    "EncoderSpec": "retrieval.encode.spec",
    "EncoderInfo": "retrieval.encode.spec",
    "Encoder": "retrieval.encode.spec",
    "TransformSpec": "retrieval.whitening",
    "IndexSpec": "retrieval.index",
    "Searcher": "retrieval.search",
    "SearchParams": "retrieval.search",
    "Hit": "retrieval.search",
    "add": "retrieval.update",
    "remove": "retrieval.update",
    "refit": "retrieval.update",
    "calibrate_index": "retrieval.update",
    "describe_index": "retrieval.info",
    "Manifest": "retrieval.manifest",
    "RetrievalError": "retrieval.errors",
    "tune_process": "retrieval.runtime",
}
__all__ = [
    "BuildOptions",
    "CorpusSpec",
    "Encoder",
    "EncoderInfo",
    "EncoderSpec",
    "Hit",
    "IndexSpec",
    "Manifest",
    "RetrievalError",
    "SearchParams",
    "Searcher",
    "TransformSpec",
    "add",
    "build_index",
    "calibrate_index",
    "describe_index",
    "refit",
    "remove",
    "tune_process",
]

if TYPE_CHECKING:
    from retrieval.build import BuildOptions, build_index
    from retrieval.corpus import CorpusSpec
    from retrieval.encode.spec import Encoder, EncoderInfo, EncoderSpec
    from retrieval.errors import RetrievalError
    from retrieval.index import IndexSpec
    from retrieval.info import describe_index
    from retrieval.manifest import Manifest
    from retrieval.runtime import tune_process
    from retrieval.search import Hit, Searcher, SearchParams
    from retrieval.update import add, calibrate_index, refit, remove
    from retrieval.whitening import TransformSpec


def __getattr__(name: str) -> Any:
    """The public API's names, imported from their modules on first use (PEP 562)."""
    if name not in _API:
        raise AttributeError(f"module 'retrieval' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
