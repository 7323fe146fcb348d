"""`asyncrl train [overrides...]`: compose and validate the config, then run the controller."""

from __future__ import annotations

import argparse
import sys

from asyncrl.config import ConfigError, load_config, to_dict

RAW_ARGS = True  # everything after `train` is a Hydra override (plus --cfg job)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        print("\nExamples:\n  asyncrl train\n  asyncrl train agent=react trainer.total_steps=5\n"
              "  asyncrl train --cfg job agent=single_turn   # print the resolved config and exit")
        return 0
    print_cfg = False
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
    from asyncrl.controller import run

    return run(cfg)
