"""The transformers encoder: a Hugging Face model with a pooling head, encoding texts by one of three routes (one
text through a traced model; short texts packed several to a row; the rest in length-sorted padded batches), in
the precision chosen for this CPU. Its parts live beside it: model lookup (``models``), pooling (``pooling``),
batch shapes and packing (``shapes``), the precision choice (``precision``) and the single-text trace
(``tracing``)."""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from retrieval.encode import attention, int8, precision, tracing
from retrieval.encode.inplace import gelu_in_place
from retrieval.encode.models import default_max_length, load_pretrained, weights_sha256
from retrieval.encode.pooling import masked_mean, pool, pool_one
from retrieval.encode.precision import (
    INT8_MIN_COSINE,
    cpu_model,
    cpu_supports_bf16,
    cpu_supports_int8,
    fastest_agreeing,
    min_cosine,
)
from retrieval.encode.shapes import (
    PACK_MAX_TOKENS,
    PACK_TOKENS,
    PACK_WIDTH_TOKENS,
    PACK_WIDTHS,
    TOKEN_BUDGET,
    narrowest_rows,
    pack_rows,
    pack_widths,
    packed_batch,
    pool_packed,
    shape_batches,
)
from retrieval.encode.spec import DEFAULT_MODEL, POOLINGS, EncoderInfo, EncoderSpec
from retrieval.errors import ConfigError, ModelError

log = logging.getLogger(__name__)

# Single texts (queries) are run through a traced copy of the model from this call on: a one-shot CLI search
# never pays the tracing (~0.3 s), a long-lived searcher does once and then saves ~2 ms of Python per query.
TRACE_AFTER = 3
# The single-text traces made in this process, by model weights and the choices a trace depends on: TorchScript
# keeps every trace's graph and folded weights (a model's size: ~95 MB for MiniLM) until the process exits, so
# each Searcher.load of an index (a new version, in an app that reopens it) traced again and grew by that much.
_TRACES: dict[tuple[Any, ...], Any] = {}
_TRACES_LOCK = threading.Lock()
# Two texts of different lengths: a padded batch, what settling precision "auto" and packing needs to time
WARM_UP_TEXTS = ["a short warm-up text", "a somewhat longer warm-up text, to time a padded batch"]


class _Work(NamedTuple):
    """One ``encode_poolings`` call's tokenised texts and where their vectors go, as its routes share them."""

    tokens: Any
    lengths: list[int]
    poolings: Sequence[str]
    out: dict[str, np.ndarray]
    on_batch: Callable[[int], None] | None


class TransformerEncoder:
    """A Hugging Face transformers model with a pooling head.

    Texts are tokenised once, sorted by length so each batch carries little padding, run under
    ``torch.inference_mode``, pooled, and returned in their original order as float32.

    Precision "auto" times the first batch in fp32 and, where the CPU computes them natively, in bf16 (and int8,
    ``retrieval.encode.int8``, where ``precision.INT8_IN_AUTO`` allows: off, its vectors stray further), and keeps the
    fastest that agrees with fp32 (cosine >= BF16_MIN_COSINE, INT8_MIN_COSINE): native bf16 is ~2x fp32 on some CPUs
    and ~0.6x on others with the same ``avx512_bf16`` flag, so the flag alone cannot decide. A single text (a query)
    has no padding: from the TRACE_AFTER-th one on it runs through a TorchScript trace of the model optimised for
    inference, fp32 or bf16 autocast, whichever is faster here among those that agree with the eager fp32 model (see
    ``_trace``).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        pooling: str = "mean",
        max_length: int | None = None,
        batch_size: int = 32,
        precision: str = "auto",
    ):
        EncoderSpec(model, pooling, max_length, batch_size, precision).check()
        import torch

        self.name = model
        self.folder, self.tokenizer, self.model = load_pretrained(model)
        gelu_in_place(self.model, torch.nn.Linear, torch)  # every copy made of it (bf16, int8) inherits it
        self.pooling = pooling
        # A tokenizer without a saved maximum reports ~1e30: never go past the model's position embeddings
        # (RoBERTa and MPNet start counting positions after their padding index).
        positions = int(getattr(self.model.config, "max_position_embeddings", None) or 1 << 30)
        positions -= self._position_offset
        self.max_length = max_length or min(default_max_length(self.folder, self.tokenizer.model_max_length), positions)
        least = self.tokenizer.num_special_tokens_to_add() + 1  # the special tokens and one of the text
        if not least <= self.max_length <= positions:
            raise ConfigError(
                f"`max_length` must be between {least} (the special tokens and one more) and the model's "
                f"{positions} positions (got {max_length})",
                "max_length",
            )
        self.batch_size = batch_size
        self.precision = precision
        # The precision batches run in: "fp32", "bf16" or "int8"; None: "auto" on a CPU with native bf16 or int8
        # products, settled by timing the first batch of more than one text.
        self.used: str | None = precision
        if precision == "auto":
            self.used = None if cpu_supports_bf16() or self._auto_weighs_int8() else "fp32"
        self._torch = torch
        # The fast tokenizer is not re-entrant ("Already borrowed"): it runs under this lock. The lazy decisions
        # (precision, trace, packing) are taken once, under it too: until they are, a whole call holds it. After
        # that (``warm_up``), forward passes of concurrent callers run side by side (torch releases the GIL).
        self._lock = threading.RLock()
        self._single_calls = 0
        self._traced: Any = None  # (traced module, bf16) for single texts; False once no trace passed its check
        self._model_bf16: Any = None  # the bf16 copy of the model, made when bf16 is first needed
        self._model_int8: Any = None  # the int8 copy (``retrieval.encode.int8``), made when int8 is first needed
        # The bf16 copy's attention: chunked products (``retrieval.encode.attention``) where the model takes them
        # and they are faster on this CPU than its own SDPA kernel; False keeps the model's own.
        self.chunked_attention = True
        self.bucketed = True  # batches take shapes from a bounded set (``shape_batches``)
        self.token_budget: int | None = TOKEN_BUDGET  # long texts in smaller batches (``shape_batches``)
        self.packing: bool | None = None  # short texts packed (``pack_rows``); None: checked on first use
        self.pack_widths: tuple[int, ...] = PACK_WIDTHS  # narrower rows for many short texts; () keeps PACK_TOKENS
        self._sha = weights_sha256(self.folder) if self.folder else None
        self._dim = int(self.model.config.hidden_size)
        if precision == "int8":  # made and checked now: a model int8 does not suit is refused before any work
            self._int8_model()

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def bf16(self) -> bool | None:
        """Whether batches run in bf16 (None: precision "auto", not settled yet)."""
        return None if self.used is None else self.used == "bf16"

    @bf16.setter
    def bf16(self, value: bool) -> None:
        self.used = "bf16" if value else "fp32"

    def info(self) -> EncoderInfo:
        return EncoderInfo(
            kind="transformers",
            dim=self.dim,
            model=self.name,
            model_path=str(self.folder) if self.folder else None,
            architecture=type(self.model).__name__,
            revision=getattr(self.model.config, "_commit_hash", None),
            weights_sha256=self._sha,
            pooling=self.pooling,
            max_length=self.max_length,
            precision=self.precision,
            precision_used=self.used,
            precision_cpu=cpu_model() if self.used is not None else None,
        )

    def warm_up(self) -> None:
        """Settle the lazy state now, not on a user's first request: precision "auto" (timed on a padded batch)
        and the single-text trace."""
        with self._lock:
            if self.used is None or self.packing is None:
                self.encode(WARM_UP_TEXTS)
            if self._traced is None:
                self._traced = self._shared_trace()

    def settle_precision(self, used: str | None = None) -> None:
        """Decide precision "auto" now: as ``used`` says (the choice a build being resumed recorded: one stash
        never mixes precisions), else by timing a small padded batch. Other precisions are fixed."""
        with self._lock:
            if self.precision != "auto":
                return
            if used is not None:
                self.used = used
            elif self.used is None:
                self.encode(WARM_UP_TEXTS)

    @property
    def settled(self) -> bool:
        """Whether every lazy decision is taken, so concurrent calls may run their forward passes side by side."""
        return self.used is not None and self.packing is not None and self._traced is not None

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return self.encode_poolings(texts, (self.pooling,))[self.pooling]

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens the model reads of each text: truncated at ``max_length``, special tokens included."""
        with self._lock:  # the fast tokenizer is not re-entrant
            tokens = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)
        return [len(ids) for ids in tokens["input_ids"]]

    def encode_poolings(
        self,
        texts: Sequence[str],
        poolings: Sequence[str],
        on_batch: Callable[[int], None] | None = None,
    ) -> dict[str, np.ndarray]:
        """Vectors for each pooling in one forward pass per batch; ``on_batch(n)`` after each batch."""
        if self.settled:
            return self._encode_poolings(texts, poolings, on_batch)
        with self._lock:
            return self._encode_poolings(texts, poolings, on_batch)

    def _encode_poolings(
        self, texts: Sequence[str], poolings: Sequence[str], on_batch: Callable[[int], None] | None
    ) -> dict[str, np.ndarray]:
        """Three routes: one text through the traced model; short texts packed several to a row; the others in
        length-sorted padded batches."""
        out = {p: np.empty((len(texts), self.dim), dtype=np.float32) for p in poolings}
        if not texts:
            return out
        if len(texts) == 1 and self._single_is_traced():
            self._encode_single(texts[0], poolings, out)
            if on_batch is not None:
                on_batch(1)
            return out
        with self._lock:
            tokens = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)
        lengths = [len(ids) for ids in tokens["input_ids"]]
        short = self._to_pack(tokens, lengths)
        work = _Work(tokens, lengths, poolings, out, on_batch)
        self._encode_packs(work, short)
        packed = set(short)
        self._encode_padded(work, [i for i in range(len(lengths)) if i not in packed])
        return out

    def _single_is_traced(self) -> bool:
        """Whether a single text goes through the traced model: traced on the ``TRACE_AFTER``-th single call."""
        if self._traced is None:
            self._single_calls += 1
            if self._single_calls >= TRACE_AFTER:
                self._traced = self._shared_trace()
        return bool(self._traced)

    def _to_pack(self, tokens: Any, lengths: Sequence[int]) -> list[int]:
        """The texts to pack (at most ``PACK_MAX_TOKENS`` tokens, two or more, packing agreeing with padded
        batches); precision "auto" is settled here on a padded batch of them, as ``_encode_padded`` would."""
        capacity = min(PACK_TOKENS, self.max_length)
        short = [i for i, n in enumerate(lengths) if n <= min(PACK_MAX_TOKENS, capacity)]
        if len(short) > 1 and self.packing is None:
            self.packing = self._packing_agrees()
        if len(short) < 2 or not self.packing:
            return []
        if self.used is None:
            self.used = self._fastest_agreeing(self._padded(tokens, short[: self.batch_size]))
        return short

    def _encode_packs(self, work: _Work, short: list[int]) -> None:
        """The ``short`` texts packed into rows (``pack_rows``; many short texts in narrower rows, ``pack_widths``), the
        rows into forward passes (``shape_batches``)."""
        if not short:
            return
        tokens, lengths, poolings, out, on_batch = work
        capacity = min(PACK_TOKENS, self.max_length)
        classes = pack_widths([lengths[i] for i in short], capacity, self.pack_widths, PACK_WIDTH_TOKENS)
        for capacity, members in classes:
            texts = [short[i] for i in members]
            text_lengths = [lengths[i] for i in texts]
            packed_rows = pack_rows(text_lengths, capacity)
            if 1 < len(packed_rows) <= self.batch_size:  # one forward pass, as wide as its widest row: even them out
                packed_rows = narrowest_rows(text_lengths, packed_rows)
            packs = [[texts[i] for i in pack] for pack in packed_rows]
            width_cap = capacity if self.bucketed else None
            widths = [sum(lengths[i] for i in pack) for pack in packs]
            for rows, width in shape_batches(widths, self.batch_size, width_cap, self.token_budget):
                self._encode_packed([packs[r] for r in rows], width, tokens["input_ids"], poolings, out)
                if on_batch:
                    on_batch(sum(len(packs[r]) for r in rows))

    def _encode_padded(self, work: _Work, texts: list[int]) -> None:
        """The texts at these indices in length-sorted batches (``batches``), each padded to its longest."""
        tokens, lengths, poolings, out, on_batch = work
        torch = self._torch
        want_hidden = "first-last-avg" in poolings
        with torch.inference_mode():
            for local, width in self.batches([lengths[i] for i in texts]):
                rows = np.asarray(texts, dtype=np.int64)[local]
                batch = self._padded(tokens, rows, width)
                if self.used is None and len(rows) > 1:
                    self.used = self._fastest_agreeing(batch)
                result = self._forward(batch, want_hidden)
                mask = batch["attention_mask"]
                for p in poolings:
                    out[p][rows] = pool(p, result, mask).numpy()
                if on_batch:
                    on_batch(len(rows))

    def _padded(self, tokens: Any, rows: Sequence[int], width: int | None = None) -> Any:
        """Rows of the tokenised texts as one batch of tensors, padded to ``width`` (None: to the longest)."""
        with self._lock:
            return self.tokenizer.pad(
                {key: [tokens[key][i] for i in rows] for key in tokens.keys()},
                padding="max_length" if width else "longest",
                max_length=width,
                return_tensors="pt",
            )

    # ----- packed rows --------------------------------------------------------------------------------------
    def _encode_packed(
        self,
        packs: list[list[int]],
        width: int,
        ids: Sequence[Sequence[int]],
        poolings: Sequence[str],
        out: dict[str, np.ndarray],
    ) -> None:
        """One forward pass over ``packs`` (each a row of several texts, padded to ``width``), pooled per text
        (``shapes.packed_batch``: each text gets the states it would get alone)."""
        torch = self._torch
        batch, segment = self._packed_batch(packs, width, ids, bool(self.bf16))
        with torch.inference_mode():
            result = self._forward(batch, "first-last-avg" in poolings)
            vectors = pool_packed(result, segment, packs, ids, width, poolings, torch)
        texts = [i for pack in packs for i in pack]
        for p in poolings:
            out[p][texts] = vectors[p].numpy()

    def _packed_batch(
        self, packs: list[list[int]], width: int, ids: Sequence[Sequence[int]], bf16: bool
    ) -> tuple[dict[str, Any], Any]:
        pad = int(self.tokenizer.pad_token_id or 0)
        return packed_batch(packs, width, ids, pad, self._position_offset, bf16, self._torch)

    @property
    def _position_offset(self) -> int:
        """Where a text's position ids start: 0 (BERT), or padding index + 1 (RoBERTa, MPNet)."""
        padding_idx = getattr(getattr(self.model, "embeddings", None), "padding_idx", None)
        return 0 if padding_idx is None else int(padding_idx) + 1

    def _packing_agrees(self) -> bool:
        """Whether packed rows give this model's texts the states they get alone (fp32, to 1e-4): a model whose
        embeddings ignore ``position_ids`` or whose attention ignores a 4-d mask fails, and keeps padded batches."""
        torch = self._torch
        texts = ["the packing check", "a second and somewhat longer text, to check the packing", "x"]
        torch = self._torch
        texts = ["the packing check", "a second and somewhat longer text, to check the packing", "x"]
        tokens = self.tokenizer(texts, truncation=True, max_length=self.max_length)
        width = min(PACK_TOKENS, self.max_length)
        if sum(len(i) for i in tokens["input_ids"]) > width:
            return False
        poolings = list(POOLINGS)
        packs = [[0, 1, 2]]
        try:
            with torch.inference_mode():  # the fp32 model, whatever precision is chosen
                batch, segment = self._packed_batch(packs, width, tokens["input_ids"], bf16=False)
                result = self.model(**batch, output_hidden_states=True)
                got = pool_packed(result, segment, packs, tokens["input_ids"], width, poolings, torch)
                for i in range(len(texts)):
                    alone = self._padded(tokens, [i])
                    result = self.model(**alone, output_hidden_states=True)
                    for p in poolings:
                        expected = pool(p, result, alone["attention_mask"]).numpy()
                        if not np.allclose(got[p][i].numpy(), expected, atol=1e-4):
                            log.info("packed rows disagree with single texts (%s pooling): padded batches only", p)
                            return False
        except Exception as err:  # noqa: BLE001 - a model that cannot take packed rows keeps padded batches
            log.info("packed rows failed (%s): padded batches only", err)
            return False
        return True

    def batches(self, lengths: Sequence[int]) -> list[tuple[np.ndarray, int]]:
        """(row numbers, padded length) per forward pass: see ``shape_batches``; ``bucketed`` False pads each batch
        to its own longest row (any shape; kept so scripts/bench_encode.py can measure what bucketing costs)."""
        return shape_batches(lengths, self.batch_size, self.max_length if self.bucketed else None, self.token_budget)

    def _forward(self, batch: Any, want_hidden: bool) -> Any:
        """One padded batch through the model in the precision chosen: the bf16 or int8 copy of the model, or fp32."""
        if self.used == "bf16":
            model = self._bf16_model()
        elif self.used == "int8":
            model = self._int8_model()
        else:
            model = self.model
        return model(**batch, output_hidden_states=want_hidden)

    @staticmethod
    def _auto_weighs_int8() -> bool:
        """Whether precision "auto" times int8 too: only where ``precision.INT8_IN_AUTO`` lets it (off: see there),
        and on a CPU with int8 instructions."""
        return precision.INT8_IN_AUTO and cpu_supports_int8()

    def _bf16_model(self) -> Any:
        """The whole model cast to bf16 (made once, kept beside the fp32 model, which the traces are checked
        against). Measured on SciFact passages (scripts/bench_encode.py): weights cast once beat autocast, which
        re-casts every weight on every call and keeps layer norms, softmax and GELU in fp32."""
        if self._model_bf16 is None:
            model = copy.deepcopy(self.model).to(self._torch.bfloat16)
            if self.chunked_attention and attention.faster_here(model, min(self.max_length, PACK_TOKENS)):
                attention.use_chunked(model)
            self._model_bf16 = model
        return self._model_bf16

    def _int8_model(self) -> Any:
        """The model with int8 transformer linear layers (``retrieval.encode.int8``: smoothing factors measured on
        its probe texts), made once and checked against the fp32 model on them: min cosine of mean-pooled vectors
        at least INT8_MIN_COSINE, else precision int8 is refused (``auto`` does not take it); refused at once where
        oneDNN's int8 product would saturate (``int8.SATURATES_MESSAGE``)."""
        if self._model_int8 is None:
            torch = self._torch
            if int8.onednn_available(torch) and int8.onednn_saturates(torch):
                raise ModelError(int8.SATURATES_MESSAGE)
            probes = [
                self.tokenizer([text], truncation=True, max_length=self.max_length, return_tensors="pt")
                for text in int8.PROBE_TEXTS
            ]

            def fp32() -> None:
                for probe in probes:
                    self.model(**probe)

            model = int8.quantise(self.model, int8.observe(self.model, fp32, torch), torch)
            batch = self._padded(
                self.tokenizer(list(int8.PROBE_TEXTS), truncation=True, max_length=self.max_length),
                range(len(int8.PROBE_TEXTS)),
            )
            with torch.inference_mode():
                expected, got = (
                    masked_mean(m(**batch).last_hidden_state, batch["attention_mask"]) for m in (self.model, model)
                )
            cos = min_cosine(expected, got, torch)
            if cos < INT8_MIN_COSINE:
                raise ModelError(
                    f"model {self.name!r} in int8 agrees with fp32 only to cosine {cos:.4f} on its probe texts (at "
                    f"least {INT8_MIN_COSINE} is needed): use precision fp32, bf16 or auto"
                )
            log.info("int8 model made: min cosine to fp32 on the probe texts %.5f", cos)
            self._model_int8 = model
        return self._model_int8

    def _fastest_agreeing(self, batch: Any) -> str:
        """Settle precision "auto" on four rows of a real batch (``precision.fastest_agreeing``): fp32, and bf16
        (and int8, where ``_auto_weighs_int8``) where this CPU computes them natively; a fraction of a percent of
        any build worth timing. The copies made for it are dropped unless chosen."""
        batch = {key: value[:4] for key, value in batch.items()}

        def run(model: Callable[[], Any]) -> Callable[[], Any]:
            return lambda: masked_mean(model()(**batch).last_hidden_state, batch["attention_mask"])

        ways = {"fp32": run(lambda: self.model)}
        if cpu_supports_bf16():
            ways["bf16"] = run(self._bf16_model)
        if self._auto_weighs_int8():
            try:
                self._int8_model()
                ways["int8"] = run(self._int8_model)
            except ModelError as err:
                log.info("precision auto: not int8 (%s)", err)
        chosen = fastest_agreeing(ways, self._torch)
        if chosen != "bf16":
            self._model_bf16 = None
        if chosen != "int8":
            self._model_int8 = None
        return chosen

    def _shared_trace(self) -> Any:
        """``_trace``'s answer, made once per process for these weights (see ``_TRACES``); a model whose weights
        file cannot be fingerprinted is traced each time."""
        if self._sha is None:
            return self._trace()
        config = hashlib.sha256(self.model.config.to_json_string().encode()).hexdigest()  # same weights, other
        key = (self._sha, config, self.max_length, self.bf16 is not False)  # layers or activation: another model
        with _TRACES_LOCK:
            if key not in _TRACES:
                _TRACES[key] = self._trace()
            return _TRACES[key]

    def _trace(self, bf16_options: Sequence[bool] | None = None) -> Any:
        """The single-text model as ``(module, bf16)``, or False to keep the eager model (``tracing.trace``): fp32
        and, unless precision is fp32, bf16 autocast. ``bf16_options`` overrides which are tried
        (scripts/bench_latency.py times each alone)."""
        if bf16_options is None:
            bf16_options = (False, True) if self.bf16 is not False else (False,)
        return tracing.trace(self.model, self.tokenizer, self.max_length, bf16_options, self._torch)

    def _encode_single(self, text: str, poolings: Sequence[str], out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        traced, bf16 = self._traced
        with self._lock:
            ids = self.tokenizer([text], truncation=True, max_length=self.max_length, return_tensors="pt")["input_ids"]
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            first, last = traced(ids)
        for p in poolings:
            out[p][0] = pool_one(p, first[0], last[0]).float().numpy()
        return out


def from_info(info: EncoderInfo, batch_size: int = 32) -> TransformerEncoder:
    """The encoder a manifest's record describes, loaded again (only the transformers kind can be).

    The precision asked at build time is asked again: "auto" re-decides on this machine's CPU."""
    if info.kind != "transformers":
        raise ConfigError(
            f"this index was built from {info.kind} vectors, not text: pass query vectors, "
            "or an Encoder object, to search it"
        )
    path = info.model_path
    source = str(path) if path and Path(path).is_dir() else str(info.model)
    encoder = EncoderSpec(source, info.pooling or "mean", info.max_length, batch_size, info.precision).load()
    encoder.name = str(info.model)
    if info.precision == "auto" and info.precision_used and info.precision_cpu == cpu_model():
        encoder.used = info.precision_used  # measured on this CPU already: the same choice again
    info.check_query(encoder.info())
    return encoder
