"""Crash safety with a real subprocess: kill -9 mid-stream, restart, commit semantics."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer
from asyncrl.net import free_port

from .conftest import traj

pytestmark = pytest.mark.timeout(120)


def drain(c: BufferConsumer, timeout_s=1.0):
    batches = []
    while (b := c.get_batch(1, 0, timeout_s=timeout_s)) is not None:
        batches.append(b)
    return batches


@pytest.mark.parametrize("fsync", ["batched", "each"])
async def test_kill9_mid_stream_then_restart_keeps_every_acked_trajectory_once(tmp_path, buffer_process, fsync):
    port, wal = free_port(), tmp_path / "wal"
    proc = buffer_process(wal, port, fsync)
    n, acked = 120, []
    p = AsyncBufferProducer(proc.address, timeout_s=0.5, retries=60)

    async def send(i):
        await p.put(traj(f"t{i}", f"t{i}", n=64))
        acked.append(f"t{i}")

    sem = asyncio.Semaphore(8)

    async def bounded(i):
        async with sem:
            await send(i)

    tasks = [asyncio.ensure_future(bounded(i)) for i in range(n)]
    while len(acked) < 40:
        await asyncio.sleep(0.005)
    # Freeze it first so the puts now in flight are delivered but certainly unacked when it dies
    # (without the freeze a fast buffer may have acked all of them, and nothing would need resending).
    proc.freeze()
    await asyncio.sleep(0.2)
    proc.kill9()
    acked_before_kill = set(acked)
    await asyncio.sleep(0.3)
    proc2 = buffer_process(wal, port, fsync)  # same port: the producer's socket reconnects and resends
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await p.close()
    assert p.resends >= 1
    c = BufferConsumer(proc2.address)
    uids = [t.uid for b in drain(c) for t in b.trajectories()]
    st = c.stats()
    c.close()
    counts = Counter(uids)
    assert acked_before_kill <= set(counts)  # every trajectory acked before the crash survived it
    assert set(counts) == {f"t{i}" for i in range(n)}
    assert max(counts.values()) == 1  # none twice
    assert st["served"] == n


async def test_uncommitted_batches_are_served_again_after_restart(tmp_path, buffer_process):
    port, wal = free_port(), tmp_path / "wal"
    proc = buffer_process(wal, port, max_staleness=10)
    p = AsyncBufferProducer(proc.address)
    await asyncio.gather(*(p.put(traj(f"u{g}-{i}", f"G{g}", version=g, group_size=2))
                           for g in range(7) for i in range(2)))
    await p.close()
    c = BufferConsumer(proc.address)
    served = [c.get_batch(2, 6, timeout_s=5) for _ in range(3)]  # 6 of 7 groups served
    assert [b.batch_id for b in served] == [0, 1, 2]
    c.commit([0], step=1)
    c.close()
    proc.kill9()

    proc = buffer_process(wal, port, max_staleness=10)
    c = BufferConsumer(proc.address)
    again = [c.get_batch(2, 6, timeout_s=5) for _ in range(2)]
    # exactly the uncommitted batches, same ids, same groups, same trajectories
    assert [b.batch_id for b in again] == [1, 2]
    for old, new in zip(served[1:], again):
        assert [(g.group_id, sorted(t.uid for t in g.trajectories)) for g in old.groups] == \
               [(g.group_id, sorted(t.uid for t in g.trajectories)) for g in new.groups]
    c.commit([1], step=2)  # a learner resuming from its checkpoint commits what it had trained
    nxt = c.get_batch(1, 6, timeout_s=5)  # then the never-served group, as a new batch
    assert (nxt.batch_id, nxt.groups[0].group_id) == (3, "G6")
    assert c.get_batch(1, 6, timeout_s=0.3) is None
    c.close()
    proc.terminate()  # a clean stop this time

    proc = buffer_process(wal, port)
    c = BufferConsumer(proc.address)
    assert [b.batch_id for b in drain(c, 0.5)] == [2, 3]  # still uncommitted: 2 and the new 3
    c.commit([2, 3], step=3)
    c.close()
    proc.kill9()

    proc = buffer_process(wal, port)
    c = BufferConsumer(proc.address)
    assert drain(c, 0.3) == []
    st = c.stats()
    # dedup survives compaction: a resend of an old, trained uid is still a duplicate
    p = AsyncBufferProducer(proc.address)
    assert await p.put_bytes(__import__("asyncrl.schema").schema.encode(traj("u0-0", "G0", group_size=2))) == "dup"
    await p.close()
    c.close()
    assert (st["size"], st["batches_outstanding"], st["next_batch_id"]) == (0, 0, 4)


async def test_replayed_batch_still_obeys_staleness(tmp_path, service):
    """A batch outstanding at a crash is served again, but never with members now too stale."""
    svc = service(wal_dir=tmp_path / "w", max_staleness=2)
    p = AsyncBufferProducer(svc.address)
    await asyncio.gather(*(p.put(traj(f"m{v}", "M", version=v, group_size=3)) for v in (1, 2, 3)))
    await p.close()
    c = BufferConsumer(svc.address)
    first = c.get_batch(1, current_version=3, timeout_s=5)
    c.close()
    svc.stop()
    assert sorted(t.uid for t in first.trajectories()) == ["m1", "m2", "m3"]
    svc = service(wal_dir=tmp_path / "w", max_staleness=2)
    c = BufferConsumer(svc.address)
    again = c.get_batch(1, current_version=5, timeout_s=5)  # now v >= 3 only
    st = c.stats()
    c.close()
    assert again.batch_id == first.batch_id
    g = again.groups[0]
    assert ([t.uid for t in g.trajectories], g.failed, g.expected) == (["m3"], 2, 3)
    assert st["dropped_stale"] == 2
