"""Reliability, options: every flag out of range or meaningless for the index at hand, refused in one line
before any work; the few that are accepted do what they say."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeEncoder, write_corpus
from reliability import PAIRS, QRELS, QUERIES, case, leftovers, ok, one_line, run, snapshot, table_file

from retrieval.build import build_index
from retrieval.corpus import CorpusSpec
from retrieval.encode.models import model_dim
from retrieval.encode.spec import DEFAULT_MODEL
from retrieval.index import IndexSpec
from retrieval.manifest import Manifest
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--dim", "0"], "--dim must be at least 1"),
        (["--dim", "-3"], "--dim must be at least 1"),
        (["--dim", "100000"], "--dim must be between 1 and the encoder's dimension 32"),
        (["--gamma", "nan"], "--gamma must be between 0 and 2"),
        (["--gamma", "inf"], "--gamma must be between 0 and 2"),
        (["--gamma", "-1"], "--gamma must be between 0 and 2"),
        (["--gamma", "1e6"], "--gamma must be between 0 and 2"),
        (["--epsilon", "nan"], "--epsilon must be between 0 and 1"),
        (["--epsilon", "inf"], "--epsilon must be between 0 and 1"),
        (["--epsilon", "-1"], "--epsilon must be between 0 and 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--max-length", "0"], "--max-length must be at least 1"),
        (
            ["--max-length", "100000"],
            "--max-length must be between 3 (the special tokens and one more) and the model's 64 positions",
        ),
        (["--m", "0"], "--m (HNSW neighbours per node) must be between 2 and 512"),
        (["--nlist", "0"], "--nlist must be between 1"),
        (["--nprobe", "-3"], "--nprobe must be between 1"),
        (["--ef-construction", "0"], "--ef-construction must be between 1"),
        (["--ef-search", "0"], "--ef-search must be between 1"),
        (["--train-size", "0"], "--train-size must be between 1"),
        (["--pooling", "max"], "unknown --pooling 'max'"),
        (["--precision", "fp8"], "unknown --precision 'fp8'"),
        (["--stash-dtype", "int4"], "unknown --stash-dtype 'int4'"),
        (["--index-type", "NotAnIndex"], "FAISS cannot build index type 'NotAnIndex'"),
        (["--index-type", "IVF4096,Flat"], "IVF with 4096 lists needs at least that many training rows"),
        (["--index-type", "PQ7x8"], "FAISS cannot build index type 'PQ7x8'"),
        (["--extra-pooling", "max"], "unknown --extra-pooling 'max'"),
        (["--no-whiten", "--gamma", "0.5"], "the raw transform has no eigenvalues to raise; drop --gamma"),
        (["--center"], "the raw transform has no kernel to centre"),
    ],
)
@case(
    "options",
    "every numeric option of `index` at 0, negative, NaN, inf, huge; unknown pooling, extra pooling, precision, "
    "dtype, index type, factory strings, IVF too large for N; a gamma or centring for the raw transform",
    "one line naming the flag; nothing written; never a FAISS abort",
)
def test_bad_index_options(tiny_bert: Path, tmp_path: Path, options: list[str], fragment: str) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=200)
    result = run("index", corpus, "--model", tiny_bert, "--out", tmp_path / "out", *options)
    one_line(result, fragment)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["-k", "0"], "-k must be an integer between 1 and 10,000"),
        (["-k", "99999999"], "-k must be an integer between 1 and 10,000"),
        (["--rescore", "-5"], "--rescore must be an integer between 0 and 10,000"),
        (["--ef", "0"], "--ef-search must be an integer between 1"),
        (["--nprobe", "-3"], "--nprobe must be an integer between 1"),
    ],
)
@case("options", "`search` with -k 0 or huge, --rescore -5, --ef 0, --nprobe -3", "one line naming the flag")
def test_bad_search_options(cli_index: Path, options: list[str], fragment: str) -> None:
    one_line(run("search", "anything", "--index", cli_index, *options), fragment)


@case(
    "options",
    "-k larger than N, on a flat, HNSW or IVF index",
    "all N documents, ranked (an approximate index searches exhaustively for it)",
)
def test_k_larger_than_n(cli_index: Path, tmp_path: Path) -> None:
    hits = ok(run("search", "document", "--index", cli_index, "--json", "-k", 5000)).stdout.splitlines()
    assert [json.loads(h)["rank"] for h in hits] == list(range(1, 121))
    # HNSW with a beam of 8, IVF probing 1 list: before, they returned only the documents they reached
    corpus = write_corpus(tmp_path / "corpus.parquet", n=450)
    for spec in (IndexSpec("hnsw", ef_search=8), IndexSpec("ivf", nlist=11, nprobe=1)):
        out = tmp_path / spec.kind
        build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(dim=8), spec)
        searcher = Searcher.load(out, encoder=FakeEncoder())
        queries = FakeEncoder().encode(["document number 3", "whitening"])
        scores, rows = searcher.search_raw(queries, SearchParams(k=5000, rescore=0))
        for query_scores, query_rows in zip(scores, rows, strict=True):
            assert sorted(query_rows.tolist()) == list(range(450)), spec.kind
            assert np.all(np.diff(query_scores) <= 1e-6), spec.kind  # ranked
        _, fewer = searcher.search_raw(queries, SearchParams(k=449, rescore=0))
        assert fewer.shape == (2, 449)  # below N: the index's own knob, as configured


@pytest.mark.parametrize("query", ["", "   ", "\t\n", "\u200b", "\x00\ufeff"])
@case("options", "empty, whitespace-only or invisible query (zero-width space, NUL)", "one line: the query is empty")
def test_empty_query(cli_index: Path, query: str) -> None:
    one_line(run("search", query, "--index", cli_index), "the query is empty")


@case("options", "a 100,000-character query", "hits (the query is truncated to the model's max length)")
def test_a_huge_query(cli_index: Path) -> None:
    hits = ok(run("search", "whitening " * 10_000, "--index", cli_index, "--json", "-k", 3)).stdout.splitlines()
    assert len(hits) == 3


@case(
    "options",
    "`eval ir --depth 0` or below 100, `--per-query` a folder or in a missing one, `tune --dims abc`, `--results` "
    "under a file, `--seed -1`, `--auto-queries 19`, `--test-pairs` for an index, `eval sts --index` with --dim",
    "one line naming the option, before any work (a bad output path failed after the sweep, and skipped --apply)",
)
def test_bad_eval_and_tune_options(cli_index: Path, tmp_path: Path) -> None:
    queries = table_file(tmp_path / "q.parquet", query_id=["q"], text=["document"])
    qrels = table_file(tmp_path / "r.parquet", query_id=["q"], doc_id=["doc1"], score=[1])
    judged = ("--queries", queries, "--qrels", qrels)
    one_line(run("eval", "ir", cli_index, *judged, "--depth", 0), "--depth must be at least 100")
    one_line(run("eval", "ir", cli_index, *judged, "--depth", 5), "--depth must be at least 100")  # labels @100
    one_line(run("eval", "ir", cli_index, *judged, "--per-query", tmp_path), "is a folder: name a file")
    one_line(run("eval", "ir", cli_index, *judged, "--per-query", tmp_path / "no" / "x.jsonl"), "does not exist")
    one_line(run("tune", cli_index, *judged, "--dims", "abc"), "--dims")
    (tmp_path / "afile").write_text("")
    for results in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        one_line(run("tune", cli_index, *judged, "--dims", 4, "--results", results, "--apply"), "is a file")
    one_line(run("tune", cli_index, "--auto", "--seed", -1), "--seed must be 0 or more")
    one_line(run("tune", cli_index, "--auto", "--auto-queries", 19), "--auto-queries must be between 20")
    one_line(run("tune", cli_index, *judged, "--test-pairs", qrels), "--test-pairs goes with --pairs")
    pairs = table_file(tmp_path / "p.parquet", **PAIRS)
    one_line(run("eval", "sts", pairs, "--index", cli_index, "--dim", 4), "--dim does not apply with --index")


@case(
    "options",
    "`eval sts --dim` past the encoder's dimension; `tune --metric nDCG@5`",
    "one line before anything is encoded (not raw scores reported as transformed, not a KeyError mid-sweep)",
)
def test_dim_and_metric_out_of_range(cli_index: Path, tiny_bert: Path, tmp_path: Path) -> None:
    pairs = table_file(tmp_path / "p.parquet", **PAIRS)
    one_line(run("eval", "sts", pairs, "--model", tiny_bert, "--dim", 64), "--dim must be between 1 and")
    q, r = table_file(tmp_path / "q.parquet", **QUERIES), table_file(tmp_path / "r.parquet", **QRELS)
    one_line(run("tune", cli_index, "--queries", q, "--qrels", r, "--metric", "nDCG@5"), "unknown --metric 'nDCG@5'")
    one_line(run("tune", "--pairs", pairs, "--model", tiny_bert, "--metric", "x"), "unknown --metric 'x'")


@case("options", "`demo --dim 0`, `demo --dim 1000` (past MiniLM's 384)", "refused before the demo corpus is written")
def test_demo_refuses_before_writing(isolated_home: Path) -> None:
    one_line(run("demo", "--dim", 0), "--dim must be at least 1")
    assert not isolated_home.exists() or not list(isolated_home.iterdir())
    if model_dim(DEFAULT_MODEL) is None:
        pytest.skip(f"{DEFAULT_MODEL} is not installed here (make install)")
    one_line(run("demo", "--dim", 1000), "--dim must be between 1 and the encoder's dimension 384")
    assert not isolated_home.exists() or not list(isolated_home.iterdir())


@case("options", "`refit --gamma nan` on a good index", "one line; the index is unchanged")
def test_refit_with_nan_gamma(copy: Path) -> None:
    before = snapshot(copy)
    one_line(run("refit", copy, "--gamma", "nan"), "--gamma must be between 0 and 2")
    assert snapshot(copy) == before and leftovers(copy) == []


@case(
    "options",
    "`refit --nprobe` on a flat index, `refit --epsilon` or `--no-center` on a raw one, `index --index-type hnsw "
    "--nlist 8` (or `IVF2,Flat --nlist 5`, or flat `--m 8`)",
    "one line naming the option that would do nothing; the index is unchanged (they were accepted and ignored)",
)
def test_options_that_would_do_nothing(copy: Path, tmp_path: Path) -> None:
    before = snapshot(copy)
    one_line(run("refit", copy, "--nprobe", 4), "--nprobe does nothing for a flat index")
    one_line(run("refit", copy, "--m", 16), "--m does nothing for a flat index")
    assert snapshot(copy) == before
    ok(run("refit", copy, "--no-whiten"))
    raw = snapshot(copy)
    one_line(run("refit", copy, "--epsilon", "1e-3"), "no eigenvalues to regularise; drop --epsilon")
    one_line(run("refit", copy, "--no-center"), "drop --center/--no-center")
    assert snapshot(copy) == raw and leftovers(copy) == []
    corpus = write_corpus(tmp_path / "c.parquet", n=50)
    out = tmp_path / "hnsw"
    one_line(run("index", corpus, "--index-type", "hnsw", "--nlist", 8, "--out", out), "--nlist does nothing")
    one_line(run("index", corpus, "--index-type", "IVF2,Flat", "--nlist", 5, "--out", out), "--nlist does nothing")
    one_line(run("index", corpus, "--m", 8, "--out", out), "--m does nothing for a flat index")
    one_line(run("index", corpus, "--index-type", "NSG32", "--out", out), "NSG graphs cannot take rows in batches")
    assert not out.exists()


@case(
    "options",
    "the default-index pointer cannot be written (`RETRIEVAL_INDEX_ROOT` is a file, a read-only working directory)",
    "the build succeeds (exit 0) with one warning naming `--index DIR`; the index is complete",
)
def test_a_pointer_that_cannot_be_written_is_a_warning(tiny_bert: Path, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("RETRIEVAL_INDEX_ROOT", str(tmp_path / "afile"))
    corpus = write_corpus(tmp_path / "c.parquet", n=20)
    result = run("index", corpus, "--model", tiny_bert, "--out", tmp_path / "idx")
    assert result.exit_code == 0, result.stderr
    assert "could not be recorded as the default index" in result.stderr and "Traceback" not in result.stderr
    assert Manifest.load(tmp_path / "idx").n == 20 and leftovers(tmp_path / "idx") == []
