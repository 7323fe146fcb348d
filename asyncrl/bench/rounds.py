"""Interleaved measurement for `asyncrl bench`: the sides of a comparison run in turns (A, B, C, A, B, C,
...) for a number of rounds in one process layout, so a load that comes and goes on a shared machine
falls on every side alike; each side is reported by its median with its spread, and a ratio is a ratio
of medians. `machine()` records what the machine was doing (CPU count, load average), which every
bench's JSON line carries (asyncrl/bench/__init__.py)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

MIN_ROUNDS = 3


def interleave(sides: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Call each side once per round, in the given order, `rounds` times; each call returns a measured
    figure (e.g. seconds or items/s). Returns side -> its figures in round order."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            out[name].append(float(fn()))
    return out


def summary(name: str, values: list[float], digits: int = 2) -> dict[str, float | list[float]]:
    """`<name>` (the median), `<name>_min`, `<name>_max` and `<name>_all` (every round, in order)."""
    return {name: round(statistics.median(values), digits), f"{name}_min": round(min(values), digits),
            f"{name}_max": round(max(values), digits), f"{name}_all": [round(v, digits) for v in values]}


def ratio(num: list[float], den: list[float], digits: int = 3) -> float:
    """The ratio of the medians (not the median of per-round ratios: the sides of a round are not paired)."""
    return round(statistics.median(num) / statistics.median(den), digits)


def machine() -> dict[str, float | int | None]:
    """CPU count and the 1-minute load average now (None where the OS does not report it)."""
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "loadavg_1m": load}
