"""The wire schema is bit-exact, and a batch assembled from stored bytes decodes as schema.Batch."""

from __future__ import annotations

import numpy as np

from asyncrl.buffer.protocol import ServedGroup, batch_frames, decode_batch
from asyncrl.buffer.server import decode_put
from asyncrl.data.schema import Array, Batch, Trajectory, decode, encode

from .conftest import traj


def test_trajectory_encode_decode_is_bit_exact():
    lp = np.array([-0.0, 0.0, np.nan, -np.inf, np.finfo(np.float32).tiny, -1.2345678], dtype=np.float32)
    t = traj("u1", "g1", versions=[0, 1, -1, 2, 2, 3], loss_mask=[1, 1, 0, 1, 1, 1])
    t.behavior_logprobs = Array.from_numpy(lp)
    t.metrics = {"x": 0.1}
    t.messages = [{"role": "user", "content": "héllo"}]
    raw = encode(t)
    back = decode(raw, Trajectory)
    assert back.behavior_logprobs.data == lp.tobytes()  # NaN payload and -0.0 sign survive
    assert np.array_equal(back.behavior_logprobs.numpy().view(np.uint32), lp.view(np.uint32))
    assert back.response_ids.numpy().tolist() == [100, 101, 102, 103, 104, 105]
    assert back.versions.numpy().tolist() == [0, 1, -1, 2, 2, 3]
    assert encode(back) == raw
    assert back.min_version() == 0


def test_batch_frames_from_stored_bytes_decode_as_schema_batch():
    ts = [traj(f"u{i}", "g", version=i, group_size=3) for i in range(2)]
    entries = [decode_put(encode(t)) for t in ts]
    frames = batch_frames(7, [(ServedGroup("g", 3, 1, [e.uid for e in entries]), entries)])
    assert frames[1] == b"".join(encode(t) for t in ts)  # stored bytes go out unchanged
    b = decode_batch(frames)
    assert isinstance(b, Batch)
    assert b.batch_id == 7
    assert [(g.group_id, g.expected, g.failed) for g in b.groups] == [("g", 3, 1)]
    assert [encode(t) for t in b.trajectories()] == [encode(t) for t in ts]
    assert [e.min_version for e in entries] == [0, 1]


def test_batch_header_and_frame_count_must_agree():
    import pytest

    t = traj("u", "g")
    frames = batch_frames(1, [(ServedGroup("g", 1, 0, ["u"]), [decode_put(encode(t))])])
    with pytest.raises(ValueError, match="names 1 trajectories of .* the blob"):
        decode_batch([frames[0], frames[1] + b"x"])
    with pytest.raises(ValueError, match="needs \\[header, blob\\]"):
        decode_batch(frames + [frames[1]])


def test_a_batch_decodes_in_one_order_whatever_order_it_was_served_in():
    """Groups come out by group id and members by (sample index, uid), however the buffer ordered them
    (completion order, arrival order: timing), so the learner's step sees the same batch in every run."""
    def member(uid, gid, k, chain=0):
        t = traj(f"{uid}c{chain}" if chain else uid, gid, group_size=2)
        t.sample_index, t.reward = k, float(k)
        return decode_put(encode(t))

    g1 = [member("g1-1", "g1", 1), member("g1-0", "g1", 0), member("g1-1", "g1", 1, chain=1)]
    g2 = [member("g2-1", "g2", 1), member("g2-0", "g2", 0)]
    served = [(ServedGroup("g2", 2, 0, [e.uid for e in g2]), g2), (ServedGroup("g1", 2, 0, [e.uid for e in g1]), g1)]
    b = decode_batch(batch_frames(3, served))
    assert [g.group_id for g in b.groups] == ["g1", "g2"]
    assert [t.uid for t in b.trajectories()] == ["g1-0", "g1-1", "g1-1c1", "g2-0", "g2-1"]
    flipped = [(sg, list(reversed(es))) for sg, es in reversed(served)]
    assert encode(decode_batch(batch_frames(3, flipped))) == encode(b)
