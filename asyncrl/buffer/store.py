"""The buffer's in-memory state, as a deterministic state machine over WAL records (no sockets, no I/O).

The server applies every request through these methods *and* logs the same record, so replaying the
log through the same methods rebuilds the state exactly. Decisions that depend on time or on the
learner's version (which trajectories are stale, which groups form a batch) are made live and logged
as explicit records (DROP with uids, SERVE with uids), so replay never re-decides them.

Rules:
- a uid is stored once (`seen`); a resend is a duplicate and changes nothing;
- a group is *complete* when ``len(members) + failed >= expected``; `failed` counts members reported
  failed by the rollout side plus members dropped as stale, so a served group carries its real size;
- a trajectory is stale when ``min_version < current_version - max_staleness``; stale ones are
  dropped and counted, never served;
- complete groups are served ordered by (oldest member's min_version, completion order), ascending
  for ``order="oldest"``, descending for ``"newest"``;
- a served batch stays *outstanding* until committed; after a restart the outstanding batches found
  in the log are served again first (one per GET, whatever its n_groups), as the same batches with
  the same ids, minus members that have become stale for the asking learner (counted as dropped);
- a group closed without being served (complete with no member left: all failed, or some stale) is
  recorded in `dropped` with its reason ("stale" if any member was dropped as stale, else "failed"),
  and so is a group of a replayed batch whose members all became stale; the rollout side takes these
  reports (`BufferService.take_dropped`) to give the groups' admission budget back. Closing is not
  logged, so after a restart the same groups close, and are reported, again: a report is at least
  once, and its reader ignores one it has applied.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from asyncrl.buffer import protocol as P


@dataclass(slots=True)
class Entry:
    uid: str
    group_id: str
    group_size: int
    min_version: int
    raw: bytes | memoryview  # the trajectory exactly as received (msgpack; a view of the received frame)


@dataclass(slots=True)
class PendingGroup:
    group_id: str
    expected: int
    failed: int = 0
    stale: int = 0  # of `failed`: members dropped as stale
    members: dict[str, Entry] = field(default_factory=dict)
    complete_seq: int = -1  # order in which the group became complete (-1: not yet)

    def is_complete(self) -> bool:
        return len(self.members) + self.failed >= self.expected

    def min_version(self) -> int:
        return min((e.min_version for e in self.members.values()), default=0)


class BufferState:
    def __init__(self, capacity_trajectories: int, capacity_bytes: int, order: str = "oldest"):
        if capacity_trajectories < 1 or capacity_bytes < 1:
            raise ValueError(f"buffer capacity must be positive, got capacity_trajectories={capacity_trajectories}"
                             f" capacity_bytes={capacity_bytes}")
        if order not in ("oldest", "newest"):
            raise ValueError(f"buffer.order={order!r} is not one of ('oldest', 'newest')")
        self.capacity_trajectories, self.capacity_bytes, self.order = capacity_trajectories, capacity_bytes, order
        self.seen: set[str] = set()
        self.fail_keys: set[str] = set()
        self.groups: dict[str, PendingGroup] = {}
        self.held: dict[str, str] = {}  # uid -> group_id of every pending member
        self.closed: set[str] = set()
        self.outstanding: dict[int, int] = {}  # batch_id -> trajectories in it (served, not committed)
        self.outstanding_bytes: dict[int, int] = {}  # batch_id -> its trajectories' bytes (sizes the WAL's live state)
        self.outstanding_nbytes = 0  # their sum
        self.replay_queue: dict[int, tuple[P.ServeRecord, dict[str, Entry]]] = {}  # to serve again
        self.next_batch_id = 0
        self.size = 0  # held (pending) trajectories
        self.nbytes = 0
        self._seq = 0
        self.dropped: deque[tuple[str, str]] = deque()  # (group_id, "stale" | "failed"): closed unserved, not yet taken
        self.counts = {"received": 0, "duplicates": 0, "late": 0, "failed_reported": 0, "dropped_stale": 0,
                       "dropped_empty_groups": 0, "groups_dropped_stale": 0, "groups_dropped_failed": 0,
                       "served": 0, "batches_served": 0, "batches_committed": 0, "batches_replayed": 0}

    # ------------------------------------------------------------------ admission

    def classify(self, uid: str, group_id: str, nbytes: int) -> str:
        """What a put of this trajectory would do now: 'dup' | 'late' | 'busy' | 'new' (no mutation).

        'busy' when holding it would exceed a capacity, unless the buffer is empty (one oversized item
        must not wedge it) or its group already has members here (completing groups is what frees space;
        refusing it could deadlock a buffer full of incomplete groups)."""
        if uid in self.seen:
            return "dup"
        if group_id in self.closed:
            return "late"
        over = self.size + 1 > self.capacity_trajectories or self.nbytes + nbytes > self.capacity_bytes
        g = self.groups.get(group_id)
        if over and self.size > 0 and not (g is not None and g.members):
            return "busy"
        return "new"

    # ------------------------------------------------------------------ record application

    def apply_put(self, e: Entry) -> str:
        """Store `e` unless it is a duplicate ('dup') or belongs to an already served group ('late')."""
        if e.uid in self.seen:
            self.counts["duplicates"] += 1
            return "dup"
        self.seen.add(e.uid)
        if e.group_id in self.closed:
            self.counts["late"] += 1
            return "late"
        g = self.groups.get(e.group_id)
        if g is None:
            g = self.groups[e.group_id] = PendingGroup(e.group_id, max(1, e.group_size))
        g.members[e.uid] = e
        self.held[e.uid] = e.group_id
        self.size += 1
        self.nbytes += len(e.raw)
        self.counts["received"] += 1
        self._check_complete(g)
        return "new"

    def apply_fail(self, rep: P.FailReport) -> bool:
        """Count `rep.count` members of the group as never arriving; False for a repeated report key."""
        if rep.key in self.fail_keys:
            return False
        self.fail_keys.add(rep.key)
        if rep.group_id in self.closed:
            return True
        g = self.groups.get(rep.group_id)
        if g is None:
            g = self.groups[rep.group_id] = PendingGroup(rep.group_id, max(1, rep.group_size))
        g.failed += rep.count
        self.counts["failed_reported"] += rep.count
        self._check_complete(g)
        return True

    def apply_drop(self, uids: list[str]) -> None:
        """Drop these pending members as stale: each counts as failed in its group."""
        for uid in uids:
            gid = self.held.pop(uid, None)
            if gid is not None:
                g = self.groups[gid]
                e = g.members.pop(uid)
                self.size -= 1
                self.nbytes -= len(e.raw)
                g.failed += 1
                g.stale += 1
                self.counts["dropped_stale"] += 1
                self._check_complete(g)

    def apply_serve(self, rec: P.ServeRecord, replaying: bool) -> list[tuple[P.ServedGroup, list[Entry]]]:
        """Move the record's groups out of the pending set; return their entries in record order.
        While replaying the log, the batch is queued to be served again (until a commit removes it)."""
        out = []
        for sg in rec.groups:
            g = self.groups.pop(sg.group_id, None)
            members = g.members if g is not None else {}
            entries = [members[u] for u in sg.uids if u in members]
            if len(entries) != len(sg.uids):
                raise ValueError(f"WAL SERVE record of batch {rec.batch_id} names members of group {sg.group_id!r} "
                                 f"that are not held: {sorted(set(sg.uids) - set(members))}")
            for e in entries:
                self.held.pop(e.uid, None)
                self.size -= 1
                self.nbytes -= len(e.raw)
            self.closed.add(sg.group_id)
            out.append((sg, entries))
        self.next_batch_id = max(self.next_batch_id, rec.batch_id + 1)
        n = sum(len(sg.uids) for sg in rec.groups)
        self.outstanding[rec.batch_id] = n
        nb = sum(len(e.raw) for _, es in out for e in es)
        self.outstanding_nbytes += nb - self.outstanding_bytes.get(rec.batch_id, 0)
        self.outstanding_bytes[rec.batch_id] = nb
        if replaying:
            self.replay_queue[rec.batch_id] = (rec, {e.uid: e for _, es in out for e in es})
        else:
            self.counts["served"] += n
            self.counts["batches_served"] += 1
        return out

    def apply_commit(self, batch_ids: list[int]) -> None:
        for b in batch_ids:
            if self.outstanding.pop(b, None) is not None:
                self.counts["batches_committed"] += 1
            self.outstanding_nbytes -= self.outstanding_bytes.pop(b, 0)
            self.replay_queue.pop(b, None)

    def apply_snapshot(self, s: P.Snapshot) -> None:
        self.seen.update(s.seen_uids)
        self.fail_keys.update(s.fail_keys)
        self.closed.update(s.closed_groups)
        for gc in s.groups:
            self.groups[gc.group_id] = PendingGroup(gc.group_id, gc.expected, gc.failed)
        self.next_batch_id = max(self.next_batch_id, s.next_batch_id)

    # ------------------------------------------------------------------ live decisions

    def stale_uids(self, threshold: int) -> list[str]:
        """Pending members whose oldest generated token is older than `threshold` (= version - eta)."""
        return [u for g in self.groups.values() for u, e in g.members.items() if e.min_version < threshold]

    def drop_empty_complete(self) -> None:
        """Close groups that are complete with no member left (all failed or stale): nothing to serve.
        Each is recorded in `dropped` with its reason."""
        for gid in [gid for gid, g in self.groups.items() if not g.members and g.is_complete()]:
            g = self.groups.pop(gid)
            self.closed.add(gid)
            self.counts["dropped_empty_groups"] += 1
            self.record_dropped(gid, "stale" if g.stale else "failed")

    def record_dropped(self, group_id: str, reason: str) -> None:
        """A group that will never be served (closed empty, or a replayed group gone stale), for the rollout side."""
        self.dropped.append((group_id, reason))
        self.counts[f"groups_dropped_{reason}"] += 1

    def take_dropped(self) -> list[tuple[str, str]]:
        """The dropped-group reports recorded since the last call (safe from another thread than the writer's)."""
        out = []
        while True:
            try:
                out.append(self.dropped.popleft())
            except IndexError:
                return out

    def complete_groups(self) -> list[PendingGroup]:
        """Servable groups in serving order."""
        done = [g for g in self.groups.values() if g.members and g.is_complete()]
        done.sort(key=lambda g: (g.min_version(), g.complete_seq), reverse=self.order == "newest")
        return done

    def plan_batch(self, n_groups: int) -> P.ServeRecord | None:
        """The next batch of `n_groups` complete groups (not yet applied), or None if too few are complete."""
        done = self.complete_groups()
        if len(done) < n_groups:
            return None
        groups = [P.ServedGroup(g.group_id, g.expected, g.failed, list(g.members)) for g in done[:n_groups]]
        return P.ServeRecord(self.next_batch_id, groups)

    def next_replay(self) -> tuple[P.ServeRecord, dict[str, Entry]] | None:
        if not self.replay_queue:
            return None
        b = min(self.replay_queue)
        rec, entries = self.replay_queue.pop(b)
        self.counts["batches_replayed"] += 1
        self.counts["served"] += len(entries)
        return rec, entries

    def snapshot_records(self) -> list[tuple[int, bytes]]:
        """The live state as a minimal record list (for compaction): a snapshot, the held trajectories,
        then the outstanding batches found in the log (their trajectories and SERVE records)."""
        held = [e for g in self.groups.values() for e in g.members.values()]
        queued = [(rec, ents) for _, (rec, ents) in sorted(self.replay_queue.items())]
        live_uids = {e.uid for e in held} | {u for _, ents in queued for u in ents}
        queued_groups = {sg.group_id for rec, _ in queued for sg in rec.groups}
        snap = P.Snapshot(
            seen_uids=sorted(self.seen - live_uids), fail_keys=sorted(self.fail_keys),
            groups=[P.GroupCounts(g.group_id, g.expected, g.failed) for g in self.groups.values()],
            closed_groups=sorted(self.closed - queued_groups), next_batch_id=self.next_batch_id)
        out = [(P.REC_SNAPSHOT, P.pack(snap))]
        out += [(P.REC_PUT, e.raw) for e in held]
        for rec, ents in queued:
            out += [(P.REC_PUT, e.raw) for e in ents.values()]
            out.append((P.REC_SERVE, P.pack(rec)))
        return out

    # ------------------------------------------------------------------ helpers

    def _check_complete(self, g: PendingGroup) -> None:
        if g.complete_seq < 0 and g.is_complete():
            g.complete_seq = self._seq
            self._seq += 1

    def stats(self, version: int) -> dict:
        ages = [version - e.min_version for g in self.groups.values() for e in g.members.values()]
        return {
            "size": self.size, "bytes": self.nbytes, "groups_pending": len(self.groups),
            "groups_complete": sum(1 for g in self.groups.values() if g.members and g.is_complete()),
            "batches_outstanding": len(self.outstanding), "batches_to_replay": len(self.replay_queue),
            "next_batch_id": self.next_batch_id, "age_versions_max": max(ages, default=0),
            "age_versions_mean": (sum(ages) / len(ages)) if ages else 0.0, **self.counts,
        }
