"""`asyncrl report RUN_DIR`: a run's curves as PNG plots and a short markdown summary, from metrics.jsonl.

Panels (each a PNG under RUN_DIR/report/, a panel whose metrics the run never logged is left out):
reward and its parts (train/reward_mean, train/reward/*), evaluation (eval/*), staleness
(train/staleness_max, train/staleness_mean), the sampler/learner mismatch and the importance weights'
spread by token staleness (learner/mismatch_s*_kl_k3, learner/mismatch_s*_is_std: asyncrl/learner/importance.py),
the learner's idle fraction, engine and learner tokens/s,
weight-sync seconds, and the buffer's size. summary.md compares the first and the last `window` training
steps (mean of each headline metric) and lists the plots. The run may still be writing its metrics: the
report covers what is there, and a torn last line is skipped.
"""

from __future__ import annotations

import fnmatch
import json
import math
from pathlib import Path
from typing import Any

from asyncrl.run_dir import METRICS, RunLayout

PANELS: list[tuple[str, str, list[str]]] = [  # (file stem, title, metric keys; a key with * is a glob)
    ("reward", "reward and its parts", ["train/reward_mean", "train/reward/*"]),
    ("eval", "evaluation", ["eval/*"]),
    ("staleness", "staleness (versions)", ["train/staleness_max", "train/staleness_mean"]),
    ("mismatch", "sampler/learner mismatch, KL k3, by token staleness s", ["learner/mismatch_s*_kl_k3"]),
    ("mismatch_spread", "importance-weight spread (std of r), by token staleness s", ["learner/mismatch_s*_is_std"]),
    ("idle", "learner idle fraction", ["learner/idle_fraction"]),
    ("throughput", "tokens/s", ["rollout/engine_tokens_per_s", "learner/tokens_per_s"]),
    ("sync", "weight sync seconds", ["sync/seconds"]),
    ("buffer", "buffer size (trajectories)", ["buffer/size"]),
    ("memory", "resident memory (GiB) by role", ["memory/*"]),
]
SUMMARY_KEYS = ["train/reward_mean", "train/staleness_mean", "learner/idle_fraction", "rollout/engine_tokens_per_s",
                "learner/tokens_per_s", "sync/seconds", "step_seconds"]


class ReportError(ValueError):
    """A run dir with nothing to report (no metrics.jsonl, or no step in it)."""


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metric records in file order; lines that do not parse (a torn last line) are skipped."""
    path = RunLayout(run_dir).metrics
    if not path.is_file():
        raise ReportError(f"{run_dir}: no {METRICS.name} (is this the output dir of an `asyncrl train` run?)")
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    if not out:
        raise ReportError(f"{path}: no step recorded yet")
    return out


def panel_keys(records: list[dict[str, Any]], patterns: list[str]) -> list[str]:
    """The metric keys a panel plots: exact keys present, and every present key under a prefix pattern."""
    present = sorted({k for r in records for k in r})
    keys: list[str] = []
    for p in patterns:
        matched = [k for k in present if fnmatch.fnmatchcase(k, p)] if "*" in p else ([p] if p in present else [])
        keys += [k for k in matched if k not in keys]
    return keys


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric: finite numbers only, in step order."""
    pts = sorted((r["step"], float(r[key])) for r in records
                 if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
                 and math.isfinite(float(r[key])))
    return [s for s, _ in pts], [v for _, v in pts]


def summary_markdown(records: list[dict[str, Any]], window: int, plots: list[Path]) -> str:
    train = [r for r in records if "train/reward_mean" in r]
    steps = sorted({r["step"] for r in train})
    lines = ["# Run report", "", f"{len(steps)} training steps recorded (steps {steps[0]}-{steps[-1]})." if steps
             else "No training step recorded yet.", ""]
    if steps:
        first, last = set(steps[:window]), set(steps[-window:])
        lines += [f"| metric | first {len(first)} steps | last {len(last)} steps |", "| --- | --- | --- |"]
        for key in [k for k in SUMMARY_KEYS if any(k in r for r in train)] + panel_keys(train, ["train/reward/*"]):
            def mean(sel: set[int], key: str = key) -> str:
                vals = [v for s, v in zip(*series(train, key)) if s in sel]
                return f"{sum(vals) / len(vals):.4g}" if vals else "-"
            lines.append(f"| {key} | {mean(first)} | {mean(last)} |")
        lines.append("")
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    if evals:
        lines += ["Evaluations:", ""]
        for r in evals:
            parts = ", ".join(f"{k} {v:.4g}" for k, v in sorted(r.items())
                              if k.startswith("eval/") and isinstance(v, (int, float)))
            lines.append(f"- step {r['step']}: {parts}")
        lines.append("")
    lines += ["Plots:", ""] + [f"- ![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)


def write_report(run_dir: str | Path, window: int = 5) -> list[Path]:
    """Write the PNG panels and summary.md under RUN_DIR/report/; returns their paths (summary last)."""
    # lazy: imports matplotlib, which this module does not load otherwise
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    # lazy: imports matplotlib, which this module does not load otherwise
    import matplotlib.pyplot as plt

    if window < 1:
        raise ReportError(f"--window must be >= 1, got {window}")
    run_dir = Path(run_dir)
    records = read_records(run_dir)
    out = RunLayout(run_dir).report
    out.mkdir(exist_ok=True)
    plots = []
    for stem, title, patterns in PANELS:
        keys = [k for k in panel_keys(records, patterns) if series(records, k)[0]]
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for key in keys:
            xs, ys = series(records, key)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        plots.append(path)
    summary = out / "summary.md"
    summary.write_text(summary_markdown(records, window, plots))
    return plots + [summary]


def add_arguments(parser: Any) -> None:
    parser.add_argument("run_dir", help="the output dir of an `asyncrl train` run (it may still be running)")
    parser.add_argument("--window", type=int, default=5, help="steps in the summary's first and last windows")


def main(args: Any) -> int:
    try:
        paths = write_report(args.run_dir, args.window)
    except ReportError as e:
        print(f"asyncrl report: {e}")
        return 2
    for p in paths:
        print(p)
    return 0
