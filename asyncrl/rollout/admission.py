"""Staleness admission control (AReaL-style), as pure arithmetic.

With batch size B (groups per training step), current policy version v and bound eta, a worker
may have started at most (v + eta + 1) * B groups in total. Each trained batch advances v by one
and opens B more starts, so no started group can be more than eta versions old by the time the
learner could consume it. eta = 0 is the synchronous baseline: B groups, train, sync, B more.
With R workers each gets an equal share of the budget (rounded up).
"""

from __future__ import annotations

import asyncio
import math


def start_budget(version: int, max_staleness: int, batch_groups: int, num_workers: int = 1) -> int:
    """Total groups this worker may have started by `version`: ceil((v + eta + 1) * B / R)."""
    return math.ceil((version + max_staleness + 1) * batch_groups / num_workers)


class StalenessGate:
    """Blocks `acquire()` until starting one more group keeps within `start_budget`."""

    def __init__(self, max_staleness: int, batch_groups: int, num_workers: int = 1, *,
                 version: int = 0, started: int = 0):
        self.max_staleness, self.batch_groups, self.num_workers = max_staleness, batch_groups, num_workers
        self.version, self.started = version, started
        self._cond = asyncio.Condition()

    def budget(self) -> int:
        return start_budget(self.version, self.max_staleness, self.batch_groups, self.num_workers)

    async def acquire(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.started < self.budget())
            self.started += 1

    async def set_version(self, version: int) -> None:
        async with self._cond:
            self.version = max(self.version, version)
            self._cond.notify_all()
