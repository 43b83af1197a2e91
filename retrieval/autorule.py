"""The rule by which label-free tuning (`tune --auto`) moves an index away from its current setting: only on
evidence that holds on every kind of pseudo-query, with confidence, by a margin; otherwise it keeps what it has.

Pseudo-queries are made from the documents themselves (``pseudo``), so each kind rewards what it shares with
its documents (a sentence: their words and style); real queries share less. A candidate replaces the current
setting only if, on each of ``AutoRule.kinds`` kinds (all of them by default), the lower confidence bound of its
mean paired gain over the current setting, query by query, exceeds ``margin`` (relative to the current score).
The bound is the normal approximation of the paired mean difference: ``mean - z * standard error``. Among the
candidates that qualify, the one whose weakest kind's bound is highest wins. The full-dimension re-scorer is
decided the same way, against the current scorer (raw cosine unless ``tune`` chose otherwise before), with its
own, larger margin. The constants were chosen by leave-one-collection-out over four IR collections and two
models (scripts/loo_tune.py, docs/benchmarks/tuning.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from retrieval.whitening import TransformSpec

# What scripts/loo_tune.py's leave-one-collection-out chose (every target met on the other collections, then the
# most demanding bar): the most demanding corner of its grid. On NPL every kind of pseudo-query favours whitening
# (full-rank gamma 0.75: +11 to +18%) that its real queries lose 6% to, while on CISI and CACM real queries gain
# 4 to 9% from whitening the pseudo-queries favour less; no bar of the grid takes the latter and refuses the
# former, so only a large, sure gain moves an index (docs/benchmarks/tuning.md)
MARGIN = 0.2
SCORER_MARGIN = 0.2
Z = 2.326  # one-sided 99%


@dataclass(frozen=True)
class AutoRule:
    """``margin``: the relative gain over the current setting that the lower confidence bound must exceed on each
    required kind (``scorer_margin`` for the re-scorer); ``z``: the one-sided normal quantile of that bound
    (1.645: 95%); ``kinds``: how many kinds must agree (None: every kind measured)."""

    margin: float = MARGIN
    scorer_margin: float = SCORER_MARGIN
    z: float = Z
    kinds: int | None = None

    def required(self, measured: int) -> int:
        return measured if self.kinds is None else min(self.kinds, measured)

    @property
    def confidence(self) -> float:
        return normal_cdf(self.z)


DEFAULT_RULE = AutoRule()


@dataclass(frozen=True)
class Evidence:
    """One candidate against the current setting on one kind of pseudo-query: mean scores, relative mean gain,
    its lower confidence bound, and the one-sided confidence that the gain is positive."""

    kind: str
    n: int
    current: float
    candidate: float
    gain: float
    low: float
    confidence: float

    def text(self) -> str:
        return f"{self.kind} {self.gain:+.1%} (sure at {self.confidence:.0%})"


@dataclass(frozen=True)
class Verdict:
    """One decision (the index's transform, or its re-scorer): what was current, what is chosen, the strongest
    challenger with its evidence per kind, and the best candidate of each kind on its own."""

    what: str
    current: TransformSpec
    chosen: TransformSpec
    challenger: TransformSpec | None
    evidence: tuple[Evidence, ...]
    winners: tuple[tuple[str, TransformSpec], ...]
    rule: AutoRule

    @property
    def kept(self) -> bool:
        return self.chosen == self.current

    @property
    def confidence(self) -> float:
        """The challenger's confidence on its weakest kind (0 without a challenger)."""
        return min((e.confidence for e in self.evidence), default=0.0)

    def lines(self) -> list[str]:
        """What a user reads: kept or changed, how sure, and which candidate won on which kind."""
        margin = self.rule.scorer_margin if self.what == "re-scorer" else self.rule.margin
        kinds = [e.kind for e in self.evidence]
        need = self.rule.required(len(kinds))
        every = "every kind" if need == len(kinds) else f"{need} of {len(kinds)} kinds"
        bar = f"by more than {margin:.1%} at {self.rule.confidence:.0%} confidence on {every} ({', '.join(kinds)})"
        evidence = ", ".join(e.text() for e in self.evidence)
        if self.kept:
            out = [f"{self.what}: kept {self.current.label}: no candidate beat it {bar}"]
            if self.challenger is not None:
                out.append(f"  the closest, {self.challenger.label}: {evidence}")
        else:
            out = [
                f"{self.what}: {self.current.label} -> {self.chosen.label}: it beat the current setting {bar}: "
                f"{evidence}; sure at {self.confidence:.1%} on its weakest kind"
            ]
        out.append("  best on each kind alone: " + ", ".join(f"{k}: {s.label}" for k, s in self.winners))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "current": self.current.label,
            "chosen": self.chosen.label,
            "kept": self.kept,
            "challenger": self.challenger.label if self.challenger else None,
            "confidence": self.confidence,
            "evidence": [asdict(e) for e in self.evidence],
            "winners": {k: s.label for k, s in self.winners},
        }


@dataclass(frozen=True)
class Decision:
    transform: Verdict
    scorer: Verdict

    @property
    def kept(self) -> bool:
        return self.transform.kept and self.scorer.kept

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": asdict(self.transform.rule),
            "transform": self.transform.to_dict(),
            "scorer": self.scorer.to_dict(),
        }

    def lines(self) -> list[str]:
        out = self.transform.lines() + self.scorer.lines()
        if self.kept:
            out.append("the index's current setting is kept: --apply changes nothing")
        return out


Scores = Mapping[str, Mapping[TransformSpec, np.ndarray]]  # kind -> candidate -> per-query metric (same order)


def normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def evidence(kind: str, current: np.ndarray, candidate: np.ndarray, z: float) -> Evidence:
    """``candidate`` against ``current``, paired query by query."""
    if current.shape != candidate.shape or current.ndim != 1 or len(current) < 2:
        raise ValueError(f"{kind}: paired per-query scores of one length (at least 2) expected")
    diff = candidate.astype(np.float64) - current.astype(np.float64)
    mean, se = float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(len(diff)))
    base = max(float(current.mean()), 1e-12)
    confidence = normal_cdf(mean / se) if se > 0 else (1.0 if mean > 0 else 0.5 if mean == 0 else 0.0)
    return Evidence(
        kind, len(diff), float(current.mean()), float(candidate.mean()), mean / base, (mean - z * se) / base, confidence
    )


def verdict(
    what: str, scores: Scores, current: TransformSpec, pool: Sequence[TransformSpec], rule: AutoRule
) -> Verdict:
    """Keep ``current`` or move to one of ``pool`` (which may include it) by ``rule``'s ``margin`` (the re-scorer:
    ``scorer_margin``)."""
    margin = rule.scorer_margin if what == "re-scorer" else rule.margin
    kinds = list(scores)
    if not kinds:
        raise ValueError("no kind of pseudo-query was measured")
    for kind in kinds:
        if current not in scores[kind]:
            raise ValueError(f"{kind}: the current setting {current.label} was not measured")
    need = rule.required(len(kinds))
    best: tuple[float, TransformSpec, tuple[Evidence, ...]] | None = None
    chosen = current
    chosen_key = -math.inf
    for spec in dict.fromkeys(pool):
        if spec == current:
            continue
        found = tuple(evidence(k, scores[k][current], scores[k][spec], rule.z) for k in kinds)
        lows = sorted((e.low for e in found), reverse=True)
        key = lows[need - 1]  # the bound on the weakest of the kinds that must agree
        if best is None or key > best[0]:
            best = (key, spec, found)
        if key > margin and key > chosen_key:
            chosen, chosen_key = spec, key
    winners = tuple((k, max(dict.fromkeys([current, *pool]), key=lambda s: float(scores[k][s].mean()))) for k in kinds)
    challenger, found = (best[1], best[2]) if best else (None, ())
    return Verdict(what, current, chosen, challenger, found, winners, rule)


def decide(
    scores: Scores,
    current: TransformSpec,
    current_scorer: TransformSpec,
    d: int,
    rule: AutoRule = DEFAULT_RULE,
) -> Decision:
    """The transform (from every candidate measured) and the full-dimension re-scorer (from the full-dimension
    candidates of the chosen transform's pooling; against the current scorer, or raw cosine where the pooling
    changed). Specs are compared resolved (``TransformSpec.resolve(d)``), as the sweep's candidates are."""
    kinds = list(scores)
    pool = list(next(iter(scores.values()))) if kinds else []
    transform = verdict("transform", scores, current, pool, rule)
    pooling = transform.chosen.pooling
    baseline = current_scorer if current_scorer.pooling == pooling else TransformSpec.raw(pooling).resolve(d)
    full = [s for s in pool if s.pooling == pooling and s.dim == d]
    return Decision(transform, verdict("re-scorer", scores, baseline, full, rule))
