"""The service over real sockets: round trip, dedup, staleness, groups, order, back-pressure, errors."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

from asyncrl.buffer import protocol as P
from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer, BufferError
from asyncrl.buffer.server import BufferConfigError, BufferService
from asyncrl.config import BufferConfig
from asyncrl.data.schema import encode
from asyncrl.util.net import free_port

from .conftest import traj, wait_until

pytestmark = pytest.mark.timeout(60)


async def put_all(addr, trajs, **kw):
    p = AsyncBufferProducer(addr, **kw)
    try:
        await asyncio.gather(*(p.put(t) for t in trajs))
    finally:
        await p.close()


def raw_request(addr, frames, timeout_ms=3000):
    """Send one raw multipart request from a fresh DEALER and return the reply frames (or None)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    try:
        s.send_multipart(frames)
        return s.recv_multipart() if s.poll(timeout_ms) else None
    finally:
        s.close()


async def test_round_trip_token_by_token(service):
    addr = service(max_staleness=2).address
    sent = [traj(f"g{g}-{i}", f"g{g}", version=g, group_size=2) for g in range(3) for i in range(2)]
    await put_all(addr, sent)
    c = BufferConsumer(addr)
    b = c.get_batch(3, current_version=2, timeout_s=5)
    c.close()
    assert b.batch_id == 0
    assert [g.group_id for g in b.groups] == ["g0", "g1", "g2"]  # oldest first
    assert all(len(g.trajectories) == 2 and g.failed == 0 and g.expected == 2 for g in b.groups)
    got = {t.uid: t for t in b.trajectories()}
    for t in sent:
        r = got[t.uid]
        assert r.response_ids.numpy().tolist() == t.response_ids.numpy().tolist()
        assert r.behavior_logprobs.data == t.behavior_logprobs.data
        assert r.versions.numpy().tolist() == t.versions.numpy().tolist()
        assert encode(r) == encode(t)


async def _until(pred, timeout_s: float = 30.0) -> None:
    """Wait for an event (a counter the code under test moves), not for a guessed duration."""
    async def poll():
        while not pred():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


async def test_retried_send_is_stored_once(service):
    svc = service()
    body = encode(traj("same", "g", group_size=2))
    r1 = raw_request(svc.address, [b"r1", P.PUT, body])
    r2 = raw_request(svc.address, [b"r2", P.PUT, body])  # the same uid again (a retry after a lost ack)
    assert r1 == [b"r1", P.OK, b"new"] and r2 == [b"r2", P.OK, b"dup"]
    p = AsyncBufferProducer(svc.address)
    assert await p.put_bytes(body) == "dup"
    await p.put(traj("other", "g", group_size=2))
    await p.close()
    c = BufferConsumer(svc.address)
    b = c.get_batch(1, 0, timeout_s=5)
    st = c.stats()
    c.close()
    assert sorted(t.uid for t in b.trajectories()) == ["other", "same"]
    assert (st["received"], st["duplicates"]) == (2, 2)


async def test_unacked_put_is_resent_until_the_buffer_appears(service, tmp_path):
    """The producer's first sends go to a port nobody serves yet; it resends the same uid until acked."""
    port = free_port()
    p = AsyncBufferProducer(f"tcp://127.0.0.1:{port}", timeout_s=0.3, retries=50)
    task = asyncio.ensure_future(p.put(traj("late-ack", "g")))
    await _until(lambda: p.resends >= 1)  # it gave up on a send and sent again: not acked yet
    assert not task.done()
    svc = service(port=port)
    await asyncio.wait_for(task, 10)
    await p.close()
    assert p.resends >= 1
    assert svc.stats()["received"] == 1


async def test_staleness_drops_exactly_the_stale_ones(service):
    addr = service(max_staleness=1).address
    sent = [traj(f"v{v}", f"s{v}", version=v) for v in range(4)]
    # a trajectory spanning an update: its generated tokens are v1 and v3, the inserted one (-1) is ignored
    sent.append(traj("span", "span", versions=[1, -1, 3], loss_mask=[1, 0, 1]))
    # a group of two: one member stale, one fresh -> served with its real size 1, failed 1
    sent += [traj("pair-old", "pair", version=0, group_size=2), traj("pair-new", "pair", version=3, group_size=2)]
    await put_all(addr, sent)
    c = BufferConsumer(addr)
    b = c.get_batch(3, current_version=3, timeout_s=5)  # threshold: version >= 2
    st = c.stats()
    assert c.get_batch(1, 3, timeout_s=0.3) is None  # nothing else was servable
    c.close()
    assert sorted(t.uid for t in b.trajectories()) == ["pair-new", "v2", "v3"]
    pair = next(g for g in b.groups if g.group_id == "pair")
    assert (len(pair.trajectories), pair.failed, pair.expected) == (1, 1, 2)
    assert st["dropped_stale"] == 4  # v0, v1, span (min version 1), pair-old
    assert st["size"] == 0


async def test_group_waits_for_all_members_or_failure_reports(service):
    addr = service().address
    p = AsyncBufferProducer(addr)
    await p.put(traj("a0", "A", group_size=3))
    await p.put(traj("a1", "A", group_size=3))
    c = BufferConsumer(addr)
    assert c.get_batch(1, 0, timeout_s=0.3) is None  # 2 of 3 arrived: incomplete
    await p.report_failed("A", 3, 1)
    b = c.get_batch(1, 0, timeout_s=5)
    assert [(g.group_id, len(g.trajectories), g.failed, g.expected) for g in b.groups] == [("A", 2, 1, 3)]
    # a group whose every member failed is never served and does not block others
    await p.report_failed("B", 2, 2)
    await p.put(traj("c0", "C", group_size=1))
    b2 = c.get_batch(1, 0, timeout_s=5)
    assert [g.group_id for g in b2.groups] == ["C"]
    assert b2.batch_id == b.batch_id + 1
    # a member arriving after its group was served is counted as late, not stored
    assert await p.put_bytes(encode(traj("a2", "A", group_size=3))) == "late"
    st = c.stats()
    assert (st["late"], st["dropped_empty_groups"], st["failed_reported"]) == (1, 1, 3)
    await p.close()
    c.close()


async def test_get_batch_blocks_until_groups_complete(service):
    svc = service()
    addr = svc.address
    c = BufferConsumer(addr)
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, lambda: c.get_batch(2, 0, timeout_s=10))
    await _until(lambda: svc.counts["requests"] >= 1)  # the GET arrived (and is parked) before any PUT
    assert not fut.done()
    await put_all(addr, [traj("x", "X"), traj("y", "Y")])
    b = await asyncio.wait_for(fut, 10)
    c.close()
    assert sorted(g.group_id for g in b.groups) == ["X", "Y"]


@pytest.mark.parametrize("order,expected", [("oldest", ["o1", "o2", "o5"]), ("newest", ["o5", "o2", "o1"])])
async def test_serving_order(service, order, expected):
    addr = service(order=order, max_staleness=10).address
    await put_all(addr, [traj(f"o{v}", f"o{v}", version=v) for v in (2, 5, 1)])
    c = BufferConsumer(addr)
    got = [c.get_batch(1, 5, timeout_s=5).groups[0].group_id for _ in range(3)]
    c.close()
    assert got == expected


async def test_back_pressure_producer_waits_then_succeeds(service):
    addr = service(capacity_trajectories=2).address
    p = AsyncBufferProducer(addr)
    await p.put(traj("b0", "b0"))
    await p.put(traj("b1", "b1"))
    third = asyncio.ensure_future(p.put(traj("b2", "b2")))
    await _until(lambda: p.busy_waits >= 1)
    assert not third.done()  # told to wait, waiting
    c = BufferConsumer(addr)
    first = c.get_batch(1, 0, timeout_s=5)
    await asyncio.wait_for(third, 10)
    rest = [c.get_batch(1, 0, timeout_s=5) for _ in range(2)]
    st = c.stats()
    c.close()
    await p.close()
    assert [b.groups[0].group_id for b in [first, *rest]] == ["b0", "b1", "b2"]  # nothing dropped
    assert st["busy_replies"] >= 1 and st["received"] == 3


async def test_capacity_in_bytes_admits_members_of_started_groups(service):
    one = len(encode(traj("z0", "Z", group_size=2)))
    svc = service(capacity_bytes=one + 10)
    addr = svc.address
    p = AsyncBufferProducer(addr)
    await p.put(traj("z0", "Z", group_size=2))
    await asyncio.wait_for(p.put(traj("z1", "Z", group_size=2)), 5)  # completes a group: admitted
    other = asyncio.ensure_future(p.put(traj("w0", "W")))
    await _until(lambda: svc.counts["busy_replies"] >= 1)  # a new group while full: refused for now
    assert not other.done()
    c = BufferConsumer(addr)
    assert c.get_batch(1, 0, timeout_s=5).groups[0].group_id == "Z"
    await asyncio.wait_for(other, 10)
    c.close()
    await p.close()


def test_malformed_and_oversized_requests_get_errors(service):
    svc = service(max_frame_bytes=4096)
    a = svc.address
    r = raw_request(a, [b"2", P.PUT, b"\x00" * 5000])
    assert r[0] == b"2" and r[1] == P.ERR and b"max_frame_bytes=4096" in r[2]
    assert raw_request(a, [b"3", b"NOPE", b""])[1] == P.ERR
    assert raw_request(a, [b"4", P.PUT])[1] == P.ERR
    assert raw_request(a, [b"5", P.PUT, b"not msgpack"])[1] == P.ERR
    bad = traj("bad", "g")
    bad.loss_mask = bad.loss_mask.__class__("uint8", (2,), b"\x01\x01")  # misaligned with response_ids
    r = raw_request(a, [b"6", P.PUT, encode(bad)])
    assert r[1] == P.ERR and b"loss_mask has 2 entries" in r[2]
    assert raw_request(a, [b"7", P.GET, P.pack(P.GetRequest(0, 0, 10))])[1] == P.ERR
    r = raw_request(a, [b"8", P.GET, P.pack(P.GetRequest(1, 0, 10, max_staleness=5))])  # the bound is the service's
    assert r[1] == P.ERR and b"max_staleness=5 disagrees with this buffer's bound 0" in r[2]
    c = BufferConsumer(a)
    assert c.stats()["malformed"] == 7
    with pytest.raises(BufferError, match="n_groups=0"):
        c.get_batch(0, 0, timeout_s=1)
    with pytest.raises(BufferError, match="max_staleness=3 disagrees"):
        c.get_batch(1, 0, max_staleness=3, timeout_s=1)
    c.close()


async def test_vanished_clients_do_not_wedge_the_service(service):
    addr = service().address
    ctx = zmq.Context.instance()
    for i in range(5):  # parked GETs and PUTs whose senders disappear before the reply
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        s.send_multipart([b"g", P.GET, P.pack(P.GetRequest(1, 0, 200))])
        s.send_multipart([b"p", P.PUT, encode(traj(f"gone{i}", f"gone{i}"))])
        await asyncio.sleep(0.02)
        s.close()
    c = BufferConsumer(addr, timeout_s=3)
    # the parked GETs expire and some are served to vanished peers; every PUT is still stored
    assert await asyncio.to_thread(wait_until, lambda: c.stats()["received"] == 5), c.stats()
    await put_all(addr, [traj("alive", "alive")])
    got = []
    while (b := c.get_batch(1, 0, timeout_s=0.5)) is not None:
        got += [t.uid for t in b.trajectories()]
    c.close()
    assert "alive" in got


async def test_a_version_before_any_get_drops_the_stale_ones(service):
    """The bound comes from construction, so the first VERSION already filters: no GET needed."""
    addr = service(max_staleness=1).address
    await put_all(addr, [traj("a", "a", version=0), traj("b", "b", version=2)])
    c = BufferConsumer(addr)
    assert (c.stats()["dropped_stale"], c.stats()["max_staleness"]) == (0, 1)
    c.set_version(2)  # threshold 2 - 1 = 1: "a" (v0) is stale
    st = c.stats()
    assert (st["version"], st["dropped_stale"], st["size"], st["age_versions_max"]) == (2, 1, 1, 0)
    assert c.get_batch(1, 2, timeout_s=5).groups[0].group_id == "b"
    await put_all(addr, [traj("c", "c", version=2)])
    c.set_version(4)  # threshold 3: "c" (v2) is dropped at the version update
    st = c.stats()
    c.close()
    assert (st["dropped_stale"], st["size"]) == (2, 0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(st)) == st


def test_the_bound_must_be_a_non_negative_integer(tmp_path):
    for bad in (-1, None, 1.5, True):
        with pytest.raises(BufferConfigError, match=f"max_staleness must be an integer >= 0, got {bad!r}"):
            BufferService(BufferConfig(curve="off"), tmp_path / "wal", bad)
