import asyncio

import pytest

from asyncrl.rollout.admission import StalenessGate, start_budget


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
