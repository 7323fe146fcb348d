"""Disk full on a real filesystem: the buffer process runs in a user + mount namespace of its own
(`unshare -rm`, as the sandbox does) with a 2 MiB tmpfs as its log directory. Producers get retryable
refusals and keep their trajectories, GET and COMMIT still work while the disk is full, acking resumes
when space is freed, the log stays well-formed, and nothing acknowledged is lost across a crash."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from asyncrl.buffer import protocol as P
from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer
from asyncrl.buffer.diskspace import RESERVE_NAME
from asyncrl.buffer.wal import WAL_NAME, BadRange, scan
from asyncrl.data.schema import encode
from asyncrl.util.durable import free_bytes
from asyncrl.util.net import free_port

from .conftest import traj

pytestmark = pytest.mark.timeout(180)

TMPFS = 2 << 20
RESERVE = 256 << 10
FILLER = 1 << 20
N = 40
# put one by one before the disk fills; the rest (concurrent) fill it. 24 of these 26 KB trajectories leave
# less than the reserve free once they are written, so after the failed write the buffer stays full until the
# filler goes (the space probe ends an episode once it holds the reserve with as much again free: with 16,
# 600 KB were free after the failure and the episode ended within one probe, racing the checks below)
FIRST = 24


def _start_in_namespace(mnt: Path) -> tuple[subprocess.Popen, str]:
    """`asyncrl buffer` with its log on a fresh 2 MiB tmpfs mounted over `mnt` in its own namespaces."""
    cmd = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={TMPFS} tmpfs "$0" && exec "$@"', str(mnt),
           sys.executable, "-m", "asyncrl.cli", "buffer", "--wal-dir", str(mnt), "--port", str(free_port()),
           "--fsync", "batched", "--max-staleness", "0", "--disk-reserve-bytes", str(RESERVE),
           "--disk-probe-s", "0.05", "--curve", "off"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    if not line.startswith("BUFFER_ADDRESS "):
        proc.kill()
        raise RuntimeError(f"buffer in a mount namespace did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, line.split()[1]


async def _until(pred, timeout_s: float = 60.0) -> None:
    async def poll():
        while not pred():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


def _raw_put(address: str, body: bytes) -> list[bytes]:
    """One PUT request (the single-trajectory op) from a fresh DEALER; its reply frames."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send_multipart([b"r1", P.PUT, body])
        assert s.poll(30_000), "no reply to a PUT while the disk is full"
        return s.recv_multipart()
    finally:
        s.close()


async def test_full_disk_refuses_puts_serves_and_resumes_losing_nothing(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="asyncrl.buffer.client")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc, address = _start_in_namespace(mnt)
    view = Path(f"/proc/{proc.pid}/root{mnt}")  # the namespace's tmpfs, seen from here
    clients: list = []
    try:
        assert (view / RESERVE_NAME).stat().st_size == RESERVE
        (view / "filler").write_bytes(b"\0" * FILLER)  # another writer takes half the disk
        size = len(encode(traj("d0", "dg0", n=2000)))
        assert free_bytes(view) < N * size < free_bytes(view) + FILLER  # the puts fill it; freeing the filler fits them

        producer = AsyncBufferProducer(address, timeout_s=30.0, retries=2)
        consumer = BufferConsumer(address, timeout_s=30.0)
        clients.extend([producer, consumer])  # closed below even when a check fails: a leaked zmq context
        # blocks whichever later test's garbage collection finalizes it
        for i in range(FIRST):  # these fit: acked one by one
            await producer.put(traj(f"d{i}", f"dg{i}", n=2000))
        tasks = [asyncio.create_task(producer.put(traj(f"d{i}", f"dg{i}", n=2000))) for i in range(FIRST, N)]
        await _until(lambda: producer.full_waits > 0)  # a retryable refusal, not an error
        await asyncio.sleep(0)
        st = await asyncio.to_thread(consumer.stats)
        assert st["disk_full"] and st["full_refusals"] > 0 and st["disk_full_episodes"] == 1
        assert not st["disk_reserve_held"]
        assert not any(t.done() and t.exception() for t in tasks)
        reply = await asyncio.to_thread(_raw_put, address, encode(traj("raw", "rawg", n=2000)))
        assert reply[:2] == [b"r1", P.FULL] and b"buffer disk full" in reply[2] and b"bytes free in" in reply[2]
        acked = FIRST + sum(t.done() for t in tasks)
        assert acked < N, "puts stay refused while the disk is full"

        # still serving and committing while full (their records go into the released reserve's space)
        batch = await asyncio.to_thread(consumer.get_batch, FIRST // 2, 0, None, 30.0)
        assert batch is not None and len(batch.groups) == FIRST // 2
        committed = [t.uid for t in batch.trajectories()]
        await asyncio.to_thread(consumer.commit, [batch.batch_id], 1)
        assert (await asyncio.to_thread(consumer.stats))["disk_full"]
        assert not all(t.done() for t in tasks), "puts stay refused while the disk is full"

        (view / "filler").unlink()  # space returns: acking resumes on its own
        await asyncio.wait_for(asyncio.gather(*tasks), 90)
        st = await asyncio.to_thread(consumer.stats)
        assert not st["disk_full"] and st["disk_reserve_held"] and st["received"] == N
        said = [r.getMessage() for r in caplog.records]
        assert sum("refuses puts" in m for m in said) == 1  # once per episode, not once per refusal
        assert sum("acks puts again" in m for m in said) == 1
        assert producer.full_waits > 1

        # the log is well-formed: every byte of it is an intact record (failed writes were cut back)
        wal = view / WAL_NAME
        os.kill(proc.pid, signal.SIGSTOP)  # a crash now: take the log as it is, then kill
        copy = tmp_path / "copy"
        copy.mkdir()
        shutil.copyfile(wal, copy / WAL_NAME)
    finally:
        for client in clients:
            if isinstance(client, AsyncBufferProducer):
                await client.close()
            else:
                client.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    parts = list(scan(copy / WAL_NAME))
    assert parts and not [p for p in parts if isinstance(p, BadRange)]
    assert parts[-1].end == (copy / WAL_NAME).stat().st_size

    # nothing acknowledged is lost: after the crash, exactly the uncommitted trajectories are served, once
    from asyncrl.buffer.server import BufferService
    from asyncrl.config import BufferConfig

    svc = BufferService(BufferConfig(disk_reserve_bytes=0, curve="off"), copy, 0)
    svc.start()
    c = BufferConsumer(svc.address, timeout_s=30.0)
    try:
        served = []
        while (b := c.get_batch(1, 0, timeout_s=0.5)) is not None:
            served += [t.uid for t in b.trajectories()]
    finally:
        c.close()
        svc.stop()
    assert len(served) == len(set(served))
    assert sorted(served + committed) == sorted(f"d{i}" for i in range(N))
