"""Quality on every shared set, per model: raw, the defaults, tuned with labels, tuned without labels.

Sets: SciFact test (nDCG@10; Recall@100 in the JSON), STS-B test, STS12-16 (Spearman x100, "all"; "wmean" in the
JSON). Columns:

* raw: mean pooling, L2-normalised, no transform;
* default: what ``retrieval index`` builds with no option;
* --dim d/3: the default transform at a third of the dimensions (``DEFAULT_GAMMA``); for SciFact also with the
  default re-scoring (the top ``RESCORE_DEPTH`` by raw cosine from the stash);
* tuned with labels: the ``tune`` grid (3 poolings x dims x gammas, raw included) chosen on SciFact train qrels,
  as ``--apply`` would leave the index (re-scored by the chosen full-dimension scorer when reduced); STS-B: chosen
  on STS-B dev; STS12-16 have no dev split: the STS-B dev choice, fitted on each year's sentences;
* tuned without labels: the same grid chosen on pseudo-queries as ``tune --auto`` chooses (AUTO_QUERIES sentences
  taken out of sampled documents, seed 0, the one-SE rule, as applied); STS: pseudo-queries made from the task's
  own sentences (no gold score).

Also: the label-free choice over many draws of pseudo-queries (how often it lands within 0.5% of the labelled
choice on SciFact test), SciFact by k for PCA / full whitening / the default kernel, and FAISS's PCAW against ours.
Every choice is made on dev or pseudo data, never on test; but STS12-16, reported here, are also dev tasks of
choose_defaults.py's basket: only SciFact test and STS-B test are held out. Data is encoded once per model and cached
(scripts/basket.py). Writes results/quality/quality.json and quality.md.

    python scripts/bench_quality.py                       # both models (mpnet: scripts/install_mpnet.sh)
    python scripts/bench_quality.py --models all-MiniLM-L6-v2
    python scripts/bench_quality.py --draw-models all-MiniLM-L6-v2   # the draws for MiniLM only
    python scripts/bench_quality.py --combine a/quality.json b/quality.json   # per-model runs as one report
    python scripts/bench_quality.py --one-se-dev --models all-MiniLM-L6-v2   # only: the pick rules on dev data

``--one-se-dev`` measures only the check of the label-free pick rules ("best" against the one-standard-error
rule) on dev data, never on a test split: SciFact train qrels, STS-B dev and STS12-16 (used as dev). Writes
one-se-dev.json and one-se-dev.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import basket  # noqa: E402
import benchlib  # noqa: E402

from retrieval.encode.models import resolve_model
from retrieval.encode.spec import POOLINGS
from retrieval.manifest import RESCORE_DEPTH
from retrieval.moments import RunningMoments
from retrieval.tune import (
    AUTO_QUERIES,
    DEFAULT_GAMMAS,
    Trial,
    TuneResult,
    candidates,
    choose,
    default_dims,
    pick,
    pick_one_se,
)
from retrieval.whitening import DEFAULT_CENTER_REDUCED, DEFAULT_GAMMA, TransformSpec, Whitening, l2_normalize

DRAWS = 40  # random draws of pseudo-queries from the pool, per size
POOL = 2000  # pseudo-queries encoded once per model for the draws
DRAW_SIZES = (300, 1000)  # a few hundred, and AUTO_QUERIES
TARGET = 0.995  # label-free within 0.5% of the labelled choice
RULES = ("best", "one-SE gentlest")  # how the label-free choice is picked from the pseudo-query scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(basket.MODELS))
    ap.add_argument("--out", type=Path, default=benchlib.RESULTS / "quality")
    ap.add_argument("--pool", type=int, default=POOL, help="pseudo-queries for the draws (0: skip the draws)")
    ap.add_argument(
        "--draw-models",
        default=",".join(basket.MODELS),
        help="models that get the draws (each encodes its own pool of pseudo-queries: mpnet's takes ~30 min here)",
    )
    ap.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        help="measure nothing: merge the models of these quality.json files (runs of one model each) into one report",
    )
    ap.add_argument(
        "--one-se-dev",
        action="store_true",
        help="measure only the pick rules on dev data (SciFact train, STS-B dev, STS12-16): one-se-dev.json/.md",
    )
    args = ap.parse_args()
    if args.combine:
        write(combine(args.combine), args.out)
        return
    if args.one_se_dev:
        one_se_dev_report(args.models.split(","), args.pool or POOL, args.out)
        return
    report: dict[str, Any] = {"machine": benchlib.machine(torch_too=True), "command": benchlib.command_line()}
    report["defaults"] = {"gamma": DEFAULT_GAMMA, "rescore_depth": RESCORE_DEPTH, "auto_queries": AUTO_QUERIES}
    report["defaults"]["center_reduced"] = DEFAULT_CENTER_REDUCED
    report["defaults"]["auto_rule"] = "one-SE gentlest (pick_one_se)"
    report["models"] = {}
    for model in args.models.split(","):
        if resolve_model(model) is None:
            print(f"skipping {model}: not installed (see DEVELOPERS.md)", file=sys.stderr)
            continue
        start = time.perf_counter()
        pool = args.pool if model in args.draw_models.split(",") else 0
        report["models"][model] = {"scifact": scifact(model, pool), "sts": sts(model)}
        report["models"][model]["seconds"] = round(time.perf_counter() - start, 1)
    write(report, args.out)


def write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(out / "quality.json", basket.jsonable(report))
    benchlib.write_md(out / "quality.md", markdown(report))
    print(markdown(report))


def combine(paths: list[Path]) -> dict[str, Any]:
    """One report from per-model runs made with the same defaults (refused otherwise): the first run's machine,
    every run's command."""
    reports = [json.loads(p.read_text()) for p in paths]
    same = [{k: v for k, v in r["defaults"].items() if k != "auto_rule"} for r in reports]  # the rule: per model
    if any(d != same[0] for d in same):
        raise SystemExit("these runs used different defaults: they do not belong in one table")
    models = {m: {"run": run_of(r), **res} for r in reports for m, res in r["models"].items()}
    command = "; ".join(r["command"] for r in reports) + f"; {benchlib.command_line()}"
    return {**reports[0], "command": command, "models": models}


def run_of(report: dict[str, Any]) -> dict[str, Any]:
    """Where a model's figures come from, for a combined report: its run's command, CPU and label-free rule."""
    rule = report["defaults"].get("auto_rule", "best (the rule before one-SE)")
    return {"command": report["command"], "cpu_flags": report["machine"].get("cpu_flags"), "auto_rule": rule}


def grid(d: int) -> list[TransformSpec]:
    """What ``retrieval tune`` sweeps by default: every pooling, raw and k x gamma."""
    return candidates(POOLINGS, default_dims(d), DEFAULT_GAMMAS, d)


def applied(task: basket.IrTask, result: TuneResult, dev: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The choice as ``tune --apply`` leaves the index: re-scored by its scorer at the default depth when reduced."""
    best = result.best.candidate
    d = task.dim
    depth = RESCORE_DEPTH if result.best.dim < d else 0
    scorer = result.scorer.candidate if result.scorer else None
    metrics = task.evaluate(best, (depth,), scorer)[depth]
    return {
        "choice": best.label,
        "scorer": scorer.label if scorer and depth else None,
        "rescore": depth,
        "dev": dev[best.label],
        "nDCG@10": metrics["nDCG@10"],
        "Recall@100": metrics["Recall@100"],
        "nDCG@10 unrescored": task.evaluate(best)[0]["nDCG@10"],
    }


# ----- SciFact ----------------------------------------------------------------------------------------------
def scifact(model: str, pool: int) -> dict[str, Any]:
    train, test = basket.scifact_task(model, "train"), basket.scifact_task(model, "test")
    d = test.dim
    specs = grid(d)
    print(f"{model}: SciFact, {len(specs)} candidates...", file=sys.stderr)
    on_test = {s.label: test.evaluate(s)[0] for s in specs}
    on_train = {s.label: train.evaluate(s)[0]["nDCG@10"] for s in specs}
    labelled = choose([Trial(s, dev={"nDCG@10": on_train[s.label]}) for s in specs], "nDCG@10")
    pseudo = basket.pseudo_task("scifact", model, AUTO_QUERIES, 0)  # the pseudo-queries `tune --auto` makes
    on_pseudo, auto = auto_choice(pseudo, specs)
    raw = on_test["mean raw"]
    third = TransformSpec(dim=d // 3, pooling="mean")
    third_metrics = test.evaluate(third, (0, RESCORE_DEPTH))
    out: dict[str, Any] = {
        "docs": len(test.doc_ids),
        "d": d,
        "raw": raw,
        "default": test.evaluate(TransformSpec(pooling="mean"))[0],
        "third": {"k": d // 3, "gamma": DEFAULT_GAMMA, **third_metrics[0]},
        "third_rescored": {"k": d // 3, "depth": RESCORE_DEPTH, **third_metrics[RESCORE_DEPTH]},
        "labelled": applied(test, labelled, {k: {"train": v} for k, v in on_train.items()}),
        "auto": applied(test, auto, {k: {"pseudo": v} for k, v in on_pseudo.items()}),
        "by_k": by_k(test, d),
        "faiss_agreement": faiss_agreement(test, min(256, d)),
        "sweep": {
            s.label: {"train": on_train[s.label], "pseudo": on_pseudo[s.label], "test": on_test[s.label]} for s in specs
        },
    }
    out["auto_vs_labelled"] = out["auto"]["nDCG@10 unrescored"] / out["labelled"]["nDCG@10 unrescored"]
    if pool:
        out["draws"] = draws(model, specs, on_train, on_test, labelled, pool)
    return out


def auto_choice(pseudo: basket.IrTask, specs: list[TransformSpec]) -> tuple[dict[str, float], TuneResult]:
    """Each candidate's nDCG@10 on the pseudo-queries, and the choice as `tune --auto` makes it (``pick_one_se``)."""
    trials = per_query_trials(specs, per_query_matrix(pseudo, specs))
    return {t.candidate.label: t.dev["nDCG@10"] for t in trials}, choose(trials, "nDCG@10", pick_one_se)


def draws(
    model: str,
    specs: list[TransformSpec],
    on_train: dict[str, float],
    on_test: dict[str, dict[str, float]],
    labelled: TuneResult,
    pool: int,
) -> dict[str, Any]:
    """The label-free choice made on many random draws of pseudo-queries from one encoded pool: how often does it
    land within 0.5% of the labelled choice (on train, the dev side, and on test)? Both rules see the same draws."""
    task = basket.pseudo_task("scifact", model, pool, 7)
    print(f"{model}: {len(task.queries)} pseudo-queries for the draws...", file=sys.stderr)
    per_query = per_query_matrix(task, specs)
    rng = np.random.default_rng(0)
    label = labelled.best.candidate.label
    out: dict[str, Any] = {"pool": len(task.queries), "draws": DRAWS, "labelled_choice": label, "sizes": {}}
    picks: dict[str, dict[int, list[str]]] = {rule: {size: [] for size in DRAW_SIZES} for rule in RULES}
    for size in DRAW_SIZES:
        for _ in range(DRAWS):  # each draw judged by every rule: the rules are compared on the same queries
            rows = rng.choice(per_query.shape[1], size=min(size, per_query.shape[1]), replace=False)
            for rule in RULES:
                picks[rule][size].append(rule_choice(rule, specs, per_query[:, rows]).label)
    for rule in RULES:
        out["sizes"][rule] = {}
        for size in DRAW_SIZES:
            choices = picks[rule][size]
            test_ratio = np.array([on_test[c]["nDCG@10"] / on_test[label]["nDCG@10"] for c in choices])
            train_ratio = np.array([on_train[c] / on_train[label] for c in choices])
            out["sizes"][rule][size] = {
                "choices": dict(Counter(choices).most_common()),
                "test_ratio_median": float(np.median(test_ratio)),
                "test_ratio_min": float(test_ratio.min()),
                "test_within_target": float((test_ratio >= TARGET).mean()),
                "train_ratio_median": float(np.median(train_ratio)),
                "train_within_target": float((train_ratio >= TARGET).mean()),
            }
    return out


def rule_choice(rule: str, specs: list[TransformSpec], per_query: np.ndarray) -> TransformSpec:
    """The label-free choice from per-query pseudo-query scores (candidates x queries) under ``rule``: "best"
    (``pick``, what labelled tuning does) or "one-SE gentlest" (``pick_one_se``, the one-standard-error rule)."""
    trials = per_query_trials(specs, per_query)
    return choose(trials, "nDCG@10", pick if rule == "best" else pick_one_se).best.candidate


def per_query_trials(specs: list[TransformSpec], per_query: np.ndarray) -> list[Trial]:
    """Trials scored by mean nDCG@10, with the per-query scores (candidates x queries) ``pick_one_se`` reads."""
    return [Trial(s, dev={"nDCG@10": float(v.mean())}, dev_per_query=v) for s, v in zip(specs, per_query, strict=True)]


def by_k(test: basket.IrTask, d: int) -> list[dict[str, Any]]:
    """SciFact test by k, mean pooling: PCA (gamma 0), full whitening (gamma 1), both centred, and the default
    kernel (``DEFAULT_GAMMA``, uncentred below d), each also re-scored."""
    raw = test.evaluate(TransformSpec.raw("mean"))[0]
    rows = [{"k": d, "method": "raw", **raw}]
    for k in sorted({d, 256, 128, 64, d // 3} - {x for x in (256,) if x > d}, reverse=True):
        for method, gamma, center in (
            ("PCA (gamma 0)", 0.0, True),
            ("whitening (gamma 1)", 1.0, True),
            ("default kernel", DEFAULT_GAMMA, None),  # uncentred when k < d
        ):
            spec = TransformSpec(dim=k, gamma=gamma, whiten=True, pooling="mean", center=center)
            m = test.evaluate(spec, (0, RESCORE_DEPTH))
            rows.append({"k": k, "method": method, "gamma": gamma, **m[0], "rescored": m[RESCORE_DEPTH]["nDCG@10"]})
    for row in rows:
        row["vs_raw"] = row["nDCG@10"] / raw["nDCG@10"]
    return rows


def faiss_agreement(test: basket.IrTask, k: int) -> dict[str, Any]:
    """FAISS's PCAW{k} (eigen power -0.5, float32) against our gamma = 1 fit (float64, epsilon 0): query-doc cosines,
    top-10 overlap; and whether FAISS's PCAW at k = d gives finite vectors (it has no epsilon)."""
    docs, q = test.docs["mean"], test.query_vectors["mean"]
    pca = faiss.PCAMatrix(docs.shape[1], k, -0.5, False)
    pca.max_points_per_d = max(1000, docs.shape[0] // docs.shape[1] + 1)
    pca.train(docs)
    ours = Whitening.fit(RunningMoments.from_array(docs), dim=k, gamma=1.0, epsilon=0.0)
    s_faiss = l2_normalize(pca.apply(q)) @ l2_normalize(pca.apply(docs)).T
    s_ours = ours.transform(q) @ ours.transform(docs).T
    top_f = np.argsort(-s_faiss, axis=1)[:, :10]
    top_o = np.argsort(-s_ours, axis=1)[:, :10]
    full = faiss.PCAMatrix(docs.shape[1], docs.shape[1], -0.5, False)
    full.train(docs)
    return {
        "k": k,
        "max_abs_cosine_diff": float(np.abs(s_faiss - s_ours).max()),
        "top10_overlap": float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top_f, top_o, strict=True)])),
        "faiss_full_rank_finite": bool(np.isfinite(full.apply(docs)).all()),
    }


# ----- STS --------------------------------------------------------------------------------------------------
def sts(model: str) -> dict[str, Any]:
    dev_task, *_ = basket.sts_tasks(model, "dev")
    test_tasks = basket.sts_tasks(model, "test")  # STS-B test (fit on all STS-B sentences), then STS12-16
    d = test_tasks[0].dim
    specs = grid(d)
    print(f"{model}: STS, {len(specs)} candidates...", file=sys.stderr)
    on_dev = {s.label: dev_task.evaluate(s)["all"] for s in specs}
    labelled = choose([Trial(s, dev={"all": on_dev[s.label]}) for s in specs], "all").best.candidate
    out: dict[str, Any] = {"labelled_choice": labelled.label, "sets": {}}
    for task in test_tasks:
        pseudo = basket.sts_pseudo_task(task, AUTO_QUERIES, 0)
        on_pseudo, auto_result = auto_choice(pseudo, specs)
        auto = auto_result.best.candidate
        scores = {
            "raw": task.evaluate(TransformSpec.raw("mean")),
            "default": task.evaluate(TransformSpec(pooling="mean")),
            "third": task.evaluate(TransformSpec(dim=d // 3, pooling="mean")),
            "labelled": task.evaluate(labelled),
            "auto": task.evaluate(auto),
        }
        out["sets"][task.name] = {
            "pairs": len(task.pairs.gold),
            "fit_sentences": len(task.fit_sentences),
            "auto_choice": auto.label,
            **{name: {"all": r["all"], "wmean": r["wmean"]} for name, r in scores.items()},
            "auto_sweep": on_pseudo,
        }
    return out


# ----- the pick rules on dev data ---------------------------------------------------------------------------
def one_se_dev_report(models: list[str], pool: int, out: Path) -> None:
    report: dict[str, Any] = {"machine": benchlib.machine(torch_too=True), "command": benchlib.command_line()}
    report |= {"auto_queries": AUTO_QUERIES, "draws": DRAWS, "pool": pool, "target": TARGET, "models": {}}
    for model in models:
        if resolve_model(model) is None:
            print(f"skipping {model}: not installed (see DEVELOPERS.md)", file=sys.stderr)
            continue
        start = time.perf_counter()
        report["models"][model] = {"scifact_train": one_se_scifact(model, pool), "sts": one_se_sts(model, pool)}
        report["models"][model]["seconds"] = round(time.perf_counter() - start, 1)
    out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(out / "one-se-dev.json", basket.jsonable(report))
    benchlib.write_md(out / "one-se-dev.md", one_se_markdown(report))
    print(one_se_markdown(report))
    print(f"command: {report['command']}")


def per_query_matrix(task: basket.IrTask, specs: list[TransformSpec]) -> np.ndarray:
    """nDCG@10 per query (candidates x queries, in ``task.queries`` order). Pseudo-queries have one relevant
    document each: then it is 1 / log2(1 + its rank) in the top 10 of the same exact ranking ``task.per_query``
    scores (which is equal, and far slower: it goes through ``evaluate_run`` query by query)."""
    row = {d: i for i, d in enumerate(task.doc_ids)}
    rels = [task.qrels.get(q, {}) for q in task.queries.ids]
    if not all(len(r) == 1 and next(iter(r.values())) > 0 for r in rels):
        return np.stack([task.per_query(s) for s in specs])
    positive = np.array([row[next(iter(r))] for r in rels])
    gain = 1.0 / np.log2(np.arange(2, 12))
    return np.stack([((task.ranking(s)[:, :10] == positive[:, None]) * gain).sum(axis=1) for s in specs])


def rule_study(
    specs: list[TransformSpec], pool: np.ndarray, default: np.ndarray, value: Callable[[str], float]
) -> dict[str, Any]:
    """Both rules on the same DRAWS draws of AUTO_QUERIES pseudo-queries from ``pool`` (candidates x queries), and
    on ``default`` (the draw `tune --auto` makes: AUTO_QUERIES, seed 0); each choice judged by ``value(label)``."""
    rng = np.random.default_rng(0)
    n = pool.shape[1]
    draws = [rng.choice(n, size=min(AUTO_QUERIES, n), replace=False) for _ in range(DRAWS)]
    out: dict[str, Any] = {}
    for rule in RULES:
        choices = [rule_choice(rule, specs, pool[:, rows]).label for rows in draws]
        chosen = rule_choice(rule, specs, default).label
        out[rule] = {
            "choices": dict(Counter(choices).most_common()),
            "values": [value(c) for c in choices],
            "default_choice": chosen,
            "default": value(chosen),
        }
    return out


def one_se_scifact(model: str, pool: int) -> dict[str, Any]:
    """SciFact, judged on the train qrels (the dev split): each label-free choice as a share of the train choice."""
    train = basket.scifact_task(model, "train")
    specs = grid(train.dim)
    print(f"{model}: SciFact train, {len(specs)} candidates...", file=sys.stderr)
    on_train = {s.label: train.evaluate(s)[0]["nDCG@10"] for s in specs}
    labelled = choose([Trial(s, dev={"nDCG@10": on_train[s.label]}) for s in specs], "nDCG@10").best.candidate.label
    pool_task = basket.pseudo_task("scifact", model, pool, 7)
    default_task = basket.pseudo_task("scifact", model, AUTO_QUERIES, 0)
    study = rule_study(
        specs,
        per_query_matrix(pool_task, specs),
        per_query_matrix(default_task, specs),
        lambda label: on_train[label] / on_train[labelled],
    )
    return {
        "labelled_choice": labelled,
        "labelled": on_train[labelled],
        "raw": on_train["mean raw"],
        "pool": len(pool_task.queries),
        "rules": study,
        "sweep_train": on_train,
    }


def one_se_sts(model: str, pool: int) -> dict[str, Any]:
    """STS-B dev and STS12-16 as dev sets: the choice made on pseudo-queries from each set's own (fit) sentences,
    judged by Spearman x100 ("all") against the labels; the labelled reference is the STS-B dev choice."""
    tasks = basket.sts_tasks(model, "dev")  # STS-B dev (fit on train + dev sentences), then STS12-16
    specs = grid(tasks[0].dim)
    on_dev = {s.label: tasks[0].evaluate(s)["all"] for s in specs}
    labelled = choose([Trial(s, dev={"all": on_dev[s.label]}) for s in specs], "all").best.candidate
    out: dict[str, Any] = {"labelled_choice": labelled.label, "sets": {}}
    for task in tasks:
        print(f"{model}: {task.name}, {len(specs)} candidates...", file=sys.stderr)
        spearman = {s.label: task.evaluate(s)["all"] for s in specs}
        pool_task = basket.sts_pseudo_task(task, pool, 7)
        default_task = basket.sts_pseudo_task(task, AUTO_QUERIES, 0)
        out["sets"][task.name] = {
            "raw": spearman["mean raw"],
            "labelled": spearman[labelled.label],
            "pool": len(pool_task.queries),
            "rules": rule_study(
                specs, per_query_matrix(pool_task, specs), per_query_matrix(default_task, specs), spearman.__getitem__
            ),
        }
    return out


def one_se_markdown(report: dict[str, Any]) -> str:
    lines = [benchlib.machine_md(report["machine"]), "", f"Command: `{report['command']}`", ""]
    n, draws = report["auto_queries"], report["draws"]
    for model, res in report["models"].items():
        sf = res["scifact_train"]
        lines += [
            f"### {model}: SciFact, judged on the train qrels (dev)",
            "",
            f"Train-qrels choice: {sf['labelled_choice']} (train nDCG@10 {sf['labelled']:.4f}; mean raw "
            f"{sf['raw']:.4f}). Label-free choices as % of it: the `--auto` draw ({n} pseudo-queries, seed 0), and "
            f"{draws} draws of {n} from a pool of {sf['pool']} (seed 7).",
            "",
            "| rule | seed 0: choice, % | draws: median %, min %, share >= 99.5% | draws: choices (count) |",
            "|---|---|---|---|",
        ]
        for rule, r in sf["rules"].items():
            v = np.array(r["values"])
            choices = ", ".join(f"{c} ({k})" for c, k in r["choices"].items())
            lines.append(
                f"| {rule} | {r['default_choice']}, {r['default']:.2%} | {np.median(v):.2%}, {v.min():.2%}, "
                f"{(v >= report['target'] - 1e-12).mean():.0%} | {choices} |"
            )
        sts_res = res["sts"]
        lines += [
            "",
            f"### {model}: STS as dev, Spearman x100 (all)",
            "",
            f"Labelled reference: the STS-B dev choice ({sts_res['labelled_choice']}; on STS-B dev itself it is "
            f"in-sample). Label-free: pseudo-queries from each set's own sentences, seed 0 ({n}), and {draws} draws "
            f"of {n} from a pool (seed 7). Points vs raw / vs labelled.",
            "",
            "| set | raw | labelled | rule | seed 0: choice, score (vs raw, vs labelled) | draws: median vs raw, "
            "min vs raw, median vs labelled | one-SE - best per draw: median, min, max | draws: choices (count) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, s in sts_res["sets"].items():
            raw, lab = s["raw"], s["labelled"]
            best_v = np.array(s["rules"]["best"]["values"])
            for rule, r in s["rules"].items():
                v = np.array(r["values"])
                d = v - best_v
                paired = f"{np.median(d):+.2f}, {d.min():+.2f}, {d.max():+.2f}" if rule != "best" else "-"
                top = list(r["choices"].items())[:3]
                choices = ", ".join(f"{c} ({k})" for c, k in top) + (" ..." if len(r["choices"]) > 3 else "")
                lines.append(
                    f"| {name} | {raw:.2f} | {lab:.2f} | {rule} | {r['default_choice']}, {r['default']:.2f} "
                    f"({r['default'] - raw:+.2f}, {r['default'] - lab:+.2f}) | {np.median(v) - raw:+.2f}, "
                    f"{v.min() - raw:+.2f}, {np.median(v) - lab:+.2f} | {paired} | {choices} |"
                )
        lines.append("")
    return "\n".join(lines) + "\n"


# ----- report -----------------------------------------------------------------------------------------------
def short(model: str) -> str:
    return {"all-MiniLM-L6-v2": "MiniLM", "all-mpnet-base-v2": "mpnet"}.get(model, model)


def cell(value: float, raw: float, scale: float = 1.0, digits: int = 4) -> str:
    return f"{value * scale:.{digits}f} ({value / raw:.1%})"


def markdown(report: dict[str, Any]) -> str:
    dfl = report["defaults"]
    centring = {None: "", True: ", centred", False: ", uncentred"}[dfl.get("center_reduced")]  # older runs: unsaid
    lines = [
        benchlib.machine_md(report["machine"]),
        "",
        f"Command: `{report['command']}`",
        "",
        f"Defaults: no --dim -> raw; --dim -> gamma {dfl['gamma']:g}{centring}; re-scoring depth "
        f"{dfl['rescore_depth']}; "
        f"`tune --auto` on {dfl['auto_queries']} pseudo-queries.",
        "",
        "SciFact test nDCG@10; STS Spearman x100 (all). In brackets: relative to raw. Choices are made on dev "
        "splits (SciFact train, STS-B dev) or pseudo-queries, never on test; STS12-16 are also dev tasks of the "
        "defaults (choose_defaults.py), so only SciFact test and STS-B test are held out.",
        "",
        *[
            f"- {short(model)}: `{res['run']['command']}`; CPU flags {' '.join(res['run']['cpu_flags'] or [])}; "
            f"label-free rule: {res['run']['auto_rule']}"
            for model, res in report["models"].items()
            if "run" in res
        ],
        "",
        "| model | set | raw | default (no --dim) | --dim d/3 | --dim d/3, re-scored | tuned with labels | "
        "tuned without labels |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, res in report["models"].items():
        sf = res["scifact"]
        raw = sf["raw"]["nDCG@10"]
        lab, auto = sf["labelled"], sf["auto"]
        lines.append(
            f"| {short(model)} | SciFact | {raw:.4f} | {cell(sf['default']['nDCG@10'], raw)} | "
            f"{cell(sf['third']['nDCG@10'], raw)} | {cell(sf['third_rescored']['nDCG@10'], raw)} | "
            f"{cell(lab['nDCG@10'], raw)} {lab['choice']} | {cell(auto['nDCG@10'], raw)} {auto['choice']} |"
        )
        for name, s in res["sts"]["sets"].items():
            r = s["raw"]["all"]
            lines.append(
                f"| {short(model)} | {name} | {r:.2f} | {cell(s['default']['all'], r, 1, 2)} | "
                f"{cell(s['third']['all'], r, 1, 2)} | - | {cell(s['labelled']['all'], r, 1, 2)} "
                f"{res['sts']['labelled_choice']} | {cell(s['auto']['all'], r, 1, 2)} {s['auto_choice']} |"
            )
    lines += ["", "Tuned choices as applied: a reduced choice re-scores its top candidates by the best full-rank", ""]
    lines += ["candidate of its pooling (the scorer); unrescored figures are in quality.json.", ""]
    for model, res in report["models"].items():
        sf = res["scifact"]
        lines += label_free(model, sf)
        lines += by_k_table(model, sf)
    return "\n".join(lines) + "\n"


def label_free(model: str, sf: dict[str, Any]) -> list[str]:
    lab, auto = sf["labelled"], sf["auto"]
    lines = [
        f"### {model}: label-free tuning on SciFact",
        "",
        f"With train qrels: {lab['choice']} (test nDCG@10 {lab['nDCG@10 unrescored']:.4f} as indexed, "
        f"{lab['nDCG@10']:.4f} as applied). Without ({AUTO_QUERIES} pseudo-queries, seed 0): {auto['choice']} "
        f"({auto['nDCG@10 unrescored']:.4f} as indexed, {auto['nDCG@10']:.4f} as applied): "
        f"{sf['auto_vs_labelled']:.2%} of the labelled choice (target >= 99.5%).",
        "",
    ]
    if "draws" in sf:
        dr = sf["draws"]
        lines += [
            f"Over {dr['draws']} random draws from {dr['pool']} pseudo-queries (labelled choice: "
            f"{dr['labelled_choice']}):",
            "",
            "| pseudo-queries, rule | choices (count) | train: median % of labelled, share >= 99.5% | "
            "test: median, min, share >= 99.5% |",
            "|---|---|---|---|",
        ]
        for rule, sizes in dr["sizes"].items():
            for size, s in sizes.items():
                choices = ", ".join(f"{c} ({n})" for c, n in s["choices"].items())
                lines.append(
                    f"| {size}, {rule} | {choices} | {s['train_ratio_median']:.2%}, {s['train_within_target']:.0%} | "
                    f"{s['test_ratio_median']:.2%}, {s['test_ratio_min']:.2%}, {s['test_within_target']:.0%} |"
                )
        lines.append("")
    return lines


def by_k_table(model: str, sf: dict[str, Any]) -> list[str]:
    a = sf["faiss_agreement"]
    lines = [
        f"### {model}: SciFact test by k (mean pooling; re-scored: top {RESCORE_DEPTH} by raw cosine)",
        "",
        "| k | method | gamma | nDCG@10 | Recall@100 | vs raw | re-scored nDCG@10 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sf["by_k"]:
        gamma = "-" if r.get("gamma") is None else f"{r['gamma']:g}"
        rescored = f"{r['rescored']:.4f}" if "rescored" in r else "-"
        lines.append(
            f"| {r['k']} | {r['method']} | {gamma} | {r['nDCG@10']:.4f} | {r['Recall@100']:.4f} | "
            f"{r['vs_raw']:.1%} | {rescored} |"
        )
    lines += [
        "",
        f"FAISS PCAW{a['k']} vs ours (gamma 1, epsilon 0): max |cosine diff| {a['max_abs_cosine_diff']:.1e}, top-10 "
        f"overlap {a['top10_overlap']:.1%}; FAISS PCAW at k = d gives finite vectors: {a['faiss_full_rank_finite']}.",
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
