"""The suite's schedule under pytest-xdist (tests/conftest.py `spread_heavy_tests`): the heavy tests start
first, shared among the workers by their declared seconds, and nothing is lost or repeated."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.conftest import spread_heavy_tests


@dataclass(frozen=True)
class Marker:
    args: tuple


@dataclass(frozen=True)
class Item:
    name: str
    seconds: float = 0.0

    def get_closest_marker(self, name):
        return Marker((self.seconds,)) if name == "heavy" and self.seconds else None


def chunks(order: list[Item], workers: int) -> list[list[Item]]:
    """What pytest-xdist's worksteal scheduler sends each idle worker first: len(pending) // workers left."""
    out, rest = [], list(order)
    for remaining in range(workers, 0, -1):
        n = len(rest) // remaining
        out.append(rest[:n])
        rest = rest[n:]
    return out


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_heavy_tests_lead_every_workers_first_chunk_balanced_by_their_seconds(workers):
    heavy = [Item(f"h{i}", s) for i, s in enumerate([95, 85, 75, 55, 55, 45, 45, 35, 30, 30, 30, 25, 15])]
    light = [Item(f"l{i}") for i in range(300)]
    items = light[:100] + heavy[::2] + light[100:200] + heavy[1::2] + light[200:]  # heavy ones anywhere
    order = spread_heavy_tests(items, workers)
    assert sorted(i.name for i in order) == sorted(i.name for i in items)  # none lost, none twice
    loads = []
    for chunk in chunks(order, workers):
        n = sum(1 for i in chunk if i.seconds)
        assert all(i.seconds for i in chunk[:n]) and not any(i.seconds for i in chunk[n:]), "heavy not first"
        loads.append(sum(i.seconds for i in chunk))
    assert max(loads) - min(loads) <= 95, loads  # greedy, longest first: within the longest test
    assert [i.name for i in order if not i.seconds] == [i.name for i in light]  # light ones keep their order


def test_one_worker_or_no_heavy_test_keeps_the_order():
    items = [Item(f"l{i}") for i in range(10)]
    assert spread_heavy_tests(items, 3) == items
    assert spread_heavy_tests([Item("a", 5), Item("b")], 1) == [Item("a", 5), Item("b")]
