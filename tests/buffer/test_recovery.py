"""Crash safety with a real subprocess: kill -9 mid-stream, restart, commit semantics, damaged logs,\nonline compaction and crashes inside it."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import zlib
from collections import Counter

import msgspec
import pytest

from asyncrl.buffer import protocol as P
from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer, BufferError
from asyncrl.buffer.wal import CRASH_ENV, CRASH_EXIT, CRASH_STEPS, MAGIC, Record, frame, scan
from asyncrl.data import schema
from asyncrl.data.schema import Trajectory, encode
from asyncrl.util.net import free_port

from .conftest import traj, wait_until

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
    frozen = asyncio.Event()

    async def bounded(i):
        if i >= 48:  # the rest wait for the freeze: however slow this loop is, they cannot all be acked first
            await frozen.wait()
        async with sem:
            await send(i)

    tasks = [asyncio.ensure_future(bounded(i)) for i in range(n)]
    while len(acked) < 40:
        await asyncio.sleep(0.005)
    # Freeze it first so the puts now in flight are delivered but certainly unacked when it dies
    # (without the freeze a fast buffer may have acked all of them, and nothing would need resending).
    proc.freeze()
    frozen.set()
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
    assert await p.put_bytes(schema.encode(traj("u0-0", "G0", group_size=2))) == "dup"
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


# ---------------------------------------------------------------------------- damaged logs


def put_records(path):
    """(offset, end, uid) of every PUT record of the log at `path`."""
    return [(r.offset, r.end, msgspec.msgpack.decode(r.payload, type=Trajectory).uid)
            for r in scan(path) if isinstance(r, Record) and r.kind == P.REC_PUT]


async def fill(proc, n, **kw):
    p = AsyncBufferProducer(proc.address)
    await asyncio.gather(*(p.put(traj(f"d{i}", f"D{i}", n=64, **kw)) for i in range(n)))
    await p.close()
    return {f"d{i}" for i in range(n)}


def served_once(proc) -> tuple[Counter, dict]:
    """Drain the buffer and commit what it served: (uids served, stats)."""
    c = BufferConsumer(proc.address)
    batches = drain(c, 0.5)
    if batches:
        c.commit([b.batch_id for b in batches], step=1)
    uids = Counter(t.uid for b in batches for t in b.trajectories())
    st = c.stats()
    c.close()
    return uids, st


@pytest.mark.parametrize("fault", ["flip", "zero4k", "truncate", "undecodable"])
async def test_damaged_log_loses_only_the_damaged_records_and_reports_them(tmp_path, buffer_process, fault):
    port, wal = free_port(), tmp_path / "wal"
    proc = buffer_process(wal, port)
    acked = await fill(proc, 24)
    proc.kill9()
    path = wal / "buffer.wal"
    puts = put_records(path)
    assert [u for _, _, u in puts] == [f"d{i}" for i in range(24)]
    raw = bytearray(path.read_bytes())
    mid = puts[12]
    if fault == "flip":  # one byte in the middle of record 12's payload (its uid stays readable)
        raw[(mid[0] + mid[1]) // 2] ^= 0x01
        lost, span = {mid[2]}, (mid[0], mid[1])
    elif fault == "zero4k":
        lo = mid[0] + 200
        raw[lo:lo + 4096] = bytes(4096)
        hit = [r for r in puts if r[0] < lo + 4096 and r[1] > lo]
        lost, span = {u for _, _, u in hit}, (hit[0][0], hit[-1][1])
    elif fault == "truncate":  # a crash in the middle of the last append
        last = puts[-1]
        del raw[last[0] + 30:]
        lost, span = {last[2]}, (last[0], last[0] + 30)
    else:  # a record whose checksums hold but whose payload is no msgpack Trajectory
        bad = frame(P.REC_PUT, b"\xc1 not msgpack")
        raw[mid[0]:mid[0]] = bad
        lost, span = set(), (mid[0], mid[0] + len(bad))
    original = bytes(raw)
    path.write_bytes(original)

    proc = buffer_process(wal, port)
    uids, st = served_once(proc)
    assert set(uids) == acked - lost and max(uids.values()) == 1  # every other acked trajectory, once
    rep = st["wal_recovery"]
    if fault == "truncate":  # the expected crash case: dropped quietly, no quarantine, still in the report
        assert rep["torn_tail"] == {"start": span[0], "end": span[1]}
        assert rep["damaged"] == [] and rep["quarantine"] is None
        assert not list(wal.glob("buffer.wal.damaged-*"))
        return
    (d,) = rep["damaged"]
    assert (d["start"], d["end"]) == span
    if fault == "flip":
        assert d["uids"] == [mid[2]]
    elif fault == "zero4k":
        assert set(d["uids"]) <= lost and d["uids"]  # the first hit record's uid lies before the zeros
    else:
        assert "not applicable" in d["reason"]
    q = rep["quarantine"]
    assert q and open(q, "rb").read() == original  # the original bytes, offsets as reported
    proc.kill9()
    proc = buffer_process(wal, port)  # the log was rewritten clean: nothing more is reported or served
    uids2, st2 = served_once(proc)
    assert st2["wal_recovery"]["damaged"] == [] and uids2 == Counter()


# ---------------------------------------------------------------------------- online compaction

COMPACT = ("--compact-min-bytes", "4096", "--compact-ratio", "2")


async def test_online_compaction_shrinks_the_log_while_serving_and_a_restart_recovers_the_uncommitted(
        tmp_path, buffer_process):
    port, wal = free_port(), tmp_path / "wal"
    proc = buffer_process(wal, port, args=COMPACT)
    p = AsyncBufferProducer(proc.address)
    c = BufferConsumer(proc.address)
    committed: set[str] = set()
    uncommitted: dict[int, list[str]] = {}
    for r in range(12):
        await asyncio.gather(*(p.put(traj(f"r{r}-{i}", f"R{r}-{i}", n=64)) for i in range(6)))
        b = c.get_batch(4, 0, timeout_s=5)
        ids = [t.uid for t in b.trajectories()]
        if r in (1, 7):  # served, never committed: must survive every compaction
            uncommitted[b.batch_id] = ids
        else:
            c.commit([b.batch_id], step=r)
            committed.update(ids)
    assert wait_until(lambda: c.stats()["wal_compactions"] >= 2)
    st = c.stats()
    assert st["wal_bytes"] < st["wal_bytes_written"]  # the file holds less than was ever appended to it
    held = {f"r{r}-{i}" for r in range(12) for i in range(6)} - committed - {u for v in uncommitted.values() for u in v}
    await p.close()
    c.close()
    proc.kill9()

    proc = buffer_process(wal, port, args=COMPACT)
    c = BufferConsumer(proc.address)
    batches = drain(c, 0.5)
    c.close()
    again = {b.batch_id: [t.uid for t in b.trajectories()] for b in batches[:2]}
    assert again == uncommitted  # the uncommitted batches again, same ids and members
    rest = Counter(t.uid for b in batches[2:] for t in b.trajectories())
    assert set(rest) == held and max(rest.values()) == 1
    p = AsyncBufferProducer(proc.address)
    assert await p.put_bytes(encode(traj(next(iter(committed)), "x"))) == "dup"  # dedupe survived compaction
    await p.close()


@pytest.mark.parametrize("step", CRASH_STEPS)
async def test_crash_inside_compaction_loses_nothing(tmp_path, buffer_process, step):
    port, wal = free_port(), tmp_path / "wal"
    proc = buffer_process(wal, port, args=COMPACT, env={CRASH_ENV: step})
    acked = await fill(proc, 30)
    c = BufferConsumer(proc.address, timeout_s=5)
    first = c.get_batch(5, 0, timeout_s=5)
    c.commit([first.batch_id], step=1)
    kept = c.get_batch(2, 0, timeout_s=5)  # served, never committed
    last = c.get_batch(15, 0, timeout_s=5)
    # committing these leaves the log > 2 x the live state: compaction starts, and the hook exits at
    # `step`, maybe before this ack goes out (the COMMIT record is in the log either way)
    with contextlib.suppress(BufferError):
        c.commit([last.batch_id], step=2)
    c.close()
    assert proc.proc.wait(timeout=60) == CRASH_EXIT
    assert (wal / "buffer.wal.compacting").exists() == (step == "compact-written")

    proc = buffer_process(wal, port)
    c = BufferConsumer(proc.address)
    batches = drain(c, 0.5)
    c.close()
    assert batches[0].batch_id == kept.batch_id  # the uncommitted batch again, same members
    assert [t.uid for t in batches[0].trajectories()] == [t.uid for t in kept.trajectories()]
    uids = Counter(t.uid for b in batches for t in b.trajectories())
    committed = {t.uid for b in (first, last) for t in b.trajectories()}
    assert set(uids) == acked - committed and max(uids.values()) == 1
    assert not (wal / "buffer.wal.compacting").exists()


async def test_served_batch_whose_put_was_damaged_is_served_again_without_it(tmp_path, service):
    wal = tmp_path / "w"
    svc = service(wal_dir=wal)
    p = AsyncBufferProducer(svc.address)
    await asyncio.gather(*(p.put(traj(f"s{g}-{i}", f"S{g}", group_size=2, n=64)) for g in range(3) for i in range(2)))
    await p.close()
    c = BufferConsumer(svc.address)
    first = c.get_batch(2, 0, timeout_s=5)  # groups S0 and S1, never committed
    c.close()
    svc.stop()
    victim = next(r for r in put_records(wal / "buffer.wal") if r[2] == "s0-0")
    raw = bytearray((wal / "buffer.wal").read_bytes())
    raw[victim[1] - 5] ^= 0x10
    (wal / "buffer.wal").write_bytes(bytes(raw))

    svc = service(wal_dir=wal)
    c = BufferConsumer(svc.address)
    again = c.get_batch(2, 0, timeout_s=5)
    st = c.stats()
    c.close()
    assert again.batch_id == first.batch_id
    got = {g.group_id: ([t.uid for t in g.trajectories], g.failed) for g in again.groups}
    assert got == {"S0": (["s0-1"], 1), "S1": (["s1-0", "s1-1"], 0)}
    rep = st["wal_recovery"]
    assert rep["lost_uids"] == ["s0-0"] and rep["damaged"][0]["uids"] == ["s0-0"] and rep["quarantine"]


@pytest.mark.parametrize("content", ["empty", "zeros", "magic", "huge_length"])
async def test_service_starts_on_a_hostile_log_and_reports_it(tmp_path, service, content):
    wal = tmp_path / "w"
    wal.mkdir()
    head = struct.pack("<4sBII", MAGIC, P.REC_PUT, 2**32 - 1, 0)
    raw = {"empty": b"", "zeros": bytes(8192), "magic": MAGIC * 2048,
           "huge_length": head + struct.pack("<I", zlib.crc32(head)) + bytes(100)}[content]
    (wal / "buffer.wal").write_bytes(raw)
    svc = service(wal_dir=wal)
    p = AsyncBufferProducer(svc.address)
    await p.put(traj("h0", "H0"))  # and it serves
    await p.close()
    c = BufferConsumer(svc.address)
    assert [t.uid for t in c.get_batch(1, 0, timeout_s=5).trajectories()] == ["h0"]
    rep = c.stats()["wal_recovery"]
    c.close()
    if content == "empty":
        assert rep["damaged"] == [] and rep["torn_tail"] is None and rep["quarantine"] is None
    elif content == "huge_length":  # a verified header running past the end: an interrupted append
        assert rep["torn_tail"] == {"start": 0, "end": len(raw)} and rep["damaged"] == []
    else:
        assert [(d["start"], d["end"]) for d in rep["damaged"]] == [(0, len(raw))]
        assert open(rep["quarantine"], "rb").read() == raw
