"""Search knobs measured on queries (``retrieval calibrate``): exact neighbours streamed from the stash against a
float64 one-shot reference, recall with tied scores, the smallest knob that reaches the target (checked by an
independent recall computation), the plateau when no knob does, and the CLI and index-directory paths that
record, apply, keep (add) and drop (refit) the measured value."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FakeEncoder, write_corpus
from typer.testing import CliRunner

import retrieval.scan
from retrieval.build import BuildOptions, build_index
from retrieval.calibrate import (
    MAX_QUERIES,
    PLATEAU,
    TIE_TOLERANCE,
    Calibration,
    calibrate,
    exact_neighbours,
    grid,
    knob_of,
    query_sample,
    recall_with_ties,
    search_with,
)
from retrieval.cli.app import app
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError
from retrieval.index import IndexSpec, describe, search_parameters
from retrieval.indexdir import IndexDir
from retrieval.info import _search_default, summary
from retrieval.manifest import RESCORE_DEPTH
from retrieval.search import Searcher, SearchParams
from retrieval.update import add, calibrate_index, refit
from retrieval.whitening import TransformSpec

N, D = 3000, 24
runner = CliRunner()


def clustered(n: int, seed: int, spread: float = 0.7) -> np.ndarray:
    """Rows around 40 centres: neighbours an approximate index can miss, unlike uniform noise's."""
    centres = np.random.default_rng(0).normal(size=(40, D))
    rng = np.random.default_rng(seed)
    return (centres[rng.integers(0, 40, n)] + spread * rng.normal(size=(n, D))).astype(np.float32)


def queries(n: int = 200, seed: int = 7) -> np.ndarray:
    """Queries from the corpus's distribution, none of them a corpus row, a little farther from the centres."""
    return clustered(n, seed, spread=0.9)


def write_vectors(path: Path, vectors: np.ndarray, first: int = 0) -> Path:
    ids = [f"r{first + i}" for i in range(len(vectors))]
    emb = pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), D)
    pq.write_table(pa.table({"id": ids, "text": [f"row {i}" for i in ids], "emb": emb}), path)
    return path


def build(root: Path, name: str, spec: IndexSpec, transform: TransformSpec = TransformSpec()) -> Path:
    out = root / name
    corpus = root / "corpus.parquet"
    if not corpus.exists():
        write_vectors(corpus, clustered(N, 0))
    # windows of 700 rows: the stash has several parts, so its blocks cross part boundaries
    build_index(CorpusSpec(corpus, vectors_column="emb"), None, out, transform, spec, BuildOptions(window_rows=700))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("calibrate")
    yield {
        "hnsw": build(root, "hnsw", IndexSpec("hnsw", m=8, ef_construction=24)),
        "ivf": build(root, "ivf", IndexSpec("ivf")),  # 3000 rows: 76 lists of 16-bit floats
        "ivf-reduced": build(root, "ivf-reduced", IndexSpec("IVF32,Flat"), TransformSpec(dim=8, gamma=0.5)),
    }


def parts(directory: Path):  # type: ignore[no-untyped-def]
    index_dir = IndexDir(directory)
    return index_dir.faiss_index(), index_dir.stash(), index_dir.transform()


def reference(directory: Path, transformed: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64, one shot: every stash row transformed at once, every product, sorted."""
    _, stash, transform = parts(directory)
    everything = transform.transform(np.concatenate(list(stash.iter_blocks()))).astype(np.float64)
    scores = transformed.astype(np.float64) @ everything.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, axis=1), order


@pytest.mark.parametrize("name", ["ivf", "ivf-reduced"])
def test_exact_neighbours_match_a_float64_one_shot_reference(built, name: str, monkeypatch) -> None:
    monkeypatch.setattr(retrieval.scan, "TILE_BYTES", 4096)  # tiles of 42 (raw) or 128 (reduced) rows
    _, stash, transform = parts(built[name])
    transformed = transform.transform(queries(60))
    scores, found = exact_neighbours(stash, transform, transformed, keep=15, block_rows=512)
    ref_scores, ref_rows = reference(built[name], transformed, 15)
    np.testing.assert_allclose(scores, ref_scores, atol=2e-6)  # float32 sums of 8-24 products of unit vectors
    # the same rows wherever the next score is clearly apart (random data: no exact ties)
    apart = np.abs(np.diff(ref_scores, axis=1)) > 1e-5
    assert (found[:, :-1][apart] == ref_rows[:, :-1][apart]).mean() > 0.99
    assert np.array_equal(found[:, 0], ref_rows[:, 0])


def test_exact_neighbours_pad_when_the_corpus_is_small(tmp_path: Path) -> None:
    write_vectors(tmp_path / "five.parquet", clustered(5, 2))
    build_index(CorpusSpec(tmp_path / "five.parquet", vectors_column="emb"), None, tmp_path / "five")
    _, stash, transform = parts(tmp_path / "five")
    scores, found = exact_neighbours(stash, transform, transform.transform(queries(3)), keep=7)
    assert (found[:, :5] >= 0).all() and (found[:, 5:] == -1).all() and np.isneginf(scores[:, 5:]).all()
    assert all(set(found[i, :5].tolist()) == set(range(5)) for i in range(3))


def test_recall_counts_rows_tied_with_the_kth_neighbour() -> None:
    """As ann-benchmarks counts: a found row is right when its exact score reaches the k-th neighbour's."""
    rows = np.array([[10, 11, 12, 13, -1]])
    scores = np.array([[0.9, 0.7, 0.7, 0.6, -np.inf]], dtype=np.float32)  # 11 and 12 tie for second place
    assert recall_with_ties(np.array([[10, 12]]), rows, scores, k=2) == 1.0  # 12 ties 11: found
    assert recall_with_ties(np.array([[10, 11]]), rows, scores, k=2) == 1.0
    assert recall_with_ties(np.array([[10, 13]]), rows, scores, k=2) == 0.5  # 13 scores below the second
    assert recall_with_ties(np.array([[10, 11]]), rows, scores, k=3) == pytest.approx(2 / 3)
    assert recall_with_ties(np.array([[10, 99]]), rows, scores, k=2) == 0.5  # 99 is not a neighbour
    assert recall_with_ties(np.array([[13, 12, 11, 10]]), rows, scores, k=4) == 1.0
    assert recall_with_ties(np.array([[13, 12, 11, 10]]), rows, scores, k=3) == pytest.approx(2 / 3)  # 13 is 4th
    # a query with fewer exact neighbours than k asks only for those
    assert recall_with_ties(np.array([[10, 11, 12, 13, -1]]), rows, scores, k=5) == 1.0
    assert recall_with_ties(np.array([[-1]]), np.array([[-1]]), np.array([[-np.inf]]), k=1) == 1.0
    # float32 sums round: a score within TIE_TOLERANCE of the k-th is a tie, one beyond it is not
    near = np.array([[0.9, 0.7, 0.7 - TIE_TOLERANCE / 2, 0.7 - 2 * TIE_TOLERANCE]], dtype=np.float64)
    near_rows = np.array([[10, 11, 12, 13]])
    assert recall_with_ties(np.array([[10, 12]]), near_rows, near, k=2) == 1.0
    assert recall_with_ties(np.array([[10, 13]]), near_rows, near, k=2) == 0.5
    # the mean is over every wanted neighbour of every query
    two = recall_with_ties(np.array([[10, 11], [10, 99]]), np.repeat(rows, 2, axis=0), np.repeat(scores, 2, axis=0), 2)
    assert two == 0.75


def independent_recall(directory: Path, transformed: np.ndarray, knob: str, value: int) -> float:
    """recall@10 from the float64 reference and FAISS's search alone (no ties in this data)."""
    index, _, _ = parts(directory)
    _, truth = reference(directory, transformed, 10)
    _, found = index.search(transformed, 10, params=search_parameters(index, **{knob: value}))
    return sum(len(set(t.tolist()) & set(f.tolist())) for t, f in zip(truth, found, strict=True)) / truth.size


@pytest.mark.parametrize("name", ["hnsw", "ivf", "ivf-reduced"])
def test_the_smallest_knob_that_reaches_the_target(built, name: str) -> None:
    index, stash, transform = parts(built[name])
    transformed = np.ascontiguousarray(transform.transform(queries()), dtype=np.float32)
    target = 0.97
    cal = calibrate(index, stash, transform, transformed, target, "q.npy")
    assert cal.reached and cal.target == target and cal.queries == 200 and cal.source == "q.npy"
    assert cal.knob == knob_of(index) == ("ef_search" if name == "hnsw" else "nprobe")
    values = [value for value, _ in cal.curve]
    assert values == grid(cal.knob, index)[: len(values)]  # the grid in order, stopped at the first success
    assert cal.curve[-1] == (cal.value, cal.recall) and cal.recall >= target
    assert all(recall < target for _, recall in cal.curve[:-1])
    assert len(cal.curve) > 1, "the first value already reached the target: the test would not see a sweep"
    # checked without the module's own neighbour search: float64 truth, FAISS's rows
    for value, recall in cal.curve[-2:]:
        assert independent_recall(built[name], transformed, cal.knob, value) == pytest.approx(recall, abs=1e-3)
    assert cal.value < (index.nlist if cal.knob == "nprobe" else max(grid("ef_search", index)))
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal


def served_recall(directory: Path, raw: np.ndarray, nprobe: int, depth: int) -> float:
    """recall@10 of searches re-scoring their top ``depth`` by raw cosine, against the exact top ``depth`` re-scored
    alike: float64 throughout, FAISS's rows for the search (no ties in this data)."""
    index, stash, transform = parts(directory)
    transformed = np.ascontiguousarray(transform.transform(raw), dtype=np.float32)
    everything = np.concatenate(list(stash.iter_blocks())).astype(np.float64)
    everything /= np.linalg.norm(everything, axis=1, keepdims=True)
    unit = raw.astype(np.float64) / np.linalg.norm(raw.astype(np.float64), axis=1, keepdims=True)

    def top10(candidates: np.ndarray) -> list[set[int]]:
        cosines = np.einsum("qd,qcd->qc", unit, everything[candidates])
        order = np.argsort(-cosines, axis=1, kind="stable")[:, :10]
        return [set(row.tolist()) for row in np.take_along_axis(candidates, order, axis=1)]

    _, exact = reference(directory, transformed, depth)
    _, found = index.search(transformed, depth, params=search_parameters(index, nprobe=nprobe))
    truth = top10(exact)
    return sum(len(t & f) for t, f in zip(truth, top10(found), strict=True)) / (10 * len(raw))


def test_a_rescoring_index_is_calibrated_as_served(built) -> None:
    """A reduced index re-scores its top 50 at full dimension by default: calibrate measures that search. Here
    (24 -> 8 dims) the served top 10 reach deep into the 50 candidates, so it needs more lists probed than
    recall in the index's own space says: measuring the index alone would have chosen too small a knob."""
    reduced = built["ivf-reduced"]
    assert IndexDir(reduced).manifest().rescoring.depth == RESCORE_DEPTH == 50
    served, _ = calibrate_index(reduced, queries(), 0.97)
    alone, _ = calibrate_index(reduced, queries(), 0.97, rescore=0)
    assert served.rescore == 50 and alone.rescore == 0 and served.reached and alone.reached
    assert served.measured_as == "as served (re-scoring the top 50)"
    for value, recall in served.curve[-2:]:  # checked by an independent float64 computation
        assert served_recall(reduced, queries(), value, 50) == pytest.approx(recall, abs=1e-3)
    assert served.value > alone.value and served_recall(reduced, queries(), alone.value, 50) < 0.97
    deeper, _ = calibrate_index(reduced, queries(), 0.97, rescore=100)
    assert deeper.rescore == 100
    assert served_recall(reduced, queries(), deeper.value, 100) == pytest.approx(deeper.recall, abs=1e-3)
    # a full-dimension index does not re-score by default: measured in its own space, as before
    assert calibrate_index(built["ivf"], queries(), 0.97)[0].rescore == 0
    # records written before re-scoring was measured read as index-space ones
    assert Calibration.from_dict({k: v for k, v in alone.to_dict().items() if k != "rescore"}) == alone
    with pytest.raises(ConfigError, match="`rescore` must be 0 or more"):
        calibrate_index(reduced, queries(), 0.97, rescore=-1)


def test_a_binary_index_is_calibrated_by_the_re_rank_it_serves_with(tmp_path: Path, monkeypatch) -> None:
    """A binary index with a raw decoder re-ranks its Hamming candidates by the queries' raw vectors when it
    serves: calibrate hands it the same raw vectors (the sampled queries, row for row), so each point of the
    curve is the recall of those searches, checked against an independent computation with them."""
    from retrieval.codes import BinaryIndex

    directory = build(tmp_path, "binary", IndexSpec("ivf", codes="binary", nlist=16), TransformSpec(dim=16))
    seen: list[np.ndarray | None] = []
    search = BinaryIndex.search

    def spy(self, vectors, k, params=None, rerank=None, raw=None):  # type: ignore[no-untyped-def]
        seen.append(raw)
        return search(self, vectors, k, params, rerank, raw)

    monkeypatch.setattr(BinaryIndex, "search", spy)
    index, stash, transform = parts(directory)
    assert isinstance(index, BinaryIndex) and index.decoder is not None
    raw = queries(60)
    calibration, _ = calibrate_index(directory, raw, 0.9, rescore=0)
    assert seen and all(r is not None and np.array_equal(r, raw) for r in seen)
    transformed = transform.transform(raw)
    scores, exact = exact_neighbours(stash, transform, transformed)
    for value, recall in calibration.curve:
        found = index.search(transformed, 10, params=search_parameters(index, nprobe=value), raw=raw)[1]
        assert recall_with_ties(found, exact, scores) == pytest.approx(recall, abs=1e-4)


def test_an_unreachable_target_takes_the_start_of_the_plateau(tmp_path: Path, caplog) -> None:
    # 4-bit product codes: the compressed scores cap recall@10 well below 1 however many lists are probed
    out = build(tmp_path, "pq", IndexSpec("IVF16,PQ4x4np"))
    index, stash, transform = parts(out)
    with caplog.at_level(logging.WARNING, logger="retrieval.calibrate"):
        cal = calibrate(index, stash, transform, transform.transform(queries()), 0.999)
    assert not cal.reached and cal.target == 0.999
    assert [value for value, _ in cal.curve] == grid("nprobe", index)  # every value tried
    best = max(recall for _, recall in cal.curve)
    assert best < 0.999
    assert cal.value == next(value for value, recall in cal.curve if recall >= best - PLATEAU) < index.nlist
    assert "reaches recall@10" in caplog.text and "target 1.00" in caplog.text


def test_apply_publishes_the_knob_add_keeps_it_refit_drops_it(tmp_path: Path) -> None:
    out = build(tmp_path, "ivf", IndexSpec("ivf"))
    before = IndexDir(out).manifest()
    assert before.index.calibration is None and before.index.search == {"nprobe": round(math.sqrt(76))}
    measured, unchanged = calibrate_index(out, queries(), 0.97, "q.npy")  # not applied: nothing written
    assert unchanged.generation == before.generation and IndexDir(out).manifest().index.calibration is None
    cal, manifest = calibrate_index(out, queries(), 0.97, "q.npy", apply=True)
    assert cal == measured and manifest.generation == before.generation + 1
    assert manifest.index.calibration == cal and manifest.index.search == {"nprobe": cal.value}
    assert manifest.index.faiss["nprobe"] == cal.value == describe(IndexDir(out).faiss_index())["nprobe"]
    IndexDir(out).verify(manifest, "full")  # every file of the new version checks out
    searcher = Searcher.load(out, encoder=None)
    vectors = queries(20, seed=11)
    _, default = searcher.search_raw(vectors, SearchParams(k=10))
    _, explicit = searcher.search_raw(vectors, SearchParams(k=10, nprobe=cal.value))
    _, other = searcher.search_raw(vectors, SearchParams(k=10, nprobe=1))
    assert np.array_equal(default, explicit) and not np.array_equal(default, other)

    add(out, CorpusSpec(write_vectors(tmp_path / "more.parquet", clustered(300, 9), first=N), vectors_column="emb"))
    grown = IndexDir(out).manifest().index
    assert grown.ntotal == N + 300 and grown.calibration == cal and grown.search == {"nprobe": cal.value}
    assert describe(IndexDir(out).faiss_index())["nprobe"] == cal.value
    # info says the knob was measured on fewer rows than the index now holds (kept through 4-22x growth on real
    # vectors, README), and how to measure again; a record from before `rows` was kept says neither
    assert cal.rows == N
    said = summary(IndexDir(out).manifest(), IndexDir(out).transform())["search default"]
    assert f"at {N:,} rows (now {N + 300:,}: `retrieval calibrate` again re-measures)" in said
    old = dataclasses.replace(grown, calibration=Calibration.from_dict(
        {key: value for key, value in cal.to_dict().items() if key != "rows"}
    ))  # fmt: skip
    assert old.calibration is not None and old.calibration.rows == 0
    assert "rows" not in _search_default(old) and "measured on" in _search_default(old)

    refit(out, TransformSpec(dim=12))  # a new index: the measured knob no longer applies
    rebuilt = IndexDir(out).manifest().index
    assert rebuilt.calibration is None and rebuilt.search == before.index.search


def test_calibrate_refuses_what_it_cannot_measure(tmp_path: Path) -> None:
    flat = build(tmp_path, "flat", IndexSpec("flat"))
    with pytest.raises(ConfigError, match="a flat index searches exactly"):
        calibrate_index(flat, queries(), 0.95)
    ivf = build(tmp_path, "ivf", IndexSpec("ivf"))
    with pytest.raises(ConfigError, match=r"shape \(5, 3\); this index takes 24-d rows"):
        calibrate_index(ivf, np.zeros((5, 3), dtype=np.float32), 0.95)
    with pytest.raises(ConfigError, match="no queries"):
        calibrate_index(ivf, np.zeros((0, D), dtype=np.float32), 0.95)
    nan = queries()
    nan[[3, 7]] = np.nan  # all-NaN queries were measured as recall 1.0, and --apply stored that
    with pytest.raises(ConfigError, match="2 of 200 query vectors contain NaN or inf"):
        calibrate_index(ivf, nan, 0.95, apply=True)
    assert IndexDir(ivf).manifest().index.calibration is None
    for bad in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ConfigError, match="`target_recall` must be above 0 and at most 1"):
            calibrate_index(ivf, queries(), bad)
    bare = tmp_path / "bare"
    corpus = tmp_path / "corpus.parquet"
    build_index(CorpusSpec(corpus, vectors_column="emb"), None, bare, TransformSpec(), IndexSpec("ivf"),
                BuildOptions(keep_vectors=False))  # fmt: skip
    with pytest.raises(Exception, match="kept no raw-vector stash, so it cannot calibrate"):
        calibrate_index(bare, queries(), 0.95)


def test_many_queries_are_sampled_down(built) -> None:
    many = queries(MAX_QUERIES + 300)
    cal, _ = calibrate_index(built["ivf"], many, 0.9)
    assert cal.queries == MAX_QUERIES
    sample = query_sample(MAX_QUERIES + 300)  # seeded, sorted, distinct, from the whole range (not the first ones)
    assert len(sample) == MAX_QUERIES and np.array_equal(sample, query_sample(MAX_QUERIES + 300))
    assert np.all(np.diff(sample) > 0) and sample[-1] >= MAX_QUERIES and sample[-1] < MAX_QUERIES + 300
    np.testing.assert_array_equal(query_sample(50), np.arange(50))


def test_the_cli_measures_on_texts_and_applies(tiny_bert: Path, tmp_path: Path) -> None:
    """Texts are encoded by the index's own encoder (a tiny random BERT), then measured and applied."""
    corpus = write_corpus(tmp_path / "corpus.parquet", n=800)
    out = tmp_path / "idx"
    built = runner.invoke(
        app, ["index", str(corpus), "--model", str(tiny_bert), "--index-type", "ivf", "--out", str(out)]
    )
    assert built.exit_code == 0, built.output
    texts = [f"a question about topic {i % 37} and item {i}" for i in range(120)]
    pq.write_table(pa.table({"question": texts}), tmp_path / "q.parquet")
    args = ["calibrate", str(out), "--queries", str(tmp_path / "q.parquet"), "--text-column", "question"]
    result = runner.invoke(app, [*args, "--json", "--target-recall", "0.9"])
    assert result.exit_code == 0, result.output
    measured = json.loads(result.stdout)
    assert measured["knob"] == "nprobe" and measured["queries"] == 120 and not measured["applied"]
    assert measured["source"] == str((tmp_path / "q.parquet").resolve())
    assert IndexDir(out).manifest().index.calibration is None
    applied = runner.invoke(app, [*args, "--apply", "--target-recall", "0.9"])
    assert applied.exit_code == 0, applied.output
    assert f"nprobe {measured['value']}: recall@10" in applied.stderr and "now the default" in applied.stderr
    record = IndexDir(out).manifest().index
    assert record.calibration is not None and record.search == {"nprobe": measured["value"]}
    shown = json.loads(runner.invoke(app, ["info", str(out), "--json"]).stdout)["summary"]["search default"]
    assert shown.startswith(f"nprobe {measured['value']}: measured on 120 queries")


@pytest.mark.parametrize(
    ("width", "args", "message"),
    [
        (D, ["--target-recall", "1.5"], "--target-recall must be above 0 and at most 1 (got 1.5)"),
        (3, [], "the queries are vectors of shape (20, 3); this index takes 24-d rows"),
        (D, ["--rescore", "-1"], "--rescore must be 0 or more (got -1)"),
    ],
)
def test_the_cli_refuses_bad_input_in_one_line(
    built, tmp_path: Path, width: int, args: list[str], message: str
) -> None:
    np.save(tmp_path / "q.npy", queries(20)[:, :width])
    before = IndexDir(built["ivf"]).manifest().generation
    result = runner.invoke(
        app, ["calibrate", str(built["ivf"]), "--queries", str(tmp_path / "q.npy"), *args, "--apply"]
    )
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output
    assert IndexDir(built["ivf"]).manifest().generation == before


def test_the_cli_says_how_recall_was_measured(built, tmp_path: Path) -> None:
    np.save(tmp_path / "q.npy", queries(100))
    args = ["calibrate", str(built["ivf-reduced"]), "--queries", str(tmp_path / "q.npy"), "--target-recall", "0.9"]
    served = runner.invoke(app, args)
    assert served.exit_code == 0 and "as served (re-scoring the top 50) on 100 queries" in served.stderr
    alone = runner.invoke(app, [*args, "--rescore", "0", "--json"])
    assert alone.exit_code == 0 and json.loads(alone.stdout)["rescore"] == 0


def test_the_cli_says_a_vectors_index_takes_vector_queries(built, tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": ["a query"]}), tmp_path / "q.parquet")
    result = runner.invoke(app, ["calibrate", str(built["ivf"]), "--queries", str(tmp_path / "q.parquet")])
    assert result.exit_code == 1 and "give --queries as a .npy of query vectors" in result.output
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    result = runner.invoke(app, ["calibrate", str(built["ivf"]), "--queries", str(tmp_path / "bad.npy")])
    assert result.exit_code == 1 and "is not a readable .npy of query vectors" in result.output


def test_search_with_passes_the_knob_for_this_call_only(built) -> None:
    index, _, transform = parts(built["ivf"])
    transformed = np.ascontiguousarray(transform.transform(queries(5)), dtype=np.float32)
    stored = index.nprobe
    every = search_with(index, transformed, "nprobe", index.nlist)
    one = search_with(index, transformed, "nprobe", 1)
    assert index.nprobe == stored and every.shape == (5, 10) and not np.array_equal(every, one)


def test_the_cli_names_refit_when_a_changed_index_falls_short(tmp_path: Path) -> None:
    """Lists and codes are trained on the first rows and kept by `add` and `remove`: QA's IVF16,SQ8 after adding
    rows unlike the first reached 0.38 at every nprobe, 0.96 refitted. Short of the target on an index whose rows
    changed, calibrate says so and names refit; on an index as built it does not."""
    out = build(tmp_path, "pq", IndexSpec("IVF16,PQ4x4np"))
    np.save(tmp_path / "q.npy", queries())
    args = ["calibrate", str(out), "--queries", str(tmp_path / "q.npy"), "--target-recall", "0.999", "--rescore", "0"]
    as_built = runner.invoke(app, args)
    assert as_built.exit_code == 0 and "short of the target" in as_built.stderr and "refit" not in as_built.stderr
    more = write_vectors(tmp_path / "more.parquet", clustered(50, 7), first=N)
    add(out, CorpusSpec(more, vectors_column="emb"))
    changed = runner.invoke(app, args)
    assert changed.exit_code == 0, changed.output
    assert "rows were added or removed since its lists and codes were trained" in changed.stderr
    assert "`retrieval refit` trains them on the rows there are now" in changed.stderr
    refit(out, TransformSpec())  # trained again on the rows there are: the advice would loop
    refitted = runner.invoke(app, args)
    assert refitted.exit_code == 0 and "short of the target" in refitted.stderr and "refit" not in refitted.stderr


@pytest.mark.parametrize(
    ("kind", "args", "message"),
    [
        ("hnsw", ["--rescore", "-1"], "--rescore must be 0 or more (got -1)"),
        ("flat", [], "a flat index searches exactly: it has no knob to calibrate"),
    ],
)
def test_the_cli_refuses_before_it_loads_the_encoder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, args: list[str], message: str
) -> None:
    """`calibrate --rescore -1` and calibrate on a flat index were refused only after the model had loaded and
    encoded every query (20-30 s with a real one): what the arguments and the manifest tell comes first."""
    from conftest import FakeEncoder, write_corpus

    from retrieval.search import Searcher

    out = tmp_path / kind
    build_index(
        CorpusSpec(write_corpus(tmp_path / "c.parquet", n=300)),
        FakeEncoder(),
        out,
        TransformSpec(dim=8),
        IndexSpec(kind, m=8) if kind == "hnsw" else IndexSpec(kind),
    )
    pq.write_table(pa.table({"text": ["a question", "another one"]}), tmp_path / "q.parquet")

    def no_encoder(*args: object, **kwargs: object) -> None:
        raise AssertionError("the encoder was loaded before the arguments were checked")

    monkeypatch.setattr(Searcher, "load", no_encoder)
    result = runner.invoke(app, ["calibrate", str(out), "--queries", str(tmp_path / "q.parquet"), *args])
    assert result.exit_code == 1 and not isinstance(result.exception, AssertionError), result.exception
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


@pytest.fixture(scope="module")
def texts_built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A text corpus with a lexical part, as IVF (the knob) and flat (the truth) indexes of the same rows."""
    root = tmp_path_factory.mktemp("calibrate-hybrid")
    rng = np.random.default_rng(3)
    words = [f"w{i}" for i in range(60)]
    n = 2000
    table = {"id": [f"d{i}" for i in range(n)], "text": [" ".join(rng.choice(words, size=8)) for _ in range(n)]}
    pq.write_table(pa.table(table), root / "c.parquet")
    out = {}
    for kind, spec in (("ivf", IndexSpec("ivf", nlist=8, codes="fp32")), ("flat", IndexSpec("flat"))):
        build_index(CorpusSpec(root / "c.parquet"), FakeEncoder(), root / kind, TransformSpec(), spec)
        out[kind] = root / kind
    options = BuildOptions(lexical=None)
    build_index(
        CorpusSpec(root / "c.parquet"), FakeEncoder(), root / "dense", TransformSpec(), IndexSpec("ivf"), options
    )
    return out | {"dense": root / "dense"}


def hybrid_queries(n: int = 80) -> list[str]:
    rng = np.random.default_rng(11)
    return [" ".join(rng.choice([f"w{i}" for i in range(60)], size=3)) for _ in range(n)]


def test_a_hybrid_calibration_measures_the_fused_top_10(texts_built: dict[str, Path]) -> None:
    """In hybrid mode the knob decides which of the dense side's top 100 reach the fusion: recall@10 of the fused
    top 10 at each nprobe, checked against hybrid searches of the IVF index and of a flat index of the same rows."""
    texts = hybrid_queries()
    raw = FakeEncoder().encode(texts)
    hybrid, _ = calibrate_index(texts_built["ivf"], raw, 0.99, mode="hybrid", texts=texts)
    dense, _ = calibrate_index(texts_built["ivf"], raw, 0.99, mode="dense")
    assert hybrid.mode == "hybrid" and dense.mode == "dense" and "hybrid mode" in hybrid.measured_as
    assert hybrid.curve != dense.curve
    ivf = Searcher.load(texts_built["ivf"], encoder=FakeEncoder())
    flat = Searcher.load(texts_built["flat"], encoder=FakeEncoder())
    truth = [{h.row for h in hits} for hits in flat.search_batch(texts, SearchParams(k=10, mode="hybrid"))]
    for value, recall in hybrid.curve[:4]:
        served = ivf.search_batch(texts, SearchParams(k=10, mode="hybrid", nprobe=value))
        found = np.mean([len(t & {h.row for h in hits}) / 10 for t, hits in zip(truth, served, strict=True)])
        assert abs(found - recall) <= 0.02, (value, found, recall)  # ties of fused scores aside
    assert calibrate_index(texts_built["ivf"], raw, 0.99, texts=texts)[0].mode == "hybrid"  # the default with texts
    assert calibrate_index(texts_built["ivf"], raw, 0.99)[0].mode == "dense"  # vectors alone search dense


def test_calibrate_refuses_modes_it_cannot_measure(texts_built: dict[str, Path]) -> None:
    texts = hybrid_queries(5)
    raw = FakeEncoder().encode(texts)
    with pytest.raises(ConfigError, match="a lexical search reads no ef-search or nprobe"):
        calibrate_index(texts_built["ivf"], raw, 0.95, mode="lexical", texts=texts)
    with pytest.raises(ConfigError, match="needs the queries' texts"):
        calibrate_index(texts_built["ivf"], raw, 0.95, mode="hybrid")
    with pytest.raises(ConfigError, match="has no lexical index"):
        calibrate_index(texts_built["dense"], raw, 0.95, mode="hybrid", texts=texts)
    with pytest.raises(ConfigError, match="unknown `mode` 'sparse'"):
        calibrate_index(texts_built["ivf"], raw, 0.95, mode="sparse")
    np.save(texts_built["flat"].parent / "q.npy", raw)
    args = ["calibrate", str(texts_built["ivf"]), "--queries", str(texts_built["flat"].parent / "q.npy")]
    said = runner.invoke(app, [*args, "--mode", "hybrid"])
    assert said.exit_code == 1 and "needs the queries' texts" in said.stderr and len(said.stderr.splitlines()) == 1
    said = runner.invoke(app, [*args, "--mode", "dense", "--json"])
    assert said.exit_code == 0 and json.loads(said.stdout)["mode"] == "dense"
