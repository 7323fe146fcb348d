"""Hostile input and exposure: random frames, raw TCP garbage, non-loopback binds, CURVE."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer import protocol as P
from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer
from asyncrl.buffer.keys import BufferKeys
from asyncrl.buffer.server import BufferConfigError, BufferService
from asyncrl.config import BufferConfig
from asyncrl.util.net import is_loopback

from .conftest import traj

pytestmark = pytest.mark.timeout(90)

frames_st = st.lists(st.one_of(st.binary(max_size=1500), st.sampled_from(list(P.OPS)), st.just(b"")),
                     min_size=0, max_size=6)


def test_random_frames_are_answered_and_the_service_stays_up(service):
    svc = service(max_frame_bytes=1024)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.address)
    sent = {"n": 0, "answered": 0}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(frames_st)
    def throw(frames):
        if not frames:  # zmq cannot send an empty multipart message
            return
        sock.send_multipart(frames)
        sent["n"] += 1
        assert sock.poll(3000), f"no reply to {frames!r}"
        sock.recv_multipart()
        sent["answered"] += 1

    throw()
    sock.close()
    assert sent["answered"] == sent["n"] > 50
    c = BufferConsumer(svc.address)
    st_ = c.stats()
    assert st_["malformed"] >= sent["n"] // 2  # the vast majority was garbage, and counted
    asyncio.run(_put_one(svc.address))
    b = c.get_batch(1, 0, 0, timeout_s=5)
    assert [t.uid for t in b.trajectories()] == ["after-fuzz"]
    c.close()
    assert svc.error is None and svc._thread.is_alive()


async def _put_one(addr):
    p = AsyncBufferProducer(addr)
    await p.put(traj("after-fuzz", "after-fuzz"))
    await p.close()


def test_raw_tcp_garbage_does_not_break_the_service(service):
    svc = service()
    host, port = svc.address[len("tcp://"):].rsplit(":", 1)
    for payload in [os.urandom(4096), b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(100), b"GET / HTTP/1.1\r\n\r\n"]:
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(payload)
    half = socket.create_connection((host, int(port)), timeout=2)  # a peer that opens and never speaks
    c = BufferConsumer(svc.address, timeout_s=3)
    assert c.stats()["size"] == 0
    asyncio.run(_put_one(svc.address))
    assert c.get_batch(1, 0, 0, timeout_s=5).groups[0].group_id == "after-fuzz"
    c.close()
    half.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "10.1.2.3", "eth0"])
def test_non_loopback_bind_without_keys_is_refused(tmp_path, host):
    with pytest.raises(BufferConfigError, match="not a loopback address and buffer.curve='off'"):
        BufferService(BufferConfig(host=host, curve="off"), tmp_path, 0)
    for curve in ("on", "auto"):  # on (the default), and auto for a non-loopback bind: keys needed
        with pytest.raises(BufferConfigError, match="needs the CURVE keys"):
            BufferService(BufferConfig(host=host, curve=curve), tmp_path, 0)


def test_loopback_recognition():
    assert all(is_loopback(h) for h in ["127.0.0.1", "127.5.0.1", "localhost", "::1"])
    assert not any(is_loopback(h) for h in ["0.0.0.0", "*", "192.168.1.1", "example.com"])


def test_cli_refuses_exposed_bind(tmp_path):
    for extra in ([], ["--curve", "off"]):  # on (the default): CURVE without --keys-dir; off: exposed without CURVE
        r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "buffer", "--host", "0.0.0.0", "--wal-dir",
                            str(tmp_path), *extra], check=False, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and ("--keys-dir" if not extra else "without CURVE") in r.stdout, r.stdout


def test_keys_without_curve_are_refused(tmp_path):
    with pytest.raises(BufferConfigError, match="CURVE keys were given but buffer.curve='auto'"):
        BufferService(BufferConfig(curve="auto"), tmp_path, 0, BufferKeys.generate())  # loopback + auto: CURVE off
