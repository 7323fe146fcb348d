"""Groups the buffer closes without serving them are reported (`take_dropped`), over real sockets.

The rollout side gives their admission budget back: a group that is never served never advances the
version, so a start it kept would be lost for good.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer

from .conftest import traj, wait_until

pytestmark = pytest.mark.timeout(60)


async def _produce(addr, trajs=(), failed=()):
    p = AsyncBufferProducer(addr)
    try:
        await asyncio.gather(*(p.put(t) for t in trajs))
        for gid, size in failed:
            await p.report_failed(gid, size, 1)
    finally:
        await p.close()


def _taken(svc, n):
    got = []
    assert wait_until(lambda: got.extend(svc.take_dropped()) or len(got) >= n), got
    return got


async def test_an_all_failed_group_is_reported_failed_and_a_partly_failed_one_is_served(service):
    svc = service(max_staleness=1)
    await _produce(svc.address, trajs=[traj("g1-0", "g1", group_size=2)],
                   failed=[("g0", 2), ("g0", 2), ("g1", 2)])
    c = BufferConsumer(svc.address)
    try:
        c.set_version(0)  # any version move closes what is complete and empty
        assert _taken(svc, 1) == [("g0", "failed")]
        b = c.get_batch(1, current_version=0, timeout_s=5)
        assert [(g.group_id, g.failed) for g in b.groups] == [("g1", 1)]  # served with its real size
        assert svc.take_dropped() == []  # each report is taken once
        assert svc.stats()["groups_dropped_failed"] == 1 and svc.stats()["groups_dropped_stale"] == 0
    finally:
        c.close()


async def test_a_group_gone_stale_is_reported_stale(service):
    svc = service(max_staleness=0)
    await _produce(svc.address, trajs=[traj(f"g{g}-{i}", f"g{g}", version=0, group_size=2) for g in (4, 5)
                                       for i in range(2)],
                   failed=[("g6", 2)])
    await _produce(svc.address, trajs=[traj("g6-1", "g6", version=0, group_size=2)])
    c = BufferConsumer(svc.address)
    try:
        c.set_version(1)  # every member of version 0 is now one version too old
        assert sorted(_taken(svc, 3)) == [("g4", "stale"), ("g5", "stale"), ("g6", "stale")]
        s = svc.stats()
        assert (s["groups_dropped_stale"], s["dropped_stale"], s["groups_dropped_failed"]) == (3, 5, 0)
    finally:
        c.close()


async def test_an_outstanding_batch_gone_stale_after_a_restart_is_reported(service, tmp_path):
    wal = tmp_path / "wal"
    svc = service(wal_dir=wal, max_staleness=1)
    await _produce(svc.address, trajs=[traj(f"g{g}-0", f"g{g}", version=g) for g in (7, 8)])
    c = BufferConsumer(svc.address)
    b = c.get_batch(2, current_version=8, timeout_s=5)  # served, never committed
    c.close()
    assert sorted(g.group_id for g in b.groups) == ["g7", "g8"]
    svc.stop()

    again = service(wal_dir=wal, max_staleness=1)
    c = BufferConsumer(again.address)
    try:
        b2 = c.get_batch(2, current_version=9, timeout_s=5)  # g7 (version 7) is now stale for version 9
        assert b2.batch_id == b.batch_id and [g.group_id for g in b2.groups] == ["g8"]
        assert _taken(again, 1) == [("g7", "stale")]
    finally:
        c.close()


def _group(gid, rewards, version=0):
    return [traj(f"{gid}-{i}", gid, version=version, group_size=len(rewards), reward=r) for i, r in enumerate(rewards)]


async def test_dynamic_sampling_closes_groups_of_equal_rewards_within_its_bound_and_after_a_restart(service, tmp_path):
    """algorithm.dynamic_sampling: a complete group whose rewards are all equal is closed unserved as
    "uniform" (its start goes back; the rollout side draws a fresh prompt), at most `uniform_limit` between
    two batches, past which it is served as it is; a group of one, or of unequal rewards, is served. The
    closing is not logged: after a restart the same groups close again, and are reported again."""
    wal = tmp_path / "wal"
    svc = service(wal_dir=wal, uniform_limit=2)
    await _produce(svc.address, trajs=[*_group("u1", [1.0, 1.0]), *_group("u2", [0.0, 0.0, 0.0]),
                                       *_group("mixed", [0.0, 1.0]), *_group("one", [1.0])])
    c = BufferConsumer(svc.address)
    try:
        c.set_version(0)
        assert sorted(_taken(svc, 2)) == [("u1", "uniform"), ("u2", "uniform")]
        await _produce(svc.address, trajs=_group("u3", [0.5, 0.5]))  # the bound is spent: u3 waits to be served
        b = c.get_batch(3, current_version=0, timeout_s=5)
        assert sorted(g.group_id for g in b.groups) == ["mixed", "one", "u3"]
        s = svc.stats()
        assert (s["groups_dropped_uniform"], s["uniform_served"], s["size"]) == (2, 1, 0)
        await _produce(svc.address, trajs=_group("u4", [1.0, 1.0]))  # a served batch opens the bound again
        c.set_version(0)
        assert _taken(svc, 1) == [("u4", "uniform")] and svc.stats()["size"] == 0
    finally:
        c.close()
    svc.stop()

    again = service(wal_dir=wal, uniform_limit=2)
    try:
        assert sorted(_taken(again, 3)) == [("u1", "uniform"), ("u2", "uniform"), ("u4", "uniform")]
        assert again.stats()["size"] == 0 and again.stats()["groups_complete"] == 0
    finally:
        again.stop()


async def test_without_dynamic_sampling_groups_of_equal_rewards_are_served(service):
    svc = service()
    await _produce(svc.address, trajs=_group("u1", [1.0, 1.0]))
    c = BufferConsumer(svc.address)
    try:
        assert [g.group_id for g in c.get_batch(1, current_version=0, timeout_s=5).groups] == ["u1"]
        assert svc.take_dropped() == [] and svc.stats()["uniform_served"] == 0
    finally:
        c.close()
