"""The corpus reader: ids, texts, titles, vectors, and every bad input refused with a clear message."""

from __future__ import annotations

import logging
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import mapped_rss_kib, write_corpus

from retrieval import corpus as corpus_module
from retrieval.corpus import Corpus, CorpusSpec
from retrieval.errors import CorpusError


def read_all(corpus: Corpus, rows: int = 64) -> tuple[list[str], list[str]]:
    ids: list[str] = []
    texts: list[str] = []
    for batch in corpus.batches(rows):
        ids += batch.ids
        texts += batch.texts
    return ids, texts


def write_table(path: Path, **columns: list) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=4)
    return path


# ----- ids and texts ---------------------------------------------------------------------------------------
def test_id_column_used_by_default_when_present(corpus: Path) -> None:
    source = Corpus(CorpusSpec(corpus))
    report = source.validate()
    ids, texts = read_all(source)
    assert source.id_column == "id"
    assert (report.rows, report.usable, report.skipped) == (300, 300, 0)
    assert ids == [f"doc{i}" for i in range(300)]
    assert texts[5] == "document number 5 about topic 5"


def test_row_numbers_when_there_is_no_id_column(tmp_path: Path) -> None:
    path = write_table(tmp_path / "c.parquet", text=["alpha", "beta", "gamma"])
    source = Corpus(CorpusSpec(path))
    source.validate()
    assert source.id_column is None
    assert read_all(source, rows=2) == (["0", "1", "2"], ["alpha", "beta", "gamma"])


def test_numeric_ids_become_strings(tmp_path: Path) -> None:
    path = write_table(tmp_path / "c.parquet", doc_id=[10, 20, 30], text=["a", "b", "c"])
    ids, _ = read_all(Corpus(CorpusSpec(path, id_column="doc_id")))
    assert ids == ["10", "20", "30"]


def test_explicit_missing_column_names_the_existing_ones(corpus: Path) -> None:
    with pytest.raises(CorpusError) as info:
        Corpus(CorpusSpec(corpus, id_column="doc_id"))
    message = str(info.value)
    assert "'doc_id'" in message and "id, text" in message and "`id_column`" in message
    with pytest.raises(CorpusError, match=r"no column 'body' \(columns: id, text\).*`text_column`"):
        Corpus(CorpusSpec(corpus, text_column="body"))
    with pytest.raises(CorpusError, match=r"no column 'heading'.*`title_column`"):
        Corpus(CorpusSpec(corpus, title_column="heading"))


def test_title_is_prepended_to_the_text(tmp_path: Path) -> None:
    path = write_table(
        tmp_path / "c.parquet", id=["a", "b", "c"], title=["Cats", None, ""], text=["purr", "bark", "moo"]
    )
    _, texts = read_all(Corpus(CorpusSpec(path, title_column="title")))
    assert texts == ["Cats purr", "bark", "moo"]


def test_a_title_does_not_make_a_null_text_usable(tmp_path: Path) -> None:
    """A null text stays null with a title (the row is empty); an empty-string text gives the title alone."""
    path = write_table(
        tmp_path / "c.parquet", id=["a", "b", "c"], title=["Cats", "Dogs", "Cows"], text=["purr", None, ""]
    )
    source = Corpus(CorpusSpec(path, title_column="title"))
    with pytest.raises(CorpusError, match=r"^1 of 3 rows have null or empty text \(first ids: b\)"):
        source.validate()
    skipping = Corpus(CorpusSpec(path, title_column="title", skip_empty=True))
    assert skipping.validate().first_skipped == ["b"]
    assert read_all(skipping) == (["a", "c"], ["Cats purr", "Cows"])


def test_a_text_column_of_nulls_only_is_counted_as_empty(tmp_path: Path) -> None:
    """A column parquet stores as type null (every value missing) is text with no values, not a type error."""
    path = write_table(tmp_path / "c.parquet", id=["a", "b", "c"], text=pa.array([None] * 3, pa.null()))
    with pytest.raises(CorpusError, match=r"^3 of 3 rows have null or empty text \(first ids: a, b, c\)"):
        Corpus(CorpusSpec(path)).validate()


def test_invalid_utf8_names_the_row_in_the_file_not_in_the_window(tmp_path: Path) -> None:
    texts = [f"text {i}".encode() for i in range(8)]
    texts[5] = b"\xff\xfe not utf-8"
    path = write_table(tmp_path / "c.parquet", id=[f"d{i}" for i in range(8)], text=pa.array(texts, pa.binary()))
    with pytest.raises(
        CorpusError, match=r"column 'text' of .*c\.parquet holds bytes that are not UTF-8 text \(row 5\)"
    ):
        list(Corpus(CorpusSpec(path)).batches(4))


@pytest.mark.parametrize("column", ["text", "id"])
@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_a_string_column_whose_bytes_are_not_utf8_names_the_row(tmp_path: Path, column: str, kind) -> None:
    """Parquet writers need not check that a string column is UTF-8: such bytes are refused as binary's are."""
    values = [f"{column} {i}".encode() for i in range(8)]
    values[6] = b"bad \xff\xfe bytes"
    offsets = np.cumsum([0] + [len(v) for v in values]).astype(np.int64 if kind == pa.large_string() else np.int32)
    unchecked = pa.Array.from_buffers(kind, 8, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(values))])
    columns = {"id": [f"d{i}" for i in range(8)], "text": [f"text {i}" for i in range(8)], column: unchecked}
    path = write_table(tmp_path / "c.parquet", **columns)
    with pytest.raises(CorpusError, match=rf"column '{column}' of .*holds bytes that are not UTF-8 text \(row 6\)"):
        list(Corpus(CorpusSpec(path)).batches(4))


@pytest.mark.parametrize("column", ["text", "id"])
def test_a_column_name_used_twice_is_refused(tmp_path: Path, column: str) -> None:
    arrays = [pa.array([f"d{i}" for i in range(4)]), pa.array([f"text {i}" for i in range(4)]), pa.array(["x"] * 4)]
    names = ["id", "text", column]
    pq.write_table(pa.Table.from_arrays(arrays, names=names), tmp_path / "c.parquet")
    with pytest.raises(CorpusError, match=rf"has 2 columns named '{column}'; rename them"):
        Corpus(CorpusSpec(tmp_path / "c.parquet"))


# ----- empty texts -----------------------------------------------------------------------------------------
def empty_corpus(tmp_path: Path) -> Path:
    texts = [f"text {i}" for i in range(20)]
    for i in (3, 7, 11):
        texts[i] = None
    texts[15] = "   "
    return write_table(tmp_path / "c.parquet", id=[f"d{i}" for i in range(20)], text=texts)


def test_null_and_empty_texts_are_refused_with_count_and_first_ids(tmp_path: Path) -> None:
    source = Corpus(CorpusSpec(empty_corpus(tmp_path)))
    with pytest.raises(CorpusError) as info:
        source.validate()
    message = str(info.value)
    assert message.startswith("4 of 20 rows have null or empty text")
    assert "first ids: d3, d7, d11, d15" in message
    assert "--skip-empty" in message


def test_first_ids_are_at_most_five(tmp_path: Path) -> None:
    texts = [None] * 8 + ["ok"] * 4
    path = write_table(tmp_path / "c.parquet", id=[f"d{i}" for i in range(12)], text=texts)
    with pytest.raises(CorpusError, match=r"8 of 12 rows .*first ids: d0, d1, d2, d3, d4\)"):
        Corpus(CorpusSpec(path)).validate()


def test_skip_empty_skips_and_reports(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = Corpus(CorpusSpec(empty_corpus(tmp_path), skip_empty=True))
    with caplog.at_level(logging.WARNING, logger="retrieval.corpus"):
        report = source.validate()
    assert (report.rows, report.usable, report.skipped) == (20, 16, 4)
    assert report.first_skipped == ["d3", "d7", "d11", "d15"]
    assert "skipping 4 of 20 rows" in caplog.text
    ids, texts = read_all(source, rows=4)
    assert len(ids) == 16 and "d3" not in ids and "d15" not in ids
    assert all(t.strip() for t in texts)


def test_first_ids_are_in_row_order_across_windows(tmp_path: Path) -> None:
    """Validation in windows smaller than the file merges each window's findings in row order, at most five."""
    source = Corpus(CorpusSpec(empty_corpus(tmp_path), skip_empty=True))
    report = source.validate(rows=4)
    assert (report.rows, report.usable, report.skipped) == (20, 16, 4)
    assert report.first_skipped == ["d3", "d7", "d11", "d15"]
    texts = ["ok"] * 3 + [None] * 9
    path = write_table(tmp_path / "m.parquet", id=[f"m{i}" for i in range(12)], text=texts)
    with pytest.raises(CorpusError, match=r"^9 of 12 rows .*\(first ids: m3, m4, m5, m6, m7\)"):
        Corpus(CorpusSpec(path)).validate(rows=2)


def test_skip_empty_still_needs_two_usable_rows(tmp_path: Path) -> None:
    path = write_table(tmp_path / "c.parquet", id=["a", "b", "c"], text=[None, "", "only one"])
    with pytest.raises(CorpusError, match="1 usable row"):
        Corpus(CorpusSpec(path, skip_empty=True)).validate()


# ----- bad files and bad shapes ------------------------------------------------------------------------------
def test_duplicate_ids_are_refused(tmp_path: Path) -> None:
    path = write_table(tmp_path / "c.parquet", id=["a", "b", "c", "b"], text=["1", "2", "3", "4"])
    with pytest.raises(CorpusError, match=r"duplicate id 'b' in column 'id'"):
        Corpus(CorpusSpec(path)).validate()


def test_duplicates_across_record_batches_are_found(tmp_path: Path) -> None:
    path = write_corpus(tmp_path / "c.parquet", n=10, id=[f"d{i}" for i in range(9)] + ["d0"])
    with pytest.raises(CorpusError, match="duplicate id 'd0'"):
        Corpus(CorpusSpec(path)).validate(rows=3)


def test_equal_hashes_of_different_ids_are_not_duplicates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """validate keeps 8-byte hashes, not the ids: every hash equal forces the check onto the strings themselves."""
    monkeypatch.setattr(corpus_module, "id_hashes", lambda ids: np.zeros(len(ids), dtype=np.int64))
    unique = write_corpus(tmp_path / "u.parquet", n=10)
    assert Corpus(CorpusSpec(unique)).validate(rows=3).usable == 10
    repeated = write_corpus(tmp_path / "r.parquet", n=10, id=[f"d{i}" for i in range(7)] + ["d5", "d2", "d9"])
    with pytest.raises(CorpusError, match="duplicate id 'd5'"):  # the first one seen twice, in row order
        Corpus(CorpusSpec(repeated)).validate(rows=3)


def peak_allocations(run: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_validation_memory_grows_by_bytes_per_id_not_by_the_ids(tmp_path: Path) -> None:
    """Peak Python allocations of a validation pass, at 6,000 and 60,000 rows: what grows is the ids' 8-byte
    hashes (a few copies of them while sorting), where a set of the id strings grows by ~110 bytes per id."""
    peaks = []
    for n in (6_000, 60_000):
        path = write_corpus(tmp_path / f"c{n}.parquet", n=n, id=[f"document-{i:012d}" for i in range(n)])
        source = Corpus(CorpusSpec(path))
        peaks.append(peak_allocations(lambda: source.validate(rows=2048)))  # noqa: B023 (called at once)
    assert (peaks[1] - peaks[0]) / 54_000 < 40, peaks


def test_null_ids_are_refused(tmp_path: Path) -> None:
    path = write_table(tmp_path / "c.parquet", id=["a", None, "c"], text=["1", "2", "3"])
    with pytest.raises(CorpusError, match="null ids"):
        Corpus(CorpusSpec(path)).validate()


def test_empty_corpus_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}), path)
    with pytest.raises(CorpusError, match="holds no rows"):
        Corpus(CorpusSpec(path)).validate()


def test_one_row_is_refused(tmp_path: Path) -> None:
    path = write_table(tmp_path / "c.parquet", id=["a"], text=["lonely"])
    with pytest.raises(CorpusError, match=r"1 usable row\(s\); at least 2"):
        Corpus(CorpusSpec(path)).validate()


def test_two_rows_are_enough(tmp_path: Path) -> None:
    path = write_table(tmp_path / "c.parquet", id=["a", "b"], text=["one", "two"])
    assert Corpus(CorpusSpec(path)).validate().usable == 2


def test_not_parquet_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    path.write_text("id,text\n1,hello\n")
    with pytest.raises(CorpusError, match="not a readable parquet file"):
        Corpus(CorpusSpec(path))


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="corpus file not found"):
        Corpus(CorpusSpec(tmp_path / "nope.parquet"))


def test_a_folder_without_parquet_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a corpus")
    with pytest.raises(CorpusError, match=r"corpus folder .* holds no \.parquet files"):
        Corpus(CorpusSpec(tmp_path))


# ----- folders and globs -----------------------------------------------------------------------------------
def split_corpus(folder: Path, sizes: tuple[int, ...] = (70, 0, 45, 100), ids: bool = True) -> list[Path]:
    """``sizes`` rows in files ``part-0.parquet``... (row groups of 16), rows numbered on across the files."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for n, rows in enumerate(sizes):
        columns: dict[str, list] = {"text": [f"text {i}" for i in range(start, start + rows)]}
        if ids:
            columns = {"id": [f"doc{i}" for i in range(start, start + rows)], **columns}
        table = pa.table(columns) if rows else pa.table({k: pa.array([], pa.string()) for k in columns})
        pq.write_table(table, folder / f"part-{n}.parquet", row_group_size=16)
        paths.append(folder / f"part-{n}.parquet")
        start += rows
    return paths


def test_a_folder_is_read_file_by_file_in_sorted_order(tmp_path: Path) -> None:
    split_corpus(tmp_path / "c")
    (tmp_path / "c" / "_SUCCESS").write_text("")  # what Spark leaves: skipped, as are hidden files
    pq.write_table(pa.table({"id": ["x"], "text": ["hidden"]}), tmp_path / "c" / ".hidden.parquet")
    source = Corpus(CorpusSpec(tmp_path / "c"))
    assert [f.name for f in source.files] == ["part-0.parquet", "part-1.parquet", "part-2.parquet", "part-3.parquet"]
    assert source.validate().rows == 215
    ids, texts = read_all(source, rows=32)
    assert ids == [f"doc{i}" for i in range(215)] and texts[100] == "text 100"
    # windows never cross a file: 70 -> 32+32+6, 0 -> none, 45 -> 32+13, 100 -> 32+32+32+4
    assert [len(b) for b in source.batches(32)] == [32, 32, 6, 32, 13, 32, 32, 32, 4]
    assert source.windows(32) == 9


def test_files_under_hidden_or_underscore_folders_are_skipped(tmp_path: Path) -> None:
    """Spark writes work in progress to ``_temporary/``, tools stage to dot-folders, pyarrow writes
    ``_metadata``: none of it is corpus, at any depth."""
    split_corpus(tmp_path / "c", sizes=(3,))
    for stray in ("_temporary/0/part-0.parquet", ".staging/part-0.parquet", "_common.parquet", "sub/_x/p.parquet"):
        (tmp_path / "c" / stray).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": [stray], "text": ["stray"]}), tmp_path / "c" / stray)
    source = Corpus(CorpusSpec(tmp_path / "c"))
    assert [f.name for f in source.files] == ["part-0.parquet"]
    assert read_all(source)[0] == ["doc0", "doc1", "doc2"]


def test_a_glob_reads_the_files_it_matches(tmp_path: Path) -> None:
    split_corpus(tmp_path / "c")
    source = Corpus(CorpusSpec(tmp_path / "c" / "part-[23].parquet"))
    assert [f.name for f in source.files] == ["part-2.parquet", "part-3.parquet"]
    assert read_all(source)[0] == [f"doc{i}" for i in range(70, 215)]
    with pytest.raises(CorpusError, match="no file matches the corpus pattern"):
        Corpus(CorpusSpec(tmp_path / "c" / "*.csv"))


def test_without_an_id_column_a_folders_ids_are_file_and_row(tmp_path: Path) -> None:
    split_corpus(tmp_path / "c" / "sub", sizes=(3, 2), ids=False)
    ids, _ = read_all(Corpus(CorpusSpec(tmp_path / "c")))
    assert ids == ["sub/part-0.parquet:0", "sub/part-0.parquet:1", "sub/part-0.parquet:2"] + [
        "sub/part-1.parquet:0",
        "sub/part-1.parquet:1",
    ]
    ids, _ = read_all(Corpus(CorpusSpec(tmp_path / "c" / "*" / "part-1.parquet")))
    assert ids == ["sub/part-1.parquet:0", "sub/part-1.parquet:1"]  # relative to the glob's fixed directory


@pytest.mark.parametrize("ids", [True, False], ids=["id-column", "row-numbers"])
@pytest.mark.parametrize("rows", [1, 7, 16, 50, 1000])
def test_any_range_of_windows_reads_what_a_full_pass_reads(tmp_path: Path, rows: int, ids: bool) -> None:
    """Windows that start inside a row group (7 rows in groups of 16) re-cut pyarrow's batches: every row
    once, in order; without an id column a window read on its own names its rows by their number in the file."""
    sizes = (70, 0, 45, 100)
    split_corpus(tmp_path / "c", sizes, ids=ids)
    source = Corpus(CorpusSpec(tmp_path / "c"))
    full = [b.ids for b in source.batches(rows)]
    assert len(full) == source.windows(rows)
    if ids:
        expected = [f"doc{i}" for i in range(sum(sizes))]
    else:
        expected = [f"part-{n}.parquet:{r}" for n, size in enumerate(sizes) for r in range(size)]
    assert [i for window in full for i in window] == expected
    assert [len(w) for w in full] == [min(rows, s - w * rows) for s in sizes for w in range(-(-s // rows))]
    for start, stop in [(0, 1), (1, 3), (len(full) // 2, len(full)), (len(full) - 1, None)]:
        assert [b.ids for b in source.batches(rows, start, stop)] == full[start:stop]
    for start in range(len(full)):  # every start, also inside a row group at an offset not a multiple of rows
        assert [b.ids for b in source.batches(rows, start, start + 2)] == full[start : start + 2]


def test_duplicate_ids_across_files_are_refused_naming_the_files(tmp_path: Path) -> None:
    """The message named neither file: in a folder of hundreds, the user had to search for them."""
    split_corpus(tmp_path / "c", sizes=(5, 5))
    pq.write_table(pa.table({"id": ["doc7"], "text": ["again"]}), tmp_path / "c" / "part-9.parquet")
    with pytest.raises(
        CorpusError, match=r"duplicate id 'doc7' in column 'id' \(in part-1.parquet and part-9.parquet\)"
    ):
        Corpus(CorpusSpec(tmp_path / "c")).validate()
    pq.write_table(pa.table({"id": ["x", "y", "x"], "text": ["a", "b", "c"]}), tmp_path / "c" / "part-9.parquet")
    with pytest.raises(CorpusError, match=r"duplicate id 'x' in column 'id' \(twice in part-9.parquet\)"):
        Corpus(CorpusSpec(tmp_path / "c")).validate()


@pytest.mark.parametrize("glob", [False, True])
def test_an_index_kept_inside_its_corpus_folder_is_not_read_as_corpus(tmp_path: Path, glob: bool) -> None:
    """`index data/ --out data/idx`, then again with --overwrite: the index's stash parts (parquet files under
    data/idx/vectors) were read as corpus files, and the error blamed duplicate ids."""
    from conftest import FakeEncoder

    from retrieval.build import BuildOptions, build_index
    from retrieval.whitening import TransformSpec

    data = split_corpus(tmp_path / "data", sizes=(30, 30))[0].parent
    corpus = CorpusSpec(data / "**" / "*.parquet" if glob else data)
    build_index(corpus, FakeEncoder(), data / "idx", TransformSpec(dim=4))
    assert list((data / "idx").rglob("*.parquet"))  # the stash's parts: what a corpus read must leave out
    assert [f.name for f in Corpus(corpus).files] == ["part-0.parquet", "part-1.parquet"]
    again = build_index(corpus, FakeEncoder(), data / "idx", TransformSpec(dim=4), options=BuildOptions(overwrite=True))
    assert again.n == 60


def test_a_bad_file_in_a_folder_is_named(tmp_path: Path) -> None:
    split_corpus(tmp_path / "c", sizes=(5, 5))
    pq.write_table(pa.table({"id": ["z"], "body": ["no text column"]}), tmp_path / "c" / "part-5.parquet")
    with pytest.raises(CorpusError, match=r"part-5\.parquet has no column 'text' \(columns: id, body\)"):
        Corpus(CorpusSpec(tmp_path / "c"))
    (tmp_path / "c" / "part-5.parquet").write_text("garbage")
    with pytest.raises(CorpusError, match=r"part-5\.parquet is not a readable parquet file"):
        Corpus(CorpusSpec(tmp_path / "c"))
    pq.write_table(pa.table({"text": ["no id column"]}), tmp_path / "c" / "part-5.parquet")
    with pytest.raises(CorpusError, match=r"part-5\.parquet has no column 'id' where other files have one"):
        Corpus(CorpusSpec(tmp_path / "c"))
    pq.write_table(pa.table({"id": ["z", None], "text": ["a", "b"]}), tmp_path / "c" / "part-5.parquet")
    with pytest.raises(CorpusError, match=r"column 'id' of .*part-5\.parquet has null ids"):
        Corpus(CorpusSpec(tmp_path / "c")).validate()


def test_a_folders_fingerprint_covers_names_and_bytes(tmp_path: Path) -> None:
    split_corpus(tmp_path / "c", sizes=(5, 5))
    before = Corpus(CorpusSpec(tmp_path / "c")).fingerprint()
    (tmp_path / "c" / "part-1.parquet").rename(tmp_path / "c" / "part-2.parquet")
    assert Corpus(CorpusSpec(tmp_path / "c")).fingerprint() != before


# ----- vectors ---------------------------------------------------------------------------------------------
def test_fixed_size_list_vectors_are_read_as_float32(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(10, 5))  # float64 on disk
    column = pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 5)
    path = tmp_path / "v.parquet"
    pq.write_table(pa.table({"id": [f"v{i}" for i in range(10)], "emb": column}), path, row_group_size=4)
    source = Corpus(CorpusSpec(path, vectors_column="emb"))
    assert source.vector_dim == 5 and not source.has_text
    source.validate()
    got = np.concatenate([b.vectors for b in source.batches(3)])
    assert got.dtype == np.float32
    # float64 -> float32 rounding only.
    np.testing.assert_allclose(got, vectors, rtol=1e-6)


def test_ragged_vectors_are_refused(tmp_path: Path) -> None:
    path = write_table(tmp_path / "v.parquet", id=["a", "b"], emb=[[1.0, 2.0], [1.0, 2.0, 3.0]])
    with pytest.raises(CorpusError, match="different lengths"):
        list(Corpus(CorpusSpec(path, vectors_column="emb")).batches(8))


def test_vectors_column_of_strings_is_refused(tmp_path: Path) -> None:
    path = write_table(tmp_path / "v.parquet", id=["a", "b"], emb=["x", "y"])
    with pytest.raises(CorpusError, match="not a list of numbers"):
        Corpus(CorpusSpec(path, vectors_column="emb"))


def vectors_file(path: Path, rows: list, width: int | None = None, row_group_size: int = 4) -> Path:
    kind = pa.list_(pa.float32(), width) if width is not None else pa.list_(pa.float32())
    ids = [f"v{i}" for i in range(len(rows))]
    pq.write_table(pa.table({"id": ids, "emb": pa.array(rows, kind)}), path, row_group_size=row_group_size)
    return path


def test_non_finite_vectors_are_counted_and_named_across_windows(tmp_path: Path) -> None:
    """Every NaN or inf (one component is enough) is counted, in every window; the ids named are those rows', in
    row order, also when null vectors skipped before them shift the window's kept rows."""
    rows: list = [[1.0, 2.0, 3.0]] * 12
    rows[1] = None  # skipped
    rows[2] = [1.0, float("nan"), 3.0]
    rows[6] = [float("inf"), 2.0, 3.0]
    rows[10] = [1.0, 2.0, float("-inf")]
    source = Corpus(CorpusSpec(vectors_file(tmp_path / "v.parquet", rows), vectors_column="emb", skip_empty=True))
    with pytest.raises(CorpusError, match=r"^3 of 12 vectors contain NaN or inf \(first ids: v2, v6, v10\)"):
        source.validate(rows=4)


def test_null_vectors_are_empty_rows(tmp_path: Path) -> None:
    rows: list = [[float(i), 1.0] for i in range(6)]
    rows[4] = None
    path = vectors_file(tmp_path / "v.parquet", rows)
    with pytest.raises(CorpusError, match=r"^1 of 6 rows have null vectors \(first ids: v4\)"):
        Corpus(CorpusSpec(path, vectors_column="emb")).validate()
    source = Corpus(CorpusSpec(path, vectors_column="emb", skip_empty=True))
    assert source.validate().first_skipped == ["v4"]
    batches = list(source.batches(4))
    assert [b.ids for b in batches] == [["v0", "v1", "v2", "v3"], ["v5"]]
    np.testing.assert_array_equal(batches[1].vectors, [[5.0, 1.0]])


def test_vector_widths_that_differ_between_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    vectors_file(tmp_path / "c" / "a.parquet", [[1.0, 2.0, 3.0]] * 3, width=3)
    pq.write_table(
        pa.table({"id": ["w0", "w1"], "emb": pa.array([[1.0] * 4] * 2, pa.list_(pa.float32(), 4))}),
        tmp_path / "c" / "b.parquet",
    )
    with pytest.raises(CorpusError, match=r"b\.parquet holds 4-d vectors where other files hold 3-d"):
        Corpus(CorpusSpec(tmp_path / "c", vectors_column="emb"))


def test_a_fixed_width_of_zero_is_refused_on_opening(tmp_path: Path) -> None:
    """The width is the column's type: refused when the corpus is opened, before any row is read."""
    path = vectors_file(tmp_path / "v.parquet", [[], []], width=0)
    with pytest.raises(CorpusError, match=r"column 'emb' holds empty vectors \(width 0\)"):
        Corpus(CorpusSpec(path, vectors_column="emb"))


def test_a_one_file_folders_fingerprint_covers_the_files_name(tmp_path: Path) -> None:
    """In a folder, rows without ids are named "file:row": renaming its only file changes the rows' ids."""
    split_corpus(tmp_path / "c", sizes=(5,), ids=False)
    before = Corpus(CorpusSpec(tmp_path / "c")).fingerprint()
    (tmp_path / "c" / "part-0.parquet").rename(tmp_path / "c" / "part-1.parquet")
    assert Corpus(CorpusSpec(tmp_path / "c")).fingerprint() != before


def test_fingerprint_changes_with_content(tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a.parquet", n=10)
    b = write_corpus(tmp_path / "b.parquet", n=10)
    c = write_corpus(tmp_path / "c.parquet", n=11)
    fa, fb, fc = (Corpus(CorpusSpec(p)).fingerprint() for p in (a, b, c))
    assert fa == fb != fc
    assert len(fa) == 64


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16])
def test_npy_windows_are_the_rows_as_float32_and_are_read_not_kept_mapped(tmp_path: Path, order: str, dtype) -> None:
    """A .npy corpus is read window by window (the last one partial), any float or integer dtype, C or Fortran
    order. C-order windows are read from the file, not taken from its mapping: mapped pages, once touched, stay
    in the process, and a 1M-row build from a .npy ended holding the whole 1.5 GB file (3.0 MiB per 1,000 rows
    instead of the index's 1.5)."""
    values = np.random.default_rng(0).standard_normal((2000, 64)) * 100
    path = tmp_path / "v.npy"
    np.save(path, np.asarray(values, dtype=dtype, order=order))
    source = Corpus(CorpusSpec(path))
    batches = list(source.batches(300))
    assert [len(b.ids) for b in batches] == [300] * 6 + [200]
    got = np.concatenate([b.vectors for b in batches])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.asarray(values, dtype=dtype).astype(np.float32))
    assert [b.ids[0] for b in batches[:2]] == ["0", "300"]
    if order == "C" and Path("/proc/self/smaps").is_file():
        assert mapped_rss_kib(path.resolve()) <= 8  # at most the header's page, not the 2000 rows read


def test_an_npy_whose_last_window_is_one_row(tmp_path: Path) -> None:
    values = np.arange(14, dtype=np.float32).reshape(7, 2)
    np.save(tmp_path / "v.npy", values)
    source = Corpus(CorpusSpec(tmp_path / "v.npy"))
    batches = list(source.batches(3))
    assert source.windows(3) == 3 and [b.ids for b in batches] == [["0", "1", "2"], ["3", "4", "5"], ["6"]]
    np.testing.assert_array_equal(np.concatenate([b.vectors for b in batches]), values)
    assert [b.ids for b in source.batches(3, 2)] == [["6"]]


@pytest.mark.parametrize("shape", ["file", "folder"])
def test_a_corpus_named_relatively_reads_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """A Ray worker joined to a cluster runs in the cluster's directory, not the driver's: the corpus must
    still find its files (it failed with "corrupt or truncated" on a relative path)."""
    (tmp_path / "data").mkdir()
    write_corpus(tmp_path / "data" / "c.parquet", n=50)
    monkeypatch.chdir(tmp_path)
    source = Corpus(CorpusSpec(Path("data/c.parquet") if shape == "file" else Path("data")))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ids = [i for batch in source.batches(16) for i in batch.ids]
    assert len(ids) == 50 and ids[0] == "doc0"


def test_a_file_gone_since_the_corpus_was_opened_is_said_to_be_gone(tmp_path: Path) -> None:
    source = Corpus(CorpusSpec(write_corpus(tmp_path / "c.parquet", n=50)))
    (tmp_path / "c.parquet").unlink()
    with pytest.raises(CorpusError, match="is no longer there"):
        list(source.batches(16))
