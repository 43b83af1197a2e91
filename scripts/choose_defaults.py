"""Choose the defaults by their worst case over a basket of dev tasks (never a test split), for both models.

Each candidate's relative loss against raw vectors is measured on every dev task of both models (mean pooling,
the default); the candidate with the smallest worst-case loss is chosen:

* no --dim: the raw vectors, or a full-rank transform (k = d) with some gamma, whichever loses least in the worst
  case (a tie goes to raw: no transform is simpler than one);
* --dim given: the gamma and centring (the kernel from the covariance, x - mean, or from the second moment, x
  as it is) with the smallest worst-case loss at k = d/3 (reported at d/2 and d/6 too); worst cases within 0.1
  percentage point are tied, and the tie goes to the smaller mean loss;
* re-scoring: the smallest depth at which every IR dev task, at d/3 with that kernel, keeps >= 99.9% of raw
  nDCG@10.

Dev tasks: SciFact train queries (nDCG@10); the stdlib docstrings with 1000 pseudo-queries (nDCG@10); STS-B dev
(fitted on STS-B train + dev sentences); STS12-16 (each fitted on its own sentences; Spearman "all", the "wmean"
in the JSON). Writes results/defaults/defaults.json and defaults.md.

    python scripts/choose_defaults.py                  # both models (mpnet: scripts/install_mpnet.sh)
    python scripts/choose_defaults.py --models all-MiniLM-L6-v2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import basket  # noqa: E402
import benchlib  # noqa: E402

from retrieval.encode.models import resolve_model
from retrieval.whitening import TransformSpec

GAMMAS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0)
DEPTHS = (0, 10, 20, 30, 50, 100, 200)
FULL_LOSS_TARGET = 0.002  # no --dim: no dev task may lose more than 0.2% against raw
REDUCED_LOSS_TARGET = 0.01  # at d/3, before re-scoring: 1%
RESCORE_TARGET = 0.999  # re-scoring: >= 99.9% of raw nDCG@10
OLD = "0.3"  # the previous default (centred): the reduced candidate shown beside the choice
CENTERINGS = {"": True, " uncentred": False}  # candidate-name suffix -> TransformSpec.center
TIE = 0.001  # worst-case losses within 0.1 percentage point are tied (then: the smaller mean loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(basket.MODELS))
    ap.add_argument("--out", type=Path, default=benchlib.RESULTS / "defaults")
    args = ap.parse_args()
    report: dict[str, Any] = {"machine": benchlib.machine(), "command": benchlib.command_line(), "models": {}}
    for model in args.models.split(","):
        if resolve_model(model) is None:
            print(f"skipping {model}: not installed (see DEVELOPERS.md)", file=sys.stderr)
            continue
        start = time.perf_counter()
        report["models"][model] = measure(model)
        report["models"][model]["seconds"] = round(time.perf_counter() - start, 1)
    report["choice"] = choose(report["models"])
    args.out.mkdir(parents=True, exist_ok=True)
    benchlib.write_json(args.out / "defaults.json", basket.jsonable(report))
    benchlib.write_md(args.out / "defaults.md", markdown(report))
    print(markdown(report))


def candidates(d: int) -> dict[str, TransformSpec]:
    specs = {"raw": TransformSpec.raw("mean").resolve(d)}
    for k in sorted({d, d // 2, d // 3, d // 6}, reverse=True):
        for g in GAMMAS:
            for center in CENTERINGS.values():
                spec = TransformSpec(dim=k, gamma=g, whiten=True, pooling="mean", center=center)
                specs[basket.spec_label(spec, d)] = spec
    return specs


def measure(model: str) -> dict[str, Any]:
    """Every candidate's score on every dev task of ``model``, and re-scoring depths on the IR tasks."""
    ir = [basket.scifact_task(model, "train"), basket.pseudo_task("stdlib", model)]
    sts = basket.sts_tasks(model, "dev")
    d = ir[0].dim
    specs = candidates(d)
    tasks: dict[str, Any] = {}
    for task in ir:
        print(f"{model}: {task.name}...", file=sys.stderr)
        scores = {label: task.evaluate(spec)[0] for label, spec in specs.items()}
        tasks[task.name] = {
            "kind": "ir",
            "metric": "nDCG@10",
            "queries": len(task.queries),
            "docs": len(task.doc_ids),
            "scores": {label: m["nDCG@10"] for label, m in scores.items()},
            "recall@100": {label: m["Recall@100"] for label, m in scores.items()},
        }
    for task in sts:
        print(f"{model}: {task.name}...", file=sys.stderr)
        results = {label: task.evaluate(spec) for label, spec in specs.items()}
        tasks[task.name] = {
            "kind": "sts",
            "metric": "Spearman all",
            "pairs": len(task.pairs.gold),
            "fit_sentences": len(task.fit_sentences),
            "scores": {label: r["all"] for label, r in results.items()},
            "wmean": {label: r["wmean"] for label, r in results.items()},
        }
    rescore = {}
    for task in ir:
        per_kernel = {}
        for g in GAMMAS:
            for suffix, center in CENTERINGS.items():
                spec = TransformSpec(dim=d // 3, gamma=g, whiten=True, pooling="mean", center=center)
                scores = task.evaluate(spec, DEPTHS)
                per_kernel[f"{g:g}{suffix}"] = {depth: m["nDCG@10"] for depth, m in scores.items()}
        rescore[task.name] = per_kernel
    return {"d": d, "third": d // 3, "tasks": tasks, "rescore": rescore}


def loss(task: dict[str, Any], label: str) -> float:
    """Relative loss against raw (positive: worse than raw)."""
    raw = task["scores"]["raw"]
    return 1.0 - task["scores"][label] / raw


def worst(models: dict[str, Any], label_of: Any) -> tuple[float, str, float]:
    """The largest loss of a candidate over every task of every model, where, and the mean loss; ``label_of(d)``
    names the candidate for a model of dimension d."""
    out = [
        (loss(task, label_of(m["d"])), f"{short(model)} {name}")
        for model, m in models.items()
        for name, task in m["tasks"].items()
    ]
    return (*max(out), float(sum(x for x, _ in out) / len(out)))


def minimax(options: dict[str, tuple[float, str, float]]) -> str:
    """The option with the smallest worst-case loss; options within TIE of it are tied, and the tie goes to the
    smallest mean loss (a worst case that moves by less than that is noise, not a reason)."""
    best = min(v[0] for v in options.values())
    tied = {name: v for name, v in options.items() if v[0] <= best + TIE}
    return min(tied, key=lambda name: tied[name][2])


def choose(models: dict[str, Any]) -> dict[str, Any]:
    full_options: dict[str, Any] = {"raw": lambda d: "raw"}
    for g in GAMMAS:
        for suffix in CENTERINGS:
            full_options[f"k=d gamma={g:g}{suffix}"] = lambda d, g=g, s=suffix: f"k={d} (d) gamma={g:g}{s}"
    full = {name: worst(models, f) for name, f in full_options.items()}
    full_choice = minimax(full)
    if full[full_choice][0] >= full["raw"][0] - TIE:  # a transform must gain clearly on its worst task to win
        full_choice = "raw"
    reduced = {
        f"{g:g}{suffix}": {
            fraction: worst(models, lambda d, g=g, n=n, s=suffix: f"k={d // n} gamma={g:g}{s}")
            for fraction, n in (("d/2", 2), ("d/3", 3), ("d/6", 6))
        }
        for g in GAMMAS
        for suffix in CENTERINGS
    }
    kernel = minimax({key: r["d/3"] for key, r in reduced.items()})
    depth_worst = {
        depth: min(
            m["rescore"][task][kernel][depth] / m["tasks"][task]["scores"]["raw"]
            for m in models.values()
            for task in m["rescore"]
        )
        for depth in DEPTHS
    }
    depth = next(
        (dp for dp in DEPTHS if dp and all(depth_worst[x] >= RESCORE_TARGET for x in DEPTHS if x >= dp)), None
    )  # the smallest depth from which every deeper one also keeps the target
    transforms = {name: v for name, v in full.items() if name != "raw"}
    return {
        "no_dim": full_choice,
        "best_full_rank": minimax(transforms),
        "no_dim_worst": full[full_choice],
        "full_dim_worst": full,
        "kernel": kernel,
        "gamma": float(kernel.split()[0]),
        "center": CENTERINGS[kernel[len(kernel.split()[0]) :]],
        "reduced_worst": reduced,
        "rescore_depth": depth,
        "rescore_worst_ratio": depth_worst,
        "targets": {
            "no_dim_max_loss": FULL_LOSS_TARGET,
            "no_dim_met": full[full_choice][0] <= FULL_LOSS_TARGET,
            "third_max_loss": REDUCED_LOSS_TARGET,
            "third_met": reduced[kernel]["d/3"][0] <= REDUCED_LOSS_TARGET,
            "rescore_min_ratio": RESCORE_TARGET,
        },
    }


# ----- report -----------------------------------------------------------------------------------------------
def pct(x: float) -> str:
    return f"{-x:+.2%}"


def markdown(report: dict[str, Any]) -> str:
    c = report["choice"]
    models = report["models"]
    g, kernel = f"{c['gamma']:g}", c["kernel"]
    lines = [
        benchlib.machine_md(report["machine"]),
        "",
        f"Command: `{report['command']}`",
        "",
        f"**Chosen**: no --dim -> {c['no_dim']} (the best full-rank transform, {c['best_full_rank']}, changes its "
        f"worst task by {pct(c['full_dim_worst'][c['best_full_rank']][0])}, "
        f"{c['full_dim_worst'][c['best_full_rank']][1]}); "
        f"--dim -> gamma {kernel} (worst loss at d/3 {pct(c['reduced_worst'][kernel]['d/3'][0])}, "
        f"{c['reduced_worst'][kernel]['d/3'][1]}); re-scoring depth {c['rescore_depth']} "
        f"(worst {c['rescore_worst_ratio'][c['rescore_depth']]:.2%} of raw nDCG@10).",
        "",
        "Per dev task: raw score, then the change against raw (relative) of each candidate; d/3 is 128 for MiniLM,",
        "256 for mpnet; IR tasks report nDCG@10, STS tasks Spearman x100 (all).",
        "",
        f"| model | dev task | raw | best full-rank (k = d) | k = d, gamma {g} | k = d/3, gamma {kernel} | "
        f"k = d/3, gamma {OLD} (old) | k = d/3, gamma {kernel}, re-score {c['rescore_depth']} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, m in models.items():
        d, third = m["d"], m["third"]
        for name, task in m["tasks"].items():
            full_labels = [f"k={d} (d) gamma={x:g}{suffix}" for x in GAMMAS for suffix in CENTERINGS]
            best_full = max(full_labels, key=lambda label: task["scores"][label])
            rescored = "-"
            if name in m["rescore"]:
                ratio = m["rescore"][name][kernel][c["rescore_depth"]] / task["scores"]["raw"]
                rescored = pct(1 - ratio)
            raw = task["scores"]["raw"]
            lines.append(
                f"| {short(model)} | {name} | {raw:.4f} | {pct(loss(task, best_full))} "
                f"({best_full.split(' ', 2)[-1]}) | {pct(loss(task, f'k={d} (d) gamma={g}'))} | "
                f"{pct(loss(task, f'k={third} gamma={kernel}'))} | {pct(loss(task, f'k={third} gamma={OLD}'))} | "
                f"{rescored} |"
            )
    lines += [
        "",
        "Worst case over all tasks of both models (relative loss against raw; negative = a gain everywhere):",
        "",
        "| candidate | no --dim (k = d) | k = d/2 | k = d/3 (mean change) | k = d/6 |",
        "|---|---|---|---|---|",
        f"| raw | {pct(c['full_dim_worst']['raw'][0])} | | | |",
    ]
    for gamma in GAMMAS:
        for suffix in CENTERINGS:
            key = f"{gamma:g}{suffix}"
            r = c["reduced_worst"][key]
            full = c["full_dim_worst"][f"k=d gamma={key}"]
            lines.append(
                f"| gamma {key} | {pct(full[0])} ({full[1]}) | {pct(r['d/2'][0])} | "
                f"{pct(r['d/3'][0])} ({r['d/3'][1]}; {pct(r['d/3'][2])}) | {pct(r['d/6'][0])} |"
            )
    lines += [
        "",
        f"Re-scoring at d/3, gamma {kernel}: worst ratio to raw nDCG@10 over the IR dev tasks of both models:",
        "",
        "| depth | " + " | ".join(str(dp) for dp in DEPTHS) + " |",
        "|---|" + "---|" * len(DEPTHS),
        "| worst % of raw | " + " | ".join(f"{c['rescore_worst_ratio'][dp]:.2%}" for dp in DEPTHS) + " |",
        "",
    ]
    return "\n".join(lines) + "\n"


def short(model: str) -> str:
    return {"all-MiniLM-L6-v2": "MiniLM", "all-mpnet-base-v2": "mpnet"}.get(model, model)


if __name__ == "__main__":
    main()
