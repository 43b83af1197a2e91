"""Chunked attention: against a float64 one-shot softmax(q k^T) v, inside a BERT against its own SDPA, and chosen
only where it is timed faster and the model takes it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from retrieval import timing  # noqa: E402
from retrieval.encode import attention  # noqa: E402
from retrieval.encode.precision import BF16_MIN_COSINE  # noqa: E402
from retrieval.encode.transformer import TransformerEncoder  # noqa: E402

TEXTS = ["whitening vectors", "the index of a corpus is fast", "a", "search query about the model", "topic 3"]


def reference(q, k, v, allowed) -> np.ndarray:
    """float64, all heads at once, (batch, length, heads, dim) as transformers' attention functions return."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if allowed is not None:
        scores = np.where(allowed.numpy(), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ v).transpose(0, 2, 1, 3)


def states(batch: int, heads: int = 3, length: int = 11, dim: int = 8, dtype=torch.float32):
    generator = torch.Generator().manual_seed(batch)
    return (torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype) for _ in range(3))


def padding(batch: int, length: int = 11) -> torch.Tensor:
    """True where a query may attend: row i has its last i % 4 keys padded."""
    allowed = torch.ones(batch, 1, length, length, dtype=torch.bool)
    for i in range(batch):
        if i % 4:
            allowed[i, :, :, length - i % 4 :] = False
    return allowed


@pytest.mark.parametrize("batch", [1, 2, 5, 7])
@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_chunked_attention_matches_a_float64_one_shot(batch: int, mask: str, monkeypatch) -> None:
    # chunks of 2 sequences (this shape's scores are 3 x 11 x 11), so 5 and 7 leave a short last chunk
    monkeypatch.setattr(attention, "CHUNK_SCORES", 2 * 3 * 11 * 11)
    q, k, v = states(batch)
    allowed = None if mask == "none" else padding(batch)
    given = allowed
    if mask == "additive":
        given = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    got, weights = attention.chunked_attention(None, q, k, v, given)
    assert weights is None and got.shape == (batch, 11, 3, 8)
    # float32 products and softmax over 8-dim heads: rounding ~1e-7 relative
    np.testing.assert_allclose(got.numpy(), reference(q, k, v, allowed), rtol=1e-5, atol=1e-6)


def test_sequences_whose_scores_exceed_the_chunk_go_one_at_a_time(monkeypatch) -> None:
    """One sequence's scores can be more than CHUNK_SCORES (12 heads x 512 x 512 for a 512-token model, twice it):
    each chunk then holds one sequence, never none (a step of 0, which range() refuses)."""
    monkeypatch.setattr(attention, "CHUNK_SCORES", 3 * 11 * 11 // 2)
    q, k, v = states(3)
    allowed = padding(3)
    got = attention.chunked_attention(None, q, k, v, allowed)[0]
    # float32 products and softmax over 8-dim heads, as above
    np.testing.assert_allclose(got.numpy(), reference(q, k, v, allowed), rtol=1e-5, atol=1e-6)


def test_chunked_attention_in_bf16_is_as_close_as_the_fused_kernel() -> None:
    q, k, v = states(6, heads=4, length=64, dim=32, dtype=torch.bfloat16)
    allowed = padding(6, 64)
    additive = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill_(~allowed, torch.finfo(torch.bfloat16).min)
    want = reference(q, k, v, allowed)
    chunked = attention.chunked_attention(None, q, k, v, additive)[0].float().numpy()
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).float()
    # bf16 keeps 8 bits of mantissa (~4e-3 relative); the outputs are weighted means of values ~N(0, 1)
    chunked_error, fused_error = np.abs(chunked - want).max(), np.abs(fused.numpy() - want).max()
    assert chunked_error < 0.05
    assert chunked_error < 2 * fused_error + 1e-2


def bert(folder: Path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder).eval()


def test_a_bert_with_chunked_attention_gives_its_sdpa_states(tiny_bert: Path) -> None:
    """Padded batches (transformers' own masks) and a packed row (a 4-d additive mask, as the encoder passes)."""
    model = bert(tiny_bert)
    assert attention.takes_chunked(model)
    chunked = bert(tiny_bert)
    attention.use_chunked(chunked)
    assert chunked.config._attn_implementation == attention.NAME
    ids = torch.randint(5, 40, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = mask[2, 3:] = 0
    packed = torch.full((1, 1, 9, 9), torch.finfo(torch.float32).min)
    packed[..., :4, :4] = packed[..., 4:, 4:] = 0  # two texts in one row
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    with torch.inference_mode():
        for inputs in (
            {"input_ids": ids, "attention_mask": mask},
            {"input_ids": ids[:1], "attention_mask": packed, "position_ids": positions},
        ):
            want, got = model(**inputs).last_hidden_state, chunked(**inputs).last_hidden_state
            # fp32, a 2-layer 32-wide model: only the order of summation differs
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_a_model_on_sdpa_takes_chunked_attention(tiny_bert: Path) -> None:
    model = bert(tiny_bert)
    model.set_attn_implementation("eager")  # chosen by someone: kept
    assert not attention.takes_chunked(model)
    assert not attention.faster_here(model, 16)
    assert not attention.takes_chunked(torch.nn.Linear(2, 2))


def test_a_model_that_cannot_switch_is_neither_timed_nor_switched(monkeypatch) -> None:
    """Only a model on SDPA whose class switches through transformers' attention interface is timed: not one set
    to another implementation (flex attention, chosen by someone), not one with its own attention code (its class
    cannot switch), not one from a transformers without the switch. faster_here says False for those without
    timing, so a timing that favours chunked cannot switch them."""
    timed = []
    monkeypatch.setattr(attention, "_FASTER", {})
    monkeypatch.setattr(attention, "_time", lambda *shape: timed.append(shape) or True)

    def model(implementation: str, can_set: bool | None = True) -> SimpleNamespace:
        config = SimpleNamespace(_attn_implementation=implementation, num_attention_heads=2, hidden_size=32)
        if can_set is None:  # transformers before set_attn_implementation
            return SimpleNamespace(config=config)
        return SimpleNamespace(config=config, _can_set_attn_implementation=lambda: can_set)

    for refused in (model("flex_attention"), model("sdpa", can_set=False), model("sdpa", can_set=None)):
        assert not attention.takes_chunked(refused)
        assert not attention.faster_here(refused, 16)
    assert not timed
    assert attention.faster_here(model("sdpa"), 16)  # the same shape on SDPA that can switch: timed
    assert timed == [(2, 16, 16, 4)]


@pytest.mark.parametrize(
    ("chunked", "sdpa", "faster"),
    [
        ([9.0, 2.0, 3.0, 2.0], [1.0, 3.0, 4.0, 3.0], True),  # chunked's first run slow (its products set up)
        ([1.0, 3.0, 3.0, 3.0], [9.0, 2.0, 2.5, 2.0], False),  # SDPA's first run slow
    ],
)
def test_the_timing_keeps_the_faster_best_of_the_timed_rounds(monkeypatch, chunked, sdpa, faster) -> None:
    """_time runs each candidate once to warm up, then three times interleaved, and chooses chunked only where its
    best timed run beats SDPA's. A fake clock that each candidate advances by its scripted milliseconds: counting
    the warm-up run would choose the other in both cases."""
    now = [0.0]

    def advancing(costs: list[float]):
        runs = iter(costs)

        def run(*args, **kwargs):
            now[0] += next(runs) / 1e3
            return torch.zeros(1, 1, 1, 1)  # the SDPA candidate transposes what it gets

        return run

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(attention, "chunked_attention", advancing(chunked))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", advancing(sdpa))
    assert attention._time(2, 4, 8, 2) is faster


def test_the_timing_is_made_once_per_shape(tiny_bert: Path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(attention, "_FASTER", {})
    monkeypatch.setattr(attention, "_time", lambda *shape: calls.append(shape) or True)
    model = bert(tiny_bert)
    assert attention.faster_here(model, 16) and attention.faster_here(model, 16)
    assert attention.faster_here(model, 32)
    assert calls == [(2, 16, 16, 4), (2, 16, 32, 4)]  # heads, head dim, length, rows
    monkeypatch.setattr(attention, "_FASTER", {})
    monkeypatch.undo()
    assert attention._time(2, 16, 32, 2) in (True, False)  # the real timing runs on these shapes


@pytest.mark.parametrize("faster", [True, False])
def test_the_bf16_encoder_takes_chunked_attention_where_it_times_faster(tiny_bert: Path, monkeypatch, faster) -> None:
    monkeypatch.setattr(attention, "faster_here", lambda model, length: faster)
    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="bf16")
    fp32 = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    got = enc.encode(TEXTS)
    assert enc._model_bf16.config._attn_implementation == (attention.NAME if faster else "sdpa")
    assert fp32.model.config._attn_implementation == "sdpa"  # the fp32 model (and the traces) keep their own
    want = fp32.encode(TEXTS)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() > BF16_MIN_COSINE


def test_an_encoder_told_not_to_keeps_the_models_attention(tiny_bert: Path, monkeypatch) -> None:
    monkeypatch.setattr(attention, "faster_here", lambda model, length: True)
    enc = TransformerEncoder(str(tiny_bert), max_length=48, precision="bf16")
    enc.chunked_attention = False
    enc.encode(TEXTS)
    assert enc._model_bf16.config._attn_implementation == "sdpa"
