"""Reliability, safety: what the tool never touches or runs (folders that are not indexes, files named as
outputs, pickles, remote code, markup)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT, write_corpus
from reliability import build_from, case, leftovers, ok, one_line, run, table_file, texts


@case(
    "safety",
    "`--out .`, `--out /` or a home-like folder of files, with --overwrite",
    "refused in one line; nothing touched",
)
def test_overwrite_never_takes_a_folder_that_is_not_an_index(tiny_bert: Path, tmp_path: Path, monkeypatch) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=20)
    home = tmp_path / "home"
    (home / ".config").mkdir(parents=True)
    (home / "thesis.tex").write_text("years")
    monkeypatch.chdir(home)
    for target in (".", "/", str(home)):
        one_line(run("index", corpus, "--model", tiny_bert, "--out", target, "--overwrite"), "not a retrieval index")
    assert (home / "thesis.tex").read_text() == "years" and sorted(p.name for p in home.iterdir()) == [
        ".config",
        "thesis.tex",
    ]


@case(
    "safety", "`--out` naming an existing file, with or without --overwrite", "refused in one line; the file untouched"
)
def test_out_is_a_file(tiny_bert: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=20)
    (tmp_path / "f").write_text("keep")
    one_line(run("index", corpus, "--model", tiny_bert, "--out", tmp_path / "f"), "already exists")
    one_line(run("index", corpus, "--model", tiny_bert, "--out", tmp_path / "f", "--overwrite"), "is a file")
    assert (tmp_path / "f").read_text() == "keep" and leftovers(tmp_path / "f") == []


@case(
    "safety",
    "pickle, allow_pickle=True, trust_remote_code anywhere in the package",
    "none: .npz/.npy/Arrow/FAISS files only; model code never runs",
)
def test_no_pickle_and_no_remote_code() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "retrieval").rglob("*.py"))
    assert not re.search(
        r"^\s*import pickle|^\s*from pickle|allow_pickle\s*=\s*True|trust_remote_code\s*=\s*True", source, re.M
    )
    assert len(re.findall(r"allow_pickle=False", source)) >= 4


@case(
    "safety",
    "rich markup ([/], [/bold]) in a query, a document or an index path",
    "shown literally; never a MarkupError",
)
def test_markup_is_never_interpreted(tiny_bert: Path, tmp_path: Path) -> None:
    rows = ["closing tag [/] here", "[/bold] and [red]x[/red]", *texts(20)]
    corpus = table_file(tmp_path / "c.parquet", id=[f"d{i}" for i in range(22)], text=rows)
    out = tmp_path / "in[/]dex[/bold]"
    result = ok(build_from(tiny_bert, corpus, out))
    assert str(out) in result.stderr
    shown = ok(run("search", "[/bold] query [/]", "--index", out, "-k", 22)).stdout
    assert "[/] here" in shown and "[/bold]" in shown and "[red]x[/red]" in shown
    one_line(run("search", "x", "--index", tmp_path / "no[/]such"), "no index directory", "no[/]such")
