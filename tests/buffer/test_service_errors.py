"""A buffer whose log write fails for real (RLIMIT_FSIZE in the service's own process): every waiting and
later request gets an ERR naming the path and errno, the service reports the error and stops, and the
log it leaves replays every trajectory it acknowledged. Never a hang."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys

import pytest

from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer, BufferError
from asyncrl.buffer.wal import WAL_NAME
from asyncrl.util.net import free_port
from tests.buffer.conftest import traj

LOG_LIMIT = 64 << 10  # bytes: the service's process may not grow a file past this


def _limited_log() -> None:  # runs in the service's process before exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (LOG_LIMIT, LOG_LIMIT))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG


def _start(wal_dir, limited: bool) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "buffer", "--wal-dir", str(wal_dir), "--port", str(free_port()),
         "--fsync", "each", "--max-staleness", "0", "--disk-reserve-bytes", "0", "--curve", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_limited_log if limited else None)
    line = proc.stdout.readline()
    if not line.startswith("BUFFER_ADDRESS "):
        proc.kill()
        raise RuntimeError(f"buffer subprocess did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, line.split()[1]


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


async def _put_until_refused(address: str) -> tuple[list[str], BufferError]:
    producer = AsyncBufferProducer(address, timeout_s=30.0, retries=2)
    acked: list[str] = []
    try:
        for i in range(100):  # ~26 KB each: the limit is crossed within a few
            t = traj(f"u{i}", f"g{i}", n=2000)
            try:
                await producer.put(t)
            except BufferError as e:
                return acked, e
            acked.append(t.uid)
    finally:
        await producer.close()
    raise AssertionError(f"100 puts of ~26 KB all acked under a {LOG_LIMIT}-byte file limit")


@pytest.mark.timeout(180)
def test_failed_log_write_is_refused_by_name_then_the_log_replays(tmp_path):
    wal = tmp_path / "wal"
    proc, address = _start(wal, limited=True)
    try:
        acked, err = asyncio.run(_put_until_refused(address))
        want = f"buffer log write failed: [Errno 27] File too large: '{wal / WAL_NAME}'"
        assert "buffer stopped: " + want in str(err)
        assert acked, "the first puts fit under the limit and were acked"
        proc.wait(timeout=60)  # the service stops on its own, with the error
        assert proc.returncode != 0
        assert want in proc.stderr.read()
    finally:
        _end(proc)

    # recovery: the log holds every acknowledged trajectory (the torn last record is cut off)
    proc, address = _start(wal, limited=False)
    consumer = BufferConsumer(address, timeout_s=30.0)
    try:
        batch = consumer.get_batch(len(acked), current_version=0, timeout_s=30.0)
        assert batch is not None
        assert sorted(t.uid for t in batch.trajectories()) == sorted(acked)
    finally:
        consumer.close()
        _end(proc)


@pytest.mark.timeout(120)
def test_a_stopped_service_answers_every_request_with_its_error(tmp_path):
    """In process: after the loop fails, a GET that was parked and any later request are answered with
    ERR naming the error, and health() reports it (what the controller's supervisor reads)."""
    from asyncrl.buffer.server import BufferService
    from asyncrl.config import BufferConfig

    svc = BufferService(BufferConfig(fsync="each", curve="off"), tmp_path / "wal", 0)
    svc.start()
    consumer = BufferConsumer(svc.address, timeout_s=30.0)
    try:
        assert svc.health() is None
        # the log's descriptor is now read-only: the next write fails for real with EBADF (an error other
        # than a full disk, which is retryable instead: test_disk_full.py)
        ro = os.open(svc.wal.path, os.O_RDONLY)
        os.dup2(ro, svc.wal._fd)
        os.close(ro)
        want = f"buffer log write failed: [Errno 9] Bad file descriptor: '{svc.wal.path}'"
        with pytest.raises(BufferError) as e:
            consumer.commit([1], step=1)  # the commit record's write fails
        assert f"buffer stopped: {want}" in str(e.value)
        assert svc.health() == want
        with pytest.raises(BufferError, match="buffer stopped: buffer log write failed"):
            consumer.get_batch(1, current_version=0, timeout_s=5.0)
        with pytest.raises(BufferError, match="buffer stopped: buffer log write failed"):
            consumer.stats()
    finally:
        consumer.close()
        svc.stop()


@pytest.mark.timeout(180)
def test_supervisor_stops_the_run_when_the_buffer_actor_reports_its_error(tmp_path):
    """The controller's path: the buffer runs in a Ray actor; its process's file-size limit is lowered under
    the log (prlimit), so the next append fails for real; the supervisor's check raises BufferFailed
    naming the path and errno instead of anyone waiting."""
    import ray

    from asyncrl.buffer.actor import BufferActor
    from asyncrl.config import BufferConfig
    from asyncrl.run.supervisor import BufferFailed, Supervisor

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = BufferActor.remote(BufferConfig(fsync="each", curve="off"), str(tmp_path / "wal"), 0, None)
        addr = ray.get(actor.address.remote())
        sup = Supervisor(engines=[], engine_urls=[], learners=None, base_weights="", restart_weights=tmp_path,
                         spawn_worker=None, buffer=actor)
        sup.check(0)  # healthy: nothing raised
        assert asyncio.run(_put_until_refused_after(addr, ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))))
        with pytest.raises(BufferFailed) as e:
            sup.check(0)
        wal = tmp_path / "wal" / WAL_NAME
        assert f"replay buffer stopped: buffer log write failed: [Errno 27] File too large: '{wal}'" in str(e.value)
        assert "resume with trainer.resume=auto" in str(e.value)
        ray.kill(actor)
    finally:
        if started:
            ray.shutdown()


async def _put_until_refused_after(address: str, pid: int) -> bool:
    """One put acked, then the service's file-size limit drops below the log: the next put is refused."""
    producer = AsyncBufferProducer(address, timeout_s=30.0, retries=2)
    try:
        await producer.put(traj("a0", "ga"))
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, 1))
        with pytest.raises(BufferError, match="buffer stopped: buffer log write failed"):
            await producer.put(traj("a1", "gb"))
        return True
    finally:
        await producer.close()
