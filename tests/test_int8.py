"""Precision int8 on a tiny random BERT: the int8 linear layer's arithmetic, the encoder's vectors against a float64
reference, the manifest record, precision "auto"'s choice, one-line refusals, and the one-shot CLI search of an
int8 index (numpy, fp32 queries: no torch)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, write_corpus
from typer.testing import CliRunner

torch = pytest.importorskip("torch")

from retrieval import timing  # noqa: E402
from retrieval.cli.app import app  # noqa: E402
from retrieval.encode import int8  # noqa: E402
from retrieval.encode import precision as precision_module  # noqa: E402
from retrieval.encode import transformer as encoder_module  # noqa: E402
from retrieval.encode.spec import POOLINGS, EncoderSpec  # noqa: E402
from retrieval.encode.transformer import TransformerEncoder, from_info  # noqa: E402
from retrieval.errors import ModelError  # noqa: E402

TEXTS = [
    "whitening vectors",
    "the index of a corpus is fast",
    "a",
    "search query about the model and the sentence cosine retrieval of a document number 7",
    " ".join(["the document about whitening and retrieval of vectors"] * 5),
]
# int8 rounds each token's activations and each weight row to 8 bits: on the random 2-layer model with weights of
# std 0.2 its pooled vectors stay within this of the float64 model's (measured: 0.99986 at worst).
INT8_BOUND = 0.999


# oneDNN's int8 op, and whether its product is exact on this CPU (without VNNI or AMX it saturates: precision int8
# is refused there, and the tests below run the int8 layers on torch's exact ``_int_mm`` instead).
ONEDNN = int8.onednn_available(torch)
EXACT_ONEDNN = ONEDNN and not int8.onednn_saturates(torch)


def skip_without_exact_onednn() -> None:
    if not ONEDNN:
        pytest.skip("this torch has no oneDNN int8 linear op")
    if not EXACT_ONEDNN:
        pytest.skip("oneDNN's int8 product saturates on this CPU (no VNNI or AMX): precision int8 is refused here")


@pytest.fixture(autouse=True)
def exact_int8_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN's product would saturate, the encoder's int8 layers run on ``torch._int_mm`` (exact, slow: a
    tiny model's worth), so the int8 encoder is still tested end to end on such a CPU."""
    if ONEDNN and not EXACT_ONEDNN:
        monkeypatch.setattr(int8, "onednn_available", lambda torch: False)


@pytest.fixture(scope="module")
def strong_bert(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT's vocabulary and shape with weights of std 0.2, not 0.02: at 0.02 the embeddings outweigh
    every layer so much that int8 layers moved pooled vectors by 6e-8 of cosine, which tests nothing."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("strong-bert")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_bert / name).is_file():
            shutil.copy(tiny_bert / name, folder / name)
    config = BertConfig.from_pretrained(tiny_bert)
    config.initializer_range = 0.2
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(folder)
    return folder


def float64_reference(enc: TransformerEncoder, text: str, pooling: str) -> np.ndarray:
    """One text alone through a float64 copy of the fp32 model, pooled."""
    model = copy.deepcopy(enc.model).double()
    ids = enc.tokenizer([text], truncation=True, max_length=enc.max_length, return_tensors="pt")
    with torch.inference_mode():
        out = model(**ids, output_hidden_states=True)
    if pooling == "cls":
        return out.last_hidden_state[0, 0].numpy()
    if pooling == "mean":
        return out.last_hidden_state[0].mean(0).numpy()
    return ((out.hidden_states[1][0] + out.hidden_states[-1][0]) / 2).mean(0).numpy()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64) / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b.astype(np.float64) / np.linalg.norm(b, axis=-1, keepdims=True)
    return np.sum(a * b, axis=-1)


@pytest.mark.parametrize("onednn", [True, False])
def test_the_int8_layer_is_exact_where_rounding_loses_nothing(onednn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer weights with 127 in every row and integer activations with 127 in every token quantise with scale
    1: the int8 product is then the float64 one exactly (int32 sums, scales of 1, float32 output of integers), by
    oneDNN's int8 matmul and by the ``torch._int_mm`` fallback."""
    if onednn:
        skip_without_exact_onednn()
    monkeypatch.setattr(int8, "onednn_available", lambda torch: onednn)
    top = 127
    rng = np.random.default_rng(0)
    linear = torch.nn.Linear(32, 24)
    weight = rng.integers(-127, 128, (24, 32)).astype(np.float64)
    weight[:, 0] = 127
    x = rng.integers(-top, top + 1, (2, 5, 32)).astype(np.float64)
    x[..., 3] = -top
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(weight))
        linear.bias.copy_(torch.arange(24, dtype=torch.float32))
    layer = int8.int8_linear_class(torch)(linear, torch.ones(32))
    got = layer(torch.from_numpy(x).float()).numpy()
    np.testing.assert_array_equal(got, x @ weight.T + np.arange(24))


def test_the_saturation_probe_tells_what_onednn_computes() -> None:
    """``onednn_saturates`` is True exactly where an 8-bit activation at its top step times a weight of 127 loses
    its sum in oneDNN's product (CPUs without VNNI or AMX: pairs of products added in int16)."""
    if not ONEDNN:
        pytest.skip("this torch has no oneDNN int8 linear op")
    weight = torch.full((16, 96), 127, dtype=torch.int8)
    weight[::2] = -127
    packed = torch.ops.onednn.qlinear_prepack(weight, None)
    x = torch.randint(200, 256, (8, 96), dtype=torch.uint8)
    sums = torch.ops.onednn.qlinear_pointwise(
        x, 1.0, 0, packed, torch.ones(16), torch.zeros(16, dtype=torch.long), None, 1.0, 0, torch.float32, "none",
        [], "",
    )  # fmt: skip
    exact = x.double() @ weight.double().T
    assert int8.onednn_saturates(torch) == bool((sums.double() != exact).any())


def test_int8_is_refused_in_one_line_where_onednn_would_saturate(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where oneDNN's int8 product saturates (no VNNI or AMX), precision int8 is refused before any int8 copy is
    made, saying what the CPU lacks and what to use; the layer itself never runs oneDNN's product there."""
    monkeypatch.setattr(int8, "onednn_available", lambda torch: True)
    monkeypatch.setattr(int8, "_saturates", True)
    monkeypatch.setattr(int8, "quantise", lambda *a: pytest.fail("no int8 copy is made"))
    with pytest.raises(ModelError) as refused:
        TransformerEncoder(str(tiny_bert), max_length=48, precision="int8")
    message = str(refused.value)
    assert "VNNI or AMX" in message and "saturate" in message and "fp32" in message and "\n" not in message
    with pytest.raises(RuntimeError, match="saturate"):
        int8.int8_linear_class(torch)


def test_the_int8_layer_rounds_each_token_on_its_own_scale() -> None:
    """A token 1000x larger than another in the same batch does not coarsen the small token's product: each row's
    relative error stays at 8-bit rounding (per-tensor scaling would zero the small row)."""
    rng = np.random.default_rng(1)
    linear = torch.nn.Linear(64, 48)
    x = rng.standard_normal((2, 64))
    x[0] *= 1000
    expected = x @ linear.weight.detach().double().numpy().T + linear.bias.detach().double().numpy()
    smooth = torch.from_numpy(rng.uniform(0.5, 2.0, 64)).float()  # the smoothing factors cancel out
    got = int8.int8_linear_class(torch)(linear, smooth)(torch.from_numpy(x).float()).double().numpy()
    assert cosines(got, expected).min() >= 0.999


def test_the_per_tensor_int8_layer_is_exact_where_rounding_loses_nothing() -> None:
    """Per tensor: activations spanning exactly 255 integer steps (-128 to 127) quantise with scale 1 and zero point
    128, and integer weights with 127 in every row with scale 1: the product, bias added inside oneDNN, is the
    float64 one exactly, whatever the (positive) smoothing factors, which the weights carry and the input sheds."""
    skip_without_exact_onednn()
    low, high = -128, 127
    rng = np.random.default_rng(2)
    linear = torch.nn.Linear(32, 24)
    weight = rng.integers(-127, 128, (24, 32)).astype(np.float64)
    weight[:, 0] = 127
    x = rng.integers(low, high + 1, (3, 4, 32)).astype(np.float64)
    x[0, 0, 1], x[1, 2, 5] = low, high
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(weight))
        linear.bias.copy_(torch.arange(24, dtype=torch.float32))
    layer = int8.int8_linear_class(torch)(linear, torch.ones(32), per_token=False)
    assert not layer.per_token
    got = layer(torch.from_numpy(x).float()).numpy()
    np.testing.assert_array_equal(got, x @ weight.T + np.arange(24))
    smooth = torch.full((32,), 2.0)  # powers of two: exact in float32 too
    halved = torch.nn.Linear(32, 24)
    with torch.no_grad():
        halved.weight.copy_(torch.from_numpy(weight / 2))
        halved.bias.copy_(torch.arange(24, dtype=torch.float32))
    got = int8.int8_linear_class(torch)(halved, smooth, per_token=False)(torch.from_numpy(x * 2).float()).numpy()
    np.testing.assert_array_equal(got, x @ weight.T + np.arange(24))


def test_only_the_layers_reading_one_tensor_quantise_it_per_tensor(strong_bert: Path) -> None:
    """The probe texts show which layers read the very same tensor: each self-attention's query, key and value, one
    group per transformer layer. They share smoothing factors and quantise that input per tensor, once for the
    three; every other layer (attention output, up and down projections) quantises per token: per tensor there
    drops the min cosine to fp32 below 0.99 on short sentences (``int8.SCHEME``)."""
    enc = TransformerEncoder(str(strong_bert), max_length=48, precision="fp32")
    probes = [enc.tokenizer([t], return_tensors="pt") for t in int8.PROBE_TEXTS]
    observed = int8.observe(enc.model, lambda: [enc.model(**p) for p in probes], torch)
    made: dict[str, tuple[bool, object, object]] = {}

    class Recorder(torch.nn.Linear):
        def __init__(self, linear: torch.nn.Linear, smooth: torch.Tensor, per_token: bool, shared: object) -> None:
            super().__init__(linear.in_features, linear.out_features)
            self.made = (per_token, shared, smooth)

    model = int8.quantise(enc.model, observed, torch, Recorder)
    for name, module in model.named_modules():
        if isinstance(module, Recorder):
            made[name.split(".layer.")[1]] = module.made
    assert len(made) == 2 * 6
    per_tensor = sorted(n for n, (per_token, _, _) in made.items() if not per_token)
    assert per_tensor == [f"{i}.attention.self.{p}" for i in (0, 1) for p in ("key", "query", "value")]
    for i in (0, 1):
        group = [made[f"{i}.attention.self.{p}"] for p in ("query", "key", "value")]
        assert group[0][1] is not None and all(g[1] is group[0][1] for g in group)  # one SharedInput for the three
        assert all(torch.equal(g[2], group[0][2]) for g in group)  # the same smoothing factors
    assert all(shared is None for n, (_, shared, _) in made.items() if "attention.self" not in n)


def test_layers_reading_one_tensor_quantise_it_once(strong_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Query, key and value quantise their shared input once a pass: the first stores it, the other two take it.
    The shared quantisation changes no vector: the encoder gives the same vectors with each layer quantising
    alone (then three times as many quantisations)."""
    skip_without_exact_onednn()
    enc = TransformerEncoder(str(strong_bert), max_length=48, precision="int8")
    model = enc._int8_model()
    layers = {name: m for name, m in model.named_modules() if type(m).__name__ == "Int8Linear"}
    calls = []
    kind = type(next(iter(layers.values())))
    original = kind._quantise_tensor
    monkeypatch.setattr(kind, "_quantise_tensor", lambda self, rows: calls.append(self) or original(self, rows))
    shared_vectors = enc.encode(TEXTS)
    shared_calls = len(calls)  # per pass: once per transformer layer (query, key and value together)
    assert shared_calls > 0 and shared_calls % 2 == 0
    for layer in layers.values():
        layer.shared = None
    calls.clear()
    alone = enc.encode(TEXTS)
    assert len(calls) == shared_calls * 3  # query, key and value each quantise their input
    np.testing.assert_array_equal(shared_vectors, alone)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_the_feed_forward_gelu_runs_in_place_and_changes_no_vector(strong_bert: Path, precision: str) -> None:
    """Each feed-forward block's exact GELU is applied in place on its up projection's own output (a fresh
    (tokens x 4d) tensor a batch cost its page faults again), in the fp32 model and so in its bf16 and int8
    copies; the vectors are those of the block's own GELU."""
    if precision == "int8":
        skip_without_exact_onednn()
    enc = TransformerEncoder(str(strong_bert), max_length=48, precision=precision)
    model = {"fp32": lambda: enc.model, "bf16": enc._bf16_model, "int8": enc._int8_model}[precision]()
    blocks = [m for m in model.modules() if hasattr(m, "intermediate_act_fn")]
    assert len(blocks) == 2 and all(type(b.intermediate_act_fn).__name__ == "GeluInPlace" for b in blocks)
    in_place = enc.encode(TEXTS)
    for block in blocks:
        block.intermediate_act_fn = torch.nn.GELU()
    np.testing.assert_array_equal(in_place, enc.encode(TEXTS))


@pytest.mark.parametrize("pooling", POOLINGS)
def test_int8_vectors_agree_with_the_float64_model(strong_bert: Path, pooling: str) -> None:
    enc = TransformerEncoder(str(strong_bert), pooling=pooling, max_length=48, precision="int8")
    assert (enc.info().precision, enc.info().precision_used) == ("int8", "int8")
    layers = [m for m in enc._int8_model().modules() if type(m).__name__ == "Int8Linear"]
    assert len(layers) == 2 * 6  # every linear layer of both transformer layers: q, k, v, out, up, down
    got = enc.encode(TEXTS)  # a padded batch and packed rows
    expected = np.stack([float64_reference(enc, text, pooling) for text in TEXTS])
    cos = cosines(got, expected)
    assert cos.min() >= INT8_BOUND
    assert cos.min() < 1 - 1e-6  # int8 did round: these are not the fp32 model's vectors
    assert all(p.dtype == torch.float32 for p in enc.model.parameters())  # the fp32 model is left alone


def test_int8_that_strays_from_fp32_is_refused_in_one_line(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoder_module, "INT8_MIN_COSINE", 1.01)
    with pytest.raises(ModelError, match=r"^model .* in int8 agrees with fp32 only to cosine [0-9.]+ .*: use") as err:
        TransformerEncoder(str(tiny_bert), max_length=48, precision="int8")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("answer", ["int8", "fp32"])
def test_auto_takes_int8_where_it_is_faster_and_agrees(
    tiny_bert: Path, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    monkeypatch.setattr(encoder_module, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(encoder_module, "cpu_supports_int8", lambda: True)
    monkeypatch.setattr(precision_module, "INT8_IN_AUTO", True)  # as on a CPU where int8 measured faster
    monkeypatch.setattr(timing, "_chosen", timing.Policy(answers={"precision": answer}))
    enc = TransformerEncoder(str(tiny_bert), max_length=48)
    assert enc.info().precision_used is None
    enc.encode(TEXTS)
    assert enc.info().precision_used == answer
    assert (enc._model_int8 is not None) == (answer == "int8")  # the copy made for the timing is not kept


def test_auto_never_takes_int8_that_disagrees_with_fp32(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoder_module, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(encoder_module, "cpu_supports_int8", lambda: True)
    monkeypatch.setattr(precision_module, "INT8_IN_AUTO", True)
    monkeypatch.setattr(timing, "_chosen", timing.Policy(answers={"precision": "int8"}))  # int8 "faster"
    monkeypatch.setattr(precision_module, "INT8_MIN_COSINE", 1.01)  # but no cosine reaches the bar
    enc = TransformerEncoder(str(tiny_bert), max_length=48)
    enc.encode(TEXTS)
    assert enc.info().precision_used == "fp32" and enc._model_int8 is None


def test_auto_leaves_int8_out_without_int8_instructions(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoder_module, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(encoder_module, "cpu_supports_int8", lambda: False)
    enc = TransformerEncoder(str(tiny_bert), max_length=48)
    assert enc.info().precision_used == "fp32"  # decided without timing anything


def test_auto_leaves_int8_out_until_it_is_measured_faster(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 vectors agree with fp32 less closely than bf16 (docs/benchmarks/encode.md): "auto" neither makes nor
    times it."""
    monkeypatch.setattr(encoder_module, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(encoder_module, "cpu_supports_int8", lambda: True)
    monkeypatch.setattr(timing, "_chosen", timing.Policy(answers={"precision": "int8"}))  # even were it "faster"
    enc = TransformerEncoder(str(tiny_bert), max_length=48)
    assert enc.info().precision_used == "fp32"  # decided without timing anything
    enc.encode(TEXTS)
    assert enc.info().precision_used == "fp32" and enc._model_int8 is None


def run(*args: str | Path) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_an_int8_index_records_int8_and_is_searched_in_int8(tiny_bert: Path, tmp_path: Path) -> None:
    """The manifest records int8 asked and run; the index's encoder, loaded again (add, search, serve), runs int8;
    the one-shot CLI search encodes its query with the numpy BERT in fp32, without importing torch, and a
    document's own text finds itself at cosine >= INT8_MIN_COSINE (int8 document against fp32 query)."""
    corpus = write_corpus(tmp_path / "corpus.parquet", n=120)
    out = tmp_path / "idx"
    result = run("index", corpus, "--model", tiny_bert, "--precision", "int8", "--out", out)
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    encoder = json.loads((out / "manifest.json").read_text())["encoder"]
    assert (encoder["precision"], encoder["precision_used"]) == ("int8", "int8")
    from retrieval.manifest import Manifest

    again = from_info(Manifest.load(out).encoder)
    assert again.used == "int8" and again.info().precision == "int8"
    probe = (
        "import json, runpy, sys\n"
        "sys.argv = ['retrieval', 'search', sys.argv[1], '--index', sys.argv[2], '-k', '3', '--json']\n"
        "try:\n    runpy.run_module('retrieval', run_name='__main__')\n"
        "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    query = "document number 42 about topic 0"
    done = subprocess.run([sys.executable, "-c", probe, query, str(out)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    *lines, imported = done.stdout.splitlines()
    assert json.loads(imported) == []
    top = json.loads(lines[0])
    assert top["id"] == "doc42" and top["score"] >= precision_module.INT8_MIN_COSINE


def test_int8_without_a_text_encoder_is_refused_in_one_line(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.parquet", n=50, vec=[[float(i), 1.0, 2.0] for i in range(50)])
    result = run("index", corpus, "--vectors-column", "vec", "--precision", "int8", "--out", tmp_path / "idx")
    assert result.exit_code != 0  # type: ignore[attr-defined]
    message = result.output.strip()  # type: ignore[attr-defined]
    assert len(message.splitlines()) == 1 and "precision" in message and "vectors" in message
    assert not (tmp_path / "idx").exists()


def test_the_spec_accepts_int8() -> None:
    EncoderSpec(precision="int8").check()
