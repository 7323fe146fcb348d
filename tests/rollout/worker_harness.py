"""What the rollout-worker tests do in the controller's place, around a real worker and a real buffer."""

from __future__ import annotations

import asyncio

from asyncrl.buffer.client import BufferConsumer
from asyncrl.buffer.server import BufferService
from asyncrl.rollout.worker import RolloutWorker


async def controller_round(svc: BufferService, consumer: BufferConsumer, worker: RolloutWorker,
                           reported: list[tuple[str, str]]) -> None:
    """What Fleet.next_batch does while it waits: a version report (a parked GET would do the same), then
    the groups the buffer closed unserved handed to the worker; they are appended to `reported`."""
    await asyncio.to_thread(consumer.set_version, 0)
    taken = svc.take_dropped()
    reported.extend(taken)
    if taken:  # as Fleet.route_dropped: the groups dynamic sampling closed are named apart
        await worker.groups_dropped([gid for gid, _ in taken], [gid for gid, why in taken if why == "uniform"])


async def rounds_until(svc: BufferService, consumer: BufferConsumer, worker: RolloutWorker, run: asyncio.Task,
                       reported: list[tuple[str, str]], done, timeout_s: float = 90) -> None:
    """`controller_round` until `done()` holds after one; the worker's loop must keep running meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        await controller_round(svc, consumer, worker, reported)
        if done():
            return
        assert not run.done(), run
        assert loop.time() < deadline, f"not done within {timeout_s}s; reported so far: {reported}"
        await asyncio.sleep(0.1)


async def stop(worker: RolloutWorker, run: asyncio.Task, consumer: BufferConsumer, svc: BufferService) -> None:
    """Stop the worker and wait for its loop, then close the consumer and the buffer service."""
    worker.stop()
    await asyncio.wait_for(run, 30)
    consumer.close()
    svc.stop()
