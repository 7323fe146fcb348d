"""Bounded yet exact dedupe: training uids are remembered by their group (closed groups per run as
intervals of positions), other uids exactly up to a cap; a snapshot keeps all of it."""

from __future__ import annotations

import random

import pytest

from asyncrl.buffer import protocol as P
from asyncrl.buffer.client import AsyncBufferProducer, BufferError
from asyncrl.buffer.server import decode_put
from asyncrl.buffer.store import BufferState, IntervalSet
from asyncrl.data.schema import encode

from .conftest import traj


def entry(uid: str, gid: str, size: int = 1, version: int = 0):
    return decode_put(encode(traj(uid, gid, group_size=size, version=version)))


def serve_all(st: BufferState) -> list[str]:
    rec = st.plan_batch(len(st.complete_groups()))
    if rec is None:
        return []
    st.apply_serve(rec, replaying=False)
    return [sg.group_id for sg in rec.groups]


def test_interval_set_matches_a_plain_set():
    rng = random.Random(0)
    iv, ref = IntervalSet(), set()
    for _ in range(3000):
        x = rng.randrange(400)
        if rng.random() < 0.8:
            iv.add(x)
            ref.add(x)
        else:
            iv.discard(x)
            ref.discard(x)
        assert all((y in iv) == (y in ref) for y in range(-2, 402, 7))
    assert all((y in iv) == (y in ref) for y in range(-2, 402))
    assert all(a < b for a, b in iv.intervals())
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(iv.intervals(), iv.intervals()[1:]))  # disjoint, not adjacent
    assert IntervalSet(iv.intervals()).intervals() == iv.intervals()


def test_closed_training_groups_take_constant_space_and_refuse_every_resend():
    st = BufferState(10**6, 1 << 40)
    order = list(range(5000))
    random.Random(1).shuffle(order[:200])  # out of order at the start, then in order (gaps come and go)
    for p in order:
        assert st.apply_put(entry(f"run1-g{p}-0", f"run1-g{p}")) == "new"
        if p % 50 == 49:
            serve_all(st)
    serve_all(st)
    sizes = st.stats(0)
    assert (sizes["closed_intervals"], sizes["closed_retries"], sizes["dedupe_other"], sizes["size"]) == (1, 0, 0, 0)
    for p in (0, 17, 4999):  # a resend of a served trajectory, or a new member of a served group: late
        assert st.classify(f"run1-g{p}-0", f"run1-g{p}", 10) == "late"
        assert st.classify(f"run1-g{p}-3", f"run1-g{p}", 10) == "late"
    assert st.classify("run1-g5000-0", "run1-g5000", 10) == "new"
    assert st.classify("run2-g17-0", "run2-g17", 10) == "new"  # another run's position
    assert st.classify("run1-g17r1-0", "run1-g17r1", 10) == "new"  # a retry is a new group
    # a uid naming another training group than its own is refused
    with pytest.raises(ValueError, match="names training group 'run1-g3'"):
        st.classify("run1-g3-0", "run1-g4", 10)


def test_pending_group_remembers_members_stale_drops_and_fail_keys():
    st = BufferState(100, 1 << 30)
    assert st.apply_put(entry("r-g1-0", "r-g1", size=3, version=0)) == "new"
    assert st.apply_put(entry("r-g1-1", "r-g1", size=3, version=5)) == "new"
    assert st.classify("r-g1-1", "r-g1", 10) == "dup"
    st.apply_drop(st.stale_uids(3))  # r-g1-0 dropped as stale: a resend must not come back
    assert st.classify("r-g1-0", "r-g1", 10) == "dup"
    assert st.apply_fail(P.FailReport("k1", "r-g1", 3, 1))
    assert not st.apply_fail(P.FailReport("k1", "r-g1", 3, 1))  # the same report again
    assert [g.group_id for g in st.complete_groups()] == ["r-g1"]
    serve_all(st)
    assert st.classify("r-g1-0", "r-g1", 10) == "late"
    assert not st.apply_fail(P.FailReport("k2", "r-g1", 3, 1))  # a closed group takes no report


def test_snapshot_keeps_what_dedupe_must_remember():
    st = BufferState(1000, 1 << 30)
    for p in range(30):
        st.apply_put(entry(f"r-g{p}-0", f"r-g{p}", version=p))
    st.apply_put(entry("r-g7r1-0", "r-g7r1"))
    st.apply_put(entry("other", "misc", size=2))
    st.apply_put(entry("r-g40-0", "r-g40", size=3, version=0))
    st.apply_put(entry("r-g40-1", "r-g40", size=3, version=9))
    st.apply_drop(["r-g40-0"])
    st.apply_fail(P.FailReport("key", "r-g40", 3, 1))
    served = P.ServeRecord(st.next_batch_id, [P.ServedGroup(f"r-g{p}", 1, 0, [f"r-g{p}-0"]) for p in range(20)]
                           + [P.ServedGroup("r-g7r1", 1, 0, ["r-g7r1-0"])])
    st.apply_serve(served, replaying=False)
    st.apply_commit([served.batch_id])
    queued = P.ServeRecord(st.next_batch_id, [P.ServedGroup("r-g25", 1, 0, ["r-g25-0"])])
    st.apply_serve(queued, replaying=True)  # outstanding, found in the log: replayed after a restart

    new = BufferState(1000, 1 << 30)
    for kind, payload in st.snapshot_records():
        if kind == P.REC_SNAPSHOT:
            new.apply_snapshot(P.unpack(payload, P.Snapshot))
        elif kind == P.REC_PUT:
            assert new.apply_put(decode_put(payload)) == "new"
        else:
            new.apply_serve(P.unpack(payload, P.ServeRecord), replaying=True)
    cases = [(f"r-g{p}-0", f"r-g{p}") for p in range(45)] + [("r-g7r1-0", "r-g7r1"), ("r-g7r2-0", "r-g7r2"),
                                                            ("other", "misc"), ("other", "x"), ("r-g40-0", "r-g40")]
    assert [new.classify(u, g, 10) for u, g in cases] == [st.classify(u, g, 10) for u, g in cases]
    assert new.classify("r-g40-0", "r-g40", 10) == "dup"
    assert not new.apply_fail(P.FailReport("key", "r-g40", 3, 1))
    assert list(new.replay_queue) == [queued.batch_id]
    assert new.stats(0)["closed_intervals"] == 2  # positions 0..19 (snapshot) and 25 (replayed batch)


def test_non_training_uids_are_exact_and_capped():
    st = BufferState(100, 1 << 30, dedupe_other_max=3)
    for u in ("a", "b", "c"):
        assert st.apply_put(entry(u, u)) == "new"
    assert st.classify("a", "zzz", 10) == "dup"  # exact: the uid, whatever its group
    assert st.classify("d", "d", 10) == "full-dedupe"
    assert st.classify("r-g1-0", "r-g1", 10) == "new"  # training uids have no such cap


async def test_service_refuses_a_non_training_uid_past_the_cap_by_name(service):
    svc = service(dedupe_other_max=1)
    p = AsyncBufferProducer(svc.address)
    try:
        await p.put(traj("a", "ga"))
        with pytest.raises(BufferError, match=r"buffer.dedupe_other_max=1\): refusing the new uid 'b'"):
            await p.put(traj("b", "gb"))
        await p.put(traj("run7-g0-0", "run7-g0"))
        with pytest.raises(BufferError, match="names training group 'run7-g1'"):
            await p.put(traj("run7-g1-0", "run7-g0"))
    finally:
        await p.close()
    assert svc.stats()["dedupe_refused"] == 1


def test_undoing_puts_restores_the_state_exactly():
    """What the service does when the write of a request's records finds the disk full."""
    st = BufferState(100, 1 << 30)
    st.apply_put(entry("r-g1-0", "r-g1", size=2))
    st.apply_put(entry("solo", "misc", size=1))  # complete before
    before = (st.stats(0), {g: (set(x.members), x.complete_seq) for g, x in st.groups.items()}, set(st.other_seen))
    applied = []
    for e in (entry("r-g1-1", "r-g1", size=2), entry("r-g2-0", "r-g2", size=1), entry("u", "misc2", size=3)):
        created = e.group_id not in st.groups
        assert st.apply_put(e) == "new"
        applied.append((e, created))
    assert {g.group_id for g in st.complete_groups()} == {"r-g1", "misc", "r-g2"}  # the puts completed r-g1
    for e, created in reversed(applied):
        st.unapply_put(e, created)
    after = (st.stats(0), {g: (set(x.members), x.complete_seq) for g, x in st.groups.items()}, set(st.other_seen))
    assert after == before
    assert st.classify("r-g1-1", "r-g1", 10) == "new" and st.classify("u", "misc2", 10) == "new"
