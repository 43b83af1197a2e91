"""The traced single-text model: the first and last layers of a model traced on an unpadded example and optimised
for inference, in fp32 and (unless precision is fp32) under bf16 autocast, each checked against the eager fp32
model at two lengths (fp32 to 1e-4; bf16 to BF16_MIN_COSINE on every pooling), which catches a model whose code
bakes the example's length into the trace. Of those that pass, the faster here is kept (``timing.policy``, site
``trace``; fp32 when the policy is deterministic)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from retrieval import timing
from retrieval.encode.pooling import first_and_last_layer
from retrieval.encode.precision import agree

log = logging.getLogger(__name__)


def trace(model: Any, tokenizer: Any, max_length: int, bf16_options: Sequence[bool], torch: Any) -> Any:
    """The single-text model as ``(module, bf16)``, or False to keep the eager model; ``bf16_options``: which
    autocast settings are tried."""
    example = tokenizer(["the trace example text"], return_tensors="pt")["input_ids"]
    longer = torch.cat([example[:, :-1], example[:, 1:-1].repeat(1, 4), example[:, -1:]], dim=1)
    lengths = (example, longer[:, :max_length])
    ends = first_and_last_layer(model, torch).eval()
    # torch.jit.trace asks every module for every attribute (hasattr), and a transformers model's
    # ``loss_function`` answers with a warning: "`loss_type=None` was set in the config but it is
    # unrecognized", printed by every server start. Quiet for the trace only.
    quiet = logging.getLogger("transformers.modeling_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        passed = _candidates(ends, example, lengths, bf16_options, torch)
    finally:
        quiet.setLevel(level)
    if not passed:
        log.info("no trace agrees with the eager model: single texts run on the eager model")
        return False
    if len(passed) == 1:
        return passed[0]
    traces = {"bf16" if bf16 else "fp32": (traced, bf16) for traced, bf16 in passed}

    def timed(candidate: tuple[Any, bool]) -> Any:
        traced, bf16 = candidate

        def run() -> None:
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                traced(lengths[1])

        return run

    ways = {name: timed(candidate) for name, candidate in traces.items()}
    return traces[timing.policy().fastest("trace", ways, default="fp32", rounds=5, warm_up=1)]


def _candidates(
    ends: Any, example: Any, lengths: tuple[Any, Any], bf16_options: Sequence[bool], torch: Any
) -> list[tuple[Any, bool]]:
    """The traces that agree with the eager fp32 model at both lengths."""
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
            if all(agree(a, b, bf16, torch) for a, b in zip(expected, got, strict=True)):
                passed.append((traced, bf16))
    return passed
