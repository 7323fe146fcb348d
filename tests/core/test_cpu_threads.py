"""How a machine's cores are split between CPU engines and learner ranks."""

import pytest

from asyncrl.fleet import cpu_threads


@pytest.mark.parametrize("mode,cpus,engines,ranks,want", [
    ("async", 2, 1, 1, (1, 1)),    # the default on the project machine: one core each, side by side
    ("sync", 2, 1, 1, (2, 2)),     # they take turns: each gets both cores
    ("async", 16, 2, 2, (4, 4)),
    ("async", 7, 1, 1, (3, 4)),    # the odd core goes to the learner
    ("async", 1, 1, 1, (1, 1)),    # never zero
    ("sync", 4, 3, 1, (1, 4)),
])
def test_cpu_threads(mode, cpus, engines, ranks, want):
    assert cpu_threads(mode, cpus, engines, ranks) == want
