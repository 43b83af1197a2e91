"""The rule by which label-free tuning (`tune --auto`) moves an index away from its current setting: only on
evidence that holds on every kind of pseudo-query, with confidence, by a margin, never to a kernel that centres the
vectors where the current setting does not, nor to one that whitens more strongly; otherwise it keeps what it has.

Pseudo-queries are made from the documents themselves (``pseudo``), so each kind rewards what it shares with
its documents (a sentence: their words and style); real queries share less. A candidate qualifies if, on each of
``AutoRule.kinds`` kinds (all of them by default), the lower confidence bound of its mean paired gain over the
current setting, query by query, exceeds ``margin`` (relative to the current score). The bound is the normal
approximation of the paired mean difference: ``mean - z * standard error``. Of the candidates that qualify, the
gentlest is taken (``prefer``): no whitening, then more dimensions, then a smaller gamma, as ``tune.pick_one_se``
orders them; the size of a pseudo-query gain says little about the real one (the strongest whitenings win
pseudo-queries by the most and lose real queries the most). A kernel that centres (subtracts the documents' mean)
is not a candidate from an uncentred setting unless ``centre``: pseudo-queries share the documents' mean and real
queries do not, so they cannot judge it. Nor is a kernel with a larger gamma than the current one (than
``DEFAULT_GAMMA`` where it does not whiten) unless ``stronger``: pseudo-queries share their documents' words, and
reward stronger whitening than real queries can use. The full-dimension re-scorer is decided the same way, against the
current scorer (raw cosine unless ``tune`` chose otherwise before), with its own margin. The constants were
chosen by leave-one-collection-out over four IR collections and two models (scripts/loo_tune.py,
docs/benchmarks/tuning.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from retrieval.whitening import DEFAULT_GAMMA, TransformSpec

# What scripts/loo_tune.py chose on all four collections and both models (the best worst case of its grid, then the
# most demanding bar; every measured case meets every target, docs/benchmarks/tuning.md): a mean gain of 0.5% on
# every kind, the gentlest such candidate, never a centring kernel from an uncentred setting nor a stronger
# whitening. The size of a pseudo-query gain does not separate real gains from false ones (NPL's false gains under
# full-rank whitening are larger than SciFact's real ones), so no bar alone is safe; what separates them is the kind
# of move: centring on the documents' mean (on NPL centring alone cost real queries 5.6% while pseudo-queries saw
# none) and raising gamma
MARGIN = 0.005
SCORER_MARGIN = 0.2  # the re-scorer's candidates are full-rank, so centred: moot unless `centre`
Z = 0.0  # the point estimate: at every kind's 99% bound SciFact's real gain (+0.9%) is not found
KINDS_REQUIRED: int | None = None  # every kind
PREFERENCES = ("gentlest", "strongest")
PREFER = "gentlest"
# Never a kernel that whitens more strongly than the current one (or than DEFAULT_GAMMA from raw vectors): every move
# of the grid that lost real queries beyond the targets raised gamma (CISI from --dim 128 to gamma 0.5, NPL's to
# 0.5 and 1), and pseudo-queries, sharing their documents' words, reward stronger whitening than real queries use
STRONGER = False


@dataclass(frozen=True)
class AutoRule:
    """``margin``: the relative gain over the current setting that the lower confidence bound must exceed on each
    required kind (``scorer_margin`` for the re-scorer); ``z``: the one-sided normal quantile of that bound
    (1.645: 95%); ``kinds``: how many kinds must agree (None: every kind measured); ``prefer``: of the
    candidates that qualify, the "gentlest" or the "strongest" (the highest bound on its weakest required kind);
    ``centre``: whether a kernel that centres may replace a setting that does not; ``stronger``: whether a kernel
    may whiten more strongly (a larger gamma) than the current setting does, or than ``DEFAULT_GAMMA`` from a
    setting that does not whiten."""

    margin: float = MARGIN
    scorer_margin: float = SCORER_MARGIN
    z: float = Z
    kinds: int | None = KINDS_REQUIRED
    prefer: str = PREFER
    centre: bool = False
    stronger: bool = STRONGER

    def __post_init__(self) -> None:
        if self.prefer not in PREFERENCES:
            raise ValueError(f"unknown preference {self.prefer!r}; choose one of {', '.join(PREFERENCES)}")

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
    qualified: int = 0  # candidates that cleared the bar (the chosen one among them)
    refused: int = 0  # candidates not measured against it because they centre and it does not
    capped: int = 0  # candidates not measured against it because they whiten more strongly than the rule allows

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
        sure = "on average" if self.rule.z == 0 else f"at {self.rule.confidence:.0%} confidence"
        bar = f"by more than {margin:.1%} {sure} on {every} ({', '.join(kinds)})"
        evidence = ", ".join(e.text() for e in self.evidence)
        why = []
        if self.refused:
            why.append(
                f"{self.refused} that centre the vectors were not considered: pseudo-queries, drawn from the "
                "documents, share their mean and real queries do not"
            )
        if self.capped:
            ceiling = max(strength(self.current), DEFAULT_GAMMA)
            why.append(
                f"{self.capped} that whiten more strongly than gamma {ceiling:g} were not considered: pseudo-queries "
                "share their documents' words and reward stronger whitening than real queries can use"
            )
        refused = f" ({'; '.join(why)})" if why else ""
        if self.challenger is None:
            out = [f"{self.what}: kept {self.current.label}: no candidate may replace it{refused}"]
        elif self.kept:
            out = [f"{self.what}: kept {self.current.label}: no candidate beat it {bar}{refused}"]
            out.append(f"  the closest, {self.challenger.label}: {evidence}")
        else:
            which = "it" if self.qualified == 1 else f"the gentlest of {self.qualified} that"
            if self.qualified > 1 and self.rule.prefer == "strongest":
                which = f"the surest of {self.qualified} that"
            out = [
                f"{self.what}: {self.current.label} -> {self.chosen.label}: {which} beat the current setting {bar}: "
                f"{evidence}; sure at {self.confidence:.1%} on its weakest kind{refused}"
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
            "qualified": self.qualified,
            "refused": self.refused,
            "capped": self.capped,
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


def gentleness(spec: TransformSpec) -> tuple[bool, int, float]:
    """Smaller: gentler (no whitening, then more dimensions, then a smaller gamma), as ``tune.pick_one_se``."""
    return (bool(spec.whiten), -(spec.dim or 0), spec.gamma or 0.0)


def strength(spec: TransformSpec) -> float:
    """How strongly ``spec`` whitens: its gamma (0 for raw vectors and a plain rotation)."""
    return float(spec.gamma or 0.0) if spec.whiten else 0.0


def centres(spec: TransformSpec, current: TransformSpec, rule: AutoRule) -> bool:
    """Whether ``spec`` is refused as a kernel that centres where ``current`` does not (unless ``rule.centre``)."""
    return not rule.centre and bool(spec.center) and not current.center


def stronger(spec: TransformSpec, current: TransformSpec, rule: AutoRule) -> bool:
    """Whether ``spec`` is refused as whitening more strongly than ``current``, or than the default gamma where
    ``current`` does not whiten (unless ``rule.stronger``)."""
    return not rule.stronger and strength(spec) > max(strength(current), DEFAULT_GAMMA) + 1e-9


def verdict(
    what: str, scores: Scores, current: TransformSpec, pool: Sequence[TransformSpec], rule: AutoRule
) -> Verdict:
    """Keep ``current`` or move to one of ``pool`` (which may include it) by ``rule``'s ``margin`` (the re-scorer:
    ``scorer_margin``); the challenger reported is the one taken, or else the closest to qualifying."""
    margin = rule.scorer_margin if what == "re-scorer" else rule.margin
    kinds = list(scores)
    if not kinds:
        raise ValueError("no kind of pseudo-query was measured")
    for kind in kinds:
        if current not in scores[kind]:
            raise ValueError(f"{kind}: the current setting {current.label} was not measured")
    need = rule.required(len(kinds))
    measured: list[tuple[float, TransformSpec, tuple[Evidence, ...]]] = []
    refused = capped = 0
    for spec in dict.fromkeys(pool):
        if spec == current:
            continue
        if centres(spec, current, rule):
            refused += 1
            continue
        if stronger(spec, current, rule):
            capped += 1
            continue
        found = tuple(evidence(k, scores[k][current], scores[k][spec], rule.z) for k in kinds)
        lows = sorted((e.low for e in found), reverse=True)
        measured.append((lows[need - 1], spec, found))  # the bound on the weakest of the kinds that must agree
    qualified = [m for m in measured if m[0] > margin]
    taken = None  # max and min keep the first of equals: the pool's order
    if qualified:
        gentlest = rule.prefer == "gentlest"
        taken = min(qualified, key=lambda m: gentleness(m[1])) if gentlest else max(qualified, key=lambda m: m[0])
    elif measured:
        taken = max(measured, key=lambda m: m[0])
    winners = tuple((k, max(dict.fromkeys([current, *pool]), key=lambda s: float(scores[k][s].mean()))) for k in kinds)
    if taken is None:
        return Verdict(what, current, current, None, (), winners, rule, 0, refused, capped)
    chosen = taken[1] if qualified else current
    return Verdict(what, current, chosen, taken[1], taken[2], winners, rule, len(qualified), refused, capped)


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
