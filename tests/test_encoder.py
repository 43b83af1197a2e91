"""The transformers encoder on a tiny random BERT: pooling maths, padding, order, identity, and load errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from retrieval import timing  # noqa: E402
from retrieval.encode import models as models_module  # noqa: E402
from retrieval.encode import precision as precision_module  # noqa: E402
from retrieval.encode import transformer as encoder_module  # noqa: E402
from retrieval.encode.models import INSTALL_DEFAULT  # noqa: E402
from retrieval.encode.shapes import (  # noqa: E402
    narrowest_rows,
    pack_rows,
    pack_widths,
    padded_length,
    shape_batches,
)
from retrieval.encode.spec import Encoder, EncoderInfo, MultiPoolingEncoder  # noqa: E402
from retrieval.encode.transformer import TransformerEncoder, from_info  # noqa: E402
from retrieval.errors import ConfigError, ModelError  # noqa: E402

TEXTS = [
    "whitening vectors",
    "the index of a corpus is fast",
    "a",
    "search query about the model and the sentence cosine retrieval of a document number 7",
    "topic 3",
]
POOLS = ("mean", "cls", "first-last-avg")
LONG = " ".join(["the document about whitening and retrieval of vectors"] * 5)

# fp32 on a 2-layer, 32-wide model: padding and batch composition change only summation order.
ATOL = 1e-5


@pytest.fixture(autouse=True)
def fresh_traces() -> None:
    """Each test traces for itself (several patch how tracing behaves): none reuses another test's trace."""
    encoder_module._TRACES.clear()


@pytest.fixture(scope="module")
def models(tiny_bert: Path) -> dict[str, TransformerEncoder]:
    """One fp32 encoder per pooling (loading the tiny model takes ~0.1 s)."""
    return {
        p: TransformerEncoder(str(tiny_bert), pooling=p, max_length=48, batch_size=32, precision="fp32")
        for p in ("mean", "cls", "first-last-avg")
    }


def reference(enc: TransformerEncoder, text: str) -> dict[str, np.ndarray]:
    """Each pooling computed by hand from one unpadded forward pass of the model itself."""
    tokens = enc.tokenizer([text], truncation=True, max_length=enc.max_length, return_tensors="pt")
    with torch.inference_mode():
        result = enc.model(**tokens, output_hidden_states=True)
    states = [h[0].numpy().astype(np.float64) for h in result.hidden_states]
    return {
        "mean": result.last_hidden_state[0].numpy().mean(axis=0),
        "cls": result.last_hidden_state[0, 0].numpy(),
        "first-last-avg": (states[1].mean(axis=0) + states[-1].mean(axis=0)) / 2,
        "wrong-first-last-avg": (states[0].mean(axis=0) + states[-1].mean(axis=0)) / 2,
    }


@pytest.mark.parametrize("pooling", ["mean", "cls", "first-last-avg"])
def test_pooling_matches_a_hand_computation(models: dict[str, TransformerEncoder], pooling: str) -> None:
    enc = models[pooling]
    got = enc.encode(TEXTS)
    assert got.shape == (len(TEXTS), 32) and got.dtype == np.float32
    for row, text in zip(got, TEXTS, strict=True):
        np.testing.assert_allclose(row, reference(enc, text)[pooling], atol=ATOL)


def test_first_last_avg_uses_the_first_transformer_layer_not_the_embeddings(
    models: dict[str, TransformerEncoder],
) -> None:
    enc = models["first-last-avg"]
    got = enc.encode([TEXTS[1]])[0]
    ref = reference(enc, TEXTS[1])
    # The embedding layer (hidden_states[0]) differs from layer 1 by O(1) on a random model.
    assert np.abs(got - ref["wrong-first-last-avg"]).max() > 100 * ATOL
    np.testing.assert_allclose(got, ref["first-last-avg"], atol=ATOL)


def test_poolings_differ_from_each_other(models: dict[str, TransformerEncoder]) -> None:
    vectors = {p: e.encode([TEXTS[1]])[0] for p, e in models.items()}
    assert np.abs(vectors["mean"] - vectors["cls"]).max() > 1e-2
    assert np.abs(vectors["mean"] - vectors["first-last-avg"]).max() > 1e-2


@pytest.mark.parametrize("pooling", ["mean", "cls", "first-last-avg"])
def test_padding_does_not_change_a_text_vector(models: dict[str, TransformerEncoder], pooling: str) -> None:
    enc = models[pooling]
    alone = enc.encode(["topic 3"])[0]
    batched = enc.encode([LONG, "topic 3"])  # "topic 3" is padded to the long text's length
    np.testing.assert_allclose(batched[1], alone, atol=ATOL)


def test_length_sorted_batches_come_back_in_input_order(tiny_bert: Path) -> None:
    # batch_size 2 forces several batches, each holding texts that were far apart in the input.
    enc = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=2, precision="fp32")
    got = enc.encode(TEXTS)
    one_by_one = np.stack([enc.encode([t])[0] for t in TEXTS])
    np.testing.assert_allclose(got, one_by_one, atol=ATOL)
    # and the rows are really different, so a permutation would have been caught
    assert min(np.abs(got[i] - got[j]).max() for i in range(5) for j in range(i)) > 1e-3


def test_encode_poolings_gives_all_poolings_in_one_pass(
    models: dict[str, TransformerEncoder],
) -> None:
    seen: list[int] = []
    got = models["mean"].encode_poolings(TEXTS, ["mean", "first-last-avg"], on_batch=seen.append)
    assert sum(seen) == len(TEXTS)
    for pooling in ("mean", "first-last-avg"):
        np.testing.assert_allclose(got[pooling], models[pooling].encode(TEXTS), atol=ATOL)


def test_empty_input_gives_an_empty_matrix(models: dict[str, TransformerEncoder]) -> None:
    assert models["mean"].encode([]).shape == (0, 32)


def test_text_longer_than_max_length_is_truncated(tiny_bert: Path) -> None:
    enc = TransformerEncoder(str(tiny_bert), max_length=8, precision="fp32")
    # Same first 8 tokens (incl. [CLS] and [SEP]): same vector, whatever follows.
    a = enc.encode(["whitening vectors search query index corpus sentence cosine model"])
    b = enc.encode(["whitening vectors search query index corpus sentence fast slow"])
    np.testing.assert_allclose(a, b, atol=ATOL)


def test_default_max_length_fits_the_model_positions(tiny_bert: Path) -> None:
    """The tiny model has 64 positions and its tokenizer no max: texts must not overflow the model."""
    enc = TransformerEncoder(str(tiny_bert), precision="fp32")
    assert enc.max_length <= 64
    assert np.isfinite(enc.encode([LONG * 4])).all()


def test_bf16_is_close_to_fp32(tiny_bert: Path, models: dict[str, TransformerEncoder]) -> None:
    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="bf16")
    assert (enc.info().precision, enc.info().precision_used) == ("bf16", "bf16")
    a, b = enc.encode(TEXTS), models["mean"].encode(TEXTS)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    # bf16 keeps 8 bits of mantissa; on a random 2-layer model cosines stay well above 0.99.
    assert cos.min() > 0.99


def test_bf16_runs_a_bf16_copy_and_leaves_the_fp32_model_alone(tiny_bert: Path) -> None:
    """The fp32 model stays fp32 (the traces are checked against it); vectors come back float32 (pooled in fp32)."""
    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="bf16")
    got = enc.encode_poolings(TEXTS, POOLS)
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in got.values())
    assert {p.dtype for p in enc.model.parameters()} == {torch.float32}
    assert {p.dtype for p in enc._bf16_model().parameters()} == {torch.bfloat16}


# ----- the traced single-text path --------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", ["mean", "cls", "first-last-avg"])
def test_single_texts_switch_to_the_traced_model_and_keep_their_vectors(tiny_bert: Path, pooling: str) -> None:
    enc = TransformerEncoder(str(tiny_bert), pooling=pooling, max_length=48, precision="fp32")
    texts = [*TEXTS, LONG]  # LONG is truncated to max_length: the trace must follow any length up to it
    eager = [enc.encode([t])[0] for t in texts[: encoder_module.TRACE_AFTER - 1]]
    assert enc._traced is None  # not traced before the TRACE_AFTER-th single text
    traced = [enc.encode([t])[0] for t in texts]
    assert enc._traced  # traced, and the trace passed its own check
    for text, row in zip(texts, traced, strict=True):
        np.testing.assert_allclose(row, reference(enc, text)[pooling], atol=ATOL)
    np.testing.assert_allclose(np.stack(eager), np.stack(traced[: len(eager)]), atol=ATOL)


def test_a_trace_that_disagrees_with_the_eager_model_is_not_used(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose code bakes the example's length into the trace would disagree at the second length."""
    real = torch.jit.optimize_for_inference

    def off_at_other_lengths(module: object) -> object:
        traced, example_length = real(module), []

        def run(ids: torch.Tensor) -> tuple:
            example_length.append(example_length[0] if example_length else ids.shape[1])  # first call: the example
            return tuple(s * (1.0 if ids.shape[1] == example_length[0] else 1.5) for s in traced(ids))

        return run

    monkeypatch.setattr(torch.jit, "optimize_for_inference", off_at_other_lengths)
    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    got = [enc.encode([TEXTS[3]])[0] for _ in range(encoder_module.TRACE_AFTER + 1)]
    assert enc._traced is False
    for row in got:
        np.testing.assert_allclose(row, reference(enc, TEXTS[3])["mean"], atol=ATOL)


def single_trace(enc: TransformerEncoder) -> tuple[object, bool]:
    for text in TEXTS[: encoder_module.TRACE_AFTER]:
        enc.encode([text])
    assert enc._traced
    return enc._traced


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("faster", [True, False])
def test_single_texts_take_the_faster_of_the_fp32_and_bf16_traces(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch, faster: bool
) -> None:
    """Unless precision is fp32, a bf16-autocast trace competes; the faster that agrees with fp32 serves queries."""
    monkeypatch.setattr(timing, "_chosen", timing.Policy(answers={"trace": "bf16" if faster else "fp32"}))
    enc = TransformerEncoder(str(tiny_bert), pooling="first-last-avg", max_length=48, precision="bf16")
    assert single_trace(enc)[1] is faster
    for text in (*TEXTS, LONG):
        got = enc.encode([text])[0]
        assert cosines(got, reference(enc, text)["first-last-avg"]) >= precision_module.BF16_MIN_COSINE


def test_a_bf16_trace_that_strays_from_fp32_is_not_taken(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "_chosen", timing.Policy(answers={"trace": "bf16"}))  # bf16 faster
    monkeypatch.setattr(precision_module, "BF16_MIN_COSINE", 1.01)  # but no cosine reaches the bar
    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="bf16")
    assert single_trace(enc)[1] is False
    np.testing.assert_allclose(enc.encode([LONG])[0], reference(enc, LONG)["mean"], atol=ATOL)


def test_a_model_is_traced_once_per_process(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TorchScript keeps every trace (graph and folded weights) until exit: each Searcher.load of an index traced
    again and the process grew by a model's size (+95 MB a load with MiniLM, measured)."""
    real, calls = torch.jit.trace, []
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    first.warm_up()
    again = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    again.warm_up()
    assert len(calls) == 1 and again._traced is first._traced
    np.testing.assert_allclose(again.encode([LONG])[0], reference(again, LONG)["mean"], atol=ATOL)
    other = TransformerEncoder(str(tiny_bert), max_length=32, precision="fp32")  # checked at other lengths
    assert single_trace(other) is not first._traced and len(calls) == 2


def test_a_trace_is_not_shared_by_a_model_with_other_config_and_the_same_weights(
    tiny_bert: Path, tmp_path: Path
) -> None:
    """Keyed by the weights alone, a folder with the same weights file and another activation got the first
    model's trace: its single queries disagreed with its own batches (max difference 0.02)."""
    import json
    import shutil

    other = Path(shutil.copytree(tiny_bert, tmp_path / "relu"))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    first = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    second = TransformerEncoder(str(other), max_length=48, precision="fp32")
    assert single_trace(second) is not single_trace(first)
    np.testing.assert_allclose(second.encode([LONG])[0], reference(second, LONG)["mean"], atol=ATOL)


def test_precision_fp32_traces_fp32_only(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = torch.jit.trace, []
    monkeypatch.setattr(
        torch.jit, "trace", lambda *a, **k: calls.append(torch.is_autocast_enabled("cpu")) or real(*a, **k)
    )
    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    assert single_trace(enc)[1] is False and calls == [False]


# ----- precision "auto" -----------------------------------------------------------------------------------
def test_auto_precision_is_fp32_without_native_bf16_or_int8(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoder_module, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(encoder_module, "cpu_supports_int8", lambda: False)
    enc = TransformerEncoder(str(tiny_bert), max_length=48)
    assert (enc.info().precision, enc.info().precision_used) == ("auto", "fp32")


def test_auto_precision_is_settled_by_the_first_batch(
    tiny_bert: Path, models: dict[str, TransformerEncoder], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(encoder_module, "cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(encoder_module, "cpu_supports_int8", lambda: False)  # bf16 against fp32 (int8: test_int8)
    enc = TransformerEncoder(str(tiny_bert), max_length=48)
    assert enc.info().precision_used is None  # nothing timed yet
    enc.encode(["one text alone does not settle it"])
    assert enc.info().precision_used is None
    got = enc.encode(TEXTS)
    # what was asked is kept (a query on another CPU decides again); what was measured is recorded beside it
    assert enc.info().precision == "auto" and enc.info().precision_used in ("fp32", "bf16")
    cos = (got * models["mean"].encode(TEXTS)).sum(1)
    cos /= np.linalg.norm(got, axis=1) * np.linalg.norm(models["mean"].encode(TEXTS), axis=1)
    assert cos.min() > 0.99


def test_auto_precision_never_takes_bf16_that_disagrees_with_fp32(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(encoder_module, "cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(encoder_module, "cpu_supports_int8", lambda: False)  # bf16 against fp32 (int8: test_int8)
    monkeypatch.setattr(precision_module, "BF16_MIN_COSINE", 1.01)  # no cosine reaches it, however fast bf16 is
    enc = TransformerEncoder(str(tiny_bert), max_length=48)
    enc.encode(TEXTS)
    assert enc.info().precision_used == "fp32"
    assert enc._model_bf16 is None  # the bf16 copy made for the timing is not kept


def test_warm_up_settles_precision_and_the_trace(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoder_module, "cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(encoder_module, "cpu_supports_int8", lambda: False)  # bf16 against fp32 (int8: test_int8)
    enc = TransformerEncoder(str(tiny_bert), max_length=48)
    assert enc.info().precision_used is None and enc._traced is None
    enc.warm_up()
    assert enc.info().precision_used in ("fp32", "bf16") and enc._traced is not None


# ----- identity --------------------------------------------------------------------------------------------
def test_info_holds_the_identity_fields(tiny_bert: Path, models: dict[str, TransformerEncoder]) -> None:
    enc = models["first-last-avg"]
    info = enc.info()
    assert isinstance(enc, Encoder) and isinstance(enc, MultiPoolingEncoder)
    assert info.kind == "transformers"
    assert info.model == str(tiny_bert)
    assert info.model_path == str(tiny_bert.resolve())
    assert info.architecture == "BertModel"
    assert info.pooling == "first-last-avg"
    assert info.max_length == 48
    assert info.precision == info.precision_used == "fp32"
    assert info.dim == enc.dim == 32
    assert info.weights_sha256 is not None and len(info.weights_sha256) == 64
    assert info.weights_sha256 == models["mean"].info().weights_sha256
    assert EncoderInfo.from_dict(info.to_dict()) == info  # the manifest's round trip


def test_check_query_accepts_the_same_and_refuses_other_settings(models: dict[str, TransformerEncoder]) -> None:
    built = models["mean"].info()
    built.check_query(built)
    built.check_query(replace(built, precision="bf16", model="renamed-folder"))  # same weights
    with pytest.raises(ConfigError, match=r"pooling 'mean' but the query encoder uses 'cls'"):
        built.check_query(models["cls"].info())
    with pytest.raises(ConfigError, match=r"max_length 48 but the query encoder uses 128"):
        built.check_query(replace(built, max_length=128))
    with pytest.raises(ConfigError, match=r"built with model .* but the query encoder uses 'other'"):
        built.check_query(replace(built, model="other", weights_sha256="0" * 64))


def test_check_query_by_hub_name_and_revision_when_no_weights_hash() -> None:
    built = EncoderInfo("transformers", 8, model="org/a", revision="r1", pooling="mean", max_length=8)
    built.check_query(built)
    with pytest.raises(ConfigError, match="model"):
        built.check_query(replace(built, revision="r2"))


def test_from_info_rebuilds_the_same_encoder(models: dict[str, TransformerEncoder]) -> None:
    info = models["cls"].info()
    enc = from_info(info)
    assert enc.info() == replace(info, precision_used="fp32")
    np.testing.assert_allclose(enc.encode(TEXTS), models["cls"].encode(TEXTS), atol=ATOL)


def test_from_info_refuses_vector_indexes() -> None:
    with pytest.raises(ConfigError, match="precomputed|vectors"):
        from_info(EncoderInfo(kind="vectors", dim=4))


# ----- bad settings ----------------------------------------------------------------------------------------
def test_unknown_pooling_is_refused(tiny_bert: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown `pooling` 'max'; choose one of mean, cls, first-last-avg"):
        TransformerEncoder(str(tiny_bert), pooling="max")


def test_unknown_precision_and_bad_sizes_are_refused(tiny_bert: Path) -> None:
    with pytest.raises(ConfigError, match="unknown `precision`"):
        TransformerEncoder(str(tiny_bert), precision="fp8")
    with pytest.raises(ConfigError, match="`batch_size` must be at least 1"):
        TransformerEncoder(str(tiny_bert), batch_size=0)


def test_unknown_hub_model_offline_gives_the_install_hint() -> None:
    with pytest.raises(ModelError) as info:
        TransformerEncoder("no-such-org/no-such-model")
    message = str(info.value)
    assert "'no-such-org/no-such-model'" in message
    assert "`model`" in message and INSTALL_DEFAULT in message
    assert "\n" not in message


def test_default_model_missing_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(models_module.OFFLINE_PACKAGES, "all-MiniLM-L6-v2", ("no_such_package_here", "model"))
    monkeypatch.setenv("RETRIEVAL_MODELS", str(tmp_path / "models"))
    monkeypatch.chdir(tmp_path)  # so no folder called all-MiniLM-L6-v2 can be picked up
    with pytest.raises(ModelError, match=rf"install the default with `{INSTALL_DEFAULT}`"):
        TransformerEncoder("all-MiniLM-L6-v2")


def test_mpnet_missing_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The README names it as an offline model: the error named only the default's install command."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never a download, wherever the suite runs
    monkeypatch.setenv("RETRIEVAL_MODELS", str(tmp_path / "models"))
    monkeypatch.chdir(tmp_path)
    for name in ("all-mpnet-base-v2", "sentence-transformers/all-mpnet-base-v2"):
        with pytest.raises(ModelError, match=r"install it offline with `bash scripts/install_mpnet.sh`.*models\)"):
            TransformerEncoder(name)


def test_folder_without_a_model_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "empty-model").mkdir()
    shown = r"cannot load the model in .*empty-model \((OSError|ValueError): .*folder whole"
    with pytest.raises(ModelError, match=shown):
        TransformerEncoder(str(tmp_path / "empty-model"))


@pytest.mark.parametrize(
    ("damage", "shown"),
    [
        ("truncate weights", r"\(SafetensorError: "),  # not an OSError: it gave a traceback
        ("garble weights", r"\(SafetensorError: "),
        ("garble config", r"\((OSError|ValueError|JSONDecodeError|EnvironmentError): "),
        ("drop vocabulary", r"its tokenizer knows \d+ tokens and the model \d+: the tokenizer files"),
    ],
)
def test_a_damaged_model_folder_is_one_line(tiny_bert: Path, tmp_path: Path, damage: str, shown: str) -> None:
    """A damaged folder is refused in one line naming what failed; without its vocabulary it loaded, and every
    text became [CLS] [UNK]... [SEP]: meaningless vectors, exit 0."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_bert, folder)
    weights = next(folder.glob("*.safetensors"))
    if damage == "truncate weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "garble weights":
        weights.write_bytes(os.urandom(5000))
    elif damage == "garble config":
        (folder / "config.json").write_text("{bad json")
    else:
        for name in ("vocab.txt", "tokenizer.json"):
            (folder / name).unlink(missing_ok=True)
    with pytest.raises(ModelError, match=shown) as info:
        TransformerEncoder(str(folder))
    assert "\n" not in str(info.value)


def test_max_length_beyond_the_model_positions_is_refused(tiny_bert: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"`max_length` must be between 3 .* and the model.s 64 positions \(got 100\)"
    ):
        TransformerEncoder(str(tiny_bert), max_length=100)
    with pytest.raises(ConfigError, match=r"`max_length` must be at least 1"):
        TransformerEncoder(str(tiny_bert), max_length=-1)


# ----- batches of a bounded set of shapes ------------------------------------------------------------------
def test_padded_length_rounds_up_to_a_few_buckets() -> None:
    for max_length in (48, 256, 512):
        got = [padded_length(n, max_length) for n in range(1, max_length + 1)]
        assert all(n <= g <= max_length for n, g in zip(range(1, max_length + 1), got, strict=True))
        assert got == sorted(got)  # a longer text never gets a shorter buffer
        # padding costs at most 7 tokens below 64 and 1/8 of the length above (LENGTH_STEPS = 8 per doubling)
        assert all(g - n <= max(7, n // 8) for n, g in zip(range(1, max_length + 1), got, strict=True))
    assert len({padded_length(n, 512) for n in range(1, 513)}) == 32  # 8 up to 64, then 8 per doubling
    assert padded_length(241, 256) == 256 and padded_length(65, 256) == 72 and padded_length(3, 256) == 8
    assert padded_length(37, None) == 37  # unbucketed: the text's own length


@pytest.mark.parametrize("batch_size", [1, 7, 16, 32])
def test_shape_batches_take_every_row_once_in_a_bounded_set_of_shapes(batch_size: int) -> None:
    rng = np.random.default_rng(1338)
    allowed_rows = {batch_size} | {1 << k for k in range(batch_size.bit_length())}
    for n in (1, 2, 5, 31, 100, 257):
        lengths = rng.integers(1, 257, size=n).tolist()
        batches = shape_batches(lengths, batch_size, 256)
        rows = np.concatenate([r for r, _ in batches])
        assert sorted(rows.tolist()) == list(range(n))  # every row exactly once
        assert [lengths[i] for i in rows] == sorted(lengths, reverse=True)  # longest first
        for chunk, width in batches:
            assert len(chunk) in allowed_rows and len(chunk) <= batch_size
            assert width == padded_length(max(lengths[i] for i in chunk), 256)


@pytest.mark.parametrize("budget", [1, 100, 4096])
def test_a_token_budget_takes_fewer_rows_of_long_texts(budget: int) -> None:
    """With a token budget, a batch pads to at most that many tokens unless one row alone is wider (then it goes
    alone); its row count is still ``batch_size`` or a power of two, the largest that fits while enough rows are
    left; every row is taken once, longest first."""
    rng = np.random.default_rng(1339)
    lengths = rng.integers(1, 257, size=300).tolist()
    batches = shape_batches(lengths, 32, 256, budget)
    rows = np.concatenate([r for r, _ in batches])
    assert sorted(rows.tolist()) == list(range(300))
    assert [lengths[i] for i in rows] == sorted(lengths, reverse=True)
    left = 300
    for chunk, width in batches:
        assert len(chunk) in {32, 16, 8, 4, 2, 1}
        assert len(chunk) * width <= budget or len(chunk) == 1
        if left >= 32:  # enough rows left: no more would have fitted
            assert len(chunk) == 32 or 2 * len(chunk) * width > budget
        left -= len(chunk)
    if budget == 4096:
        assert [len(c) for c, w in batches if w == 256][:2] == [16, 16]  # 16 rows of 256 tokens, not 32
        assert 32 in [len(c) for c, w in batches if w <= 128]  # short rows fill the batch size
    unbudgeted = [(c.tolist(), w) for c, w in shape_batches(lengths, 32, 256, None)]
    assert unbudgeted == [(c.tolist(), w) for c, w in shape_batches(lengths, 32, 256, 32 * 256)]


def test_the_encoder_runs_only_a_bounded_set_of_shapes(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many random inputs, as a server sees them: the model meets at most |row counts| x |lengths| shapes."""
    monkeypatch.setattr(encoder_module, "TRACE_AFTER", 10**9)  # single texts stay on the padded eager path here
    enc = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=16, precision="fp32")
    shapes: set[tuple[int, int]] = set()
    forward = enc._forward

    def spy(batch: dict, want_hidden: bool) -> object:
        shapes.add(tuple(batch["input_ids"].shape))
        return forward(batch, want_hidden)

    monkeypatch.setattr(enc, "_forward", spy)
    words = " ".join(TEXTS).split()
    rng = np.random.default_rng(7)
    for _ in range(150):
        texts = [" ".join(rng.choice(words, size=rng.integers(1, 60))) for _ in range(rng.integers(1, 40))]
        enc.encode(texts)
    allowed = {(r, w) for r in (1, 2, 4, 8, 16) for w in {padded_length(n, 48) for n in range(1, 49)}}
    assert shapes <= allowed
    assert len(allowed) == 5 * 6  # lengths 8, 16, ..., 48; an unbucketed encoder met ~40 lengths x ~16 sizes


@pytest.mark.parametrize("batch_size", [1, 3, 7, 32])
def test_bucketed_batches_give_the_vectors_of_unbucketed_ones(tiny_bert: Path, batch_size: int) -> None:
    """Padding is masked, so a longer buffer changes only summation order: fp32 to ATOL, in input order."""
    texts = [*TEXTS, LONG, "topic 4 about the index", *[f"document number {i}" for i in range(9)]]
    bucketed = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=batch_size, precision="fp32")
    plain = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=batch_size, precision="fp32")
    plain.bucketed = False
    got, want = bucketed.encode_poolings(texts, POOLS), plain.encode_poolings(texts, POOLS)
    for pooling in POOLS:
        np.testing.assert_allclose(got[pooling], want[pooling], atol=ATOL)
        np.testing.assert_allclose(
            got[pooling][:5], np.stack([reference(bucketed, t)[pooling] for t in TEXTS]), atol=ATOL
        )


def test_bf16_bucketed_batches_agree_with_unbucketed(tiny_bert: Path) -> None:
    """In bf16 a longer buffer may change how a matrix product is blocked, so rounding, not the maths, differs:
    cosine >= 0.9999 (bf16 itself is held to BF16_MIN_COSINE = 0.999 against fp32)."""
    texts = [*TEXTS, LONG, *[f"document number {i} about topic {i % 3}" for i in range(11)]]
    bucketed = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=4, precision="bf16")
    plain = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=4, precision="bf16")
    plain.bucketed = False
    got, want = bucketed.encode_poolings(texts, POOLS), plain.encode_poolings(texts, POOLS)
    for pooling in POOLS:
        assert cosines(got[pooling], want[pooling]).min() >= 0.9999


# ----- short texts packed several to a row ------------------------------------------------------------------
def test_pack_rows_puts_every_text_in_one_row_within_capacity() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        lengths = [int(n) for n in rng.integers(1, 17, size=rng.integers(1, 60))]
        rows = pack_rows(lengths, 16)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 16 for row in rows)
        assert len(rows) <= -(-sum(lengths) * 11 // 9 // 16) + 1  # first fit decreasing: within 11/9 of the best
    assert pack_rows([9, 3, 8, 5, 7], 16) == [[0, 4], [2, 3, 1]]  # longest first; 3 goes where it first fits
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([17], 16)


def test_rows_of_one_forward_pass_are_evened_out() -> None:
    lengths = [22, 19, 25, 18, 20, 21, 17, 24, 23, 16, 20, 22, 19, 21, 18, 25]  # 16 queries, 330 tokens
    assert [sum(lengths[i] for i in row) for row in pack_rows(lengths, 256)] == [242, 88]
    rows = narrowest_rows(lengths, pack_rows(lengths, 256))
    assert sorted(i for row in rows for i in row) == list(range(16)) and len(rows) == 2
    assert max(sum(lengths[i] for i in row) for row in rows) <= 173  # an even share (165) plus a step
    rng = np.random.default_rng(4)
    for _ in range(50):
        lengths = [int(n) for n in rng.integers(1, 65, size=rng.integers(2, 60))]
        wide = pack_rows(lengths, 256)
        rows = narrowest_rows(lengths, wide)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths))) and len(rows) <= len(wide)
        widest = max(sum(lengths[i] for i in row) for row in rows)
        assert widest <= max(sum(lengths[i] for i in row) for row in wide)


def test_many_short_texts_take_the_narrowest_rows_that_hold_two_of_them() -> None:
    """Each text goes to the narrowest width at least twice its length; a width with fewer than ``least`` tokens of
    texts joins the next wider (a few queries keep one pass of wide rows); every text exactly once."""
    lengths = [10] * 120 + [20] * 60 + [40] * 3  # 1,200 / 1,200 / 120 tokens
    classes = pack_widths(lengths, 256, (32, 64, 128), least=1024)
    assert [(width, len(members)) for width, members in classes] == [(32, 120), (64, 60), (256, 3)]
    assert all(2 * lengths[i] <= width for width, members in classes[:2] for i in members)
    few = pack_widths([10] * 16 + [20] * 4, 256, (32, 64, 128), least=1024)  # 16 queries: one width, as before
    assert [(width, len(members)) for width, members in few] == [(256, 20)]
    assert pack_widths([10] * 200, 256, (), least=1) == [(256, list(range(200)))]  # no widths: rows of capacity
    assert [w for w, _ in pack_widths([5] * 300, 48, (32, 64, 128), least=1024)] == [32]  # never past capacity
    rng = np.random.default_rng(5)
    for _ in range(50):
        lengths = [int(n) for n in rng.integers(1, 65, size=rng.integers(1, 400))]
        classes = pack_widths(lengths, 256, (32, 64, 128), least=int(rng.integers(1, 2000)))
        assert sorted(i for _, members in classes for i in members) == list(range(len(lengths)))
        assert all(lengths[i] <= width for width, members in classes for i in members)
        assert [w for w, _ in classes] == sorted({w for w, _ in classes})
    with pytest.raises(ValueError, match="does not fit"):
        pack_widths([300], 256)


def test_many_short_texts_in_narrow_rows_get_the_vectors_they_get_alone(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Enough short texts for rows of their own width (``PACK_WIDTH_TOKENS`` lowered so a test needs few): they
    run in rows narrower than ``PACK_TOKENS`` and every text's vector is still its single forward pass's."""
    monkeypatch.setattr(encoder_module, "PACK_WIDTH_TOKENS", 40)
    texts = [*[f"topic {i}" for i in range(12)], *[f"document number {i} about topic {i % 3}" for i in range(12)]]
    enc = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=4, precision="fp32")
    widths: list[int] = []
    forward = enc._forward
    enc._forward = lambda batch, hidden: widths.append(int(batch["input_ids"].shape[1])) or forward(batch, hidden)
    got = enc.encode_poolings(texts, POOLS)
    assert enc.packing is True and widths and max(widths) <= 32  # rows of 32, not of the capacity (48)
    for pooling in POOLS:
        want = np.stack([reference(enc, t)[pooling] for t in texts])
        np.testing.assert_allclose(got[pooling], want, atol=ATOL)
    wide = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=4, precision="fp32")
    wide.pack_widths = ()
    widths.clear()
    forward_wide = wide._forward
    wide._forward = lambda batch, hidden: widths.append(int(batch["input_ids"].shape[1])) or forward_wide(batch, hidden)
    wide.encode(texts)
    assert max(widths) > 32  # without the widths, the same texts fill rows of up to 48 (the capacity here)


@pytest.mark.parametrize("pooling", POOLS)
@pytest.mark.parametrize("batch_size", [1, 4, 32])
def test_packed_texts_get_the_vectors_they_get_alone(tiny_bert: Path, pooling: str, batch_size: int) -> None:
    """Short texts share rows (own positions, block-diagonal attention); long ones go in padded batches: every
    text's vector is its unpadded single forward pass's, fp32 to ATOL, in input order."""
    texts = [*TEXTS, LONG, *[f"document number {i} about topic {i % 3}" for i in range(11)]]
    enc = TransformerEncoder(str(tiny_bert), pooling=pooling, max_length=48, batch_size=batch_size, precision="fp32")
    rows: list[tuple[int, ...]] = []
    forward = enc._forward
    enc._forward = lambda batch, hidden: rows.append(tuple(batch["input_ids"].shape)) or forward(batch, hidden)
    got = enc.encode(texts)
    assert enc.packing is True
    packed_rows = sum(r for r, _ in rows)
    assert packed_rows < len(texts) - 1  # several texts to a row: fewer rows than texts
    np.testing.assert_allclose(got, np.stack([reference(enc, t)[pooling] for t in texts]), atol=ATOL)


def test_a_model_that_packing_would_change_keeps_padded_batches(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packing is checked against single texts first: wrong position ids (as for a model whose positions start
    elsewhere) fail the check, and the encoder keeps padded batches with the right vectors."""
    monkeypatch.setattr(TransformerEncoder, "_position_offset", property(lambda self: 3))
    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    got = enc.encode(TEXTS)
    assert enc.packing is False
    np.testing.assert_allclose(got, np.stack([reference(enc, t)["mean"] for t in TEXTS]), atol=ATOL)


def test_bf16_packed_texts_agree_with_padded_batches(tiny_bert: Path) -> None:
    """bf16 rounds differently in a row of other texts than in a padded one: cosine >= 0.9999, as for buckets."""
    texts = [*TEXTS, *[f"document number {i} about topic {i % 3}" for i in range(11)]]
    packed = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=4, precision="bf16")
    padded = TransformerEncoder(str(tiny_bert), max_length=48, batch_size=4, precision="bf16")
    padded.packing = False
    got, want = packed.encode_poolings(texts, POOLS), padded.encode_poolings(texts, POOLS)
    assert packed.packing is True
    for pooling in POOLS:
        assert cosines(got[pooling], want[pooling]).min() >= 0.9999


def test_a_warmed_up_encoder_runs_concurrent_callers_side_by_side(tiny_bert: Path) -> None:
    """After warm_up only the tokenizer is locked: two threads are inside the model at once (a barrier in the
    forward pass, which the old whole-call lock deadlocked), and 4 threads x 20 calls give the serial vectors."""
    import threading

    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    enc.warm_up()
    assert enc.settled
    texts = [*TEXTS, LONG]
    want = {t: enc.encode([t, "topic 9"])[0] for t in texts}
    barrier = threading.Barrier(2, timeout=30)
    forward = enc._forward

    def forward_at_the_barrier(batch: dict, hidden: bool) -> object:
        barrier.wait()
        return forward(batch, hidden)

    enc._forward = forward_at_the_barrier  # type: ignore[method-assign]
    got: dict[int, np.ndarray] = {}
    threads = [threading.Thread(target=lambda i=i: got.update({i: enc.encode([texts[i], "topic 9"])})) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not barrier.broken and sorted(got) == [0, 1]
    enc._forward = forward  # type: ignore[method-assign]

    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(20):
                text = texts[rng.integers(len(texts))]
                np.testing.assert_allclose(enc.encode([text, "topic 9"])[0], want[text], atol=ATOL)
                np.testing.assert_allclose(enc.encode([text])[0], want[text], atol=ATOL)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    workers = [threading.Thread(target=hammer, args=(seed,)) for seed in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert not errors, errors[0]


def tokenizer_variant(tiny_bert: Path, tmp_path: Path, **config: object) -> Path:
    """A copy of the tiny model whose tokenizer_config.json says ``config`` (what another model might ship)."""
    import json
    import shutil

    folder = Path(shutil.copytree(tiny_bert, tmp_path / "variant"))
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return folder


@pytest.mark.parametrize("pooling", ["mean", "cls", "first-last-avg"])
def test_a_tokenizer_that_pads_on_the_left_gives_the_same_vectors(
    tiny_bert: Path, tmp_path: Path, pooling: str
) -> None:
    """cls reads the first token and positions count from the left: padding on the left (a tokenizer config may
    ask for it) would read a pad token and shift every position. Padded batches, no packing."""
    left = tokenizer_variant(tiny_bert, tmp_path, padding_side="left", truncation_side="left")
    texts = [LONG, "topic 3", "whitening vectors for search"]
    want = TransformerEncoder(str(tiny_bert), pooling=pooling, max_length=48, precision="fp32")
    got = TransformerEncoder(str(left), pooling=pooling, max_length=48, precision="fp32")
    want.packing = got.packing = False
    np.testing.assert_allclose(got.encode(texts), want.encode(texts), atol=ATOL)


def test_a_tokenizer_without_a_pad_token_pads_with_another(tiny_bert: Path, tmp_path: Path) -> None:
    """GPT-2's tokenizer has no pad token: batches pad with another token (masked out, so any will do)."""
    no_pad = tokenizer_variant(tiny_bert, tmp_path, pad_token=None)
    texts = [LONG, "topic 3"]
    enc = TransformerEncoder(str(no_pad), max_length=48, precision="fp32")
    enc.packing = False
    np.testing.assert_allclose(
        enc.encode(texts), TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32").encode(texts), atol=ATOL
    )


def test_max_length_fits_positions_after_the_padding_offset(tiny_bert: Path, tmp_path: Path) -> None:
    """RoBERTa and MPNet count positions from padding index + 1: a model with 66 position embeddings and
    padding index 1 holds 64 tokens, not 66. And a max_length below the special tokens plus one is refused."""
    import torch
    from conftest import VOCAB
    from transformers import RobertaConfig, RobertaModel

    folder = tokenizer_variant(tiny_bert, tmp_path)
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=66, pad_token_id=1,
    )  # fmt: skip
    for name in ("model.safetensors", "config.json"):
        (folder / name).unlink()
    RobertaModel(config).eval().save_pretrained(folder)
    with pytest.raises(ConfigError, match="model's 64 positions"):
        TransformerEncoder(str(folder), max_length=65, precision="fp32")
    enc = TransformerEncoder(str(folder), max_length=64, precision="fp32")
    assert np.isfinite(enc.encode([LONG * 4, "topic"])).all()
    with pytest.raises(ConfigError, match="between 3"):
        TransformerEncoder(str(tiny_bert), max_length=2, precision="fp32")


def test_progress_counts_texts_encoded_one_at_a_time(tiny_bert: Path) -> None:
    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    seen: list[int] = []
    for i in range(6):  # past the third single text, the traced path
        enc.encode_poolings([f"document number {i}"], ["mean"], on_batch=seen.append)
    assert enc._traced and sum(seen) == 6


@pytest.mark.process
def test_tracing_prints_no_transformers_warning(tiny_bert: Path) -> None:
    """torch.jit.trace asks the model for every attribute; transformers' ``loss_function`` answered with
    "`loss_type=None` was set in the config but it is unrecognized", on every server start. A fresh process:
    transformers warns once per process."""
    code = (
        "import sys; from retrieval.encode.transformer import EncoderSpec\n"
        "encoder = EncoderSpec(sys.argv[1], precision='fp32').load(); encoder.warm_up()\n"
        "assert encoder._traced, 'not traced'\n"
        "import logging\n"
        "assert logging.getLogger('transformers.modeling_utils').level == logging.NOTSET, 'left quiet'\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tiny_bert)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "loss_type" not in done.stderr, done.stderr
