import asyncio

import pytest

from asyncrl.rollout.admission import StalenessGate, admitted, start_budget


@pytest.mark.parametrize("v,eta,b,r,expected", [
    (0, 0, 4, 1, 4),      # sync baseline: one batch ahead only
    (3, 0, 4, 1, 16),
    (0, 2, 4, 1, 12),     # (0 + 2 + 1) * 4
    (5, 4, 2, 1, 20),
    (0, 2, 4, 3, 4),      # ceil(12 / 3)
    (1, 0, 3, 2, 3),      # ceil(6 / 2)
])
def test_start_budget(v, eta, b, r, expected):
    assert start_budget(v, eta, b, r) == expected


async def test_gate_blocks_until_version_advances():
    gate = StalenessGate(max_staleness=1, batch_groups=2)
    for _ in range(4):  # (0 + 1 + 1) * 2
        await asyncio.wait_for(gate.acquire(), 1)
    blocked = asyncio.create_task(gate.acquire())
    for _ in range(10):  # let the loop run the task until it parks on the gate (no clock involved)
        await asyncio.sleep(0)
    assert not blocked.done() and gate.started == 4
    await gate.set_version(1)
    await asyncio.wait_for(blocked, 1)
    assert gate.started == 5 and gate.budget() == 6


async def test_gate_version_never_goes_back():
    gate = StalenessGate(0, 1, version=3, started=4)
    await gate.set_version(1)
    assert gate.version == 3 and gate.budget() == 4


@pytest.mark.parametrize("started,returned,expected", [(0, 0, 0), (5, 0, 5), (5, 2, 3), (4, 4, 0)])
def test_admitted_counts_starts_less_returned(started, returned, expected):
    assert admitted(started, returned) == expected


@pytest.mark.parametrize("started,returned", [(2, 3), (0, 1), (3, -1)])
def test_admitted_refuses_an_impossible_pair(started, returned):
    with pytest.raises(ValueError, match=f"returned={returned} must be in"):
        admitted(started, returned)
    with pytest.raises(ValueError, match="returned="):
        StalenessGate(0, 1, started=started, returned=returned)  # e.g. a corrupt RolloutPosition


async def test_a_returned_start_admits_one_more_group_at_the_same_version():
    gate = StalenessGate(max_staleness=0, batch_groups=2)  # sync: 2 groups at version 0
    for _ in range(2):
        await asyncio.wait_for(gate.acquire(), 1)
    blocked = asyncio.create_task(gate.acquire())
    for _ in range(10):
        await asyncio.sleep(0)
    assert not blocked.done()
    await gate.give_back()  # one of the two groups was closed unserved by the buffer
    await asyncio.wait_for(blocked, 1)
    assert (gate.started, gate.returned, gate.version) == (3, 1, 0)
    again = asyncio.create_task(gate.acquire())
    for _ in range(10):
        await asyncio.sleep(0)
    assert not again.done()  # 3 started - 1 returned = 2: the budget holds again
    again.cancel()


async def test_give_back_never_exceeds_what_was_started():
    gate = StalenessGate(0, 1, started=1, returned=1)
    with pytest.raises(ValueError, match=r"returned=2 must be in \[0, started=1\]"):
        await gate.give_back()
    assert gate.returned == 1
