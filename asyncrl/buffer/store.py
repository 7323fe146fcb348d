"""The buffer's in-memory state, as a deterministic state machine over WAL records (no sockets, no I/O).

The server applies every request through these methods *and* logs the same record, so replaying the
log through the same methods rebuilds the state exactly. Decisions that depend on time or on the
learner's version (which trajectories are stale, which groups form a batch) are made live and logged
as explicit records (DROP with uids, SERVE with uids), so replay never re-decides them.

Rules:
- a uid is stored once; a resend is a duplicate ('dup') or late ('late') and changes nothing. The memory of
  what was stored is bounded (`ClosedGroups`, `IntervalSet`): a *training* uid ``<group_id>-<k>`` of a training group id
  ``<run_id>-g<position>[r<retry>]`` belongs to that one group, so it is remembered by its group: in the
  pending group's member and dropped sets while the group is open, and by the group's closure once it is
  closed (a closed group takes no member: 'late'), where closed groups are kept per run as intervals of
  positions plus a set of closed retries (O(gaps), not O(uids)). A uid of that shape naming another group
  than its own is refused. Any other uid (tests, eval, tools) and its group id are remembered exactly in
  plain sets, at most `dedupe_other_max` entries: past that a new such uid is refused ('full-dedupe'),
  never forgotten;
- a group is *complete* when ``len(members) + failed >= expected``; `expected` starts at the group's size
  (episodes) and grows by ``chains - 1`` the first time a trajectory of a split episode (``episode_chains =
  chains > 1``, its chains sharing the episode's sample_index) arrives, so the group waits for every chain; `failed` counts members reported
  failed by the rollout side plus members dropped as stale, so a served group carries its real size;
- a trajectory is stale when ``min_version < current_version - max_staleness``; stale ones are
  dropped and counted, never served;
- complete groups are served ordered by (oldest member's min_version, completion order), ascending
  for ``order="oldest"``, descending for ``"newest"``;
- a served batch stays *outstanding* until committed; after a restart the outstanding batches found
  in the log are served again first (one per GET, whatever its n_groups), as the same batches with
  the same ids, minus members that have become stale for the asking learner (counted as dropped);
- a FAIL report is applied once per key while its group is open (keys live in the pending group); a
  report for a closed group changes nothing;
- a group closed without being served (complete with no member left: all failed, or some stale) is
  recorded in `dropped` with its reason ("stale" if any member was dropped as stale, else "failed"),
  and so is a group of a replayed batch whose members all became stale; the rollout side takes these
  reports (`BufferService.take_dropped`) to give the groups' admission budget back. Closing is not
  logged, so after a restart the same groups close, and are reported, again: a report is at least
  once, and its reader ignores one it has applied;
- dynamic sampling (`uniform_limit` not None; algorithm.dynamic_sampling): a complete group expecting two
  or more members whose members' rewards are all equal carries no gradient in a group-relative estimator,
  so it is closed unserved with reason "uniform" (its members freed; the rollout side gives its start back
  and draws a fresh prompt, never the same one) before any batch is planned. At most `uniform_limit` such
  groups are closed between two served batches; past that a uniform group is served as it is (counted
  `uniform_served`), so a run whose prompts are all solved or all failed still trains. The counter
  restarts at every SERVE, and the closing is not logged: it depends only on the group, and after a
  replay every uniform complete group is closed, unbounded (those closed live come back from their PUTs).
"""

from __future__ import annotations

import bisect
import functools
import re
from collections import deque
from dataclasses import dataclass, field

from asyncrl.buffer import protocol as P
from asyncrl.data.group_ids import GroupKey, parse_group_id


@dataclass(slots=True)
class Entry:
    uid: str
    group_id: str
    group_size: int
    min_version: int
    raw: bytes | memoryview  # the trajectory exactly as received (msgpack; a view of the received frame)
    episode: int = 0  # the trajectory's sample_index: the episode of its group it comes from
    chains: int = 1  # trajectories that episode produced (Trajectory.episode_chains)
    extended: bool = False  # storing it grew its group's `expected` by chains - 1 (undone with it)
    reward: float = 0.0  # the trajectory's reward (dynamic sampling reads it)


@dataclass(slots=True)
class PendingGroup:
    group_id: str
    expected: int
    failed: int = 0
    stale: int = 0  # of `failed`: members dropped as stale
    members: dict[str, Entry] = field(default_factory=dict)
    complete_seq: int = -1  # order in which the group became complete (-1: not yet)
    dropped: set[str] = field(default_factory=set)  # uids dropped as stale (a resend stays a duplicate)
    fail_keys: set[str] = field(default_factory=set)  # FAIL report keys applied (a resent report is ignored)
    extended: set[int] = field(default_factory=set)  # episodes whose extra chains `expected` counts

    def is_complete(self) -> bool:
        return len(self.members) + self.failed >= self.expected

    def min_version(self) -> int:
        return min((e.min_version for e in self.members.values()), default=0)


class IntervalSet:
    """A set of ints as sorted, disjoint, non-adjacent half-open intervals [start, end)."""

    __slots__ = ("starts", "ends")

    def __init__(self, intervals: list[tuple[int, int]] | None = None):
        self.starts: list[int] = []
        self.ends: list[int] = []
        for a, b in intervals or ():
            if b > a:
                self.add_range(a, b)

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self.starts, x) - 1
        return i >= 0 and x < self.ends[i]

    def __len__(self) -> int:
        return len(self.starts)

    def add(self, x: int) -> None:
        self.add_range(x, x + 1)

    def add_range(self, a: int, b: int) -> None:
        lo = bisect.bisect_left(self.ends, a)  # first interval that ends at or after a (may touch)
        hi = bisect.bisect_right(self.starts, b)  # intervals [lo, hi) overlap or touch [a, b)
        if lo < hi:
            a, b = min(a, self.starts[lo]), max(b, self.ends[hi - 1])
        self.starts[lo:hi] = [a]
        self.ends[lo:hi] = [b]

    def discard(self, x: int) -> None:
        i = bisect.bisect_right(self.starts, x) - 1
        if i < 0 or x >= self.ends[i]:
            return
        a, b = self.starts[i], self.ends[i]
        parts = [(s, e) for s, e in ((a, x), (x + 1, b)) if e > s]
        self.starts[i:i + 1] = [s for s, _ in parts]
        self.ends[i:i + 1] = [e for _, e in parts]

    def intervals(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.ends))


_UID_INDEX = re.compile(r"(.+)-(0|[1-9]\d*)(?:-c[1-9]\d*)?")


@functools.lru_cache(maxsize=8192)  # each put asks twice for its uid and several times for its group
def group_key(group_id: str) -> GroupKey | None:
    """The GroupKey of a training group id, None for any other id."""
    try:
        return parse_group_id(group_id)
    except ValueError:
        return None


@functools.lru_cache(maxsize=8192)
def uid_group(uid: str) -> str | None:
    """The training group a uid names by its shape (``<group_id>-<k>``, or ``<group_id>-<k>-c<j>`` for chain j of
    a split episode, with a training group id), or None."""
    m = _UID_INDEX.fullmatch(uid)
    return m.group(1) if m is not None and group_key(m.group(1)) is not None else None


class ClosedGroups:
    """Group ids closed for good (served, or closed unserved): training ids per run as an interval set of
    retry-0 positions plus a set of closed (position, retry > 0); other ids in a plain set."""

    def __init__(self):
        self.runs: dict[str, IntervalSet] = {}
        self.retries: set[tuple[str, int, int]] = set()
        self.other: set[str] = set()

    def __contains__(self, group_id: str) -> bool:
        key = group_key(group_id)
        if key is None:
            return group_id in self.other
        run, pos, retry = key
        if retry:
            return (run, pos, retry) in self.retries
        iv = self.runs.get(run)
        return iv is not None and pos in iv

    def add(self, group_id: str) -> None:
        key = group_key(group_id)
        if key is None:
            self.other.add(group_id)
            return
        run, pos, retry = key
        if retry:
            self.retries.add((run, pos, retry))
        else:
            self.runs.setdefault(run, IntervalSet()).add(pos)

    def records(self, reopen: set[str]) -> tuple[list[P.RunClosed], list[str]]:
        """(per-run records, other ids) for a snapshot, leaving out `reopen` (groups whose records follow)."""
        runs = {r: IntervalSet(iv.intervals()) for r, iv in self.runs.items()}
        retries, other = set(self.retries), self.other - reopen
        for gid in reopen:
            key = group_key(gid)
            if key is None:
                continue
            run, pos, retry = key
            if retry:
                retries.discard((run, pos, retry))
            elif run in runs:
                runs[run].discard(pos)
        by_run: dict[str, list[tuple[int, int]]] = {}
        for run, pos, retry in retries:
            by_run.setdefault(run, []).append((pos, retry))
        out = [P.RunClosed(run, runs[run].intervals() if run in runs else [], sorted(by_run.get(run, [])))
               for run in sorted(set(runs) | set(by_run))]
        return out, sorted(other)

    def load(self, runs: list[P.RunClosed], other: list[str]) -> None:
        for rc in runs:
            iv = self.runs.setdefault(rc.run_id, IntervalSet())
            for a, b in rc.intervals:
                if b > a:
                    iv.add_range(a, b)
            self.retries.update((rc.run_id, p, k) for p, k in rc.retries)
        self.other.update(other)

    def sizes(self) -> dict:
        return {"closed_runs": len(self.runs), "closed_intervals": sum(len(iv) for iv in self.runs.values()),
                "closed_retries": len(self.retries), "closed_other": len(self.other)}


class BufferState:
    def __init__(self, capacity_trajectories: int, capacity_bytes: int, order: str = "oldest",
                 dedupe_other_max: int = 1_000_000, uniform_limit: int | None = None):
        if capacity_trajectories < 1 or capacity_bytes < 1 or dedupe_other_max < 1:
            raise ValueError(f"buffer capacity must be positive, got capacity_trajectories={capacity_trajectories}"
                             f" capacity_bytes={capacity_bytes} dedupe_other_max={dedupe_other_max}")
        if order not in ("oldest", "newest"):
            raise ValueError(f"buffer.order={order!r} is not one of ('oldest', 'newest')")
        if uniform_limit is not None and uniform_limit < 1:
            raise ValueError(f"uniform_limit (groups of equal rewards closed between two batches) must be >= 1 or "
                             f"None (dynamic sampling off), got {uniform_limit}")
        self.uniform_limit, self.uniform_since_serve = uniform_limit, 0
        self.capacity_trajectories, self.capacity_bytes, self.order = capacity_trajectories, capacity_bytes, order
        self.dedupe_other_max = dedupe_other_max
        self.other_seen: set[str] = set()  # uids that are not training uids, ever stored
        self.groups: dict[str, PendingGroup] = {}
        self.held: dict[str, str] = {}  # uid -> group_id of every pending member
        self.closed = ClosedGroups()
        self.outstanding: dict[int, int] = {}  # batch_id -> trajectories in it (served, not committed)
        self.outstanding_bytes: dict[int, int] = {}  # batch_id -> its trajectories' bytes (sizes the WAL's live state)
        self.outstanding_nbytes = 0  # their sum
        self.replay_queue: dict[int, tuple[P.ServeRecord, dict[str, Entry]]] = {}  # to serve again
        self.next_batch_id = 0
        self.size = 0  # held (pending) trajectories
        self.nbytes = 0
        self._seq = 0
        self.dropped: deque[tuple[str, str]] = deque()  # (group_id, "stale" | "failed" | "uniform"): not yet taken
        self.counts = {"received": 0, "duplicates": 0, "late": 0, "failed_reported": 0, "dropped_stale": 0,
                       "dropped_empty_groups": 0, "groups_dropped_stale": 0, "groups_dropped_failed": 0,
                       "groups_dropped_uniform": 0, "uniform_served": 0,
                       "served": 0, "batches_served": 0, "batches_committed": 0, "batches_replayed": 0}

    # ------------------------------------------------------------------ admission

    def _is_dup(self, uid: str, group_id: str) -> bool:
        """Stored before, as far as the group still open or the plain set can tell (closure is checked apart)."""
        if uid in self.other_seen:
            return True
        g = self.groups.get(group_id)
        return g is not None and (uid in g.members or uid in g.dropped)

    def classify(self, uid: str, group_id: str, nbytes: int) -> str:
        """What a put of this trajectory would do now: 'dup' | 'late' | 'busy' | 'new' | 'full-dedupe'
        (no mutation); ValueError for a uid that names another training group than its own.

        'busy' when holding it would exceed a capacity, unless the buffer is empty (one oversized item
        must not wedge it) or its group already has members here (completing groups is what frees space;
        refusing it could deadlock a buffer full of incomplete groups). 'full-dedupe': a new non-training
        uid while `dedupe_other_max` non-training uids and group ids are remembered."""
        named = uid_group(uid)
        if named is not None and named != group_id:
            raise ValueError(f"uid {uid!r} names training group {named!r} but the trajectory's group_id is "
                             f"{group_id!r}")
        if self._is_dup(uid, group_id):
            return "dup"
        if group_id in self.closed:
            return "late"
        if named is None and len(self.other_seen) + len(self.closed.other) >= self.dedupe_other_max:
            return "full-dedupe"
        over = self.size + 1 > self.capacity_trajectories or self.nbytes + nbytes > self.capacity_bytes
        g = self.groups.get(group_id)
        if over and self.size > 0 and not (g is not None and g.members):
            return "busy"
        return "new"

    # ------------------------------------------------------------------ record application

    def apply_put(self, e: Entry) -> str:
        """Store `e` unless it is a duplicate ('dup') or belongs to an already closed group ('late'). A late
        trajectory is not remembered: it was never stored, and its group stays closed."""
        if self._is_dup(e.uid, e.group_id):
            self.counts["duplicates"] += 1
            return "dup"
        if e.group_id in self.closed:
            self.counts["late"] += 1
            return "late"
        if uid_group(e.uid) is None:
            self.other_seen.add(e.uid)
        g = self.groups.get(e.group_id)
        if g is None:
            g = self.groups[e.group_id] = PendingGroup(e.group_id, max(1, e.group_size))
        e.extended = e.chains > 1 and e.episode not in g.extended
        if e.extended:  # the first chain of a split episode: its group waits for all of them
            g.extended.add(e.episode)
            g.expected += e.chains - 1
        g.members[e.uid] = e
        self.held[e.uid] = e.group_id
        self.size += 1
        self.nbytes += len(e.raw)
        self.counts["received"] += 1
        self._check_complete(g)
        return "new"

    def unapply_put(self, e: Entry, created: bool) -> None:
        """Undo the last `apply_put(e)` that returned 'new' (its record could not be written: disk full).
        Undo in reverse order of application, with nothing else applied in between. `created`: the put
        made its group."""
        g = self.groups[e.group_id]
        del g.members[e.uid]
        if e.extended:
            g.extended.discard(e.episode)
            g.expected -= e.chains - 1
        del self.held[e.uid]
        self.other_seen.discard(e.uid)
        self.size -= 1
        self.nbytes -= len(e.raw)
        self.counts["received"] -= 1
        if created and not g.members and not g.failed:
            del self.groups[e.group_id]
        elif g.complete_seq >= 0 and not g.is_complete():
            g.complete_seq = -1

    def apply_fail(self, rep: P.FailReport) -> bool:
        """Count `rep.count` members of the group as never arriving; False (nothing to log) for a repeated
        report key or a group already closed."""
        if rep.group_id in self.closed:
            return False
        g = self.groups.get(rep.group_id)
        if g is None:
            g = self.groups[rep.group_id] = PendingGroup(rep.group_id, max(1, rep.group_size))
        elif rep.key in g.fail_keys:
            return False
        g.fail_keys.add(rep.key)
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
                g.dropped.add(uid)
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
        self.uniform_since_serve = 0
        for sg in rec.groups:
            g = self.groups.pop(sg.group_id, None)
            members = g.members if g is not None else {}
            entries = [members[u] for u in sg.uids if u in members]
            if not replaying and self.is_uniform(g):
                self.counts["uniform_served"] += 1
            if len(entries) != len(sg.uids):
                raise ValueError(f"WAL SERVE record of batch {rec.batch_id} names members of group {sg.group_id!r} "
                                 f"that are not held: {sorted(set(sg.uids) - set(members))}")
            for e in entries:
                self._release(e)
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
        self.other_seen.update(s.other_uids)
        self.closed.load(s.closed_runs, s.closed_other)
        for gc in s.groups:
            self.groups[gc.group_id] = PendingGroup(gc.group_id, gc.expected, gc.failed, gc.stale,
                                                    dropped=set(gc.dropped_uids), fail_keys=set(gc.fail_keys),
                                                    extended=set(gc.extended))
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

    def is_uniform(self, g: PendingGroup | None) -> bool:
        """Dynamic sampling is on and `g` expects two or more members, whose rewards are all equal."""
        return (self.uniform_limit is not None and g is not None and g.expected >= 2 and bool(g.members)
                and len({e.reward for e in g.members.values()}) == 1)

    def close_uniform_complete(self, bounded: bool = True) -> None:
        """Dynamic sampling: close complete groups of equal rewards, at most `uniform_limit` between two
        served batches (see the module doc). Each is recorded in `dropped` as "uniform". Unbounded after a
        replay: the groups it closed live come back from their PUTs and must not spend the bound."""
        if self.uniform_limit is None:
            return
        for g in [g for g in self.groups.values() if g.is_complete() and self.is_uniform(g)]:
            if bounded and self.uniform_since_serve >= self.uniform_limit:
                return
            del self.groups[g.group_id]
            for e in g.members.values():
                self._release(e)
            self.closed.add(g.group_id)
            self.uniform_since_serve += bounded
            self.record_dropped(g.group_id, "uniform")

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
        closed_runs, closed_other = self.closed.records(queued_groups)
        snap = P.Snapshot(
            other_uids=sorted(self.other_seen - live_uids), closed_runs=closed_runs, closed_other=closed_other,
            groups=[P.GroupCounts(g.group_id, g.expected, g.failed, g.stale, sorted(g.dropped), sorted(g.fail_keys),
                                  sorted(g.extended))
                    for g in self.groups.values()],
            next_batch_id=self.next_batch_id)
        out = [(P.REC_SNAPSHOT, P.pack(snap))]
        out += [(P.REC_PUT, e.raw) for e in held]
        for rec, ents in queued:
            out += [(P.REC_PUT, e.raw) for e in ents.values()]
            out.append((P.REC_SERVE, P.pack(rec)))
        return out

    # ------------------------------------------------------------------ helpers

    def _release(self, e: Entry) -> None:
        """`e` leaves the pending set (served, or its group closed): no longer held, counted or sized."""
        self.held.pop(e.uid, None)
        self.size -= 1
        self.nbytes -= len(e.raw)

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
            "age_versions_mean": (sum(ages) / len(ages)) if ages else 0.0, "dedupe_other": len(self.other_seen),
            **self.closed.sizes(), **self.counts,
        }
