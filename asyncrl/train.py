"""`asyncrl train [--dry-run] [overrides...]`: compose and validate the config, run the preflight
checks (asyncrl/preflight.py), then run the controller. `--dry-run` stops after the preflight: it
prints what the run would use and exits 0, creating no output dir and starting no Ray.
A config or preflight mistake exits 2 with one line per problem on stderr, before anything starts."""

from __future__ import annotations

import argparse
import sys

from asyncrl.config import ConfigError, load_config, to_dict
from asyncrl.preflight import PreflightError, preflight

RAW_ARGS = True  # everything after `train` is a Hydra override (plus --cfg job, --dry-run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        print("\nExamples:\n  asyncrl train\n  asyncrl train agent=react trainer.total_steps=5\n"
              "  asyncrl train --cfg job agent=single_turn   # print the resolved config and exit\n"
              "  asyncrl train --dry-run env.train_file=x.parquet   # check everything, start nothing")
        return 0
    print_cfg = False
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    if "--cfg" in argv:
        i = argv.index("--cfg")
        what = argv[i + 1] if i + 1 < len(argv) else "job"
        if what != "job":
            print(f"asyncrl train: --cfg {what!r} is not supported; use --cfg job", file=sys.stderr)
            return 2
        del argv[i : i + 2]
        print_cfg = True
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"asyncrl train: config error: {e}", file=sys.stderr)
        return 2
    if print_cfg:
        from omegaconf import OmegaConf

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
    if dry_run:
        print(f"preflight passed; nothing started (--dry-run)\n{report.summary()}")
        return 0
    from asyncrl.controller import run  # imports ray: only once the preflight passed

    return run(cfg, rows=report.train_rows)
