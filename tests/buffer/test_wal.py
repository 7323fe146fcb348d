"""The write-ahead log: framing, torn tails, corrupted records, policies."""

from __future__ import annotations

import pytest

from asyncrl.buffer.wal import WalError, WriteAheadLog, frame, read_records


def test_append_and_replay_in_order(tmp_path):
    w = WriteAheadLog(tmp_path, "each")
    list(w.replay())
    w.open()
    w.append(1, b"abc")
    w.append_many([frame(2, b""), frame(3, b"x" * 70000)])
    w.close()
    assert list(WriteAheadLog(tmp_path, "off").replay()) == [(1, b"abc"), (2, b""), (3, b"x" * 70000)]
    assert w.bytes_written == (9 + 3) + 9 + (9 + 70000)


def test_torn_tail_is_cut_and_earlier_records_survive(tmp_path):
    w = WriteAheadLog(tmp_path, "batched")
    w.open()
    w.append_many([frame(1, b"one"), frame(1, b"two")])
    w.sync()
    w.close()
    whole = w.path.stat().st_size
    with open(w.path, "ab") as f:
        f.write(frame(1, b"three")[:7])  # a write cut short by a crash
    assert list(WriteAheadLog(tmp_path).replay()) == [(1, b"one"), (1, b"two")]
    assert w.path.stat().st_size == whole  # truncated on disk, so new appends follow intact records


def test_corrupted_record_stops_replay_there(tmp_path):
    p = tmp_path / "buffer.wal"
    a, b, c = frame(1, b"aaaa"), frame(1, b"bbbb"), frame(1, b"cccc")
    bad = bytearray(b)
    bad[-1] ^= 0xFF
    p.write_bytes(a + bytes(bad) + c)
    records, good = read_records(p)
    assert records == [(1, b"aaaa")] and good == len(a)


def test_unknown_policy_is_refused(tmp_path):
    with pytest.raises(WalError, match="'sometimes'"):
        WriteAheadLog(tmp_path, "sometimes")
