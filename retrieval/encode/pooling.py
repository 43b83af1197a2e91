"""Pooling token states into one vector per text (mean, cls, first-last-avg), padding never counted; and the
first and last layers' states of one unpadded text, what the traced single-text model returns."""

from __future__ import annotations

from typing import Any

from retrieval.encode.spec import POOLINGS
from retrieval.errors import ConfigError


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


def pool_one(pooling: str, first: Any, last: Any) -> Any:
    """One unpadded text's pooled vector from its first and last layer's token states."""
    return last[0] if pooling == "cls" else last.mean(0) if pooling == "mean" else (first + last).mean(0) / 2


def first_and_last_layer(model: Any, torch: Any) -> Any:
    """``model`` as a module of input ids alone (no padding) returning its first and last layer's token states."""

    class FirstAndLastLayer(torch.nn.Module):  # type: ignore[misc, name-defined]  # torch is imported lazily
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any) -> tuple[Any, Any]:
            states = self.model(input_ids=input_ids, output_hidden_states=True).hidden_states
            return states[1], states[-1]

    return FirstAndLastLayer()
