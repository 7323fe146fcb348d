"""`asyncrl bench NAME`: each benchmark is a module asyncrl/bench/NAME.py with `add_arguments(parser)`
and `run(args) -> dict`. The dict is printed as one JSON line; it always holds a ratio against a
baseline measured in the same run, because absolute times on shared machines drift. Comparisons run
their sides interleaved over rounds and report medians (asyncrl/bench/rounds.py); every line also
carries the machine's CPU count and its load average when the bench started and ended."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys

from asyncrl.bench.rounds import machine

RAW_ARGS = True


HELPERS = ("rounds",)  # modules the benchmarks share, not benchmarks themselves


def available() -> list[str]:
    """The benchmarks: every module here but the helpers (read from the folder: nothing is imported)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_") and m.name not in HELPERS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: asyncrl bench {{{','.join(names)}}} [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"asyncrl bench: unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__name__}.{name}")
    parser = argparse.ArgumentParser(prog=f"asyncrl bench {name}", description=module.__doc__)
    module.add_arguments(parser)
    parsed = parser.parse_args(rest)
    start = machine()
    result = module.run(parsed)
    end = machine()
    print(json.dumps({"bench": name, **result, "cpus": start["cpus"], "loadavg_start": start["loadavg_1m"],
                      "loadavg_end": end["loadavg_1m"]}), flush=True)
    return 0
