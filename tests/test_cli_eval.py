"""`retrieval eval ir`, `eval sts` and `tune` on the real transformers path (the tiny random BERT as --model,
stashing mean and cls pooling): tables, JSON, per-query files, re-scoring, which fit STS used, a sweep that
never re-encodes the corpus, --apply re-fitting the index, and bad inputs giving one clear line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_corpus
from typer.testing import CliRunner, Result

from retrieval.cli.app import app
from retrieval.encode.transformer import TransformerEncoder
from retrieval.manifest import RESCORE_DEPTH, Manifest
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import _warn_few_rows

runner = CliRunner()
METRICS = ("nDCG@10", "Recall@10", "Recall@100", "MRR@10", "MAP@100")


def run(*args: str | Path | int) -> Result:
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(autouse=True)
def fp32_for_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """Precision "auto" times bf16 and int8 against fp32, and on the tiny model they are close enough to flip from
    run to run: the tests here compare runs (an index's encoder with `--model`), so auto settles on fp32 throughout."""
    monkeypatch.setattr("retrieval.encode.transformer.cpu_supports_bf16", lambda: False)
    monkeypatch.setattr("retrieval.encode.transformer.cpu_supports_int8", lambda: False)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def one_error_line(result: Result, *fragments: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1, (result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def doc_text(i: int) -> str:
    return f"document number {i} about topic {i % 7}"  # as write_corpus writes them


def write_split(folder: Path, name: str, docs: list[int]) -> tuple[Path, Path]:
    """Queries equal to the documents' texts; each judged relevant to its own document (plus graded noise)."""
    queries = folder / f"{name}-queries.parquet"
    qrels = folder / f"{name}-qrels.parquet"
    pq.write_table(pa.table({"query_id": [f"{name}{i}" for i in docs], "text": [doc_text(i) for i in docs]}), queries)
    pq.write_table(
        pa.table(
            {
                "query_id": [f"{name}{i}" for i in docs] * 2,
                "doc_id": [f"doc{i}" for i in docs] + [f"doc{(i + 7) % 200}" for i in docs],
                "score": [2] * len(docs) + [1] * len(docs),
            }
        ),
        qrels,
    )
    return queries, qrels


def write_pairs(path: Path, seed: int, n: int = 24, subsets: bool = False) -> Path:
    """Sentence pairs in the tiny BERT's vocabulary, gold = topic overlap, so scores vary."""
    import random

    rng = random.Random(seed)
    s1, s2, gold = [], [], []
    for _ in range(n):
        a, b = rng.randrange(60), rng.randrange(60)
        s1.append(f"the sentence {a} about topic {a % 5}")
        s2.append(f"a query {b} about index {b % 5}")
        gold.append(float(5 - abs(a % 5 - b % 5)) + rng.random())
    columns = {"sentence1": s1, "sentence2": s2, "score": gold}
    if subsets:
        columns["subset"] = ["first"] * (n // 2) + ["second"] * (n - n // 2)
    pq.write_table(pa.table(columns), path)
    return path


@pytest.fixture(scope="module")
def built(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """One index (200 docs, mean pooling, cls stashed too) and dev/test query splits, shared read-only."""
    root = tmp_path_factory.mktemp("cli-eval")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RETRIEVAL_INDEX_ROOT", str(root / "indexes"))
        mp.setattr("retrieval.encode.transformer.cpu_supports_bf16", lambda: False)  # see fp32_for_auto
        mp.setattr("retrieval.encode.transformer.cpu_supports_int8", lambda: False)
        corpus = write_corpus(root / "corpus.parquet", n=200)
        ok(run("index", corpus, "--model", tiny_bert, "--extra-pooling", "cls", "--out", root / "idx"))
    dev_q, dev_r = write_split(root, "dev", list(range(0, 60, 5)))
    test_q, test_r = write_split(root, "test", list(range(3, 200, 13)))
    yield {"index": root / "idx", "dev_q": dev_q, "dev_r": dev_r, "test_q": test_q, "test_r": test_r}


# ----- eval ir ---------------------------------------------------------------------------------------------
def test_eval_ir_table_json_and_per_query(built: dict[str, Path], tmp_path: Path) -> None:
    table = ok(run("eval", "ir", built["index"], "--queries", built["test_q"], "--qrels", built["test_r"])).stdout
    assert all(name in table for name in METRICS)
    assert "(16 queries)" in table  # 3, 16, ..., 198

    per_query = tmp_path / "per-query.jsonl"
    result = ok(
        run(
            "eval", "ir", built["index"], "--queries", built["test_q"], "--qrels", built["test_r"],
            "--json", "--per-query", per_query,
        )
    )  # fmt: skip
    metrics = json.loads(result.stdout)
    assert set(metrics) == {"queries", *METRICS} and metrics["queries"] == 16
    assert all(0.0 <= metrics[name] <= 1.0 for name in METRICS)
    # each query is its own document's text: the same encoder and transform put that document first
    assert metrics["MRR@10"] == pytest.approx(1.0)
    lines = [json.loads(line) for line in per_query.read_text().splitlines()]
    assert len(lines) == 16 and {line["query_id"] for line in lines} == {f"test{i}" for i in range(3, 200, 13)}
    assert all(set(line) == {"query_id", *METRICS} for line in lines)
    # the summary is the mean of the per-query lines
    assert metrics["nDCG@10"] == pytest.approx(sum(line["nDCG@10"] for line in lines) / 16, abs=1e-12)


def test_eval_ir_rescore(built: dict[str, Path]) -> None:
    args = ("eval", "ir", built["index"], "--queries", built["dev_q"], "--qrels", built["dev_r"], "--json")
    plain = json.loads(ok(run(*args)).stdout)
    rescored = json.loads(ok(run(*args, "--rescore", 20)).stdout)
    assert set(rescored) == set(plain) and rescored["queries"] == plain["queries"] == 12
    assert all(0.0 <= rescored[name] <= 1.0 for name in METRICS)
    # re-ranked by raw cosine: identical texts have raw cosine 1 as well, so the own document stays first
    assert rescored["MRR@10"] == pytest.approx(1.0)


def test_eval_ir_missing_qrels_column_is_one_line(built: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "qrels.parquet"
    pq.write_table(pa.table({"query_id": ["dev0"], "corpus_id": ["doc0"], "score": [1]}), bad)
    line = one_error_line(run("eval", "ir", built["index"], "--queries", built["dev_q"], "--qrels", bad))
    assert "no column 'doc_id'" in line and "corpus_id" in line


def test_eval_ir_with_an_empty_qrels_file_says_it_is_empty(built: dict[str, Path], tmp_path: Path) -> None:
    """A qrels file of no rows was reported as a mismatch of query ids ("no query ... has a relevant judgement
    ... query ids such as none"), which sent the user looking at the ids."""
    empty = tmp_path / "qrels.parquet"
    schema = pa.schema([("query_id", pa.string()), ("doc_id", pa.string()), ("score", pa.int64())])
    pq.write_table(schema.empty_table(), empty)
    line = one_error_line(run("eval", "ir", built["index"], "--queries", built["dev_q"], "--qrels", empty))
    assert "holds no judgement (no rows)" in line and "query ids" not in line


# ----- eval sts --------------------------------------------------------------------------------------------
def test_eval_sts_target_fit_and_index_fit(built: dict[str, Path], tiny_bert: Path, tmp_path: Path) -> None:
    sts12 = write_pairs(tmp_path / "sts12.parquet", seed=1, subsets=True)
    stsb = write_pairs(tmp_path / "stsb.parquet", seed=2)
    target = ok(run("eval", "sts", sts12, stsb, "--model", tiny_bert, "--pooling", "cls", "--dim", 16, "--json"))
    report = json.loads(target.stdout)
    assert report["fit"].startswith("target (") and "sts12, stsb" in report["fit"]
    assert [row["file"] for row in report["results"]] == ["sts12", "stsb"]
    first = report["results"][0]
    assert set(first["raw"]) == {"first", "second", "wmean", "all"}
    assert all(
        -100 <= v <= 100 for row in report["results"] for part in ("raw", "transformed") for v in row[part].values()
    )
    assert "k=16" in report["transform"] or "16" in report["transform"]

    table = ok(run("eval", "sts", stsb, "--model", tiny_bert)).stdout
    assert "raw wmean" in table and "transformed all" in table
    default = json.loads(ok(run("eval", "sts", stsb, "--model", tiny_bert, "--json")).stdout)
    assert default["fit"].startswith("nothing: the raw transform")  # no dim, no gamma: raw, as `index` does
    assert default["results"][0]["transformed"] == default["results"][0]["raw"]

    with_index = json.loads(ok(run("eval", "sts", stsb, "--index", built["index"], "--json")).stdout)
    assert with_index["fit"] == f"index {built['index']}"
    assert with_index["results"][0]["raw"] == pytest.approx(
        json.loads(ok(run("eval", "sts", stsb, "--model", tiny_bert, "--json")).stdout)["results"][0]["raw"]
    )  # the same encoder (mean pooling) gives the same raw vectors either way


# ----- tune ------------------------------------------------------------------------------------------------
class EncodeCounter:
    """Counts the texts the transformers encoder is asked for, whichever method is used."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.texts: list[str] = []
        real = TransformerEncoder.encode_poolings

        def counting(encoder, texts, poolings, on_batch=None):
            self.texts.extend(texts)
            return real(encoder, texts, poolings, on_batch=on_batch)

        monkeypatch.setattr(TransformerEncoder, "encode_poolings", counting)


def tune_ir_args(built: dict[str, Path], index: Path, results: Path) -> list:
    return [
        "tune", index, "--queries", built["dev_q"], "--qrels", built["dev_r"],
        "--test-queries", built["test_q"], "--test-qrels", built["test_r"],
        "--dims", "16,8", "--gammas", "0,1", "--results", results,
    ]  # fmt: skip


def test_tune_ir_sweeps_the_stash_without_re_encoding(
    built: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = EncodeCounter(monkeypatch)
    before = (built["index"] / "index.faiss").read_bytes()
    result = ok(run(*tune_ir_args(built, built["index"], tmp_path / "out")))
    assert "the corpus was not re-encoded" in result.stderr
    assert len(counter.texts) == 12 + 16  # the dev and test queries, once each for both poolings; no document
    assert "chosen:" in result.stdout and "of raw" in result.stdout
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert report["metric"] == "nDCG@10" and report["corpus_rows_encoded"] == 0
    labels = [t["label"] for t in report["trials"]]
    assert labels[:2] == ["mean raw", "cls raw"] and len(labels) == 2 + 2 * 2 * 2
    best = report["best"]
    assert best["dev"]["nDCG@10"] == max(t["dev"]["nDCG@10"] for t in report["trials"])  # raw included
    assert all(set(t["test"]) >= set(METRICS) and t["search_ms"] > 0 for t in report["trials"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "out" / "tune.png").exists()
    else:
        assert (tmp_path / "out" / "tune.png").read_bytes()[:4] == b"\x89PNG"
    assert (built["index"] / "index.faiss").read_bytes() == before  # without --apply the index is untouched


def test_tune_apply_refits_the_index(built: dict[str, Path], tmp_path: Path) -> None:
    index = Path(shutil.copytree(built["index"], tmp_path / "idx"))
    assert (Manifest.load(index).transform.dim, Manifest.load(index).transform.spec.whiten) == (32, False)  # no --dim
    ok(run("refit", index, "--dim", 24, "--gamma", 0.5))  # a transform the sweep below does not try
    old = Manifest.load(index).transform
    assert (old.dim, old.spec.gamma, old.spec.whiten) == (24, 0.5, True)
    # mean pooling only: the tiny random BERT's raw cls vectors are nearly parallel, so their cosines tie to float32
    # rounding, and the sweep's blocked product and FAISS's scan may order such ties differently
    result = ok(run(*tune_ir_args(built, index, tmp_path / "out"), "--poolings", "mean", "--apply"))
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    best = report["best"]
    new = Manifest.load(index).transform
    assert (new.dim, new.spec.whiten, new.pooling) == (best["dim"], best["whiten"], best["pooling"])
    assert (new.dim, new.spec.gamma, new.spec.whiten) != (old.dim, old.spec.gamma, old.spec.whiten)
    assert Manifest.load(index).encoder.pooling == best["pooling"]  # queries pooled as the documents now are
    assert f"32 -> {best['dim']} dims" in result.stderr
    # re-scoring: by the best full-dimension candidate of the sweep, on by default only when the index is reduced
    rescore = Manifest.load(index).rescoring
    scorer = report["scorer"]
    assert scorer["dim"] == 32 and rescore.scorer.to_dict() == {k: scorer[k] for k in rescore.scorer.to_dict()}
    assert rescore.depth == (RESCORE_DEPTH if best["dim"] < 32 else 0)
    assert (index / "rescore.npz").is_file() == scorer["whiten"]
    hits = ok(run("search", doc_text(42), "--index", index, "--json", "-k", 3)).stdout.splitlines()
    assert len(hits) == 3 and json.loads(hits[0])["id"] == "doc42"
    args = ("eval", "ir", index, "--queries", built["dev_q"], "--qrels", built["dev_r"], "--json", "--rescore", 0)
    args += ("--mode", "dense")  # the sweep scores the dense side; the default mode is hybrid
    metrics = json.loads(ok(run(*args)).stdout)
    assert metrics["nDCG@10"] == pytest.approx(best["dev"]["nDCG@10"], abs=1e-6)  # flat index = the sweep's search


def test_tune_apply_refuses_an_index_refitted_during_its_sweep(
    built: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `refit` published while `tune --apply` swept: the apply replaced that newer version without a word (its
    choice was measured on the older one)."""
    from retrieval import tune, update
    from retrieval.whitening import TransformSpec

    index = Path(shutil.copytree(built["index"], tmp_path / "idx"))
    sweep = tune.tune_ir

    def another_writer_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = sweep(*args, **kwargs)
        update.refit(index, TransformSpec(dim=20, gamma=0.5, pooling="mean"))
        return result

    monkeypatch.setattr(tune, "tune_ir", another_writer_meanwhile)
    result = run(*tune_ir_args(built, index, tmp_path / "out"), "--poolings", "mean", "--apply")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert "changed since this refit read it (version 1 -> 2" in errors[0] and "run it again" in errors[0]
    assert Manifest.load(index).transform.dim == 20 and Manifest.load(index).generation == 2  # the refit stands


def test_tune_apply_writes_a_raw_index_when_raw_wins(built: dict[str, Path], tmp_path: Path) -> None:
    """The bug: when raw was best, --apply refitted a gamma-0 PCA. Dev qrels made from raw cosine's own top 10
    (graded 10..1) give raw nDCG@10 = 1, which no whitening reaches: tune must keep raw and write it."""
    index = Path(shutil.copytree(built["index"], tmp_path / "idx"))
    ok(run("refit", index, "--no-whiten"))
    queries = pq.read_table(built["dev_q"]).to_pydict()
    ranked = Searcher.load(index).search_batch(queries["text"], SearchParams(k=10, mode="dense"))
    graded = [
        (q, hit.id, 10 - hit.rank + 1) for q, hits in zip(queries["query_id"], ranked, strict=True) for hit in hits
    ]
    qrels = tmp_path / "raw-qrels.parquet"
    pq.write_table(
        pa.table(dict(zip(("query_id", "doc_id", "score"), map(list, zip(*graded, strict=True)), strict=True))), qrels
    )
    ok(run("refit", index, "--whiten", "--dim", 16, "--gamma", 0.25))
    assert Manifest.load(index).transform.kind == "whitening"
    args = ["tune", index, "--queries", built["dev_q"], "--qrels", qrels, "--poolings", "mean"]
    result = ok(run(*args, "--dims", "32,16", "--gammas", "0,0.5,1", "--results", tmp_path / "out", "--apply"))
    best = json.loads((tmp_path / "out" / "tune.json").read_text())["best"]
    assert best["whiten"] is False and best["label"] == "mean raw" and best["dev"]["nDCG@10"] == pytest.approx(1.0)
    manifest = Manifest.load(index)
    assert (manifest.transform.kind, manifest.transform.dim) == ("raw", 32)
    assert "32 -> 32 dims (raw)" in result.stderr


def test_refit_to_the_stashed_cls_pooling_pools_queries_the_same_way(built: dict[str, Path], tmp_path: Path) -> None:
    index = Path(shutil.copytree(built["index"], tmp_path / "idx"))
    ok(run("refit", index, "--pooling", "cls", "--dim", 16))
    manifest = Manifest.load(index)
    assert (manifest.transform.pooling, manifest.encoder.pooling) == ("cls", "cls")
    hit = json.loads(ok(run("search", doc_text(42), "--index", index, "--json", "-k", 1)).stdout)
    # the query is the document's own text, so with the same pooling on both sides the cosine is 1
    assert hit["id"] == "doc42" and hit["score"] == pytest.approx(1.0, abs=1e-3)  # bf16 autocast, batch padding


def test_tune_sts_pairs(tiny_bert: Path, tmp_path: Path) -> None:
    dev = write_pairs(tmp_path / "dev.parquet", seed=3)
    test = write_pairs(tmp_path / "test.parquet", seed=4)
    result = ok(
        run(
            "tune", "--pairs", dev, "--test-pairs", test, "--model", tiny_bert, "--poolings", "mean,cls",
            "--dims", "16,8", "--gammas", "0,1", "--results", tmp_path / "out",
        )
    )  # fmt: skip
    assert "chosen:" in result.stdout
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert report["metric"] == "all" and len(report["trials"]) == 10
    assert all(
        set(t["dev"]) == {"dev", "wmean", "all"} and set(t["test"]) == {"test", "wmean", "all"}
        for t in report["trials"]
    )
    assert report["best"]["dev"]["all"] == max(t["dev"]["all"] for t in report["trials"])


def test_tune_bad_inputs_are_one_line(built: dict[str, Path], tmp_path: Path) -> None:
    one_error_line(run("tune"), "give an INDEX_DIR")
    pairs = write_pairs(tmp_path / "p.parquet", seed=5)
    one_error_line(run("tune", built["index"], "--pairs", pairs), "give an INDEX_DIR")
    one_error_line(run("tune", built["index"], "--queries", built["dev_q"]), "needs --queries and --qrels")
    one_error_line(run("tune", "--pairs", pairs, "--apply"), "--apply re-fits an index")
    one_error_line(run("tune", built["index"], "--dims", "abc"), "--dims takes comma-separated numbers")
    one_error_line(run("tune", built["index"], "--gammas", "0,x"), "--gammas takes comma-separated numbers")
    dev = ("--queries", built["dev_q"], "--qrels", built["dev_r"])
    one_error_line(run("tune", built["index"], *dev, "--test-queries", built["dev_q"]), "go together")


def write_multi_sentence_corpus(path: Path, n: int = 120) -> Path:
    """Documents of three sentences in the tiny BERT's vocabulary, so a sentence can be taken out of each."""
    words = "whitening vectors search query index corpus sentence cosine model retrieval".split()
    texts = [
        f"The document number {i} is about topic {i % 7}. This {words[i % 10]} of the {words[(i * 3) % 10]} "
        f"is fast. A {words[(i + 4) % 10]} with {words[(i * 7) % 10]} vectors was slow for {i % 9}."
        for i in range(n)
    ]
    pq.write_table(pa.table({"id": [f"doc{i}" for i in range(n)], "text": texts}), path)
    return path


def test_tune_auto_chooses_without_qrels(
    tiny_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built: dict[str, Path]
) -> None:
    corpus = write_multi_sentence_corpus(tmp_path / "corpus.parquet")
    ok(run("index", corpus, "--model", tiny_bert, "--out", tmp_path / "idx"))
    counter = EncodeCounter(monkeypatch)
    # full rank only: every candidate centres, which `--auto` never moves an uncentred index to
    args = ["tune", tmp_path / "idx", "--auto", "--auto-queries", 30, "--dims", "32", "--gammas", "0,1"]
    before = Manifest.load(tmp_path / "idx")
    _warn_few_rows.cache_clear()  # once per process and shape: earlier tests may have fitted this shape
    result = ok(run(*args, "--results", tmp_path / "out", "--apply"))
    # 3 candidates x 3 kinds fitted on 120 rows of 32 dimensions: the warning comes once
    assert " ".join(result.stderr.split()).count("fitting a 32 x 32 covariance on only 120 rows") == 1
    source = "30 sentence + 30 keywords + 30 half pseudo-queries (seed 0)"
    assert f"tuned on {source}: only their 60 documents were encoded again" in result.stderr
    assert len(counter.texts) == 3 * 30 + 2 * 30  # the pseudo-queries, the documents without them; nothing else
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert report["dev_source"] == source and report["corpus_rows_encoded"] == 60
    assert len(report["trials"]) == 1 + 2 and all(0 <= t["dev"]["nDCG@10"] <= 1 for t in report["trials"])
    stdout = " ".join(result.stdout.split())  # as printed, but for where the console wrapped it
    assert report["rule"] == "safe" and "kept unless a candidate wins on each kind" in stdout
    # raw is kept, and said so
    decision = report["decision"]
    assert decision["transform"]["current"] == decision["transform"]["chosen"] == "mean raw"
    assert decision["scorer"]["kept"] and decision["rule"]["margin"] == 0.005
    assert report["best"]["label"] == "mean raw" and "transform: kept mean raw: no candidate may replace it" in stdout
    assert "the index's current setting is kept: --apply changes nothing" in stdout
    assert f"--apply: {tmp_path / 'idx'} is unchanged" in " ".join(result.stderr.split())
    assert Manifest.load(tmp_path / "idx") == before  # not even a new version
    assert "(dev: 30 sentence + 30 keywords + 30 half pseudo-queries (seed 0))" in stdout
    # the same seed makes the same pseudo-queries: the sweep is repeatable
    ok(run(*args, "--results", tmp_path / "again"))
    trials = json.loads((tmp_path / "again" / "tune.json").read_text())["trials"]
    assert [t["dev"] for t in trials] == [t["dev"] for t in report["trials"]]
    # bad combinations and a corpus of single short sentences: one line each
    one_error_line(run("tune", tmp_path / "idx", "--auto", "--queries", built["dev_q"]), "--auto tunes an INDEX_DIR")
    one_error_line(run("tune", "--pairs", built["dev_q"], "--auto"), "--auto tunes an INDEX_DIR")
    one_error_line(run("tune", tmp_path / "idx", "--auto", "--auto-queries", 0), "--auto-queries must be between")
    one_error_line(run("tune", built["index"], "--auto"), "no kind of pseudo-query", "200 documents", "--queries")


def test_tune_apply_keeps_binary_codes_and_their_rerank_depth(built: dict[str, Path], tmp_path: Path) -> None:
    index = Path(shutil.copytree(built["index"], tmp_path / "idx"))
    ok(run("refit", index, "--codes", "binary", "--rerank", 64))
    assert (Manifest.load(index).index.spec.codes, Manifest.load(index).index.spec.rerank) == ("binary", 64)
    ok(run(*tune_ir_args(built, index, tmp_path / "out"), "--poolings", "mean", "--apply"))
    spec = Manifest.load(index).index.spec
    assert (spec.codes, spec.rerank) == ("binary", 64)
    best = json.loads((tmp_path / "out" / "tune.json").read_text())["best"]
    assert Manifest.load(index).transform.dim == best["dim"]
    for rerank in (0, 64):
        hits = ok(run("search", doc_text(42), "--index", index, "--json", "-k", 3, "--rerank", rerank)).stdout
        assert len(hits.splitlines()) == 3
