"""The write-ahead log: framing, resynchronisation after damage, torn tails, hostile bytes, policies."""

from __future__ import annotations

import random
import struct
import tracemalloc
import zlib

import msgspec
import pytest

from asyncrl.buffer import protocol as P
from asyncrl.buffer import wal as W
from asyncrl.buffer.wal import BadRange, Record, WalError, WriteAheadLog, frame, scan, should_compact, uids_in
from asyncrl.config import BufferConfig, ConfigError

from .conftest import wait_until


def recs(path, **kw):
    return [(r.kind, r.payload) if isinstance(r, Record) else ("bad", r.start, r.end, r.torn) for r in scan(path, **kw)]


def put_payload(uid: str, n: int = 40) -> bytes:
    return msgspec.msgpack.encode({"uid": uid, "group_id": "g", "blob": b"z" * n})


def test_append_and_replay_in_order(tmp_path):
    w = WriteAheadLog(tmp_path, "each")
    list(w.replay())
    w.open()
    w.append(1, b"abc")
    w.append_many([frame(2, b""), frame(3, b"x" * 70000)])
    w.close()
    r = WriteAheadLog(tmp_path, "off")
    assert [(x.kind, x.payload) for x in r.replay()] == [(1, b"abc"), (2, b""), (3, b"x" * 70000)]
    assert w.bytes_written == w.offset == 3 * W.HEADER_SIZE + 3 + 70000
    assert r.recovery.as_dict()["damaged"] == [] and r.recovery.torn_tail is None


def test_small_chunks_read_the_same_records(tmp_path):
    """Streaming: records larger than the read chunk, and headers split across chunks."""
    p = tmp_path / "buffer.wal"
    items = [(1, bytes([i]) * (i * 37)) for i in range(1, 30)]
    p.write_bytes(b"".join(frame(k, v) for k, v in items))
    assert recs(p, chunk=7) == items


def test_torn_tail_is_dropped_quietly_and_rewrite_cuts_it(tmp_path, caplog):
    w = WriteAheadLog(tmp_path, "batched")
    w.open()
    w.append_many([frame(1, b"one"), frame(1, b"two")])
    w.close()
    whole = w.path.stat().st_size
    with open(w.path, "ab") as f:
        f.write(frame(1, b"three")[:20])  # a write cut short by a crash: header whole, payload short
    w2 = WriteAheadLog(tmp_path)
    assert [(r.kind, r.payload) for r in w2.replay()] == [(1, b"one"), (1, b"two")]
    assert w2.recovery.torn_tail == (whole, whole + 20) and w2.recovery.damaged == []
    w2.rewrite([(1, b"one"), (1, b"two")])
    assert w.path.stat().st_size == whole
    assert not list(tmp_path.glob("buffer.wal.damaged-*"))  # nothing quarantined
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_short_header_at_the_end_is_torn(tmp_path):
    p = tmp_path / "buffer.wal"
    p.write_bytes(frame(1, b"a") + frame(1, b"b")[:5])
    assert recs(p) == [(1, b"a"), ("bad", W.HEADER_SIZE + 1, W.HEADER_SIZE + 6, True)]


def test_a_flipped_byte_is_skipped_and_the_records_after_it_survive(tmp_path):
    p = tmp_path / "buffer.wal"
    a, b, c = frame(1, put_payload("ua")), frame(1, put_payload("ub")), frame(1, put_payload("uc"))
    bad = bytearray(b)
    bad[-3] ^= 0xFF  # in the payload, after the uid
    p.write_bytes(a + bytes(bad) + c)
    assert recs(p) == [(1, put_payload("ua")), ("bad", len(a), len(a) + len(b), False), (1, put_payload("uc"))]
    assert uids_in(p, len(a), len(a) + len(b)) == ["ub"]


@pytest.mark.parametrize("where", [0, 4, 5, 9, 13, 16])
def test_a_flipped_header_byte_never_loses_the_next_record(tmp_path, where):
    """Magic, kind, length, payload crc or header crc: each is caught by the header checksum."""
    p = tmp_path / "buffer.wal"
    a, b, c = frame(1, b"a" * 50), frame(2, b"b" * 50), frame(3, b"c" * 50)
    bad = bytearray(b)
    bad[where] ^= 0x40
    p.write_bytes(a + bytes(bad) + c)
    assert recs(p) == [(1, b"a" * 50), ("bad", len(a), len(a) + len(b), False), (3, b"c" * 50)]


def test_length_of_2_pow_32_minus_1_with_a_valid_header_crc(tmp_path):
    """A hostile header that verifies but claims 4 GiB: no allocation, the next record is found."""
    p = tmp_path / "buffer.wal"
    head = struct.pack("<4sBII", W.MAGIC, 1, 2**32 - 1, 0)
    hostile = head + struct.pack("<I", zlib.crc32(head)) + b"junk"
    p.write_bytes(frame(1, b"a") + hostile + frame(1, b"c"))
    assert recs(p) == [(1, b"a"), ("bad", W.HEADER_SIZE + 1, W.HEADER_SIZE + 1 + len(hostile), False), (1, b"c")]
    p.write_bytes(frame(1, b"a") + hostile)  # the same at the end: an append cut short
    assert recs(p)[-1] == ("bad", W.HEADER_SIZE + 1, W.HEADER_SIZE + 1 + len(hostile), True)


@pytest.mark.parametrize("content", [b"", b"\0" * 10000, W.MAGIC * 1000, W.MAGIC[:3]], ids=["empty", "zeros", "magic", "short"])
def test_hostile_whole_files(tmp_path, content):
    p = tmp_path / "buffer.wal"
    p.write_bytes(content)
    w = WriteAheadLog(tmp_path)
    assert list(w.replay()) == []
    rep = w.recovery
    if len(content) >= W.HEADER_SIZE:  # garbage that is no interrupted append: damage, kept
        assert [(d.start, d.end) for d in rep.damaged] == [(0, len(content))] and rep.torn_tail is None
        w.rewrite([])
        assert open(rep.quarantine, "rb").read() == content
    else:
        assert rep.damaged == [] and rep.torn_tail == ((0, len(content)) if content else None)
        w.rewrite([])
    w.open()
    w.append(1, b"after")
    w.close()
    assert [(r.kind, r.payload) for r in WriteAheadLog(tmp_path).replay()] == [(1, b"after")]


def test_damage_is_quarantined_with_the_original_bytes_before_rewrite(tmp_path, caplog):
    p = tmp_path / "buffer.wal"
    recs_ = [frame(1, put_payload(f"u{i}", 3000)) for i in range(6)]
    raw = bytearray(b"".join(recs_))
    lo = len(recs_[0]) + 100
    raw[lo:lo + 4096] = bytes(4096)  # a zeroed 4 KiB block: breaks u1 and u2
    original = bytes(raw)
    p.write_bytes(original)
    w = WriteAheadLog(tmp_path)
    got = [r.payload for r in w.replay()]
    assert got == [put_payload(f"u{i}", 3000) for i in (0, 3, 4, 5)]
    (d,) = w.recovery.damaged
    assert (d.start, d.end) == (len(recs_[0]), sum(len(r) for r in recs_[:3]))
    assert d.uids == ["u1", "u2"] or d.uids == ["u1"]  # u2's uid may lie in the zeroed block
    w.rewrite([(1, x) for x in got])
    q = w.recovery.quarantine
    assert q and q.startswith(str(tmp_path / "buffer.wal.damaged-"))
    assert open(q, "rb").read() == original
    assert f"bytes [{d.start}, {d.end})" in caplog.text and q in caplog.text
    assert [r.payload for r in WriteAheadLog(tmp_path).replay()] == got  # the new log is clean


def test_leftover_compaction_file_is_removed(tmp_path):
    (tmp_path / W.COMPACT_NAME).write_bytes(frame(1, b"half"))
    w = WriteAheadLog(tmp_path)
    assert list(w.replay()) == []
    assert not (tmp_path / W.COMPACT_NAME).exists()


def test_should_compact_rule():
    assert not should_compact(100, 10, 1000, 4.0)  # under the floor
    assert should_compact(1001, 10, 1000, 4.0)
    assert not should_compact(3999, 1000, 1000, 4.0)  # under ratio x live
    assert should_compact(4001, 1000, 1000, 4.0)


@pytest.mark.parametrize("kw,match", [({"compact_ratio": 1.5}, "compact_ratio"), ({"compact_min_bytes": 0}, "compact_min_bytes"),
                                      ({"compact_ratio": float("nan")}, "compact_ratio")])
def test_compaction_config_is_validated(kw, match):
    with pytest.raises(ConfigError, match=match):
        BufferConfig(**kw)


def test_unknown_crash_step_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(W.CRASH_ENV, "somewhere")
    with pytest.raises(WalError, match="somewhere"):
        WriteAheadLog(tmp_path)


def test_unknown_policy_is_refused(tmp_path):
    with pytest.raises(WalError, match="'sometimes'"):
        WriteAheadLog(tmp_path, "sometimes")



def _log_with_two_served_batches(tmp_path) -> WriteAheadLog:
    w = WriteAheadLog(tmp_path, "batched")
    list(w.replay())
    w.rewrite([])
    w.open()
    w.append_many([frame(P.REC_PUT, put_payload("a")), frame(P.REC_PUT, put_payload("b")),
                   frame(P.REC_SERVE, serve(7, "a")), frame(P.REC_SERVE, serve(8, "b"))])
    return w


def serve(batch_id: int, uid: str) -> bytes:
    return P.pack(P.ServeRecord(batch_id, [P.ServedGroup(f"g{uid}", 1, 0, [uid])]))


def finish(w: WriteAheadLog) -> None:
    assert wait_until(w.compaction_ready)
    w.finish_compaction()


def test_online_compaction_keeps_uncommitted_batches_and_what_was_appended_meanwhile(tmp_path):
    w = _log_with_two_served_batches(tmp_path)
    before = w.offset
    w.start_compaction([(P.REC_SNAPSHOT, b"snap")], keep_batches={7})
    w.append(P.REC_COMMIT, b"during")  # the loop keeps appending to the old log
    finish(w)
    w.append(P.REC_COMMIT, b"after")  # and then to the new one
    w.close()
    assert w.compactions == 1 and w.offset == w.path.stat().st_size < before + 2 * W.HEADER_SIZE + 11
    assert recs(w.path) == [(P.REC_PUT, put_payload("a")), (P.REC_SERVE, serve(7, "a")), (P.REC_SNAPSHOT, b"snap"),
                            (P.REC_COMMIT, b"during"), (P.REC_COMMIT, b"after")]
    assert not (tmp_path / W.COMPACT_NAME).exists()


def test_online_compaction_refuses_a_log_it_no_longer_understands(tmp_path, caplog):
    w = _log_with_two_served_batches(tmp_path)
    with open(w.path, "r+b") as f:  # bit rot under a running service
        f.seek(W.HEADER_SIZE + 30)
        f.write(b"\xff")
    original = w.path.read_bytes()
    w.start_compaction([(P.REC_SNAPSHOT, b"snap")], keep_batches={7})
    finish(w)
    assert w.compaction_error and "no longer verify" in w.compaction_error and not w.may_compact()
    assert w.path.read_bytes() == original and not (tmp_path / W.COMPACT_NAME).exists()
    assert "not compacted again" in caplog.text
    w.append(P.REC_COMMIT, b"still logging")
    w.close()
    assert recs(w.path)[-1] == (P.REC_COMMIT, b"still logging")


@pytest.mark.parametrize("seed", range(40))
def test_random_damage_never_hides_an_intact_record(tmp_path, seed):
    """Random records, random flips / zeroed runs / cut tails: the scan tiles the file exactly, every
    record it returns is the bytes at its offset, every record the damage did not touch is returned, and
    the result does not depend on the read chunk size."""
    rng = random.Random(seed)
    items = [(rng.randrange(1, 7), rng.randbytes(rng.randrange(0, 300))) for _ in range(rng.randrange(1, 40))]
    frames = [frame(k, v) for k, v in items]
    offs = [sum(len(f) for f in frames[:i]) for i in range(len(frames) + 1)]
    raw = bytearray(b"".join(frames))
    touched = set()
    for _ in range(rng.randrange(1, 4)):
        lo = rng.randrange(len(raw))
        hi = min(len(raw), lo + rng.choice([1, 1, 5, 64, 700]))
        raw[lo:hi] = bytes(hi - lo) if rng.random() < 0.5 else rng.randbytes(hi - lo)
        touched |= {i for i in range(len(frames)) if offs[i] < hi and offs[i + 1] > lo}
    if rng.random() < 0.3:
        cut = rng.randrange(len(raw) + 1)
        del raw[cut:]
        touched |= {i for i in range(len(frames)) if offs[i + 1] > cut}
    p = tmp_path / "buffer.wal"
    p.write_bytes(bytes(raw))
    got = list(scan(p, chunk=rng.choice([1, 7, 64])))
    assert [(type(x), x.start if isinstance(x, BadRange) else x.offset) for x in got] == \
           [(type(x), x.start if isinstance(x, BadRange) else x.offset) for x in scan(p)]
    pos = 0
    for x in got:
        start, end = (x.start, x.end) if isinstance(x, BadRange) else (x.offset, x.end)
        assert start == pos and end > start
        if isinstance(x, Record):
            assert bytes(raw[start:end]) == frame(x.kind, x.payload)
        pos = end
    assert pos == len(raw)
    found = {x.offset for x in got if isinstance(x, Record)}
    assert {offs[i] for i in range(len(frames)) if i not in touched} <= found


def test_replay_streams_with_bounded_memory(tmp_path):
    """A 24 MiB log is replayed with a few MiB of memory (one read chunk plus a record), not its size."""
    w = WriteAheadLog(tmp_path, "off")
    w.open()
    rec = frame(P.REC_PUT, b"p" * 1000)
    for _ in range(24):
        w.append_many([rec] * (1024 * 1024 // len(rec)))
    w.close()
    assert w.path.stat().st_size > 23 << 20
    tracemalloc.start()
    try:
        n = sum(1 for _ in WriteAheadLog(tmp_path, "off").replay())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 24 * (1024 * 1024 // len(rec))
    assert peak < 6 << 20, f"replay peaked at {peak} bytes"
