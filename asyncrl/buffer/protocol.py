"""Wire protocol of the replay buffer (ZMQ ROUTER on the service, DEALER on clients).

A request is three frames ``[req_id, op, body]`` (PUTS: ``[req_id, op, body, body, ...]``); the
ROUTER prepends the peer identity. The reply is ``[req_id, status, body]`` (BATCH:
``[req_id, status, header, blob]``) with the same ``req_id``, so a client can match replies to
concurrent requests and ignore late ones.

=========  =====================================  ==============================================
op         body                                   reply
=========  =====================================  ==============================================
PUT        msgpack Trajectory (as sent, stored    OK (``b"new"`` | ``b"dup"`` | ``b"late"``),
           verbatim in the WAL)                   BUSY (back-pressure: retry later), FULL (disk
                                                  full: nothing stored, retry later), ERR
PUTS       one frame per trajectory (a client's   OK with a msgpack list of per-item verdicts:
           concurrent puts, coalesced; at most    ``"new"`` | ``"dup"`` | ``"late"`` | ``"busy"``
           `MAX_PUTS` items)                      | ``"full: <why>"`` | ``"err: <why>"``
FAIL       msgpack `FailReport`                   OK
GET        msgpack `GetRequest`                   BATCH (`batch_frames`) or EMPTY on its deadline
COMMIT     msgpack `CommitRequest`                OK
VERSION    msgpack `VersionRequest`               OK
STATS      empty                                  STATS (msgpack dict)
=========  =====================================  ==============================================

Any other shape (wrong frame count, unknown op, undecodable or oversized body) is answered ``ERR``
with a message, and counted as malformed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from asyncrl.data.schema import Batch, Group, Trajectory

if TYPE_CHECKING:
    from asyncrl.data.schema import Batch

# request ops
PUT, PUTS, FAIL, GET, COMMIT, VERSION, STATS = (b"PUT", b"PUTS", b"FAIL", b"GET", b"COMMIT", b"VERSION",
                                                b"STATS")
OPS = (PUT, PUTS, FAIL, GET, COMMIT, VERSION, STATS)
MAX_PUTS = 1024
# reply statuses
OK, BUSY, ERR, BATCH, EMPTY, STATS_REPLY = b"OK", b"BUSY", b"ERR", b"BATCH", b"EMPTY", b"STATS"
FULL = b"FULL"  # PUT refused, disk full: nothing stored, retry later (the body says the dir and free bytes)

# WAL record kinds
REC_PUT, REC_FAIL, REC_DROP, REC_SERVE, REC_COMMIT, REC_SNAPSHOT = 1, 2, 3, 4, 5, 6


class FailReport(msgspec.Struct, frozen=True):
    """`count` members of group `group_id` (started with `group_size`) will never arrive.
    `key` is unique per report call, so a retried report is applied once."""

    key: str
    group_id: str
    group_size: int
    count: int


class GetRequest(msgspec.Struct, frozen=True):
    """`n_groups` complete groups fresh enough for `current_version`. The staleness bound is the
    service's own (given when it is built); `max_staleness`, when a client still sends it, must equal
    that bound (a disagreement is answered ERR, never silently obeyed)."""

    n_groups: int
    current_version: int
    timeout_ms: int
    max_staleness: int | None = None


class CommitRequest(msgspec.Struct, frozen=True):
    batch_ids: list[int]
    step: int


class VersionRequest(msgspec.Struct, frozen=True):
    version: int


class DropRecord(msgspec.Struct, frozen=True):
    uids: list[str]


class ServedGroup(msgspec.Struct, frozen=True):
    group_id: str
    expected: int
    failed: int
    uids: list[str]


class ServeRecord(msgspec.Struct, frozen=True):
    batch_id: int
    groups: list[ServedGroup]


class GroupCounts(msgspec.Struct, frozen=True):
    """A pending group's counts and what it must still refuse (its stale-dropped uids, its applied FAIL keys)."""

    group_id: str
    expected: int
    failed: int
    stale: int = 0
    dropped_uids: list[str] = []
    fail_keys: list[str] = []
    extended: list[int] = []  # episodes whose extra chains `expected` already counts


class RunClosed(msgspec.Struct, frozen=True):
    """The closed training groups of one run: retry-0 positions as [start, end) intervals, and (position,
    retry) of closed retries."""

    run_id: str
    intervals: list[tuple[int, int]]
    retries: list[tuple[int, int]]


class Snapshot(msgspec.Struct, frozen=True):
    """First record of a compacted log: what the dropped history still has to remember (bounded: see
    `asyncrl.buffer.store`, rules on dedupe)."""

    other_uids: list[str]  # non-training uids no longer held: a resend stays a duplicate
    closed_runs: list[RunClosed]  # closed training groups: a late member is not a new group
    closed_other: list[str]  # closed non-training groups
    groups: list[GroupCounts]  # pending groups
    next_batch_id: int


# A BATCH reply is ``[req_id, BATCH, header, blob]``: the header lists the groups (with how many
# trajectories each owns) and the byte size of every trajectory; the blob is the trajectories' bytes
# exactly as received, concatenated (one copy, one large frame sent zero-copy), so the service never
# decodes or re-encodes a trajectory on the way out.
class BatchHeader(msgspec.Struct, array_like=True):
    batch_id: int
    groups: list[tuple[str, int, int, int]]  # (group_id, expected, failed, n_trajectories)
    sizes: list[int]  # byte length of each trajectory in the blob, in order


def batch_frames(batch_id: int, groups) -> list:
    """Body frames ``[header, blob]`` of a BATCH reply from ``[(ServedGroup, [Entry, ...]), ...]``."""
    raws = [e.raw for _, es in groups for e in es]
    header = BatchHeader(batch_id, [(sg.group_id, sg.expected, sg.failed, len(es)) for sg, es in groups],
                         [len(r) for r in raws])
    return [pack(header), b"".join(raws)]


def canonical_batch(batch_id: int, groups: list[Group]) -> Batch:
    """THE batch order: groups by group id, each group's members by (sample index, uid). The buffer serves
    groups in completion order and stores members in arrival order, both set by timing; the learner's
    step (packing, sums, advantages) follows the batch's order, so this makes it depend only on which
    trajectories the batch holds: two runs that train the same trajectories compute the same bits."""
    return Batch(batch_id=batch_id, groups=sorted(
        (msgspec.structs.replace(g, trajectories=sorted(g.trajectories, key=lambda t: (t.sample_index, t.uid)))
         for g in groups), key=lambda g: g.group_id))


def decode_batch(frames: list) -> Batch:
    """Inverse of `batch_frames`: an `asyncrl.data.schema.Batch` (raises ValueError on a bad reply), in its
    canonical order (`canonical_batch`)."""
    if len(frames) != 2:
        raise ValueError(f"BATCH reply needs [header, blob], got {len(frames)} frames")
    h = unpack(frames[0], BatchHeader)
    blob = memoryview(frames[1])
    if sum(g[3] for g in h.groups) != len(h.sizes) or sum(h.sizes) != len(blob):
        raise ValueError(f"BATCH {h.batch_id}: header names {sum(g[3] for g in h.groups)} trajectories of "
                         f"{sum(h.sizes)} bytes, sizes has {len(h.sizes)} and the blob {len(blob)} bytes")
    dec = msgspec.msgpack.Decoder(Trajectory)
    trajs, pos = [], 0
    for n in h.sizes:
        trajs.append(dec.decode(blob[pos:pos + n]))
        pos += n
    groups, i = [], 0
    for gid, expected, failed, n in h.groups:
        groups.append(Group(group_id=gid, expected=expected, failed=failed, trajectories=trajs[i:i + n]))
        i += n
    return canonical_batch(h.batch_id, groups)


_enc = msgspec.msgpack.Encoder()


def pack(obj) -> bytes:
    return _enc.encode(obj)


def unpack(data: bytes, type):
    """Decode `data` as `type`; raise ValueError naming the type (the server turns it into ERR)."""
    try:
        return msgspec.msgpack.decode(data, type=type)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"bad {type.__name__} body: {e}") from e
