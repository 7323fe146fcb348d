"""`asyncrl plugins`: every registered plugin by kind, with where it came from."""

from __future__ import annotations

import argparse

from asyncrl import registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plugin", action="append", default=[], help="also load this module path or .py file")


def main(args: argparse.Namespace) -> int:
    registry.load_all(args.plugin)
    plugins = registry.all_plugins()
    for kind in registry.KINDS:
        rows = [p for p in plugins if p.kind == kind]
        print(f"{kind}s:")
        if not rows:
            print("  (none)")
        width = max((len(p.name) for p in rows), default=0)
        for p in rows:
            print(f"  {p.name:<{width}}  {p.origin}")
    return 0
