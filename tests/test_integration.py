"""End to end with the real all-MiniLM-L6-v2 on a slice of SciFact: build at k = 128, then titles find
their documents. The model is loaded once per session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SHARED_DATA, needs_minilm, needs_shared

from retrieval.build import build_index
from retrieval.corpus import CorpusSpec
from retrieval.index import flat_vectors
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec

pytestmark = [pytest.mark.slow, needs_shared, needs_minilm]

ROWS = 200
SCIFACT = SHARED_DATA / "scifact" / "corpus.parquet"


@pytest.fixture(scope="session")
def minilm():
    from retrieval.encode.transformer import TransformerEncoder

    # max_length 64 (the title and the start of the abstract) keeps the build fast on 2 cores;
    # queries get the same value from the manifest.
    return TransformerEncoder("all-MiniLM-L6-v2", max_length=64, batch_size=32)


@pytest.fixture(scope="session")
def scifact_index(minilm, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("scifact")
    corpus = root / "scifact-slice.parquet"
    batches = pq.ParquetFile(SCIFACT).iter_batches(batch_size=ROWS, columns=["doc_id", "title", "text"])
    pq.write_table(pa.Table.from_batches([next(batches)]), corpus)
    spec = CorpusSpec(corpus, id_column="doc_id", title_column="title")
    build_index(spec, minilm, root / "idx", TransformSpec(dim=128))
    return corpus, root / "idx"


def test_the_slice_builds_at_k_128(scifact_index: tuple[Path, Path], minilm) -> None:
    _, out = scifact_index
    searcher = Searcher.load(out, encoder=minilm)
    t = searcher.manifest.transform
    assert (t.d, t.dim, searcher.manifest.n) == (384, 128, ROWS)
    assert searcher.manifest.encoder.model == "all-MiniLM-L6-v2"
    assert len(str(searcher.manifest.encoder.weights_sha256)) == 64
    # 128 of 384 directions of real sentence embeddings hold most of the variance
    assert t.explained_variance is not None and 0.6 < t.explained_variance < 1.0
    stored = flat_vectors(searcher.index)
    np.testing.assert_allclose(np.linalg.norm(stored, axis=1), 1.0, atol=1e-5)  # unit rows, float32


def test_titles_find_their_documents(scifact_index: tuple[Path, Path], minilm) -> None:
    corpus, out = scifact_index
    table = pq.read_table(corpus)
    ids, titles = table.column("doc_id").to_pylist(), table.column("title").to_pylist()
    searcher = Searcher.load(out, encoder=minilm)
    picks = [0, 37, 101, 150, 199]
    results = searcher.search_batch([titles[i] for i in picks], SearchParams(k=3))
    for i, hits in zip(picks, results, strict=True):
        assert ids[i] in [h.id for h in hits], (titles[i], [h.id for h in hits])


def test_the_index_reloads_its_own_model_from_the_manifest(scifact_index: tuple[Path, Path], minilm) -> None:
    corpus, out = scifact_index
    searcher = Searcher.load(out)  # no encoder given: the manifest names it
    assert searcher.encoder is not None and searcher.encoder.info() == minilm.info()
    title = pq.read_table(corpus).column("title")[5].as_py()
    first = pq.read_table(corpus).column("doc_id")[5].as_py()
    assert first in [h.id for h in searcher.search(title, SearchParams(k=3))]
