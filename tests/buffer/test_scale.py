"""The buffer process's memory does not grow with the number of trajectories it has carried: small
training trajectories go through put / get / commit in rounds, and the real process's RSS after many
rounds stays within a fixed bound of its RSS after the first ones (dedupe keeps closed groups as
intervals, served and committed batches leave nothing behind). The million-trajectory run is
`asyncrl bench buffer --scale` (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio

import msgspec
import psutil
import pytest

from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer
from asyncrl.data.schema import encode
from asyncrl.util.net import free_port

from .conftest import traj

pytestmark = pytest.mark.timeout(240)

GROUP = 4
ROUND = 2048  # trajectories put, then served and committed, per round
RSS_GROWTH_MAX = 4 << 20  # bytes: allocator noise; remembering every uid (as the old dedupe did) grew it 10 MiB here


async def _rounds(producer: AsyncBufferProducer, consumer: BufferConsumer, start: int, n_rounds: int) -> None:
    base = traj("x", "x", group_size=GROUP)
    for r in range(start, start + n_rounds):
        first = r * ROUND // GROUP
        bodies = [encode(msgspec.structs.replace(base, uid=f"run1-g{p}-{i}", group_id=f"run1-g{p}"))
                  for p in range(first, first + ROUND // GROUP) for i in range(GROUP)]
        await asyncio.gather(*(producer.put_bytes(b) for b in bodies))
        ids, got = [], 0
        while got < ROUND:
            b = await asyncio.to_thread(consumer.get_batch, 128, 0, None, 30.0)
            assert b is not None, f"round {r}: the buffer served {got} of {ROUND}"
            ids.append(b.batch_id)
            got += sum(len(g.trajectories) for g in b.groups)
        await asyncio.to_thread(consumer.commit, ids, r)


async def test_rss_does_not_grow_with_the_trajectories_carried(tmp_path, buffer_process):
    proc = buffer_process(tmp_path / "wal", free_port(), fsync="batched", max_staleness=0)
    ps = psutil.Process(proc.proc.pid)
    producer = AsyncBufferProducer(proc.address, timeout_s=60.0)
    consumer = BufferConsumer(proc.address, timeout_s=60.0)
    try:
        await _rounds(producer, consumer, 0, 8)  # warm: allocator pools, socket buffers
        rss_warm = ps.memory_info().rss
        await _rounds(producer, consumer, 8, 32)
        rss = ps.memory_info().rss
        st = await asyncio.to_thread(consumer.stats)
    finally:
        await producer.close()
        consumer.close()
    assert rss - rss_warm < RSS_GROWTH_MAX, f"RSS grew {(rss - rss_warm) >> 20} MiB over {32 * ROUND} trajectories"
    assert (st["received"], st["size"], st["batches_outstanding"]) == (40 * ROUND, 0, 0)
    assert (st["closed_intervals"], st["closed_other"], st["dedupe_other"]) == (1, 0, 0)
