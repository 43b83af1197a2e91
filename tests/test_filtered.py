"""Filtered dense search (retrieval.filtered): which path a filter of a given share takes, how far the selector
search widens its knob, what a filter's searches reuse, and flat results equal to exact search over the kept rows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retrieval import filtered
from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.filtered import RULES, Rule
from retrieval.filters import parse
from retrieval.index import IndexSpec
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec

N, D = 4000, 16


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Clumped vectors (40 clumps) with ``bucket`` = row % 1000, so ``bucket < b`` keeps b / 1000 of the rows."""
    root = tmp_path_factory.mktemp("filtered")
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(40, D))
    vectors = (centres[rng.integers(0, 40, N)] + 0.6 * rng.normal(size=(N, D))).astype(np.float32)
    table = pa.table(
        {
            "id": [str(i) for i in range(N)],
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), D),
            "bucket": pa.array(np.arange(N) % 1000, pa.int32()),
        }
    )
    pq.write_table(table, root / "v.parquet")
    corpus = CorpusSpec(root / "v.parquet", vectors_column="vector", columns=("bucket",))
    specs = {
        "flat": IndexSpec(kind="flat"),
        "hnsw": IndexSpec(kind="hnsw", m=8, ef_construction=40, ef_search=16),
        "ivf": IndexSpec(kind="ivf", nlist=32, nprobe=4, codes="fp32"),
    }
    for kind, spec in specs.items():
        build_index(corpus, None, root / kind, TransformSpec.raw(), spec, options=BuildOptions(lexical=None))
    return {kind: root / kind for kind in specs}


def queries(searcher: Searcher, n: int = 30) -> np.ndarray:
    rng = np.random.default_rng(3)
    rows = searcher.stash().read_rows(rng.choice(N, n, replace=False), None)
    return rows + 0.3 * rng.normal(size=rows.shape).astype(np.float32)


def exact_filtered(searcher: Searcher, raw: np.ndarray, mask: np.ndarray, k: int) -> list[list[int]]:
    """The reference: every kept row's vector in the index's space, scored in float64, best k."""
    rows = np.flatnonzero(mask)
    vectors = searcher.transform.transform(searcher.stash().read_rows(rows, None)).astype(np.float64)
    q = searcher.transform.transform(raw).astype(np.float64)
    return [rows[np.argsort(-(vectors @ one), kind="stable")[:k]].tolist() for one in q]


class Spy:
    """Records the knobs each FAISS search of a filtered search was given, and whether it scored exactly."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.knobs: list[tuple[int | None, int | None]] = []
        self.exact = 0
        real_parameters, real_exact = filtered.search_parameters, filtered.exact_top

        def parameters(index, ef_search=None, nprobe=None, selector=None):
            self.knobs.append((ef_search, nprobe))
            return real_parameters(index, ef_search=ef_search, nprobe=nprobe, selector=selector)

        def exact(*args, **kwargs):
            self.exact += 1
            return real_exact(*args, **kwargs)

        monkeypatch.setattr(filtered, "search_parameters", parameters)
        monkeypatch.setattr(filtered, "exact_top", exact)


@pytest.mark.parametrize(
    ("kind", "kept", "n", "exact"),
    [
        ("hnsw", 20_000, 1_000_000, True),  # 2% of a million rows: scored exactly (the cost switch, in rows)
        ("hnsw", 20_001, 1_000_000, False),
        ("hnsw", 50_000, 10_000_000, True),  # 0.5%: below HNSW's share switch, whatever the rows
        ("hnsw", 100_001, 10_000_000, False),
        ("ivf", 20_000, 1_000_000, True),
        ("ivf", 20_001, 1_000_000, False),
        ("ivf", 50_000, 10_000_000, False),  # 0.5%: IVF's lists still find them
        ("ivf", 10_000, 10_000_000, True),  # 0.1%: IVF's share switch
        ("hnsw", 2_000, 4_000, True),  # a small index: every filter up to 20,000 rows is scored exactly by HNSW
        ("ivf", 200, 4_000, True),  # and up to 5% of it by IVF, whose lists are cheap to search at that size
        ("ivf", 201, 4_000, False),
        ("ivf", 5_000, 100_000, True),
        ("ivf", 5_001, 100_000, False),
    ],
)
def test_the_rule_scores_exactly_at_or_below_the_switch_in_rows_and_in_share(
    kind: str, kept: int, n: int, exact: bool
) -> None:
    assert RULES[kind].exact(kept, n) is exact


@pytest.mark.parametrize(
    ("kind", "value", "k", "share", "rows_per_unit", "most", "want"),
    [
        ("hnsw", 128, 10, 0.5, 1.0, 10**6, 128),  # half the rows kept: the beam as it is
        ("hnsw", 128, 10, 0.1, 1.0, 10**6, 200),  # a beam of 2 k / share
        ("hnsw", 128, 10, 0.05, 1.0, 10**6, 400),
        ("hnsw", 128, 10, 0.001, 1.0, 10**6, 2048),  # at most 16x
        ("hnsw", 128, 10, 0.001, 1.0, 1000, 1000),  # and at most every row
        ("ivf", 32, 10, 0.5, 977.0, 1024, 46),  # nprobe x share ** -0.5
        ("ivf", 32, 10, 0.1, 977.0, 1024, 102),
        ("ivf", 32, 10, 0.01, 977.0, 1024, 320),
        ("ivf", 32, 10, 0.001, 977.0, 1024, 1012),
        ("ivf", 1, 10, 0.01, 100.0, 64, 64),  # lists holding 10 k kept rows: 100 lists, and there are 64
        ("ivf", 1, 10, 0.5, 100.0, 64, 2),  # the floor needs 2 lists, the power 1.41: 2
    ],
)
def test_the_rule_widens_the_knob_by_the_share_kept(
    kind: str, value: int, k: int, share: float, rows_per_unit: float, most: int, want: int
) -> None:
    assert RULES[kind].widened(value, k, share, rows_per_unit, most) == want


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
@pytest.mark.parametrize("bucket", [1, 10, 100, 500])
def test_a_filter_takes_the_path_its_share_says(
    built: dict[str, Path], kind: str, bucket: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact scoring at or below the switch, else the selector search with the knob the rule widens to; the hits
    are kept rows either way."""
    searcher = Searcher.load(built[kind])
    rule = replace(RULES[kind], exact_rows=40, exact_share=0.0)  # 4 and 40 rows scored exactly, 400 and 2000 not
    searcher.filter_rule = rule
    spy = Spy(monkeypatch)
    raw = queries(searcher, 1)
    where = parse(f"bucket < {bucket}")
    hits = searcher.search_vectors(raw, SearchParams(k=10, where=where))[0]
    mask = searcher.mask(where)
    kept = int(mask.sum())
    assert kept == N * bucket // 1000 and all(mask[h.row] for h in hits)
    if kept <= 40:
        assert spy.exact == 1 and spy.knobs == []
        assert [h.row for h in hits] == exact_filtered(searcher, raw, mask, 10)[0]
        return
    assert spy.exact == 0 and len(hits) == 10
    defaults = searcher.manifest.index.search
    if kind == "hnsw":
        assert spy.knobs[0] == (rule.widened(defaults["ef_search"], 10, kept / N, 1.0, N), None)
    else:
        assert spy.knobs[0] == (None, rule.widened(defaults["nprobe"], 10, kept / N, N / 32, 32))


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_a_selector_search_short_of_k_is_widened_until_it_fills(
    built: dict[str, Path], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filter keeping 12 rows, searched through the selector with no widening: the default beam or probed lists
    hold fewer than 10 of them for some queries; those are searched again, the knob doubled, until 10 are found."""
    searcher = Searcher.load(built[kind])
    searcher.filter_rule = Rule(exact_rows=0, exact_share=0.0, power=0.0, per_k=0.0, cap=1.0)  # the knob as it is
    spy = Spy(monkeypatch)
    where = parse("bucket < 3")
    raw = queries(searcher)
    results = searcher.search_vectors(raw, SearchParams(k=10, where=where))
    assert len(spy.knobs) > 1  # some queries were short at the first knob
    assert all(len(hits) == 10 for hits in results)
    mask = searcher.mask(where)
    assert all(mask[h.row] for hits in results for h in hits)


def test_a_filter_is_evaluated_once_and_its_kept_vectors_gathered_once(
    built: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every search with an equal filter reuses its rows, bitmap and (for exact scoring) the kept rows' vectors:
    the columns are read once, the stash once, and the answers are those of the first search."""
    import retrieval.search

    searcher = Searcher.load(built["ivf"])
    raw = queries(searcher, 5)
    calls = {"evaluate": 0, "read_rows": 0}
    real_evaluate, stash = retrieval.search.evaluate, searcher.stash()
    real_read = stash.read_rows

    def evaluate(*args, **kwargs):
        calls["evaluate"] += 1
        return real_evaluate(*args, **kwargs)

    def read_rows(*args, **kwargs):
        calls["read_rows"] += 1
        return real_read(*args, **kwargs)

    monkeypatch.setattr(retrieval.search, "evaluate", evaluate)
    monkeypatch.setattr(stash, "read_rows", read_rows)
    first = searcher.search_vectors(raw, SearchParams(k=3, where=parse("bucket < 1")))  # 4 rows: scored exactly
    again = [searcher.search_vectors(q[None], SearchParams(k=3, where=parse("bucket < 1")))[0] for q in raw]
    assert [[h.row for h in hits] for hits in again] == [[h.row for h in hits] for hits in first]
    # float32 products of one query and of a batch sum in different orders: equal to float32's precision
    np.testing.assert_allclose(
        [[h.score for h in hits] for hits in again], [[h.score for h in hits] for hits in first], rtol=1e-5
    )
    assert calls == {"evaluate": 1, "read_rows": 1}
    assert searcher.kept(parse("bucket < 1")) is searcher.kept(parse("bucket < 1"))


@pytest.mark.parametrize("bucket", [1, 5, 10, 100, 500])
def test_flat_filtered_search_equals_exact_search_over_the_kept_rows(built: dict[str, Path], bucket: int) -> None:
    """Both of flat's paths (the selector below 2% kept, masked products above) give the float64 reference's rows,
    for one query and for a batch."""
    searcher = Searcher.load(built["flat"])
    where = parse(f"bucket < {bucket}")
    raw = queries(searcher, 8)
    want = exact_filtered(searcher, raw, searcher.mask(where), 10)
    batch = searcher.search_vectors(raw, SearchParams(k=10, where=where))
    single = [searcher.search_vectors(q[None], SearchParams(k=10, where=where))[0] for q in raw]
    assert [[h.row for h in hits] for hits in batch] == want
    assert [[h.row for h in hits] for hits in single] == want


def test_ivf_single_queries_search_the_twin_with_the_selector(built: dict[str, Path]) -> None:
    """A single filtered IVF query goes to the twin that spreads its lists over the threads, as an unfiltered one
    does, with the same selector: the same rows as the batch search of the index itself."""
    searcher = Searcher.load(built["ivf"])
    assert searcher._one_query is not None
    searcher.filter_rule = replace(RULES["ivf"], exact_rows=0, exact_share=0.0)
    where = parse("bucket < 100")
    raw = queries(searcher, 8)
    batch = searcher.search_vectors(raw, SearchParams(k=10, where=where))
    single = [searcher.search_vectors(q[None], SearchParams(k=10, where=where))[0] for q in raw]
    assert [[h.row for h in hits] for hits in single] == [[h.row for h in hits] for hits in batch]
    mask = searcher.mask(where)
    assert all(mask[h.row] for hits in single for h in hits)


def test_a_searcher_bounds_what_its_filters_hold(built: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The least recently used filters are dropped past ``KEPT_FILTERS`` of them or ``KEPT_BYTES`` held together;
    the one in use stays, and one used again is kept ahead of older ones."""
    import retrieval.search

    searcher = Searcher.load(built["hnsw"])
    raw = queries(searcher, 1)
    monkeypatch.setattr(retrieval.search, "KEPT_FILTERS", 3)
    for bucket in (1, 2, 3):
        searcher.search_vectors(raw, SearchParams(k=5, where=parse(f"bucket < {bucket}")))
    searcher.kept(parse("bucket < 1"))  # used again: now the most recent
    searcher.search_vectors(raw, SearchParams(k=5, where=parse("bucket < 4")))
    assert list(searcher._kept) == [parse("bucket < 3"), parse("bucket < 1"), parse("bucket < 4")]
    one = searcher.kept(parse("bucket < 4")).nbytes  # its mask, rows and gathered vectors (scored exactly)
    assert one >= N + 16 * 4 * D
    monkeypatch.setattr(retrieval.search, "KEPT_BYTES", one + 1)
    searcher.search_vectors(raw, SearchParams(k=5, where=parse("bucket < 5")))
    assert list(searcher._kept) == [parse("bucket < 5")]
