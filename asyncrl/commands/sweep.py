"""`asyncrl train -m key=a,b other=x,y`: the combinations run one after another, each as its own
`asyncrl train` child process (a crash of one does not end the sweep) in its own run directory
`<sweep dir>/<k>_<what varies>`; the sweep dir (`hydra.sweep.dir`, default `outputs/sweeps/<start time>`)
also gets `sweep.json` (the command and every combination) and, at the end, `summary.json` and
`summary.md`: each run's exit status, steps trained and last mean reward. The sweep exits 0 when every
run did, else 1 naming the runs that did not. Ctrl-C stops the running child (it checkpoints as any
run does) and starts no further run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from asyncrl.commands.train_args import TrainArgs, TrainArgsError, expand_sweep
from asyncrl.config import ConfigError, group_options, load_config
from asyncrl.metrics import read_metrics
from asyncrl.run_dir import RunLayout, timestamp_name

MAX_SWEEP_RUNS = 256
RUN_DIR_KEYS = ("trainer.output_dir", "trainer.run_name")


def run_name(k: int, varying: list[str]) -> str:
    """`<k>_<key=value,...>` with the characters a directory name should not hold replaced, at most 100 long."""
    slug = re.sub(r"[^A-Za-z0-9._=-]+", "_", ",".join(v.lstrip("+~") for v in varying)).strip("_")
    return f"{k}_{slug}"[:100] if slug else str(k)


def hydra_quoted(value: str) -> str:
    """`value` as a quoted Hydra override value (a path may hold '=', ',', spaces or quotes)."""
    return "'" + value.replace("'", "\\'") + "'"


def plan(args: TrainArgs) -> tuple[Path, list[list[str]], list[list[str]]]:
    """(sweep dir, each run's overrides, what varies in each): checked before any run starts."""
    for ov in args.overrides:
        if ov.lstrip("+~").split("=", 1)[0] in RUN_DIR_KEYS:
            raise TrainArgsError(f"{ov!r}: in a sweep each run's directory is <sweep dir>/<k>_<values>; set the "
                                 "sweep's directory with hydra.sweep.dir=DIR")
    combos = expand_sweep(args.overrides, group_options)
    if len(combos) > MAX_SWEEP_RUNS:
        raise TrainArgsError(f"the sweep has {len(combos)} combinations, more than {MAX_SWEEP_RUNS}; split it")
    for combo in combos:  # every run's config is valid before the first one starts
        try:
            load_config(combo)
        except ConfigError as e:
            raise TrainArgsError(f"sweep run {' '.join(combo)}: config error: {e}") from None
    fixed = set(args.overrides)
    varying = [[c for c in combo if c not in fixed] for combo in combos]
    root = Path(args.sweep_dir or Path("outputs") / "sweeps" / timestamp_name()).resolve()
    return root, combos, varying


def run_sweep(args: TrainArgs) -> int:
    root, combos, varying = plan(args)
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps({"command": ["asyncrl", "train", "-m", *args.typed],
                                                 "runs": combos}, indent=2))
    print(f"asyncrl sweep: {len(combos)} runs, one after another, in {root}", flush=True)
    results: list[dict[str, Any]] = []
    for k, (combo, vary) in enumerate(zip(combos, varying)):
        out = root / run_name(k, vary)
        cmd = [sys.executable, "-m", "asyncrl.cli", "train", *combo, f"trainer.output_dir={hydra_quoted(str(out))}"]
        if args.dry_run:
            cmd.append("--dry-run")
        print(f"asyncrl sweep: run {k + 1}/{len(combos)}: {' '.join(vary) or '(no varying value)'} -> {out}", flush=True)
        child = subprocess.Popen(cmd)
        try:
            rc = child.wait()
        except KeyboardInterrupt:  # the child got the same SIGINT: let it checkpoint and stop
            rc = child.wait()
            results.append(_result(k, vary, out, rc))
            print(f"asyncrl sweep: interrupted during run {k + 1}; no further run started", file=sys.stderr, flush=True)
            _write_summary(root, results)
            return 130
        results.append(_result(k, vary, out, rc))
    _write_summary(root, results)
    failed = [r for r in results if r["exit_code"] != 0]
    if failed:
        print("asyncrl sweep: runs that did not exit 0: " + "; ".join(f"{r['run']} (exit {r['exit_code']})" for r in failed),
              file=sys.stderr, flush=True)
        return 1
    return 0


def _result(k: int, vary: list[str], out: Path, rc: int) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    try:
        summary = json.loads(RunLayout(out).summary.read_text())
    except (OSError, ValueError):
        pass
    reward = None
    try:
        rewards = [m["train/reward_mean"] for m in read_metrics(RunLayout(out).metrics) if "train/reward_mean" in m]
        reward = rewards[-1] if rewards else None
    except (OSError, ValueError):
        pass
    return {"run": out.name, "overrides": vary, "exit_code": rc, "exit_reason": summary.get("exit_reason", ""),
            "steps_trained": summary.get("steps_trained"), "last_reward_mean": reward, "dir": str(out)}


def _write_summary(root: Path, results: list[dict[str, Any]]) -> None:
    (root / "summary.json").write_text(json.dumps(results, indent=2))
    lines = ["| run | exit | steps | last reward | overrides |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        reward = "" if r["last_reward_mean"] is None else f"{r['last_reward_mean']:.4f}"
        steps = "" if r["steps_trained"] is None else r["steps_trained"]
        lines.append(f"| {r['run']} | {r['exit_code']} | {steps} | {reward} | {' '.join(r['overrides'])} |")
    table = "\n".join(lines)
    (root / "summary.md").write_text(table + "\n")
    print(f"asyncrl sweep: summary ({root / 'summary.md'}):\n{table}", flush=True)
