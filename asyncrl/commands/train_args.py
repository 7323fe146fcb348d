"""The command line of `asyncrl train`, read before Hydra composes anything.

    asyncrl train [-m|--multirun] [--dry-run] [--cfg job] [-h|--help] [overrides...]

Overrides are Hydra's (`key=value`, `group=option`, `+key=value`, `~key`), parsed with Hydra's own
override parser. Three things are settled here so that nothing a Hydra user types is silently ignored:

- Sweeps. A sweep value (`a,b`, `range(...)`, `choice(...)`, `glob(...)` on a config group) runs the
  combinations one after another with `-m` (asyncrl/commands/sweep.py); without `-m` it is refused with the
  command that would run it. `interval(...)` (an optimizer's search space) is refused by name.
- `hydra.*` overrides. asyncrl composes with Hydra's Compose API, so Hydra's own runtime settings do
  not exist; the ones with a meaning here are translated, every other is refused naming the key:
      hydra.run.dir=D    -> trainer.output_dir=D          (the run's directory)
      hydra.job.name=N   -> trainer.run_name=N            (outputs/<N>)
      hydra.sweep.dir=D  -> the sweep's directory (with -m only)
  and `hydra/<group>=...` (launchers, sweepers, job_logging) is refused.
- The flags above; anything else starting with `-` is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Optional

HYDRA_TRANSLATED = {"hydra.run.dir": "trainer.output_dir", "hydra.job.name": "trainer.run_name"}
FLAGS = ("-m", "--multirun", "--dry-run", "--cfg", "-h", "--help")


class TrainArgsError(ValueError):
    """A command-line mistake; the message names the argument and what to type instead."""


@dataclass
class TrainArgs:
    overrides: list[str] = field(default_factory=list)  # what Hydra composes (hydra.* translated away)
    typed: list[str] = field(default_factory=list)  # the overrides exactly as typed (the run's record)
    multirun: bool = False
    dry_run: bool = False
    print_cfg: bool = False
    help: bool = False
    sweep_dir: Optional[str] = None


def parse_train_args(argv: list[str]) -> TrainArgs:
    """Split flags from overrides, translate or refuse `hydra.*`, and refuse a sweep without -m."""
    out = TrainArgs()
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "--multirun"):
            out.multirun = True
        elif a == "--dry-run":
            out.dry_run = True
        elif a in ("-h", "--help"):
            out.help = True
        elif a == "--cfg":
            what = argv[i + 1] if i + 1 < len(argv) else "job"
            if what != "job":
                raise TrainArgsError(f"--cfg {what!r} is not supported; use --cfg job")
            out.print_cfg = True
            i += 1
        elif a.startswith("-") and "=" not in a:
            raise TrainArgsError(f"unknown option {a!r}; options: {', '.join(FLAGS)}; everything else is a Hydra "
                                 "override such as trainer.total_steps=5")
        else:
            rest.append(a)
        i += 1
    out.typed = list(rest)
    for ov in rest:
        key, sep, value = ov.partition("=")
        bare = key.lstrip("+~")
        if bare == "hydra" or bare.startswith(("hydra.", "hydra/")):
            translated = _hydra_override(bare, value if sep else None, out)
            if translated is not None:
                out.overrides.append(translated)
        else:
            out.overrides.append(ov)
    sweeps = sweep_keys(out.overrides)
    if sweeps and not out.multirun:
        raise TrainArgsError(f"{', '.join(repr(s) for s in sweeps)} {'is a sweep' if len(sweeps) == 1 else 'are sweeps'} "
                             "(several values); to run each combination one after another add -m: asyncrl train -m "
                             + " ".join(out.typed) + "; for a list value write key=[a,b]")
    if out.sweep_dir is not None and not out.multirun:
        raise TrainArgsError("hydra.sweep.dir applies to sweeps only (asyncrl train -m ...); for one run use "
                             "hydra.run.dir=DIR or trainer.output_dir=DIR")
    return out


def _hydra_override(key: str, value: Optional[str], out: TrainArgs) -> Optional[str]:
    if value is None or key.startswith("hydra/") or key == "hydra":
        raise TrainArgsError(f"{key!r}: Hydra's runtime groups (launchers, sweepers, logging) are not used by "
                             "asyncrl train, which composes its config itself; sweeps run with -m, one after "
                             "another; logging goes to the run dir's train.log")
    if key in HYDRA_TRANSLATED:
        return f"{HYDRA_TRANSLATED[key]}={value}"
    if key == "hydra.sweep.dir":
        out.sweep_dir = value
        return None
    known = ", ".join([*HYDRA_TRANSLATED, "hydra.sweep.dir"])
    raise TrainArgsError(f"{key!r} is a Hydra runtime setting that asyncrl train does not use; the ones it "
                         f"understands: {known} (or set trainer.output_dir / trainer.run_name directly)")


def sweep_keys(overrides: list[str]) -> list[str]:
    """The overrides whose value is a sweep (Hydra's sweep syntax), as typed."""
    return [o.input_line for o in _parse(overrides) if o.is_sweep_override()]


def _parse(overrides: list[str]):
    # lazy: imports hydra, which this module does not load otherwise
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise TrainArgsError(" ".join(str(e).split())) from None


def expand_sweep(overrides: list[str], group_options) -> list[list[str]]:
    """Every combination of the sweep values (the first sweep varies slowest, as Hydra's BasicSweeper
    orders them); fixed overrides are kept in each. `group_options(group)` lists a config group's options
    for `glob(...)`. interval() is refused: it describes a search space, not values to run."""
    # lazy: imports hydra, which this module does not load otherwise
    from hydra.core.override_parser.types import ValueType

    axes: list[list[str]] = []
    for o in _parse(overrides):
        if not o.is_sweep_override():
            axes.append([o.input_line])
            continue
        key = o.get_key_element()
        if o.value_type == ValueType.INTERVAL_SWEEP:
            raise TrainArgsError(f"{o.input_line!r}: interval() is a search space for an optimizing sweeper; "
                                 "asyncrl train -m runs lists, range() and choice() one after another")
        if o.value_type == ValueType.GLOB_CHOICE_SWEEP:
            options = group_options(o.key_or_group)
            if options is None:
                raise TrainArgsError(f"{o.input_line!r}: glob() selects options of a config group, and "
                                     f"{o.key_or_group!r} is not one")
            values = o.value().filter(options)
        else:
            values = list(o.sweep_string_iterator())
        if not values:
            raise TrainArgsError(f"{o.input_line!r} selects no value")
        axes.append([f"{key}={v}" for v in values])
    return [list(c) for c in product(*axes)]
