"""BufferActor: the service inside a real Ray actor, driven the way the controller drives it (with
CURVE: the keys travel as an actor argument and each client uses its role's pair)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer
from asyncrl.buffer.keys import BufferKeys, endpoint
from asyncrl.config import BufferConfig

from .conftest import traj


@pytest.mark.timeout(180)
def test_buffer_actor_serves_and_reports(tmp_path):
    from asyncrl.buffer.actor import BufferActor

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        cfg = BufferConfig(curve="on")
        keys = BufferKeys.for_run(cfg)
        actor = BufferActor.remote(cfg, str(tmp_path / "wal"), 2, keys)
        addr = ray.get(actor.address.remote())
        assert addr.startswith("tcp://127.0.0.1:")

        async def produce():
            p = AsyncBufferProducer(endpoint(keys, addr, "producer"))
            await p.put(traj("r0", "R", version=1, group_size=2))
            await p.put(traj("r1", "R", version=3, group_size=2))
            await p.put(traj("s0", "S", version=1))
            await p.close()

        asyncio.run(produce())
        ray.get(actor.set_version.remote(4))  # with the bound 2 it was built with, r0 (v1 < 2) is stale
        st = ray.get(actor.stats.remote())
        assert (st["version"], st["size"], st["groups_complete"], st["age_versions_max"]) == (4, 1, 1, 1)
        assert st["dropped_stale"] == 2
        assert ray.get(actor.take_dropped.remote()) == [("S", "stale")]  # closed unserved: for the rollout side
        c = BufferConsumer(endpoint(keys, addr, "consumer"))
        b = c.get_batch(1, current_version=4, timeout_s=5)
        c.close()
        assert [(t.uid, g.failed) for g in b.groups for t in g.trajectories] == [("r1", 1)]
        ray.get(actor.stop.remote())
        ray.kill(actor)
    finally:
        if started:
            ray.shutdown()
