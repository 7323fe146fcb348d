"""`asyncrl train [-m] [--dry-run] [--cfg job] [overrides...]`: compose and validate the config, run the
preflight checks (asyncrl/run/preflight.py), then run the controller. `--dry-run` stops after the preflight:
it prints what the run would use and exits 0, creating no output dir and starting no Ray. `-m` runs a
sweep (asyncrl/commands/sweep.py). The command line is read by asyncrl/commands/train_args.py (hydra.* overrides, sweeps).
A config or preflight mistake exits 2 with one line per problem on stderr, before anything starts."""

from __future__ import annotations

import argparse
import sys

from omegaconf import OmegaConf

from asyncrl.commands.sweep import run_sweep
from asyncrl.commands.train_args import TrainArgsError, parse_train_args
from asyncrl.commands.train_help import render
from asyncrl.config import ConfigError, load_config, to_dict
from asyncrl.run.preflight import PreflightError, preflight

RAW_ARGS = True  # everything after `train` is a Hydra override (plus the flags of asyncrl/commands/train_args.py)

EXAMPLES = """Examples:
  asyncrl train
  asyncrl train agent=react trainer.total_steps=5
  asyncrl train -m algorithm.lr=1e-6,2e-6 algorithm.n_samples=4,8   # a sweep: 4 runs, one after another
  asyncrl train --cfg job agent=single_turn   # print the resolved config and exit
  asyncrl train --dry-run env.train_file=x.parquet   # check everything, start nothing"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    try:
        targs = parse_train_args(list(args.argv))
    except TrainArgsError as e:
        print(f"asyncrl train: {e}", file=sys.stderr)
        return 2
    if targs.help:
        print(__doc__.strip() + "\n\n" + EXAMPLES + "\n\n" + render())
        return 0
    if targs.multirun:
        try:
            return run_sweep(targs)
        except TrainArgsError as e:
            print(f"asyncrl train: {e}", file=sys.stderr)
            return 2
    try:
        cfg = load_config(targs.overrides)
    except ConfigError as e:
        print(f"asyncrl train: config error: {e}", file=sys.stderr)
        return 2
    if targs.print_cfg:
        print(OmegaConf.to_yaml(to_dict(cfg)), end="")
        return 0
    try:
        report = preflight(cfg)
    except PreflightError as e:
        for line in e.problems:
            print(f"asyncrl train: preflight: {line}", file=sys.stderr)
        return 2
    for line in report.warnings:
        print(f"asyncrl train: warning: {line}", file=sys.stderr)
    for line in report.notes:
        print(f"asyncrl train: {line}", file=sys.stderr)
    cfg.algorithm.micro_batch_tokens = report.micro_batch_tokens  # trainer.learner_memory_gb's choice, if any
    if targs.dry_run:
        print(f"preflight passed; nothing started (--dry-run)\n{report.summary()}")
        return 0
    # lazy: imports ray, which this module does not load otherwise
    from asyncrl.run.controller import run  # imports ray: only once the preflight passed

    return run(cfg, rows=report.train_rows, overrides=targs.typed)
