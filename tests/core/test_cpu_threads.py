"""How a machine's cores are split between CPU engines and learner ranks."""

import pytest

from asyncrl.util.cpus import available_cpus, cpu_threads


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


@pytest.mark.parametrize("args,match", [
    (("fast", 2, 1, 1), "mode must be 'async' or 'sync', got 'fast'"),
    (("async", 0, 1, 1), "got 0, 1, 1"),
    (("sync", 2, 0, 1), "got 2, 0, 1"),
])
def test_cpu_threads_rejects_nonsense(args, match):
    with pytest.raises(ValueError, match=match):
        cpu_threads(*args)


def test_available_cpus_is_positive():
    assert available_cpus() >= 1
