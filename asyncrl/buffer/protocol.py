"""Wire protocol of the replay buffer (ZMQ ROUTER on the service, DEALER on clients).

A request is three frames ``[req_id, op, body]`` (PUTS: ``[req_id, op, body, body, ...]``); the ROUTER prepends the peer identity. The reply is
``[req_id, status, body]`` with the same ``req_id`` so a client can match replies to concurrent
requests and ignore late ones.

=========  =====================================  ==============================================
op         body                                   reply
=========  =====================================  ==============================================
PUT        msgpack Trajectory (as sent, stored    OK (``b"new"`` | ``b"dup"`` | ``b"late"``),
           verbatim in the WAL)                   BUSY (back-pressure: retry later), ERR
PUTS       one frame per trajectory (a client's   OK with a msgpack list of per-item verdicts:
           concurrent puts, coalesced; at most    ``"new"`` | ``"dup"`` | ``"late"`` | ``"busy"``
           `MAX_PUTS` items)                      | ``"err: <why>"``
FAIL       msgpack `FailReport`                   OK
GET        msgpack `GetRequest`                   BATCH (msgpack `Batch`) or EMPTY on its deadline
COMMIT     msgpack `CommitRequest`                OK
VERSION    msgpack `VersionRequest`               OK
STATS      empty                                  STATS (msgpack dict)
=========  =====================================  ==============================================

Any other shape (wrong frame count, unknown op, undecodable or oversized body) is answered ``ERR``
with a message, and counted as malformed.
"""

from __future__ import annotations

import msgspec

# request ops
PUT, PUTS, FAIL, GET, COMMIT, VERSION, STATS = (b"PUT", b"PUTS", b"FAIL", b"GET", b"COMMIT", b"VERSION",
                                                b"STATS")
OPS = (PUT, PUTS, FAIL, GET, COMMIT, VERSION, STATS)
MAX_PUTS = 1024
# reply statuses
OK, BUSY, ERR, BATCH, EMPTY, STATS_REPLY = b"OK", b"BUSY", b"ERR", b"BATCH", b"EMPTY", b"STATS"

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
    n_groups: int
    current_version: int
    max_staleness: int
    timeout_ms: int


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
    group_id: str
    expected: int
    failed: int


class Snapshot(msgspec.Struct, frozen=True):
    """First record of a compacted log: what the dropped history still has to remember."""

    seen_uids: list[str]  # uids no longer held (served+committed, dropped): a resend stays a duplicate
    fail_keys: list[str]
    groups: list[GroupCounts]  # pending groups' expected size and failed count
    closed_groups: list[str]  # groups already served: a late member is not a new group
    next_batch_id: int


# The batch reply reuses the trajectories' bytes as received (msgspec.Raw): no decode/re-encode on
# the way out, and the client decodes it as asyncrl.schema.Batch (same msgpack shape).
class WireGroup(msgspec.Struct, kw_only=True):
    group_id: str
    trajectories: list[msgspec.Raw]
    expected: int
    failed: int = 0


class WireBatch(msgspec.Struct, kw_only=True):
    batch_id: int
    groups: list[WireGroup]


_enc = msgspec.msgpack.Encoder()


def pack(obj) -> bytes:
    return _enc.encode(obj)


def unpack(data: bytes, type):
    """Decode `data` as `type`; raise ValueError naming the type (the server turns it into ERR)."""
    try:
        return msgspec.msgpack.decode(data, type=type)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"bad {type.__name__} body: {e}") from e
