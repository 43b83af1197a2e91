"""Int8 linear layers: a copy of the model whose encoder ``nn.Linear`` layers multiply int8 by int8 into int32
(oneDNN's int8 matmul, with VNNI or AMX kernels where the CPU has them), for precision "int8".

Each layer's weight is quantised once, symmetric per output channel; each token's activations are quantised on
every call, symmetric per token (a batch's padding or one long outlier token cannot coarsen another token's
scale). Before quantising, SmoothQuant's per-input-channel factors ``s = max|x|^0.5 / max|w|^0.5`` move the
activations' outlier channels (BERT's layer-norm outputs have a few) into the weights: ``x W^T = (x / s)(W s)^T``.
``max|x|`` comes from a fixed set of probe texts run through the fp32 model when the copy is made.

Measured on all-MiniLM-L6-v2, 200 STS-B sentences and 40 SciFact passages against fp32 (min cosine of mean-pooled
vectors): torch's ``quantize_dynamic`` 0.900 (per-tensor weights; its x86 kernels quantise activations to 7 bits,
per tensor) and 0.963 (per-channel weights); per-token activations without smoothing 0.9948; with smoothing 0.9981.
scripts/bench_encode.py measures speed and quality on this model each run (docs/benchmarks/encode.md).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# SmoothQuant's migration strength: 0 leaves activations as they are, 1 moves all their range into the weights.
SMOOTHING = 0.5
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


def int8_linear_class(torch: Any) -> type:
    """The int8 linear layer (made here, so importing this module does not import torch)."""
    onednn = onednn_available(torch)

    class Int8Linear(torch.nn.Module):  # type: ignore[misc, name-defined]
        """``linear(x / smooth)`` in int8: weights per output channel, activations per token, int32 sums, by
        oneDNN's int8 matmul (``onednn.qlinear_pointwise``: VNNI or AMX kernels; weight scales applied in it,
        each token's scale after it), else ``torch._int_mm``."""

        def __init__(self, linear: Any, smooth: Any):
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

        def forward(self, x: Any) -> Any:
            shape = x.shape
            rows = (x.float() * self.inv_smooth).reshape(-1, shape[-1])
            scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            quantised = torch.round(rows / scale)
            if onednn:  # unsigned with zero point 128: oneDNN has VNNI kernels for u8 x s8 only (s8 x s8 ran its
                # reference kernel, ~100x slower, with the ISA capped at AVX512_CORE_VNNI; AMX takes either)
                sums = torch.ops.onednn.qlinear_pointwise(
                    (quantised + 128).to(torch.uint8),
                    1.0,
                    128,
                    self.packed,
                    self.weight_scale,
                    self.zero_points,
                    None,
                    1.0,
                    0,
                    torch.float32,
                    "none",
                    [],
                    "",
                )
                out = sums * scale + self.bias
            else:
                sums = torch._int_mm(quantised.to(torch.int8), self.packed).float()
                out = sums * (scale * self.weight_scale) + self.bias
            return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

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


def input_ranges(model: Any, run: Callable[[], Any], torch: Any) -> dict[str, Any]:
    """Each transformer linear layer's largest absolute input per input channel, over what ``run`` runs."""
    ranges: dict[str, Any] = {}
    hooks = []
    for parent, attribute, full in _linears(model, torch):

        def seen(_module: Any, inputs: Any, _output: Any, full: str = full) -> None:
            x = inputs[0].detach().float()
            largest = x.reshape(-1, x.shape[-1]).abs().amax(dim=0)
            ranges[full] = torch.maximum(ranges[full], largest) if full in ranges else largest

        hooks.append(getattr(parent, attribute).register_forward_hook(seen))
    try:
        with torch.inference_mode():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def quantise(model: Any, ranges: dict[str, Any], torch: Any) -> Any:
    """A copy of ``model`` with its transformer linear layers in int8 (``ranges``: ``input_ranges``'s)."""
    layer = int8_linear_class(torch)
    quantised = copy.deepcopy(model)
    with torch.inference_mode(False), torch.no_grad():
        for parent, attribute, full in _linears(quantised, torch):
            linear = getattr(parent, attribute)
            weight_range = linear.weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
            activation_range = ranges[full].clone().clamp(min=1e-5) if full in ranges else torch.ones_like(weight_range)
            smooth = (activation_range**SMOOTHING / weight_range ** (1 - SMOOTHING)).clamp(min=1e-5)
            setattr(parent, attribute, layer(linear, smooth))
    return quantised.eval()
