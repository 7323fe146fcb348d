"""Staleness admission control (AReaL-style), as pure arithmetic.

With batch size B (groups per training step), current policy version v and bound eta, a worker
may have started at most (v + eta + 1) * B groups in total. Each trained batch advances v by one
and opens B more starts, so no started group can be more than eta versions old by the time the
learner could consume it. eta = 0 is the synchronous baseline: B groups, train, sync, B more.
With R workers each gets an equal share of the budget (rounded up).

Returned budget: a group the buffer closes without serving it (every member failed, or every member
was dropped as stale) never reaches a batch, so it never advances v; if it kept its start, enough such
groups (more than eta * B; one in sync mode) would leave too few starts for a batch, and the run would
wait forever. So each such group gives its start back: a worker may start one more group while
``started - returned < start_budget(v)`` (`admitted`). This keeps the bound's meaning: groups that can
still be trained never exceed (v + eta + 1) * B / R per worker, and a returned start is spent again
under the current v, so what it admits is no older than any other start at v.
"""

from __future__ import annotations

import asyncio
import math


def start_budget(version: int, max_staleness: int, batch_groups: int, num_workers: int = 1) -> int:
    """Total groups this worker may have started by `version`: ceil((v + eta + 1) * B / R)."""
    return math.ceil((version + max_staleness + 1) * batch_groups / num_workers)


def admitted(started: int, returned: int) -> int:
    """Starts that count against the budget: all groups started less those given back (closed unserved)."""
    if not 0 <= returned <= started:
        raise ValueError(f"returned={returned} must be in [0, started={started}]")
    return started - returned


class StalenessGate:
    """Blocks `acquire()` until starting one more group keeps `admitted(started, returned)` within
    `start_budget`; `give_back()` returns the start of a group the buffer closed unserved."""

    def __init__(self, max_staleness: int, batch_groups: int, num_workers: int = 1, *,
                 version: int = 0, started: int = 0, returned: int = 0):
        admitted(started, returned)  # refuses an impossible pair (a corrupt position) here, by name
        self.max_staleness, self.batch_groups, self.num_workers = max_staleness, batch_groups, num_workers
        self.version, self.started, self.returned = version, started, returned
        self._cond = asyncio.Condition()

    def budget(self) -> int:
        return start_budget(self.version, self.max_staleness, self.batch_groups, self.num_workers)

    async def acquire(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: admitted(self.started, self.returned) < self.budget())
            self.started += 1

    async def give_back(self) -> None:
        async with self._cond:
            admitted(self.started, self.returned + 1)
            self.returned += 1
            self._cond.notify_all()

    async def set_version(self, version: int) -> None:
        async with self._cond:
            self.version = max(self.version, version)
            self._cond.notify_all()
