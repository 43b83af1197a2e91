"""Choosing the constants of `tune --auto`'s rule (retrieval/autorule.py) by leave-one-collection-out.

For every IR collection in the shared data (SciFact, CISI, CACM, NPL) and model, once: the corpus is indexed raw
with its stash kept (under --work, never committed), `tune_auto` measures every candidate on every kind of
pseudo-query (the library's own sweep, default grid and AUTO_QUERIES of each kind), and every candidate, and
every reduced candidate re-scored at the default depth by every full-dimension scorer, is scored on the real
queries (nDCG@10, exact search). Those measurements are cached as JSON beside the indexes.

Then, for each collection left out: every rule of a grid (margin, re-scorer margin, z, kinds required, preference,
centring, a cap on gamma) decides, from the pseudo-queries alone, what `tune --auto --apply` would do to two
starting indexes: the default `retrieval index` (raw, full dimension) and `--dim d/3` (gamma 0.3, re-scored by raw
cosine at depth 50). A rule
is chosen on the other collections x both models x both starts (every target met there, then the highest mean
nDCG@10 after re-scoring, then the more cautious) and tested on the one left out. The targets, per case: after
tuning at least 99.5% of the index before (each with its default re-scoring) and at least 99% before re-scoring;
on SciFact, from the raw start, the test nDCG@10 within 0.5% of the train-qrels choice (`tune_index`'s ``pick``).

    python scripts/loo_tune.py                  # both models, every collection; writes results/tune-loo/
    python scripts/loo_tune.py --models all-MiniLM-L6-v2 --measure-only   # one model's measurements only

Encoding (the first run) goes through the index build and the pseudo-queries: run it under the shared benchmark
lock where other jobs time things.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import basket  # noqa: E402
import benchlib  # noqa: E402

from retrieval.autorule import AutoRule, decide  # noqa: E402
from retrieval.build import BuildOptions, build_index  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.encode.transformer import from_info  # noqa: E402
from retrieval.evaluate import read_qrels, read_queries  # noqa: E402
from retrieval.indexdir import IndexDir  # noqa: E402
from retrieval.manifest import RESCORE_DEPTH
from retrieval.tune import AUTO_QUERIES, choose, pick, pick_one_se, tune_auto  # noqa: E402
from retrieval.whitening import DEFAULT_GAMMA, TransformSpec  # noqa: E402

COLLECTIONS = ("scifact", "cisi", "cacm", "npl")
TARGET_AFTER, TARGET_BEFORE, TARGET_SCIFACT = 0.995, 0.99, 0.995
MARGINS = (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2)
SCORER_MARGINS = (0.0, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2)
ZS = (0.0, 1.0, 1.645, 2.326)
KINDS_REQUIRED = (None, 2)  # every kind, or two of the three
PREFERENCES = ("gentlest", "strongest")
CENTRE = (False, True)
STRONGER = (False, True)  # whether a kernel may whiten more strongly than the start (or the default gamma)
# the rule shipped before the gentlest / no-centring choice: 20% at 99% on every kind, the strongest candidate
PREVIOUS_RULE = AutoRule(0.2, 0.2, 2.326, None, "strongest", True, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(basket.MODELS))
    parser.add_argument("--collections", default=",".join(COLLECTIONS))
    parser.add_argument("--data", type=Path, default=basket.DATA, help="the shared evaluation data")
    parser.add_argument("--work", type=Path, default=basket.ROOT / "indexes" / "tune-loo")
    parser.add_argument("--queries", type=int, default=AUTO_QUERIES, help="pseudo-queries of each kind")
    parser.add_argument("--measure-only", action="store_true")
    parser.add_argument(
        "--skip-missing", action="store_true", help="leave out (and name) what is not measured yet: nothing encoded"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: results/tune-loo")
    args = parser.parse_args()
    models, collections = args.models.split(","), args.collections.split(",")
    pairs = [(m, c) for m in models for c in collections]
    missing = [p for p in pairs if args.skip_missing and not cache_path(args.work, *p, args.queries).is_file()]
    measured = {p: measure(args.data, args.work, *p, args.queries) for p in pairs if p not in missing}
    if args.measure_only:
        return
    report = loo(measured, collections)
    report |= {"command": benchlib.command_line(), "machine": benchlib.machine(), "queries_per_kind": args.queries}
    report["not_measured"] = [f"{m} on {c}" for m, c in missing]
    out = args.out or benchlib.out_dir("tune-loo")
    out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(out / "loo.json", report)
    (out / "loo.md").write_text(markdown(report))
    print(markdown(report))


# ----- measuring ----------------------------------------------------------------------------------------------
def measure(data: Path, work: Path, model: str, collection: str, n: int) -> dict[str, Any]:
    """Pseudo-query scores per kind and candidate, real-query nDCG@10 per candidate and re-scored pair: cached."""
    cache = cache_path(work, model, collection, n)
    if cache.is_file():
        return dict(json.loads(cache.read_text()))
    directory = work / f"{collection}-{model.lower()}"
    if not (directory / "manifest.json").is_file():
        print(f"indexing {collection} with {model}...", file=sys.stderr)
        spec = CorpusSpec(data / collection / "corpus.parquet", id_column="doc_id", title_column="title")
        encoder = from_info(_encoder_info(model))
        build_index(spec, encoder, directory, TransformSpec.raw(), options=BuildOptions(overwrite=True))
    index = IndexDir(directory)
    encoder = from_info(index.manifest().encoder)
    print(f"pseudo-queries of {collection} with {model}...", file=sys.stderr)
    result = tune_auto(directory, n, 0, encoder=encoder)
    assert result.decision is not None
    d = index.stash().dim
    grid = [t.candidate for t in result.trials]
    kinds = list(result.kind_scores)
    pseudo = {
        k: {key(s): [float(v) for v in per_query] for s, per_query in result.kind_scores[k].items()} for k in kinds
    }
    ids, docs, moments = basket.stash_corpus(directory)
    real = {}
    for split in ("test", "train") if collection == "scifact" else ("test",):
        queries = read_queries(data / collection / f"queries-{split}.parquet")
        qrels = read_qrels(data / collection / f"qrels-{split}.parquet")
        vectors = encoder.encode_poolings(queries.texts, ["mean"])
        task = basket.IrTask(f"{collection} {split}", model, ids, docs, moments, queries, qrels, vectors)
        real[split] = _real_scores(task, grid, d)
    out = {"model": model, "collection": collection, "d": d, "kinds": kinds, "pseudo": pseudo, "real": real}
    out["grid"] = [asdict(s) for s in grid]
    cache.write_text(json.dumps(out))
    return out


def cache_path(work: Path, model: str, collection: str, n: int) -> Path:
    return work / f"{collection}-{model.lower()}-q{n}.json"


def _encoder_info(model: str) -> Any:
    from retrieval.encode.spec import EncoderSpec

    return EncoderSpec(model, "mean").load().info()


def _real_scores(task: basket.IrTask, grid: list[TransformSpec], d: int) -> dict[str, float]:
    """nDCG@10 of each candidate as indexed (exact search), and of each reduced one's top RESCORE_DEPTH re-scored
    by each full-dimension one, as `search` re-scores; each transform applied once."""
    out = {}
    full = {}
    tops = {}
    for spec in grid:
        transform = task.fit(spec)
        docs, queries = transform.transform(task.docs["mean"]), transform.transform(task.query_vectors["mean"])
        if spec.dim == d:
            full[spec] = (docs, queries)
        tops[spec] = top = task.ranking(spec) if spec.dim == d else _ranking(queries @ docs.T)
        out[key(spec)] = task.result(top).metrics["nDCG@10"]
    for spec, top in tops.items():
        if spec.dim == d:
            continue
        for scorer, (docs, queries) in full.items():
            rows = top.copy()
            for i in range(len(rows)):
                candidates = top[i, :RESCORE_DEPTH]
                rows[i, :RESCORE_DEPTH] = candidates[np.argsort(-(docs[candidates] @ queries[i]), kind="stable")]
            out[f"{key(spec)} | {key(scorer)}"] = task.result(rows).metrics["nDCG@10"]
    return out


def _ranking(scores: np.ndarray, depth: int = 100) -> np.ndarray:
    depth = min(depth, scores.shape[1])
    top = np.argpartition(-scores, depth - 1, axis=1)[:, :depth]
    order = np.take_along_axis(scores, top, axis=1).argsort(axis=1, kind="stable")[:, ::-1]
    return np.take_along_axis(top, order, axis=1)


def key(spec: TransformSpec) -> str:
    return spec.label


# ----- the rules ----------------------------------------------------------------------------------------------
def rules() -> list[AutoRule]:
    grid = itertools.product(MARGINS, SCORER_MARGINS, ZS, KINDS_REQUIRED, PREFERENCES, CENTRE, STRONGER)
    return [AutoRule(*values) for values in grid]


def starts(d: int) -> dict[str, tuple[TransformSpec, TransformSpec]]:
    """(transform, re-scorer) of the indexes tuned: the default build, and `--dim d/3`."""
    raw = TransformSpec.raw("mean").resolve(d)
    reduced = TransformSpec(dim=d // 3, gamma=DEFAULT_GAMMA, pooling="mean").resolve(d)
    return {"raw": (raw, raw), f"k={d // 3}": (reduced, raw)}


def served(real: dict[str, float], transform: TransformSpec, scorer: TransformSpec, d: int) -> tuple[float, float]:
    """(nDCG@10 as indexed, as served: re-scored at the default depth when the index is reduced)."""
    before = real[key(transform)]
    return before, before if transform.dim == d else real[f"{key(transform)} | {key(scorer)}"]


def outcome(m: dict[str, Any], rule: AutoRule | None) -> list[dict[str, Any]]:
    """What `tune --auto --apply` with ``rule`` (None: the rule before this one) does to each start, measured on
    the real test queries."""
    d, grid = m["d"], [TransformSpec(**s) for s in m["grid"]]
    scores = {k: {s: np.asarray(m["pseudo"][k][key(s)]) for s in grid} for k in m["kinds"]}
    real = m["real"]["test"]
    rows = []
    for name, (transform, scorer) in starts(d).items():
        if rule is None:
            chosen, chosen_scorer = _old_rule(scores["sentence"], grid, d)
            confidence = None
        else:
            decision = decide(scores, transform, scorer, d, rule)
            chosen, chosen_scorer = decision.transform.chosen, decision.scorer.chosen
            confidence = decision.transform.confidence
        old_before, old_served = served(real, transform, scorer, d)
        new_before, new_served = served(real, chosen, chosen_scorer, d)
        row = {
            "model": m["model"],
            "collection": m["collection"],
            "start": name,
            "chosen": chosen.label,
            "scorer": chosen_scorer.label,
            "kept": (chosen, chosen_scorer) == (transform, scorer),
            "confidence": confidence,
            "before": old_before,
            "after": new_before,
            "served_before": old_served,
            "served_after": new_served,
            "ratio_before_rescoring": new_before / old_before,
            "ratio_served": new_served / old_served,
        }
        if "train" in m["real"] and name == "raw":  # SciFact: against the train-qrels choice, test as indexed
            train = m["real"]["train"]
            labelled = max(grid, key=lambda s: (round(train[key(s)], 6), -(s.dim or 0), not s.whiten))
            row["labelled"] = labelled.label
            row["ratio_labelled"] = new_before / real[key(labelled)]
        rows.append(row)
    return rows


def _old_rule(sentence: dict[TransformSpec, np.ndarray], grid: list[TransformSpec], d: int) -> tuple[Any, Any]:
    """What `tune --auto` chose before: the one-SE rule on sentence pseudo-queries, the best full-rank scorer."""
    from retrieval.tune import Trial

    trials = [Trial(s, {"nDCG@10": float(v.mean())}, dev_per_query=v) for s, v in sentence.items()]
    result = choose(trials, "nDCG@10", pick_one_se)
    full = [t for t in trials if t.candidate.dim == d]
    return result.best.candidate, pick(full, "nDCG@10").candidate


def slack(row: dict[str, Any]) -> float:
    """How far a case is from failing its targets (negative: failed)."""
    out = min(row["ratio_served"] - TARGET_AFTER, row["ratio_before_rescoring"] - TARGET_BEFORE)
    return min(out, row["ratio_labelled"] - TARGET_SCIFACT) if "ratio_labelled" in row else out


def caution(rule: AutoRule) -> tuple[float, ...]:
    """Larger: harder to move: no centring, no stronger whitening, the gentlest candidate, every kind required (a
    rule that takes what one kind says loses repeats the issue's failure), then the margins and z."""
    return (
        not rule.centre,
        not rule.stronger,
        rule.prefer == "gentlest",
        rule.kinds is None,
        rule.margin,
        rule.scorer_margin,
        rule.z,
    )


def principled(rule: AutoRule) -> bool:
    """The rule's form fixed by argument before any data, as `tune --auto` ships it: no centring of an uncentred
    index (pseudo-queries share the documents' mean, so they cannot judge it), the gentlest qualifying candidate,
    every kind in agreement, no stronger whitening than the start's (pseudo-queries reward more whitening than
    real queries use). Only the constants (margins, z) are left to the data."""
    return not rule.centre and not rule.stronger and rule.prefer == "gentlest" and rule.kinds is None


def score(rows: list[dict[str, Any]], rule: AutoRule, objective: str = "cautious") -> tuple[Any, ...]:
    """How a rule did on ``rows``: every target met first (else the worst case's slack); then "cautious": the most
    demanding bar (margin, re-scorer margin, z, every kind), a tuner that moves only when it must to meet the
    targets; "gainful": the highest mean nDCG@10 as indexed and as served (re-scoring by raw cosine hides much
    of what a reduced index gains), then the more cautious rule; or "principled": "gainful" among the rules of
    the shipped form only (``principled``), the others never chosen."""
    if objective == "principled" and not principled(rule):
        return (False, -1.0, caution(rule))
    worst = min(slack(x) for x in rows)
    if worst < 0:
        return (False, round(worst, 4), caution(rule))
    if objective == "cautious":
        return (True, caution(rule))
    gain = np.mean([x["ratio_served"] + x["ratio_before_rescoring"] for x in rows]) / 2
    return (True, round(float(gain), 4), caution(rule))


def loo(measured: dict[tuple[str, str], dict[str, Any]], collections: list[str]) -> dict[str, Any]:
    grid = rules()
    by_rule = {r: [row for m in measured.values() for row in outcome(m, r)] for r in grid}
    out: dict[str, Any] = {
        "targets": {"served": TARGET_AFTER, "before_rescoring": TARGET_BEFORE, "scifact_vs_labelled": TARGET_SCIFACT}
    }
    for objective in OBJECTIVES:
        folds = []
        for left_out in collections if len(collections) > 1 else ():
            train = {r: [x for x in rows if x["collection"] != left_out] for r, rows in by_rule.items()}
            chosen = max(grid, key=lambda r, train=train: score(train[r], r, objective))  # type: ignore[misc]
            test = [x for x in by_rule[chosen] if x["collection"] == left_out]
            folds.append({"left_out": left_out, "rule": asdict(chosen), "test": test})
        on_all = max(grid, key=lambda r: score(by_rule[r], r, objective))
        out[objective] = {"folds": folds, "chosen_on_all": asdict(on_all)}
    shipped = AutoRule()
    out["default_rule"] = asdict(shipped)
    out["default_rule_rows"] = by_rule.get(shipped) or [row for m in measured.values() for row in outcome(m, shipped)]
    out["previous_rule"] = asdict(PREVIOUS_RULE)
    out["previous_rule_rows"] = by_rule.get(PREVIOUS_RULE) or [
        row for m in measured.values() for row in outcome(m, PREVIOUS_RULE)
    ]
    out["old_rule_rows"] = [row for m in measured.values() for row in outcome(m, None)]
    return out


# ----- the report ---------------------------------------------------------------------------------------------
COLUMNS = [
    ("model", "model"),
    ("collection", "collection"),
    ("start", "index before"),
    ("chosen", "after tune --auto --apply"),
    ("scorer", "re-scorer"),
    ("ratio_before_rescoring", "% before re-scoring (>= 99%)"),
    ("ratio_served", "% as served (>= 99.5%)"),
    ("ratio_labelled", "SciFact: % of train-qrels choice (>= 99.5%)"),
]


def _pct(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("ratio_before_rescoring", "ratio_served", "ratio_labelled")
    return [r | {k: f"{r[k]:.2%}" for k in keys if k in r} for r in rows]


def markdown(report: dict[str, Any]) -> str:
    lines = ["# `tune --auto`: leave-one-collection-out", "", f"Command: `{report['command']}`", ""]
    lines += [benchlib.machine_md(report["machine"]), ""]
    if report.get("not_measured"):
        lines += [f"Not measured (not encoded): {', '.join(report['not_measured'])}.", ""]
    lines += [f"{report['queries_per_kind']} pseudo-queries of each kind; nDCG@10 on each collection's real test "]
    lines += ["queries; % = after tuning / before tuning (SciFact also: / the train-qrels choice, as indexed).", ""]
    for objective in OBJECTIVES:
        lines += [f"## Rules chosen on the other collections ({objective}: {OBJECTIVES[objective]})", ""]
        for fold in report[objective]["folds"]:
            lines += [f"{fold['left_out']} left out: {_rule(fold['rule'])}", ""]
            lines += [benchlib.md_table(_pct(fold["test"]), COLUMNS), ""]
        lines += [f"Chosen the same way on every collection: {_rule(report[objective]['chosen_on_all'])}.", ""]
    lines += [f"## The shipped rule ({_rule(report['default_rule'])}) on every collection", ""]
    lines += [benchlib.md_table(_pct(report["default_rule_rows"]), COLUMNS), ""]
    lines += [f"## The rule shipped before ({_rule(report['previous_rule'])}) on every collection", ""]
    lines += [benchlib.md_table(_pct(report["previous_rule_rows"]), COLUMNS), ""]
    lines += ["## The first rule (one-SE on sentence pseudo-queries, best full-rank re-scorer)", ""]
    lines += [benchlib.md_table(_pct(report["old_rule_rows"]), COLUMNS), ""]
    return "\n".join(lines)


OBJECTIVES = {
    "cautious": "every target met on them, then the most demanding bar",
    "gainful": "every target met on them, then the highest mean nDCG@10 as indexed and as served",
    "principled": "the shipped form (no centring, no stronger whitening, the gentlest candidate, every kind); of "
    "its constants, every "
    "target met on them, then the highest mean nDCG@10 as indexed and as served",
}


def _rule(rule: dict[str, Any]) -> str:
    return (
        f"margin {rule['margin']:.1%}, re-scorer margin {rule['scorer_margin']:.1%}, z {rule['z']}, "
        f"kinds {rule['kinds'] or 'all'}, {rule['prefer']}, {'centring allowed' if rule['centre'] else 'no centring'}, "
        f"{'any gamma' if rule.get('stronger', True) else 'no stronger whitening'}"
    )


if __name__ == "__main__":
    main()
