"""The replay buffer service: one ZMQ ROUTER socket, one write-ahead log, one serving thread.

Loop (single thread, owns the socket and the state): wait for requests, drain up to
`DRAIN_MAX` of them without blocking, apply each (logging its WAL record), try to answer the parked
GET requests, write the round's WAL records with one syscall and one fsync (``batched``: group
commit), and only then send the replies (acks, batches) with ``NOBLOCK``, so an ack always means
"in the log" and a vanished peer can never block the loop (ROUTER drops what it cannot route).

The staleness bound (eta) is the service's own, given when it is built (`max_staleness`, resolved
once in `asyncrl.config`); the version comes from VERSION requests (the controller publishes the
learner's version after each weight sync) and from each GET. So a VERSION arriving before any GET
already drops the trajectories it makes stale.

A GET is parked until enough complete groups exist or its deadline passes (then EMPTY). A new GET
from the same peer replaces its parked one. On start the log is replayed through the same state
machine (`asyncrl.buffer.store`) and compacted to the live state (damage reported in
`stats()['wal_recovery']` and quarantined: `asyncrl.buffer.wal`); while serving, `_compact_step`
compacts it again whenever it outgrows the live state.

With CURVE keys (`asyncrl.buffer.keys`), a ZAP handler in the service's own context (`AllowList`)
admits only the allow-listed producer and consumer public keys and names each connection's role;
`_handle` answers a request outside its role's `ROLE_OPS` with ERR. A non-loopback bind without
CURVE is refused (`check_bind`).

Disk full (a log write fails with ENOSPC or EDQUOT): the log is cut back to where the write began (no
torn or half-acknowledged record), what that write held other than PUTs is written again into the space
of the reserve (`asyncrl.buffer.diskspace.DiskReserve`, `buffer.disk_reserve_bytes` preallocated beside
the log, released now), and the service stops acknowledging PUTs: each new trajectory is answered FULL
(PUTS: the verdict ``"full: <why>"``) naming the directory and its free bytes, with nothing applied, so
the producer keeps it and retries. GET, COMMIT, FAIL, VERSION and STATS are served as before; their small
records go into the reserve's space. Every `buffer.disk_probe_s` the service tries to allocate the
reserve again; once it holds it and as much again is free, PUTs are acknowledged again. If the reserve's
space is used up too, the next write fails the service (below). PUT records are written before they are
applied (with the records of the round that came before them, one write), and undone in memory if that
write finds the disk full; everything else is applied, then written at the end of the round.

Fatal errors (a failed log write or fsync other than disk full: I/O error, file too large, a disk still
full once the reserve is used up; a bug): the loop stops applying
requests, keeps the error (`error`, `health()`) and from then on answers every request, the ones
waiting for an ack or a batch included, with ERR "buffer stopped: <error>" (never an ack: what was not
logged is not acknowledged). Nobody waits on silence; the controller reads `health()` and stops the run.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from asyncrl.buffer import protocol as P
from asyncrl.buffer.diskspace import DiskReserve
from asyncrl.buffer.keys import BufferKeys, curve_enabled
from asyncrl.buffer.store import BufferState, Entry
from asyncrl.buffer.wal import WalError, WriteAheadLog, frame_parts, should_compact
from asyncrl.config import BufferConfig
from asyncrl.data.schema import SchemaError, Trajectory
from asyncrl.util.durable import free_bytes, full_errno
from asyncrl.util.net import is_loopback

log = logging.getLogger(__name__)

DRAIN_MAX = 512
BUSY_RETRY_MS = 50
ZAP_DOMAIN = b"asyncrl-buffer"
# what each client role may ask (with CURVE; the role is the User-Id the ZAP handler gave its key)
ROLE_OPS = {"producer": {P.PUT, P.PUTS, P.FAIL}, "consumer": {P.GET, P.COMMIT, P.VERSION, P.STATS}}


class BufferConfigError(ValueError):
    """A buffer configuration that must not run (e.g. a non-loopback bind without CURVE keys)."""


def check_bind(cfg: BufferConfig, keys: BufferKeys | None) -> None:
    """Refuse a non-loopback bind without CURVE, CURVE without keys, and keys without CURVE."""
    curve = curve_enabled(cfg)
    if not is_loopback(cfg.host) and not curve:
        raise BufferConfigError(
            f"buffer.host={cfg.host!r} is not a loopback address and buffer.curve={cfg.curve!r}: refusing to "
            "expose the replay buffer without CURVE. Set buffer.curve=on (or auto) or bind to 127.0.0.1.")
    if curve and keys is None:
        raise BufferConfigError(f"buffer.curve={cfg.curve!r} (host {cfg.host!r}) needs the CURVE keys "
                                "(asyncrl.buffer.keys.BufferKeys) and none were given")
    if keys is not None and not curve:
        raise BufferConfigError(f"CURVE keys were given but buffer.curve={cfg.curve!r} (host {cfg.host!r}) "
                                "turns CURVE off")
    if curve and not zmq.has("curve"):
        raise BufferConfigError("buffer.curve is on but this libzmq was built without CURVE support")


class AllowList(ThreadAuthenticator):
    """The ZAP handler of the service's context: a CURVE client is admitted only if its public key
    is on the allow-list, and its User-Id is its role. Runs in its own thread of the service."""

    def __init__(self, ctx: zmq.Context, allowed: dict[str, str]):
        super().__init__(ctx, log=log.getChild("zap"))
        self._roles = {k.encode(): role for k, role in allowed.items()}  # (base class's `_allowed`: addresses)
        self.denied = 0  # refused handshakes (a refused client retries: one key may count many times)
        self._warned: set[bytes] = set()
        self.configure_curve_callback(ZAP_DOMAIN.decode(), self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self._roles:
            return True
        self.denied += 1
        if client_key not in self._warned and len(self._warned) < 100:  # once per key: retries would flood
            self._warned.add(client_key)
            log.warning("replay buffer refused a CURVE client whose public key %s is not on the allow-list",
                        client_key.decode(errors="replace"))
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._roles[z85.encode(client_public_key)]


_TRAJECTORY = msgspec.msgpack.Decoder(Trajectory)


def decode_put(body: bytes) -> Entry:
    """Decode a PUT body as a Trajectory and check it with `Trajectory.validate` (the one validation);
    raise ValueError naming what is wrong."""
    try:
        t = _TRAJECTORY.decode(body).validate()
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"PUT body is not a valid Trajectory: {e}") from e
    except SchemaError as e:
        raise ValueError(f"PUT {e}") from e
    return Entry(t.uid, t.group_id, t.group_size, t.min_version(), body, t.sample_index, t.episode_chains,
                 reward=t.reward)


class _DiskFull(Exception):
    """A log write found the disk full; the log was cut back to where that write began."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class _Parked(msgspec.Struct):
    ident: bytes
    req_id: bytes
    req: P.GetRequest
    deadline: float


class BufferService:
    """Owns the socket, the WAL and the in-memory state. `start()` returns the address to connect to."""

    def __init__(self, cfg: BufferConfig, wal_dir: str | Path, max_staleness: int, keys: BufferKeys | None = None,
                 uniform_limit: int | None = None):
        check_bind(cfg, keys)
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise BufferConfigError(f"buffer max_staleness must be an integer >= 0, got {max_staleness!r}")
        self.cfg, self.keys = cfg, keys
        self._auth: AllowList | None = None
        self.wal = WriteAheadLog(wal_dir, cfg.fsync)
        self._meta_bytes = 0  # size of the last compaction's SNAPSHOT record (part of the live state)
        # uniform_limit: dynamic sampling's groups of equal rewards closed between two batches (None: off)
        self.state = BufferState(cfg.capacity_trajectories, cfg.capacity_bytes, cfg.order, cfg.dedupe_other_max,
                                 uniform_limit)
        self.reserve = DiskReserve(self.wal.dir, cfg.disk_reserve_bytes)
        self.full: str | None = None  # why PUTs are refused (disk full), None while they are acknowledged
        self._next_probe = 0.0
        self._wrote = False  # this round wrote records (the batched policy's fsync covers them)
        self.max_staleness = max_staleness  # eta: fixed for the service's life
        self.version = 0
        self.threshold = -max_staleness  # version - eta, from the last VERSION or GET
        self.counts = {"malformed": 0, "bytes_received": 0, "busy_replies": 0, "requests": 0, "forbidden": 0,
                       "full_refusals": 0, "disk_full_episodes": 0, "dedupe_refused": 0}
        self._parked: dict[bytes, _Parked] = {}
        self._sync_fut = None  # running fsync (batched policy) and the replies it releases
        self._in_sync: list[list[bytes]] = []
        self._after_sync: list[list[bytes]] = []  # replies waiting for the next fsync
        self._need_sync = False
        self._round: list[list[bytes]] = []  # the replies of the round being written
        self._current: list[bytes] | None = None  # [ident, req_id] of the PUT being written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self.address: str | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        self._replay()
        self.state.drop_empty_complete()  # groups the log leaves complete and empty are closed before any PUT
        self.state.close_uniform_complete(bounded=False)
        try:
            room = self.reserve.try_acquire()
        except OSError as e:
            raise WalError(f"cannot allocate the buffer's disk reserve {self.reserve.path} "
                           f"(buffer.disk_reserve_bytes={self.reserve.nbytes}): {e}") from e
        if not room:
            self._enter_full(OSError(28, f"no room for the {self.reserve.nbytes}-byte disk reserve at start"))
        self._ctx = zmq.Context()
        if self.keys is not None:  # the ZAP handler must serve before the first client handshakes
            self._auth = AllowList(self._ctx, self.keys.allowed())
            self._auth.start()
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.setsockopt(zmq.RCVHWM, 10_000)
        # protocol-level ceiling (the peer is disconnected); frames up to max_frame_bytes get an ERR reply
        s.setsockopt(zmq.MAXMSGSIZE, 2 * self.cfg.max_frame_bytes + (1 << 20))
        if self.keys is not None:
            s.curve_server = True
            s.curve_secretkey = self.keys.server.secret.encode()
            s.curve_publickey = self.keys.server.public.encode()
            s.zap_domain = ZAP_DOMAIN
        host = "*" if self.cfg.host in ("0.0.0.0", "*") else self.cfg.host
        url = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
        try:
            if self.cfg.port:
                s.bind(f"{url}:{self.cfg.port}")
                port = self.cfg.port
            else:
                port = s.bind_to_random_port(url)
        except zmq.ZMQError as e:
            s.close()
            if self._auth is not None:
                self._auth.stop()
                self._auth = None
            raise BufferConfigError(f"buffer cannot bind {url}:{self.cfg.port or '<random>'}: {e}") from e
        self._sock = s
        shown = "127.0.0.1" if host == "*" else (f"[{host}]" if ":" in host else host)
        self.address = f"tcp://{shown}:{port}"
        self._thread = threading.Thread(target=self._run, name="asyncrl-buffer", daemon=True)
        self._thread.start()
        log.info("replay buffer serving on %s (wal %s, fsync=%s)", self.address, self.wal.path, self.cfg.fsync)
        return self.address

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._sock is not None:
            # after a failure, the refusals already queued still go out (up to 1 s); otherwise drop at once
            self._sock.close(linger=1000 if self.error is not None else 0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self.wal.close()

    def _replay(self) -> None:
        """Rebuild the state from the log (streamed), then compact the log to that state. A verified
        record the state machine refuses is reported and kept (quarantined) like a damaged range."""
        n = 0
        for rec in self.wal.replay():
            try:
                self._apply_record(rec.kind, rec.payload)
            except (ValueError, KeyError) as e:
                self.wal.recovery.unapplied(rec, str(e))
                continue
            n += 1
        self.wal.rewrite(self._live_records())
        self.wal.open()
        if n:
            log.info("replayed %d WAL records: %d held, %d batches to serve again", n, self.state.size,
                     len(self.state.replay_queue))

    def _apply_record(self, kind: int, payload: bytes) -> None:
        st = self.state
        if kind == P.REC_PUT:
            st.apply_put(decode_put(payload))
        elif kind == P.REC_FAIL:
            st.apply_fail(P.unpack(payload, P.FailReport))
        elif kind == P.REC_DROP:
            st.apply_drop(P.unpack(payload, P.DropRecord).uids)
        elif kind == P.REC_SERVE:
            st.apply_serve(self._servable(P.unpack(payload, P.ServeRecord)), replaying=True)
        elif kind == P.REC_COMMIT:
            st.apply_commit(P.unpack(payload, P.CommitRequest).batch_ids)
        elif kind == P.REC_SNAPSHOT:
            st.apply_snapshot(P.unpack(payload, P.Snapshot))
        else:
            raise ValueError(f"{self.wal.path}: unknown WAL record kind {kind}")

    def _servable(self, rec: P.ServeRecord) -> P.ServeRecord:
        """A replayed SERVE record without the members that are not held (their PUT was in a damaged
        range of the log: reported as lost, counted as failed), so the rest of the batch is served again."""
        held = self.state.held
        lost = [u for sg in rec.groups for u in sg.uids if held.get(u) != sg.group_id]
        if not lost:
            return rec
        self.wal.recovery.lost_uids += lost
        return P.ServeRecord(rec.batch_id, [
            P.ServedGroup(sg.group_id, sg.expected, sg.failed + sum(held.get(u) != sg.group_id for u in sg.uids),
                          [u for u in sg.uids if held.get(u) == sg.group_id]) for sg in rec.groups])

    def _compact_step(self) -> None:
        """Online compaction (between rounds): start one when the log has outgrown the live state
        (`should_compact`), finish the running one once its file is written. Live: the held and the
        served-uncommitted trajectories' bytes plus the snapshot record the last compaction wrote."""
        w, st = self.wal, self.state
        if w.compacting:
            if w.compaction_ready():
                w.finish_compaction()
        elif w.offset > self.cfg.compact_min_bytes and w.may_compact() and should_compact(
                w.offset, st.nbytes + st.outstanding_nbytes + self._meta_bytes, self.cfg.compact_min_bytes,
                self.cfg.compact_ratio):
            t0 = time.perf_counter()
            w.start_compaction(self._live_records(), set(st.outstanding) - set(st.replay_queue))
            log.info("compacting the buffer log (%d bytes; live state: %d bytes, taken in %.3f s on the serving thread)",
                     w.offset, st.nbytes + st.outstanding_nbytes + self._meta_bytes, time.perf_counter() - t0)

    def _live_records(self) -> list[tuple[int, bytes]]:
        records = self.state.snapshot_records()
        self._meta_bytes = len(records[0][1])  # the SNAPSHOT record: first, by contract of snapshot_records
        return records

    # ------------------------------------------------------------------ the loop

    def health(self) -> str | None:
        """None while serving; the error that stopped the service otherwise."""
        return None if self.error is None else _describe(self.error)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            log.exception("replay buffer loop died")
            try:
                self._refuse_all(e)
            except Exception:
                log.exception("replay buffer: answering after the failure failed too")
            finally:
                self.error = e

    def _refuse_all(self, e: BaseException) -> None:
        """After a fatal error `e`: publish it (`error`, `health()`), answer every waiting request with ERR
        naming it, then every new request the same way until stopped (`stop` lingers so they go out)."""
        self.error = e
        msg = f"buffer stopped: {_describe(e)}".encode()[:1000]
        waiting = self._in_sync + self._after_sync + [[p.ident, p.req_id] for p in self._parked.values()]
        waiting += [r for r in self._round if not any(r is w for w in waiting)]
        if self._current is not None:  # the PUT whose write failed
            waiting.append(self._current)
        self._in_sync, self._after_sync, self._parked, self._round = [], [], {}, []
        self._send([[r[0], r[1], P.ERR, msg] for r in waiting])
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                req_id = frames[1] if len(frames) > 1 and len(frames[1]) <= 64 else b""
                self._send([[frames[0], req_id, P.ERR, msg]])

    def _loop(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            self._compact_step()
            now = time.monotonic()
            wait = min([50.0] + [max(0.0, (p.deadline - now) * 1000) for p in self._parked.values()])
            if self._sync_fut is not None:
                wait = min(wait, 1.0)  # come back soon to release the acks of the running fsync
            msgs = []
            if poller.poll(wait):
                while len(msgs) < DRAIN_MAX:
                    try:
                        msgs.append(sock.recv_multipart(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
            records: list[bytes] = []
            replies: list[list[bytes]] = []
            self._round = replies  # what a failure below leaves unanswered (_refuse_all answers it)
            for m in msgs:
                self._handle(m, records, replies)
            self._answer_parked(records, replies)
            self._flush(records)
            if self.full is not None and time.monotonic() >= self._next_probe:
                self._probe_space()
            if self.wal.policy == "batched":
                self._group_commit(replies)
                continue
            self._wrote = False
            self._send(replies)

    # ------------------------------------------------------------------ writing, disk full

    def _append(self, records: list) -> None:
        """Write `records` now (``each``: one fsync per record). On ENOSPC/EDQUOT the log is cut back to
        where this write began and `_DiskFull` is raised; any other failure raises WalError."""
        if not records:
            return
        start = self.wal.end()
        try:
            if self.wal.policy == "each":  # every record fsynced on its own, before any ack
                for r in records:
                    self.wal.append_many([r])
            else:
                self.wal.append_many(records)
        except WalError as e:
            if full_errno(e) is None:
                raise
            try:
                self.wal.cut(start)
            except OSError as cut_err:
                raise WalError(f"{e}; cutting the log back to byte {start} failed too: {cut_err}") from e
            raise _DiskFull(e) from e
        self._wrote = True

    def _flush(self, records: list) -> None:
        """Write the round's records that are applied already (not PUTs): if the disk is full, into the
        reserve's space; with no reserve left, the service fails."""
        try:
            self._append(records)
        except _DiskFull as e:
            if not self._enter_full(e.cause):
                raise WalError(f"{e} (disk full and the {self.reserve.nbytes}-byte reserve "
                               f"{self.reserve.path} is used up)") from e.cause
            try:
                self._append(records)
            except _DiskFull as e2:
                raise WalError(f"{e2} (disk full and the {self.reserve.nbytes}-byte reserve "
                               f"{self.reserve.path} is used up)") from e2.cause
        records.clear()

    def _enter_full(self, cause: BaseException) -> bool:
        """Refuse PUTs from now on; release the reserve. False if the reserve was already released."""
        released = self.reserve.release()
        if self.full is None:
            self.counts["disk_full_episodes"] += 1
            log.warning("replay buffer: disk full (%s); refusing PUTs until space returns, still serving", cause)
        self.full = f"{cause}"
        self._next_probe = time.monotonic() + self.cfg.disk_probe_s
        return released

    def _full_verdict(self) -> str:
        self.counts["full_refusals"] += 1
        return (f"full: buffer disk full, {free_bytes(self.wal.dir)} bytes free in {self.wal.dir} "
                f"({self.full}); PUTs are refused until space returns: retry")[:500]

    def _probe_space(self) -> None:
        """While full: take the reserve again; with it held and as much again free, acknowledge PUTs again."""
        self._next_probe = time.monotonic() + self.cfg.disk_probe_s
        if self.reserve.try_acquire() and free_bytes(self.wal.dir) >= self.reserve.nbytes:
            log.warning("replay buffer: disk space returned (%d bytes free in %s); acknowledging PUTs again",
                        free_bytes(self.wal.dir), self.wal.dir)
            self.full = None

    def _group_commit(self, replies: list[list[bytes]]) -> None:
        """This round's records are written; replies wait for the fsync that covers them. One fsync runs at a
        time on a helper thread; rounds arriving meanwhile queue behind the next one. While anything
        is unsynced every reply waits (a 'dup' ack or a served batch may rest on unsynced records)."""
        wrote, self._wrote = self._wrote, False
        if wrote or self._sync_fut is not None or self._after_sync:
            self._after_sync += replies
            self._need_sync = self._need_sync or wrote
        else:
            self._send(replies)
        if self._sync_fut is not None and self._sync_fut.done():
            self._sync_fut.result()  # an fsync error ends the loop loudly (health() reports it)
            self._send(self._in_sync)
            self._in_sync, self._sync_fut = [], None
        if self._sync_fut is None and (self._need_sync or self._after_sync):
            if self._need_sync:
                self._in_sync, self._after_sync = self._after_sync, []
                self._need_sync = False
                self._sync_fut = self.wal.sync_async()
            else:  # nothing new written since the last fsync completed
                self._send(self._after_sync)
                self._after_sync = []

    def _send(self, replies: list[list[bytes]]) -> None:
        for r in replies:
            try:
                self._sock.send_multipart(r, zmq.NOBLOCK, copy=len(r) <= 4)
            except zmq.ZMQError:  # peer gone or its queue full: never block on a peer
                pass

    def _handle(self, frames: list, records: list, replies: list[list]) -> None:
        """One request. Small frames become bytes; bodies stay zero-copy views of the received frames
        (a stored trajectory keeps its frame alive and goes out again from the same memory)."""
        self.counts["requests"] += 1
        m = [f.bytes if len(f) <= 64 else f.buffer for f in frames]
        ident = m[0]
        req_id = m[1] if len(m) > 1 and isinstance(m[1], bytes) else b""

        def err(msg: str) -> None:
            self.counts["malformed"] += 1
            replies.append([ident, req_id, P.ERR, msg.encode()[:1000]])

        if self._auth is not None:  # CURVE: the ZAP handler named the sender's role
            op = m[2] if len(m) >= 3 and isinstance(m[2], bytes) else b""
            role = frames[-1].get("User-Id")
            if op not in ROLE_OPS.get(role, ()):
                self.counts["forbidden"] += 1
                replies.append([ident, req_id, P.ERR, f"a {role} key may not send {op[:32]!r}".encode()])
                return
        if len(m) >= 4 and m[2] == P.PUTS and isinstance(m[1], bytes):
            if len(m) - 3 > P.MAX_PUTS:
                return err(f"PUTS with {len(m) - 3} items exceeds {P.MAX_PUTS}")
            self._current = [ident, req_id]
            replies.append([ident, req_id, P.OK, P.pack(self._puts(m[3:], records))])
            self._current = None
            return
        if len(m) != 4:
            return err(f"expected 3 frames [req_id, op, body], got {len(m) - 1}")
        _, req_id, op, body = m
        if len(req_id) > 64:
            return err(f"req_id frame of {len(req_id)} bytes exceeds 64")
        if len(body) > self.cfg.max_frame_bytes:
            return err(f"body of {len(body)} bytes exceeds buffer.max_frame_bytes={self.cfg.max_frame_bytes}")
        try:
            if op == P.PUT:
                self._current = [ident, req_id]
                self._put(ident, req_id, body, records, replies)
                self._current = None
            elif op == P.FAIL:
                rep = P.unpack(body, P.FailReport)
                if rep.count < 1 or rep.group_size < 1:
                    raise ValueError(f"FAIL count={rep.count} group_size={rep.group_size} must be >= 1")
                if self.state.apply_fail(rep):
                    records.append(frame_parts(P.REC_FAIL, body))
                replies.append([ident, req_id, P.OK, b""])
            elif op == P.GET:
                req = P.unpack(body, P.GetRequest)
                if req.n_groups < 1:
                    raise ValueError(f"GET n_groups={req.n_groups} must be >= 1")
                if req.max_staleness is not None and req.max_staleness != self.max_staleness:
                    raise ValueError(f"GET max_staleness={req.max_staleness} disagrees with this buffer's bound "
                                     f"{self.max_staleness} (set when the buffer was built)")
                self._parked[ident] = _Parked(ident, req_id, req, time.monotonic() + max(0, req.timeout_ms) / 1000)
            elif op == P.COMMIT:
                req = P.unpack(body, P.CommitRequest)
                self.state.apply_commit(req.batch_ids)
                records.append(frame_parts(P.REC_COMMIT, body))
                replies.append([ident, req_id, P.OK, b""])
            elif op == P.VERSION:
                self.version = P.unpack(body, P.VersionRequest).version
                self.threshold = self.version - self.max_staleness
                self._drop_stale(records)
                replies.append([ident, req_id, P.OK, b""])
            elif op == P.STATS:
                replies.append([ident, req_id, P.STATS_REPLY, P.pack(self.stats())])
            else:
                err(f"unknown op {bytes(op[:32])!r}; ops: {[o.decode() for o in P.OPS]}")
        except ValueError as e:
            err(str(e))

    def _put(self, ident, req_id, body, records, replies) -> None:
        verdict = self._puts([body], records)[0]
        if verdict.startswith("err: "):
            replies.append([ident, req_id, P.ERR, verdict[5:].encode()])
        elif verdict.startswith("full: "):
            replies.append([ident, req_id, P.FULL, verdict[6:].encode()])
        elif verdict == "busy":
            replies.append([ident, req_id, P.BUSY, str(BUSY_RETRY_MS).encode()])
        else:
            replies.append([ident, req_id, P.OK, verdict.encode()])

    def _puts(self, bodies: list, records: list) -> list[str]:
        """Admit the trajectories of one request, one verdict each: 'new' | 'dup' | 'late' | 'busy' |
        'full: <why>' (disk full: retry) | 'err: <why>' (malformed or refused, counted). The new ones are
        applied, then written with the round's earlier records in one write before anything is answered;
        if that write finds the disk full they are undone and answered 'full: ...' instead."""
        st = self.state
        if self.full is None and (st.size + len(bodies) > st.capacity_trajectories
                                  or st.nbytes + sum(len(b) for b in bodies) > st.capacity_bytes):
            self._drop_stale(records)  # free what may be freed before refusing any as busy
        verdicts: list[str] = []
        uids: list[str | None] = []
        applied: list[tuple[Entry, bool]] = []  # (entry, its group was created by it)
        for body in bodies:
            verdict, e = self._admit(body)
            if verdict == "new" and self.full is not None:
                verdict = self._full_verdict()
            elif verdict == "new":
                created = e.group_id not in st.groups
                st.apply_put(e)
                records.append(frame_parts(P.REC_PUT, e.raw))
                applied.append((e, created))
            verdicts.append(verdict)
            uids.append(e.uid if e is not None else None)
        if not applied:
            return verdicts
        try:
            self._append(records)
        except _DiskFull as ex:
            for e, created in reversed(applied):
                st.unapply_put(e, created)
            del records[len(records) - len(applied):]
            self._enter_full(ex.cause)  # releases the reserve
            self._flush(records)  # the round's earlier records (applied already), into the reserve's space
            undone = {e.uid for e, _ in applied}
            for i, (v, uid) in enumerate(zip(verdicts, uids)):
                if uid in undone and v in ("new", "dup"):  # a 'dup' of an undone copy in the same request
                    verdicts[i] = self._full_verdict()
            return verdicts
        records.clear()
        return verdicts

    def _admit(self, body) -> tuple[str, Entry | None]:
        """Decode, validate and classify one trajectory (no state change): ('new', entry) or (verdict, ...)."""
        if len(body) > self.cfg.max_frame_bytes:
            self.counts["malformed"] += 1
            return f"err: body of {len(body)} bytes exceeds buffer.max_frame_bytes={self.cfg.max_frame_bytes}", None
        try:
            e = decode_put(body)
            verdict = self.state.classify(e.uid, e.group_id, len(body))
        except ValueError as ex:
            self.counts["malformed"] += 1
            return f"err: {ex}"[:1000], None
        self.counts["bytes_received"] += len(body)
        if verdict in ("dup", "late"):
            self.state.counts["duplicates" if verdict == "dup" else "late"] += 1
        elif verdict == "busy":
            self.counts["busy_replies"] += 1
        elif verdict == "full-dedupe":
            self.counts["dedupe_refused"] += 1
            cap = self.state.dedupe_other_max
            return (f"err: the buffer remembers {cap} uids and group ids that are not training ids "
                    f"(buffer.dedupe_other_max={cap}): refusing the new uid {e.uid!r} of group {e.group_id!r}; "
                    "training ids (<run_id>-g<position>[r<retry>]-<i>) have no such cap"), e
        return verdict, e

    def _drop_stale(self, records: list[bytes]) -> None:
        uids = self.state.stale_uids(self.threshold)
        if uids:
            self.state.apply_drop(uids)
            records.append(frame_parts(P.REC_DROP, P.pack(P.DropRecord(uids))))
        self.state.drop_empty_complete()
        self.state.close_uniform_complete()

    def _answer_parked(self, records: list[bytes], replies: list[list[bytes]]) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        for ident in list(self._parked):
            p = self._parked[ident]
            body = self._try_serve(p.req, records)
            if body is not None:
                replies.append([p.ident, p.req_id, P.BATCH, *body])
            elif now >= p.deadline:
                replies.append([p.ident, p.req_id, P.EMPTY, b""])
            else:
                continue
            del self._parked[ident]

    def _try_serve(self, req: P.GetRequest, records: list[bytes]) -> list | None:
        st = self.state
        self.threshold = req.current_version - self.max_staleness
        while (replay := st.next_replay()) is not None:
            # outstanding before a restart: the same batch again, same id, whatever n_groups asks;
            # the staleness rule still holds (members now stale are left out and counted)
            rec, entries = replay
            groups = []
            for sg in rec.groups:
                fresh = [entries[u] for u in sg.uids if entries[u].min_version >= self.threshold]
                st.counts["dropped_stale"] += len(sg.uids) - len(fresh)
                if not fresh:
                    st.record_dropped(sg.group_id, "stale")
                if fresh:
                    groups.append((P.ServedGroup(sg.group_id, sg.expected, sg.failed + len(sg.uids) - len(fresh),
                                                 [e.uid for e in fresh]), fresh))
            if groups:
                return P.batch_frames(rec.batch_id, groups)
        self._drop_stale(records)
        rec = st.plan_batch(req.n_groups)
        if rec is None:
            return None
        groups = st.apply_serve(rec, replaying=False)
        records.append(frame_parts(P.REC_SERVE, P.pack(rec)))
        return P.batch_frames(rec.batch_id, groups)

    def take_dropped(self) -> list[tuple[str, str]]:
        """(group_id, "stale" | "failed" | "uniform") of the groups closed unserved since the last call (any thread)."""
        return self.state.take_dropped()

    def stats(self) -> dict:
        return {**self.state.stats(self.version), **self.counts, "version": self.version,
                "max_staleness": self.max_staleness, "auth_denied": self._auth.denied if self._auth else 0,
                "wal_bytes_written": self.wal.bytes_written, "wal_fsyncs": self.wal.fsyncs,
                "wal_bytes": self.wal.offset, "wal_compactions": self.wal.compactions,
                "wal_compaction_error": self.wal.compaction_error,
                "wal_recovery": self.wal.recovery.as_dict(),
                "disk_full": self.full is not None, "disk_reserve_held": self.reserve.held}


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, WalError) else f"{type(e).__name__}: {e}"


def serve_forever(cfg: BufferConfig, wal_dir, max_staleness: int, keys: BufferKeys | None = None) -> None:
    """Run the service in this process until SIGINT/SIGTERM (used by `asyncrl buffer` and tests).
    Prints one line ``BUFFER_ADDRESS tcp://host:port`` on stdout once it serves."""
    svc = BufferService(cfg, wal_dir, max_staleness, keys)
    addr = svc.start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"BUFFER_ADDRESS {addr}", flush=True)
    try:
        while not stop.wait(0.2):
            if svc.error is not None:
                break
    finally:
        svc.stop()
    if svc.error is not None:
        raise RuntimeError(f"replay buffer stopped: {svc.health()}") from svc.error
