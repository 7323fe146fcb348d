"""Helpers for the buffer tests: trajectory factory, an in-process service, a subprocess service."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.buffer.server import BufferService
from asyncrl.config import BufferConfig
from asyncrl.data.schema import make_trajectory


def traj(uid: str, group_id: str, version: int = 0, group_size: int = 1, n: int = 4, reward: float = 1.0,
         versions=None, loss_mask=None):
    """A small valid trajectory: prompt [1..3], response 100+i, generated tokens at `version`."""
    versions = versions if versions is not None else [version] * n
    loss_mask = loss_mask if loss_mask is not None else [1] * len(versions)
    r = len(versions)
    return make_trajectory(uid=uid, group_id=group_id, group_size=group_size, prompt_ids=[1, 2, 3],
                           response_ids=[100 + i for i in range(r)], loss_mask=loss_mask,
                           behavior_logprobs=[-0.5 * (i + 1) for i in range(r)], versions=versions,
                           reward=reward)


@pytest.fixture
def service(tmp_path):
    """Factory: start a BufferService on a WAL dir (default tmp_path/wal) with staleness bound
    `max_staleness` (default 0), CURVE `keys` (default none) and dynamic sampling's `uniform_limit` (default
    None: off); all are stopped at teardown."""
    started = []

    def make(wal_dir=None, max_staleness=0, keys=None, uniform_limit=None, **cfg_kw):
        cfg = BufferConfig(**{"curve": "off" if keys is None else "on", **cfg_kw})  # the protocol, in plain text
        svc = BufferService(cfg, wal_dir or tmp_path / "wal", max_staleness, keys, uniform_limit)
        svc.start()
        started.append(svc)
        return svc

    yield make
    for s in started:
        s.stop()


class BufferProcess:
    """`asyncrl buffer` in a real subprocess (python -m asyncrl.cli buffer ...)."""

    def __init__(self, wal_dir, port: int, fsync: str = "batched", max_staleness: int = 0, args=(), env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "buffer", "--wal-dir", str(wal_dir), "--port", str(port),
             "--fsync", fsync, "--max-staleness", str(max_staleness), "--curve", "off", *args], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=None if env is None else {**os.environ, **env})
        line = self.proc.stdout.readline()
        if not line.startswith("BUFFER_ADDRESS "):
            self.proc.kill()
            raise RuntimeError(f"buffer subprocess did not start: {line!r}")
        self.address = line.split()[1]

    def freeze(self) -> None:
        """SIGSTOP: requests still reach its socket but are never processed or acked."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def buffer_process():
    procs = []

    def make(wal_dir, port, fsync="batched", max_staleness=0, args=(), env=None):
        """`args`: more `asyncrl buffer` flags; `env`: variables added to the process's environment."""
        p = BufferProcess(wal_dir, port, fsync, max_staleness, args, env)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.terminate()


def wait_until(pred, timeout=60.0):
    """Poll `pred` until it holds (True) or `timeout` passes (False); generous for a loaded machine."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(0.02)
    return False
