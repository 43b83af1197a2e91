"""The numpy BERT a one-shot search encodes its query with: the transformers model's own vectors, in fp32, for
every pooling and for texts cut at max_length; None wherever it does not apply; the CLI search importing neither
torch nor transformers and finding what the Searcher with the transformers encoder finds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, needs_minilm, write_corpus

from retrieval.encode import numpy_bert
from retrieval.encode.spec import POOLINGS, EncoderInfo, EncoderSpec

pytest.importorskip("torch")

# float32 sums in another order than torch's kernels; states are O(1), pooled over a few tokens.
ATOL = 1e-5
TEXTS = [
    "whitening vectors",
    "the query about topic 7 and the index of a corpus with 42 sentences",
    "",
    "Ünïcödé text, MIXED case; punctuation!",
    " ".join(["cosine"] * 100),  # cut at max_length
]


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("max_length", [None, 12])
def test_the_numpy_forward_pass_equals_the_transformers_model(
    tiny_bert: Path, pooling: str, max_length: int | None
) -> None:
    torch_encoder = EncoderSpec(str(tiny_bert), pooling, max_length, precision="fp32").load()
    encoder = numpy_bert.load(torch_encoder.info())
    assert encoder is not None
    assert encoder.dim == torch_encoder.dim
    torch_encoder.info().check_query(encoder.info())  # the same identity: Searcher.load accepts it
    for text in TEXTS:  # one at a time (no padding on either side), then as a batch
        np.testing.assert_allclose(
            encoder.encode([text]), torch_encoder.encode_poolings([text], [pooling])[pooling], atol=ATOL
        )
    batch = encoder.encode(TEXTS)
    assert batch.shape == (len(TEXTS), encoder.dim) and batch.dtype == np.float32
    np.testing.assert_allclose(batch, np.concatenate([encoder.encode([t]) for t in TEXTS]))


@pytest.mark.slow
@needs_minilm
def test_minilm_queries_agree_with_transformers_in_fp32() -> None:
    torch_encoder = EncoderSpec("all-MiniLM-L6-v2", precision="fp32").load()
    encoder = numpy_bert.load(torch_encoder.info())
    assert encoder is not None
    texts = TEXTS + [f"how do I configure interface eth{i} for a static address on debian" for i in range(5)]
    expected = torch_encoder.encode(texts)
    got = encoder.encode(texts)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    cosines = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() >= 0.99999


@pytest.mark.slow
@needs_minilm
def test_minilm_queries_of_a_bf16_corpus_agree_with_its_vectors_as_well_as_transformers_own_queries() -> None:
    """A bf16-encoded corpus gets float32 queries: the same text's query and corpus vectors agree to cosine
    0.9998 (0.99989 at worst, measured), no worse than transformers' own single-text path (after its first
    queries, a trace that ran in fp32 here)."""
    torch_encoder = EncoderSpec("all-MiniLM-L6-v2", precision="bf16").load()
    texts = TEXTS + [f"how do I configure interface eth{i} for a static address on debian" for i in range(5)]
    corpus = torch_encoder.encode(texts)  # batches, as an index is built
    torch_queries = np.concatenate([torch_encoder.encode([text]) for text in texts])
    encoder = numpy_bert.load(torch_encoder.info())
    assert encoder is not None
    queries = encoder.encode(texts)

    def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)

    assert cosines(queries, corpus).min() >= 0.9998
    assert cosines(queries, corpus).min() >= cosines(torch_queries, corpus).min() - 2e-5


def model_copy(tiny_bert: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_bert, tmp_path / "model"))


def test_what_it_does_not_compute_exactly_is_left_to_transformers(tiny_bert: Path, tmp_path: Path) -> None:
    info = EncoderSpec(str(tiny_bert), precision="fp32").load().info()
    assert numpy_bert.load(EncoderInfo(kind="vectors", dim=32)) is None
    assert numpy_bert.load(replace(info, max_length=None)) is None
    assert numpy_bert.load(replace(info, precision="bf16", precision_used="bf16")) is not None  # fp32 queries
    for change in ({"hidden_act": "gelu_new"}, {"model_type": "roberta"}, {"position_embedding_type": "relative_key"}):
        folder = model_copy(tiny_bert, tmp_path / next(iter(change)))
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | change))
        assert numpy_bert.load(replace(info, model_path=str(folder))) is None, change
    for name in ("tokenizer.json", "config.json"):
        folder = model_copy(tiny_bert, tmp_path / f"no-{name}")
        (folder / name).unlink()
        assert numpy_bert.load(replace(info, model_path=str(folder))) is None, name
    # transformers normalises as tokenizer_config says; tokenizer.json says otherwise: left to transformers
    for setting in ({"strip_accents": False}, {"tokenize_chinese_chars": False}, {"do_lower_case": False}):
        folder = model_copy(tiny_bert, tmp_path / next(iter(setting)))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(config | setting))
        assert numpy_bert.load(replace(info, model_path=str(folder))) is None, setting
    assert numpy_bert.load(replace(info, model_path=str(model_copy(tiny_bert, tmp_path / "same")))) is not None


@pytest.mark.process
def test_cli_search_imports_neither_torch_nor_transformers(tiny_bert: Path, tmp_path: Path) -> None:
    """A one-shot search of a BERT index: the numpy encoder, no torch import, and the hits the Searcher with the
    transformers encoder returns (same ids; scores to float32 rounding)."""
    from retrieval.build import build_index
    from retrieval.corpus import CorpusSpec
    from retrieval.search import Searcher, SearchParams
    from retrieval.whitening import TransformSpec

    corpus = write_corpus(tmp_path / "corpus.parquet", n=200)
    index = tmp_path / "idx"
    build_index(CorpusSpec(corpus), EncoderSpec(str(tiny_bert), precision="fp32").load(), index, TransformSpec(dim=8))
    query = "a query about whitening and topic 3"
    expected = Searcher.load(index).search(query, SearchParams(k=5))
    probe = (
        "import json, runpy, sys\n"
        "sys.argv = ['retrieval', 'search', sys.argv[1], '--index', sys.argv[2], '-k', '5', '--json']\n"
        "try:\n    runpy.run_module('retrieval', run_name='__main__')\n"
        "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", probe, query, str(index)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    *lines, imported = done.stdout.splitlines()
    assert json.loads(imported) == []
    hits = [json.loads(line) for line in lines]
    assert [h["id"] for h in hits] == [h.id for h in expected]
    np.testing.assert_allclose([h["score"] for h in hits], [h.score for h in expected], atol=ATOL)
