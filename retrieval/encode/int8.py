"""Int8 linear layers: a copy of the model whose encoder ``nn.Linear`` layers multiply int8 by int8 into int32
(oneDNN's int8 matmul, with VNNI or AMX kernels where the CPU has them), for precision "int8".

Each layer's weight is quantised once, symmetric per output channel; activations are quantised on every call,
symmetric per token (a batch's padding or one long outlier token cannot coarsen another token's scale), but per
tensor, once for the three, where a self-attention's query, key and value read the same tensor (``SCHEME``).
Before quantising, SmoothQuant's per-input-channel factors ``s = max|x|^0.5 / max|w|^0.5`` move the activations'
outlier channels (BERT's layer-norm outputs have a few) into the weights: ``x W^T = (x / s)(W s)^T``. ``max|x|``
comes from a fixed set of probe texts run through the fp32 model when the copy is made.

Measured on all-MiniLM-L6-v2, 200 STS-B sentences and 40 SciFact passages against fp32 (min cosine of mean-pooled
vectors): torch's ``quantize_dynamic`` 0.900 (per-tensor weights; its x86 kernels quantise activations to 7 bits,
per tensor) and 0.963 (per-channel weights); per-token activations without smoothing 0.9948; with smoothing 0.9981.
scripts/bench_encode.py measures speed and quality on this model each run (docs/benchmarks/encode.md).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# SmoothQuant's migration strength: 0 leaves activations as they are, 1 moves all their range into the weights.
SMOOTHING = 0.5
# SCHEME: which layers quantise their input per tensor (one scale for the batch: cheaper) and which per token.
# Per tensor only in a self-attention's query, key and value, which read one tensor and so quantise it once for
# the three. Min cosine against fp32 on 1,000 STS-B test sentences (all-MiniLM-L6-v2, products exact as VNNI and
# AMX compute them; scripts/probe_int8_range.py, results/encode/int8-range.md): 0.9910; per token everywhere 0.9913;
# per tensor also in the attention output 0.9902, in the feed-forward up projection 0.9865, in every layer but the
# down projection 0.9874: short sentences fall below INT8_MIN_COSINE (0.99) or too near it.
# What the smoothing factors are measured on and the int8 copy is checked against fp32 with: short and long,
# plain and technical, as queries and passages are.
PROBE_TEXTS = (
    "what is the capital of france",
    "A man is playing a guitar on the street.",
    "Two dogs run across a snowy field while a child watches from the fence.",
    "Does vitamin D supplementation reduce the risk of respiratory infections in adults?",
    "The 2019 revision of the SI defines the kilogram by fixing the numerical value of the Planck constant.",
    "Mutations in BRCA1 and BRCA2 raise the lifetime risk of breast and ovarian cancer; carriers are offered "
    "screening from an earlier age, and risk-reducing surgery is discussed once childbearing is complete.",
    "In a randomised controlled trial of 1,204 patients with type 2 diabetes, metformin combined with lifestyle "
    "intervention lowered HbA1c by 0.8 percentage points over 12 months compared with lifestyle intervention alone "
    "(95% CI 0.6-1.0), with no increase in serious adverse events.",
    "error: connection refused (ECONNREFUSED) at 127.0.0.1:5432 -- is the server running?",
)


def onednn_available(torch: Any) -> bool:
    """Whether torch has oneDNN's int8 linear op (x86 builds: what torch's own x86 quantisation runs)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.onednn, "qlinear_prepack")


class SharedInput:
    """Layers that read the same tensor with the same smoothing (a self-attention's query, key and value) quantise
    it once: the first of them stores (input, quantised input) for its thread, the others find it there."""

    def __init__(self) -> None:
        self._last = threading.local()

    def get(self, x: Any) -> Any:
        last = getattr(self._last, "pair", None)
        return last[1] if last is not None and last[0] is x else None

    def put(self, x: Any, quantised: Any) -> None:
        self._last.pair = (x, quantised)


_saturates: bool | None = None


def onednn_saturates(torch: Any) -> bool:
    """Whether oneDNN's u8 x s8 product loses sums on this CPU: without VNNI or AMX (AVX2, AVX-512 before Cascade
    Lake) it adds each pair of u8 x s8 products in int16 with saturation (``vpmaddubsw``), so 255 x 127 twice
    (64,770) is clipped at 32,767. Measured once per process on one product that needs every bit, rather than
    read from CPU flags: oneDNN picks its kernel by what it detects, and ``ONEDNN_MAX_CPU_ISA`` changes that."""
    global _saturates
    if _saturates is None:
        weight = torch.full((8, 64), 127, dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        ones, zeros = torch.ones(8), torch.zeros(8, dtype=torch.long)
        x = torch.full((4, 64), 255, dtype=torch.uint8)
        sums = torch.ops.onednn.qlinear_pointwise(
            x, 1.0, 0, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )  # fmt: skip
        _saturates = bool((sums != 64 * 255 * 127).any())
    return _saturates


# Why precision int8 is refused where oneDNN's product saturates (scripts/probe_int8_range.py, same texts): a range
# narrowed so that it cannot saturate costs too much, 7-bit activations 0.959 and 7-bit weights 0.978 (8 bits:
# 0.991); oneDNN's kernel on 7-bit inputs ran at 1.85x an fp32 product on an AVX2 CPU, torch's exact ``_int_mm``
# at 0.02x. So int8 is offered only where it is both exact and fast.
SATURATES_MESSAGE = (
    "precision int8 needs int8 dot-product instructions (VNNI or AMX), which this CPU lacks: its int8 products "
    "saturate; use precision fp32 or auto"
)


def int8_linear_class(torch: Any) -> type:
    """The int8 linear layer (made here, so importing this module does not import torch): by oneDNN's product where
    torch has it, ``torch._int_mm`` where it has not; never where oneDNN's would saturate (``SATURATES_MESSAGE``)."""
    onednn = onednn_available(torch)
    if onednn and onednn_saturates(torch):
        raise RuntimeError(SATURATES_MESSAGE)
    half = 128.5  # u8 zero point 128, and 0.5 so that truncation rounds

    def to_uint8(values: Any) -> Any:
        """float32 ``values`` in [0, 256) truncated to uint8, through int16: the same bytes as ``.to(torch.uint8)``,
        whose float-to-uint8 cast torch does not vectorise (4096 x 1536, 2 threads: 1.67 ms; through int32 1.40,
        through int16 0.86)."""
        return values.to(torch.int16).to(torch.uint8)

    class Int8Linear(torch.nn.Module):  # type: ignore[misc, name-defined]
        """``linear(x / smooth)`` in int8: weights per output channel, int32 sums, by oneDNN's int8 matmul
        (``onednn.qlinear_pointwise``: VNNI or AMX kernels), else ``torch._int_mm``.

        Activations are quantised per token (``per_token``: each row its own scale, applied after the product) or
        per tensor (one scale and zero point for the whole batch, the bias added by oneDNN: half the passes over
        memory; ``shared``: the quantised input kept for the other layers reading it). Which layers take which:
        ``SCHEME``. The ``torch._int_mm`` fallback is per token throughout."""

        def __init__(self, linear: Any, smooth: Any, per_token: bool = True, shared: SharedInput | None = None):
            super().__init__()
            weight = linear.weight.detach().float() * smooth
            scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
            quantised = torch.round(weight / scale[:, None]).to(torch.int8)
            if onednn:  # prepacked for any input shape: the encoder's shapes vary
                self.packed = torch.ops.onednn.qlinear_prepack(quantised, None)  # oneDNN's layout: not a buffer
                self.register_buffer("zero_points", torch.zeros(scale.shape[0], dtype=torch.long))
            else:
                self.packed = quantised.t().contiguous()
            self.register_buffer("weight_scale", scale)
            self.register_buffer("inv_smooth", 1 / smooth)
            bias = linear.bias.detach().float() if linear.bias is not None else torch.zeros(weight.shape[0])
            self.register_buffer("bias", bias)
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.per_token = per_token or not onednn
            self.shared = shared

        def forward(self, x: Any) -> Any:
            shape = x.shape
            out = self._per_token(x) if self.per_token else self._per_tensor(x)
            return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

        def _per_tensor(self, x: Any) -> Any:
            quantised = self.shared.get(x) if self.shared is not None else None
            if quantised is None:
                quantised = self._quantise_tensor(x.float().reshape(-1, x.shape[-1]))
                if self.shared is not None:
                    self.shared.put(x, quantised)
            u8, scale, zero_point = quantised
            return torch.ops.onednn.qlinear_pointwise(
                u8, scale, zero_point, self.packed, self.weight_scale, self.zero_points, self.bias,
                1.0, 0, torch.float32, "none", [], "",
            )  # fmt: skip

        def _quantise_tensor(self, rows: Any) -> tuple[Any, float, int]:
            """``rows / smooth`` as u8 with one scale and zero point: the range from per-channel extremes (the
            smoothing factors are positive, so the smoothed extremes are the extremes times them), then smoothing,
            scaling, shifting and rounding in one pass, without the smoothed copy."""
            high = max(float((rows.amax(dim=0) * self.inv_smooth).max()), 0.0)
            low = min(float((rows.amin(dim=0) * self.inv_smooth).min()), 0.0)
            scale = max(high - low, 1e-12) / 255
            zero_point = math.floor(-low / scale)  # floor, not round: low lands in [0, 1), high below 256
            shifted = (rows * (self.inv_smooth / scale)).add_(zero_point + 0.5)  # rows are the caller's: one copy
            return to_uint8(shifted), scale, zero_point  # the cast truncates: + 0.5 made it round

        def _per_token(self, x: Any) -> Any:
            rows = (x.float() * self.inv_smooth).reshape(-1, x.shape[-1])
            # max |x| per row from two plain reductions: far cheaper than abs() (a full copy) then amax
            largest = torch.maximum(rows.amax(dim=1), -rows.amin(dim=1)).clamp_(min=1e-12)
            scale = (largest / 127)[:, None]
            if onednn:  # unsigned with zero point 128: oneDNN has VNNI kernels for u8 x s8 only (s8 x s8 ran its
                # reference kernel, ~100x slower, with the ISA capped at AVX512_CORE_VNNI; AMX takes either)
                # in place on rows (this layer's own copy): a fresh tensor of a batch's activations costs more in
                # page faults than the arithmetic (addcmul into a new 47 MB tensor: 21 ms; in place: 2 ms)
                u8 = to_uint8(rows.mul_(1 / scale).add_(half))  # round(x / scale) + 128, in [1, 255]
                sums = torch.ops.onednn.qlinear_pointwise(
                    u8, 1.0, 128, self.packed, self.weight_scale, self.zero_points, None,
                    1.0, 0, torch.float32, "none", [], "",
                )  # fmt: skip
                return sums.mul_(scale).add_(self.bias)  # in place on oneDNN's fresh output
            s8 = torch.round(rows / scale).to(torch.int8)
            sums = torch._int_mm(s8, self.packed).float()
            return sums.mul_(scale * self.weight_scale).add_(self.bias)

    return Int8Linear


def _linears(model: Any, torch: Any) -> list[tuple[Any, str, str]]:
    """(parent module, attribute, full name) of each ``nn.Linear`` inside the transformer layers (the pooler and
    any head stay fp32: they are not what the encoder runs)."""
    out = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and ".layer." in f".{full}":
                out.append((module, child_name, full))
    return out


@dataclass
class Observed:
    """What the probe texts showed of each transformer linear layer: its largest absolute input per input channel
    (``ranges``), and the groups of layers of one parent that read the very same tensor on every call (``shared``:
    a self-attention's query, key and value)."""

    ranges: dict[str, Any]
    shared: list[list[str]]


def observe(model: Any, run: Callable[[], Any], torch: Any) -> Observed:
    """Run ``run`` (the fp32 model on the probe texts) and record what ``Observed`` holds."""
    ranges: dict[str, Any] = {}
    inputs_seen: dict[str, list[Any]] = {}
    parents: dict[str, list[str]] = {}
    hooks = []
    for parent, attribute, full in _linears(model, torch):
        parents.setdefault(full.rsplit(".", 1)[0], []).append(full)

        def seen(_module: Any, inputs: Any, _output: Any, full: str = full) -> None:
            x = inputs[0]
            inputs_seen.setdefault(full, []).append(x)  # the tensor itself: siblings are told by identity
            largest = x.float().reshape(-1, x.shape[-1]).abs().amax(dim=0)
            ranges[full] = torch.maximum(ranges[full], largest) if full in ranges else largest

        hooks.append(getattr(parent, attribute).register_forward_hook(seen))
    try:
        with torch.inference_mode():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    shared = []
    for names in parents.values():
        groups: list[list[str]] = []
        for name in names:
            calls = inputs_seen.get(name, [])
            for group in groups:
                other = inputs_seen[group[0]]
                if calls and len(calls) == len(other) and all(a is b for a, b in zip(calls, other, strict=True)):
                    group.append(name)
                    break
            else:
                groups.append([name])
        shared += [group for group in groups if len(group) > 1]
    return Observed(ranges, shared)


def quantise(model: Any, observed: Observed, torch: Any, layer: type | None = None) -> Any:
    """A copy of ``model`` with its transformer linear layers in int8. Each layer's smoothing factors come from its
    input range (``observed``) and its weights' (the largest over a group that shares its input, so the group
    quantises that input once, per tensor); every other layer quantises its input per token (``SCHEME``).
    ``layer``: the class each linear layer becomes, called as ``Int8Linear`` is (default
    ``int8_linear_class``'s; scripts/probe_int8_range.py passes one that emulates other bit widths)."""
    layer = layer or int8_linear_class(torch)
    quantised = copy.deepcopy(model)
    found = _linears(quantised, torch)
    group_of = {name: group for group in observed.shared for name in group}
    linears = {full: getattr(parent, attribute) for parent, attribute, full in found}
    shared = {id(group): SharedInput() for group in observed.shared}
    with torch.inference_mode(False), torch.no_grad():
        for parent, attribute, full in found:
            linear = linears[full]
            group = group_of.get(full, [full])
            weight_range = (
                torch.stack([linears[name].weight.detach().float().abs().amax(dim=0) for name in group])
                .amax(dim=0)
                .clamp(min=1e-5)
            )
            activation_range = (
                observed.ranges[full].float().clamp(min=1e-5)
                if full in observed.ranges
                else torch.ones_like(weight_range)
            )
            per_token = full not in group_of  # per tensor only where a group shares the input (SCHEME)
            smooth = (activation_range**SMOOTHING / weight_range ** (1 - SMOOTHING)).clamp(min=1e-5)
            setattr(parent, attribute, layer(linear, smooth, per_token, shared.get(id(group_of.get(full)))))
    return quantised.eval()
