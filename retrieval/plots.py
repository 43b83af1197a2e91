"""A tuning sweep's outputs: its plot (quality vs dimension, one line per gamma, and quality vs search latency) and
the pair of files a run leaves, tune.json and tune.png, written together or not at all."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

from retrieval import files
from retrieval.tune import TuneResult

log = logging.getLogger(__name__)


def plot_tuning(result: TuneResult, path: Path, split: str = "test", title: str = "") -> Path | None:
    """Write a two-panel PNG; returns None (with a warning) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install matplotlib): no plot written")
        return None
    metric = result.metric
    trials = [t for t in result.trials if (t.test if split == "test" else t.dev)]
    score = (lambda t: t.test[metric]) if split == "test" else (lambda t: t.dev[metric])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    poolings = list(dict.fromkeys(t.candidate.pooling for t in trials))
    styles = ["-", "--", ":"]
    for p_i, pooling in enumerate(poolings):
        mine = [t for t in trials if t.candidate.pooling == pooling]
        gammas = sorted({t.candidate.gamma for t in mine if t.candidate.whiten and t.candidate.gamma is not None})
        for gamma in gammas:
            line = sorted((t for t in mine if t.candidate.whiten and t.candidate.gamma == gamma), key=lambda t: t.dim)
            label = f"{pooling} gamma={gamma}" if len(poolings) > 1 else f"gamma={gamma}"
            left.plot([t.dim for t in line], [score(t) for t in line], styles[p_i % 3], marker="o", label=label)
        for raw in (t for t in mine if not t.candidate.whiten):
            left.axhline(score(raw), color="grey", linestyle=styles[p_i % 3], linewidth=1)
            left.annotate(f"raw {pooling}", (min(t.dim for t in mine), score(raw)), fontsize=8)
    left.set_xscale("log", base=2)
    left.set_xlabel("output dimension k")
    left.set_ylabel(f"{metric} ({split})")
    left.set_title("quality vs dimension")
    left.legend(fontsize=7)
    points = sorted(((t.search_ms or 0.0, score(t), t) for t in trials), key=lambda p: (p[0], -p[1]))
    right.scatter([p[0] for p in points], [p[1] for p in points], s=12, color="lightsteelblue")
    front, best = [], float("-inf")
    for ms, value, trial in points:
        if value > best:
            front.append((ms, value, trial))
            best = value
    right.plot([p[0] for p in front], [p[1] for p in front], "-o", color="crimson", label="Pareto front")
    for ms, value, trial in front:
        right.annotate(trial.candidate.label, (ms, value), fontsize=7, rotation=15)
    right.set_xlabel("single-query flat search (ms, median, scaled to N from the first block)")
    right.set_ylabel(f"{metric} ({split})")
    right.set_title("quality vs search latency")
    right.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    files.write_atomic(path, image.getvalue())  # a link planted at ``path`` is replaced, never written through
    return path


def write_results(result: TuneResult, folder: Path) -> Path | None:
    """``tune.json`` and ``tune.png`` (when matplotlib is installed) into ``folder``: both new, or, failed or
    interrupted, neither touched (each is written under a temporary name, then both renamed) and a folder made
    for them removed again. Returns the plot's path."""
    split = "test" if result.best.test else "dev"
    made = not folder.exists()
    temporary = [folder / f".tune.{os.getpid()}.png", folder / f".tune.{os.getpid()}.json"]
    with files.output_errors(folder):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            png = plot_tuning(result, temporary[0], split=split, title=f"{result.metric} ({split})")
            files.write_atomic(temporary[1], json.dumps(result.to_dict(), indent=1).encode())
            if png is None:
                (folder / "tune.png").unlink(missing_ok=True)  # an earlier run's plot would belong to other results
            else:
                os.replace(png, folder / "tune.png")
            os.replace(temporary[1], folder / "tune.json")
        except BaseException:
            for path in temporary:
                path.unlink(missing_ok=True)
            if made and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
            raise
    return None if png is None else folder / "tune.png"
