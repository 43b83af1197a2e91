"""Search modes and filtered search in an index: fusion by its formulas, flat filtered search equal to exact search
over the kept rows, HNSW / IVF filtered recall against it, and lexical and hybrid obeying the same filter."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FakeEncoder

from retrieval import filtered, update
from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError, CorpusError
from retrieval.filters import FilterError, parse
from retrieval.fusion import FusionSpec, fuse
from retrieval.index import IndexSpec
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
N = 1200


def write(path: Path, n: int = N, start: int = 0, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    table = pa.table(
        {
            "id": [f"d{start + i}" for i in range(n)],
            "text": [" ".join(rng.choice(WORDS, size=6)) for _ in range(n)],
            "year": pa.array(rng.integers(2000, 2025, n), pa.int16()),
            "source": rng.choice(np.array(["pubmed", "arxiv", "acl"], dtype=object), n),
        }
    )
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    corpus = CorpusSpec(write(root / "c.parquet"), columns=("year", "source"))
    out = {}
    for kind in ("flat", "hnsw", "ivf"):
        spec = IndexSpec(kind=kind, nlist=16 if kind == "ivf" else None, nprobe=2 if kind == "ivf" else None)
        build_index(corpus, FakeEncoder(), root / kind, TransformSpec(dim=16), spec)
        out[kind] = root / kind
    return out


def exact_filtered(searcher: Searcher, query: str, mask: np.ndarray, k: int) -> list[int]:
    """The reference: every kept row's vector in the index's space, scored in float64, best k."""
    stash = searcher.stash()
    rows = np.flatnonzero(mask)
    vectors = searcher.transform.transform(stash.read_rows(rows, searcher.manifest.transform.pooling))
    q = searcher.transform.transform(searcher.encode([query]))[0]
    scores = vectors.astype(np.float64) @ q.astype(np.float64)
    return rows[np.argsort(-scores, kind="stable")[:k]].tolist()


def test_fusion_by_its_formulas() -> None:
    dense = (np.array([[0.9, 0.5, 0.1]], np.float32), np.array([[7, 3, 5]]))
    lexical = (np.array([[10.0, 4.0, -np.inf]], np.float32), np.array([[3, 9, -1]]))
    scores, rows = fuse(dense, lexical, FusionSpec("rrf", weight=0.5, rrf_k=60), k=4)
    want = {7: 0.5 / 61, 3: 0.5 / 62 + 0.5 / 61, 5: 0.5 / 63, 9: 0.5 / 62}
    assert rows[0].tolist() == sorted(want, key=lambda r: -want[r])
    np.testing.assert_allclose(scores[0], sorted(want.values(), reverse=True), rtol=1e-6)
    scores, rows = fuse(dense, lexical, FusionSpec("convex", weight=0.25), k=5)
    want = {7: 0.25 * 1.0, 3: 0.25 * 0.5 + 0.75 * 1.0, 5: 0.0, 9: 0.0}
    assert rows[0][:2].tolist() == [3, 7] and rows[0][4] == -1 and np.isneginf(scores[0][4])
    np.testing.assert_allclose(scores[0][:4], sorted(want.values(), reverse=True), atol=1e-7)


@pytest.mark.parametrize("where", ["year >= 2020", "source = 'acl' and year < 2005", "year = 2003"])
def test_flat_filtered_search_equals_exact_search_over_the_kept_rows(built: dict[str, Path], where: str) -> None:
    searcher = Searcher.load(built["flat"], encoder=FakeEncoder())
    mask = searcher.mask(parse(where))
    assert 0 < mask.sum() < N
    for query in ("alpha beta", "kappa mu zeta", "theta"):
        hits = searcher.search(query, SearchParams(k=10, mode="dense", where=parse(where)))
        assert [h.row for h in hits] == exact_filtered(searcher, query, mask, 10)
        assert all(mask[h.row] for h in hits)


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
@pytest.mark.parametrize("path", ["approximate", "exact"])
def test_hnsw_and_ivf_filtered_recall(built: dict[str, Path], kind: str, path: str) -> None:
    """Both sides of the switch: the selector search (widened knobs) and exact scoring of the kept rows."""
    searcher = Searcher.load(built[kind], encoder=FakeEncoder())
    rule = filtered.rule_for(searcher.index)
    searcher.filter_rule = replace(rule, exact_rows=0, exact_share=0.0 if path == "approximate" else 1.0)
    queries = [" ".join(np.random.default_rng(i).choice(WORDS, size=3)) for i in range(20)]
    for where in ("year >= 2012", "year >= 2021", "source = 'acl' and year < 2004"):
        mask = searcher.mask(parse(where))
        found = total = 0
        for query in queries:
            hits = searcher.search(query, SearchParams(k=10, mode="dense", rescore=0, where=parse(where)))
            assert all(mask[h.row] for h in hits)
            want = set(exact_filtered(searcher, query, mask, 10))
            found += len(want & {h.row for h in hits})
            total += len(want)
        assert found / total >= (0.95 if path == "approximate" else 1.0), (where, found / total)


def test_lexical_and_hybrid_obey_the_filter(built: dict[str, Path]) -> None:
    searcher = Searcher.load(built["hnsw"], encoder=FakeEncoder())
    where = parse("source in ('arxiv') and year >= 2010")
    mask = searcher.mask(where)
    for mode in ("lexical", "hybrid"):
        hits = searcher.search("alpha beta gamma", SearchParams(k=50, mode=mode, where=where))
        assert hits and all(mask[h.row] for h in hits)
        unfiltered = searcher.search("alpha beta gamma", SearchParams(k=50, mode=mode))
        assert any(not mask[h.row] for h in unfiltered)
    nothing = searcher.search("alpha", SearchParams(k=5, where=parse("year > 3000")))
    assert nothing == []


def test_modes_default_and_refusals(built: dict[str, Path], tmp_path: Path) -> None:
    searcher = Searcher.load(built["flat"], encoder=FakeEncoder())
    assert searcher.mode(SearchParams()) == "hybrid"
    lexical = searcher.search("alpha beta", SearchParams(k=5, mode="lexical"))
    assert all({"alpha", "beta"} & set(h.text.split()) for h in lexical)
    hybrid = searcher.search("alpha beta", SearchParams(k=5))
    assert len(hybrid) == 5 and [h.rank for h in hybrid] == [1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match="unknown `mode`"):
        searcher.search("alpha", SearchParams(mode="sparse"))
    with pytest.raises(FilterError, match="no column 'venue'"):
        searcher.search("alpha", SearchParams(where=parse("venue = 'x'")))
    with pytest.raises(ConfigError, match="needs the query texts"):
        searcher.search_vectors(searcher.encode(["alpha"]), SearchParams(mode="hybrid"))
    assert searcher.search_vectors(searcher.encode(["alpha"]), SearchParams(k=3))[0]  # vectors alone: dense

    build_index(
        CorpusSpec(write(tmp_path / "c.parquet", 100)),
        FakeEncoder(),
        tmp_path / "dense",
        TransformSpec(dim=8),
        options=BuildOptions(lexical=None),
    )
    dense_only = Searcher.load(tmp_path / "dense", encoder=FakeEncoder())
    assert dense_only.mode(SearchParams()) == "dense"
    with pytest.raises(ConfigError, match="has no lexical index"):
        dense_only.search("alpha", SearchParams(mode="lexical"))
    with pytest.raises(FilterError, match="kept no columns"):
        dense_only.search("alpha", SearchParams(where=parse("year = 1")))


def test_columns_follow_add_and_remove_with_their_types(tmp_path: Path) -> None:
    corpus = CorpusSpec(write(tmp_path / "a.parquet", 200), columns=("year", "source"))
    build_index(corpus, FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    added = CorpusSpec(write(tmp_path / "b.parquet", 50, start=200, seed=1), columns=("year", "source"))
    with pytest.raises(ConfigError, match="same `columns`"):
        update.add(tmp_path / "idx", CorpusSpec(added.path), FakeEncoder())
    manifest = update.add(tmp_path / "idx", added, FakeEncoder())
    assert manifest.columns == {"year": "int16", "source": "string"}
    manifest = update.remove(tmp_path / "idx", [f"d{i}" for i in range(0, 250, 5)])
    searcher = Searcher.load(tmp_path / "idx", encoder=FakeEncoder())
    table = pa.concat_tables([pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")])
    kept = table.filter(pa.array([i % 5 != 0 for i in range(250)]))
    assert searcher.loaded.columns.column("year").type == pa.int16()
    assert searcher.loaded.columns.column("year").to_pylist() == kept.column("year").to_pylist()
    assert [searcher.docs.id(r) for r in range(len(searcher.docs))] == kept.column("id").to_pylist()
    hits = searcher.search("alpha", SearchParams(k=20, where=parse("year < 2003")))
    assert hits and all(kept.column("year")[h.row].as_py() < 2003 for h in hits)


def test_columns_must_exist(tmp_path: Path) -> None:
    corpus = CorpusSpec(write(tmp_path / "a.parquet", 50), columns=("venue",))
    with pytest.raises(CorpusError, match="no column 'venue'"):
        build_index(corpus, FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    assert not (tmp_path / "idx").exists()


def test_tune_fusion_chooses_on_dev_and_apply_records_it(built: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from retrieval.evaluate import Queries
    from retrieval.tune_fusion import GRID, tune_fusion

    shutil.copytree(built["flat"], tmp_path / "idx")
    searcher = Searcher.load(tmp_path / "idx", encoder=FakeEncoder())
    texts = [searcher.docs.texts([r])[0] for r in range(0, 400, 20)]
    queries = Queries([f"q{i}" for i in range(len(texts))], [" ".join(t.split()[:3]) for t in texts])
    qrels = {f"q{i}": {searcher.docs.id(r): 1} for i, r in enumerate(range(0, 400, 20))}
    result = tune_fusion(tmp_path / "idx", (queries, qrels), encoder=FakeEncoder())
    fused = [t for t in result.trials if t.fusion is not None]
    assert [t.fusion for t in fused] == list(GRID) and {t.mode for t in result.trials} == {"dense", "lexical", "hybrid"}
    assert result.best.dev["nDCG@10"] == max(t.dev["nDCG@10"] for t in fused)
    manifest = update.set_fusion(tmp_path / "idx", result.best.fusion)
    assert manifest.fusion == result.best.fusion and manifest.generation == searcher.manifest.generation + 1
    again = Searcher.load(tmp_path / "idx", encoder=FakeEncoder())
    assert again.manifest.fusing == result.best.fusion
    mine = again.search_batch(queries.texts, SearchParams(k=10))
    theirs = again.search_batch(queries.texts, SearchParams(k=10, fusion=result.best.fusion))
    assert [[h.row for h in hits] for hits in mine] == [[h.row for h in hits] for hits in theirs]
    with pytest.raises(ConfigError, match="dense weight|fusion_weight"):
        update.set_fusion(tmp_path / "idx", FusionSpec("convex", weight=2.0))


def test_ivf_selector_search_probes_lists_holding_enough_kept_rows(tmp_path: Path) -> None:
    """A filter keeping 1% of an IVF index's rows without clumps, searched through the selector from nprobe 1:
    share ** -0.5 alone would probe 10 of the 64 lists (recall@10 0.56 against exact search over the kept rows);
    the lists must also hold 10 k kept rows in expectation, which here is every list."""
    rng = np.random.default_rng(0)
    n, d = 6400, 16
    vectors = rng.normal(size=(n, d))  # no clumps: the kept rows nearest a query lie in lists far apart
    table = pa.table(
        {
            "id": [str(i) for i in range(n)],
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.astype(np.float32).ravel()), d),
            "bucket": pa.array(np.arange(n) % 100, pa.int32()),
        }
    )
    pq.write_table(table, tmp_path / "v.parquet")
    corpus = CorpusSpec(tmp_path / "v.parquet", vectors_column="vector", columns=("bucket",))
    spec = IndexSpec(kind="ivf", nlist=64, nprobe=1, codes="fp32")
    build_index(corpus, None, tmp_path / "ivf", TransformSpec.raw(), spec, options=BuildOptions(lexical=None))
    searcher = Searcher.load(tmp_path / "ivf")
    searcher.filter_rule = replace(filtered.RULES["ivf"], exact_rows=0, exact_share=0.0)  # the selector path
    where = parse("bucket < 1")
    mask = searcher.mask(where)
    assert mask.sum() == n // 100
    queries = rng.normal(size=(40, d))
    q = searcher.transform.transform(queries.astype(np.float32)).astype(np.float64)
    kept = np.flatnonzero(mask)
    kept_vectors = searcher.transform.transform(vectors[kept].astype(np.float32)).astype(np.float64)
    found = 0
    results = searcher.search_vectors(queries.astype(np.float32), SearchParams(k=10, where=where))
    for query, hits in zip(q, results, strict=True):
        want = set(kept[np.argsort(-(kept_vectors @ query), kind="stable")[:10]].tolist())
        found += len(want & {h.row for h in hits})
        assert all(mask[h.row] for h in hits)
    assert found / (10 * len(q)) >= 0.95
