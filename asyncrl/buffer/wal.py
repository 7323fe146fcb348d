"""The buffer's write-ahead log: one append-only file of framed, checksummed, resynchronisable records.

Record layout (little-endian, 17-byte header)::

    magic b"\\xa7RLw" | u8 kind | u32 length | u32 crc32(payload) | u32 crc32(the 13 header bytes before it) | payload

`length` is the payload's size. A record *verifies* when its magic and header checksum match, its payload
lies within the file and the payload checksum matches. The header checksum guards the length: a
corrupt length is detected before it is used, so it can never make the reader skip good records.

Reading (`scan`) streams the file in chunks (memory: one chunk plus the largest record). At a record
that does not verify the reader searches forward for the next magic whose record verifies and goes on
from there; the bytes in between are one bad range. The last bad range of the file (nothing after it
verifies) is a *torn tail*, the expected result of a crash during an append, when it is shorter than a
header or starts with a verified header whose payload runs past the end of the file: it is dropped
quietly (one INFO line). Every other bad range is *damage*: reported with its byte offsets and the uids
found in it (a PUT payload is a msgpack Trajectory whose first key is ``uid``), and never compacted
away: before the startup compaction replaces the log, the old file is kept, byte for byte, as
``buffer.wal.damaged-<UTC time>`` beside it (a hard link: no copy) and a WARNING names it.
`WriteAheadLog.recovery` holds the report (the service shows it as ``stats()['wal_recovery']``).

Online compaction (`start_compaction` / `finish_compaction`, driven by the service's loop): a helper
thread writes the live state to ``buffer.wal.compacting`` while the loop keeps appending to the log;
the loop then copies the records appended meanwhile, fsyncs the new file, renames it over the log,
fsyncs the directory and appends to the new file from then on. A crash at any point leaves either the
old, complete log or the new, complete one; a leftover ``buffer.wal.compacting`` is deleted before replay.
For tests, ``ASYNCRL_WAL_CRASH_AT=compact-written`` (new file complete, not yet renamed) or
``compact-renamed`` (renamed, the service not yet appending to it) makes the process ``os._exit(86)``
at that step.

Durability policy (``fsync``): ``each`` fsyncs after every record, ``batched`` once per group of
records (the server writes each drained round of requests with one syscall and starts one fsync with
`sync_async`; the acks of those records wait for it, new requests do not: pipelined group commit),
``off`` never (data written with ``os.write`` is in the page cache, so it survives a killed
process but not a machine crash).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import struct
import time
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from asyncrl.util.durable import fsync_dir

log = logging.getLogger(__name__)

MAGIC = b"\xa7RLw"
_HEAD = struct.Struct("<4sBII")  # magic, kind, length, payload crc: covered by the header crc
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEAD.size + _CRC.size  # 17
WAL_NAME = "buffer.wal"
COMPACT_NAME = WAL_NAME + ".compacting"
QUARANTINE_PREFIX = WAL_NAME + ".damaged-"
CRASH_ENV = "ASYNCRL_WAL_CRASH_AT"
CRASH_STEPS = ("compact-written", "compact-renamed")
CRASH_EXIT = 86
CHUNK = 1 << 20
_IOV_MAX = 512
FSYNC_POLICIES = ("each", "batched", "off")
REC_PUT, REC_SERVE = 1, 4  # the kinds this module reads (asyncrl.buffer.protocol owns the numbering)
_UID_KEY = re.compile(rb"\xa3uid(?:([\xa0-\xbf])|\xd9(.))", re.DOTALL)


class WalError(RuntimeError):
    """The log cannot be opened or written (bad directory, bad policy, a failed write or fsync)."""


def _io_error(what: str, e: OSError, path: Path) -> WalError:
    """`e` as a WalError naming the log file and the errno: 'buffer log write failed: [Errno 28] No space
    left on device: '/out/buffer/buffer.wal''."""
    return WalError(f"buffer log {what} failed: {OSError(e.errno, e.strerror, str(path))}")


def frame_parts(kind: int, payload) -> tuple[bytes, object]:
    """One record as (header, payload). The payload may be any bytes-like object; it is written as is
    (no copy) by `append_many`."""
    head = _HEAD.pack(MAGIC, kind, len(payload), zlib.crc32(payload))
    return head + _CRC.pack(zlib.crc32(head)), payload


def frame(kind: int, payload) -> bytes:
    """One record as contiguous bytes."""
    header, payload = frame_parts(kind, payload)
    return header + bytes(payload)


def should_compact(log_bytes: int, live_bytes: int, min_bytes: int, ratio: float) -> bool:
    """The online compaction rule: the log has outgrown both `min_bytes` and `ratio` x the live state."""
    return log_bytes > max(min_bytes, ratio * live_bytes)


# ---------------------------------------------------------------------------- reading


@dataclass(slots=True)
class Record:
    offset: int  # [offset, end): the record's bytes in the file
    end: int
    kind: int
    payload: bytes


@dataclass(slots=True)
class BadRange:
    start: int  # [start, end): bytes that are no verified record
    end: int
    torn: bool  # the file's last bad range, shaped like an interrupted append (see the module doc)


class _Window:
    """A sliding view of [base, base + len(buf)) of a file, read in chunks up to `limit`."""

    def __init__(self, f, start: int, limit: int, chunk: int):
        self.f, self.base, self.limit, self.chunk = f, start, limit, chunk
        self.buf = bytearray()
        f.seek(start)

    def have(self, pos: int, n: int) -> bool:
        """Make [pos, pos + n) available; False if it runs past the end."""
        if pos + n > self.limit:
            return False
        while self.base + len(self.buf) < pos + n:
            top = self.base + len(self.buf)
            data = self.f.read(min(max(self.chunk, pos + n - top), self.limit - top))
            if not data:
                return False
            self.buf += data
        return True

    def get(self, pos: int, n: int) -> bytes:
        i = pos - self.base
        with memoryview(self.buf) as v:
            return bytes(v[i:i + n])

    def forget_before(self, pos: int) -> None:
        pos = min(pos, self.base + len(self.buf))  # never past what was read: base + len(buf) is the file position
        if pos > self.base:
            del self.buf[:pos - self.base]
            self.base = pos

    def find_magic(self, pos: int) -> int:
        """Offset of the next MAGIC at or after `pos`, or -1."""
        while True:
            top = self.base + len(self.buf)
            if pos < top:
                i = self.buf.find(MAGIC, pos - self.base)
                if i >= 0:
                    return self.base + i
            self.forget_before(min(pos, top - len(MAGIC) + 1))  # a magic may straddle the next read
            if not self.have(top, 1):
                return -1


def _verify(w: _Window, pos: int) -> tuple[int, int] | None:
    """(kind, length) of a verified record at `pos`, else None (its payload is then available in `w`)."""
    if not w.have(pos, HEADER_SIZE):
        return None
    head = w.get(pos, HEADER_SIZE)
    magic, kind, length, pcrc = _HEAD.unpack_from(head)
    if magic != MAGIC or _CRC.unpack_from(head, _HEAD.size)[0] != zlib.crc32(head[:_HEAD.size]):
        return None
    if not w.have(pos + HEADER_SIZE, length):
        return None
    i = pos + HEADER_SIZE - w.base
    with memoryview(w.buf) as v:
        if zlib.crc32(v[i:i + length]) != pcrc:
            return None
    return kind, length


def _runs_past_end(w: _Window, pos: int, size: int) -> bool:
    """A verified header at `pos` whose payload would end beyond `size` (an interrupted append)."""
    if not w.have(pos, HEADER_SIZE):
        return False
    head = w.get(pos, HEADER_SIZE)
    magic, _, length, _ = _HEAD.unpack_from(head)
    return (magic == MAGIC and _CRC.unpack_from(head, _HEAD.size)[0] == zlib.crc32(head[:_HEAD.size])
            and pos + HEADER_SIZE + length > size)


def scan(path: Path, start: int = 0, end: int | None = None, chunk: int = CHUNK) -> Iterator[Record | BadRange]:
    """The records of `path` in [start, end) in order, with a BadRange for every stretch between them
    that does not verify. Streams: memory is one chunk plus the largest record."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size if end is None else end
        w = _Window(f, start, size, chunk)
        pos, bad = start, -1
        while pos < size:
            v = _verify(w, pos)
            if v is None:
                if bad < 0:
                    bad = pos
                nxt = w.find_magic(pos + 1)
                if nxt < 0:
                    break
                pos = nxt
                continue
            if bad >= 0:
                yield BadRange(bad, pos, False)
                bad = -1
            kind, length = v
            end_ = pos + HEADER_SIZE + length
            yield Record(pos, end_, kind, w.get(pos + HEADER_SIZE, length))
            w.forget_before(end_)
            pos = end_
        if bad >= 0:
            w2 = _Window(f, bad, size, chunk)
            yield BadRange(bad, size, size - bad < HEADER_SIZE or _runs_past_end(w2, bad, size))


def uids_in(path: Path, start: int, end: int, chunk: int = CHUNK) -> list[str]:
    """The uids readable in the bytes [start, end) of `path` (msgpack ``"uid": <str>`` keys, as a PUT's
    Trajectory payload starts), in order, each once."""
    out: list[str] = []
    overlap = 300  # longer than a key + a str8 uid
    with open(path, "rb") as f:
        pos = start
        while pos < end:
            f.seek(pos)
            data = f.read(min(chunk, end - pos))
            if not data:
                break
            for m in _UID_KEY.finditer(data):
                n = (m.group(1)[0] & 0x1F) if m.group(1) else m.group(2)[0]
                raw = data[m.end():m.end() + n]
                if len(raw) == n:
                    try:
                        uid = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        continue
                    if uid.isprintable() and uid not in out:
                        out.append(uid)
            if pos + len(data) >= end:
                break
            pos += max(1, len(data) - overlap)
    return out


# ---------------------------------------------------------------------------- recovery report


@dataclass
class Damage:
    start: int
    end: int
    uids: list[str]
    reason: str

    def as_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "bytes": self.end - self.start, "uids": self.uids,
                "reason": self.reason}


@dataclass
class RecoveryReport:
    """What replaying the log found: how many records verified, the torn tail dropped, and every damaged
    range (bytes that did not verify, or a verified record the state machine could not apply)."""

    path: str
    size: int = 0
    records: int = 0
    torn_tail: tuple[int, int] | None = None
    damaged: list[Damage] = field(default_factory=list)
    lost_uids: list[str] = field(default_factory=list)  # named by a SERVE whose PUT was in a damaged range
    quarantine: str | None = None

    def unapplied(self, rec: Record, why: str) -> None:
        """A verified record the state machine refused: kept (quarantined) and reported, never applied."""
        uids = uids_in(Path(self.path), rec.offset, rec.end) if rec.kind == REC_PUT else []
        self.damaged.append(Damage(rec.offset, rec.end, uids, f"record of kind {rec.kind} not applicable: {why}"))

    def as_dict(self) -> dict:
        return {"path": self.path, "size": self.size, "records": self.records,
                "torn_tail": None if self.torn_tail is None else {"start": self.torn_tail[0], "end": self.torn_tail[1]},
                "damaged": [d.as_dict() for d in self.damaged], "lost_uids": self.lost_uids,
                "quarantine": self.quarantine}


# ---------------------------------------------------------------------------- the log


class _ServedUids(msgspec.Struct):
    uids: list[str]


class _ServeUids(msgspec.Struct):
    batch_id: int
    groups: list[_ServedUids]


class _Uid(msgspec.Struct):
    uid: str


class _Damaged(Exception):
    """The log changed under us (bytes that no longer verify): compaction must not drop them."""


@dataclass
class _Compaction:
    start_offset: int  # the log's size when the live state was taken
    fd: int
    future: Future


class WriteAheadLog:
    """Append-only record log in `directory`/buffer.wal with a configurable fsync policy."""

    def __init__(self, directory: str | Path, fsync: str = "batched"):
        if fsync not in FSYNC_POLICIES:
            raise WalError(f"buffer.fsync={fsync!r} is not one of {FSYNC_POLICIES}")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WalError(f"cannot create the buffer WAL directory {str(self.dir)!r}: {e}") from e
        self.path = self.dir / WAL_NAME
        self.policy = fsync
        self._fd: int | None = None
        self._dirty = False
        self._pool: ThreadPoolExecutor | None = None
        self._compactor: ThreadPoolExecutor | None = None
        self._compaction: _Compaction | None = None
        self.crash_at = os.environ.get(CRASH_ENV) or None
        if self.crash_at is not None and self.crash_at not in CRASH_STEPS:
            raise WalError(f"{CRASH_ENV}={self.crash_at!r} is not one of {CRASH_STEPS}")
        self.recovery = RecoveryReport(str(self.path))
        self.offset = 0  # the log file's size (what has been appended to it)
        self.bytes_written = 0
        self.fsyncs = 0
        self.compactions = 0
        self.compaction_error: str | None = None  # why online compaction is off for the rest of the run
        self._retry_at = 0  # after a failed compaction: the log size at which to try again

    # ------------------------------------------------------------------ recovery

    def replay(self) -> Iterator[Record]:
        """Stream the verified records of the existing log, filling `recovery` as it goes (damage is
        logged by `rewrite`, which must follow). A leftover compaction file is removed first."""
        tmp = self.dir / COMPACT_NAME
        if tmp.exists():
            log.info("removing %s, left by a compaction that did not finish (the log beside it is whole)", tmp)
            tmp.unlink()
        rep = self.recovery = RecoveryReport(str(self.path))
        if not self.path.exists():
            return
        rep.size = self.path.stat().st_size
        for item in scan(self.path):
            if isinstance(item, Record):
                rep.records += 1
                yield item
            elif item.torn:
                rep.torn_tail = (item.start, item.end)
                log.info("%s: dropping a torn tail of %d bytes at offset %d (an append cut short by a crash)",
                         self.path, item.end - item.start, item.start)
            else:
                rep.damaged.append(Damage(item.start, item.end, uids_in(self.path, item.start, item.end),
                                          "bytes that are no verified record"))

    def rewrite(self, records: Iterable[tuple[int, bytes]]) -> None:
        """Atomically replace the log by `records` (startup compaction): write a temp file, fsync, rename.
        If replay found damage, the old log is first kept as a quarantine file (never compacted away)."""
        self.close()
        tmp = self.dir / COMPACT_NAME
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._write_records(fd, records)
            os.fsync(fd)
        finally:
            os.close(fd)
        rep = self.recovery
        if (rep.damaged or rep.lost_uids) and self.path.exists():
            q = self._quarantine()
            rep.quarantine = str(q)
            log.warning("%s: damaged write-ahead log kept as %s (original bytes); unrecoverable ranges: %s%s", self.path,
                        q, "; ".join(f"bytes [{d.start}, {d.end}) uids {d.uids or 'unreadable'}: {d.reason}"
                                     for d in rep.damaged) or "none",
                        f"; lost uids named by served batches: {rep.lost_uids}" if rep.lost_uids else "")
        os.replace(tmp, self.path)
        fsync_dir(self.dir)

    def _quarantine(self) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        q, i = self.dir / f"{QUARANTINE_PREFIX}{stamp}", 1
        while q.exists():
            q, i = self.dir / f"{QUARANTINE_PREFIX}{stamp}.{i}", i + 1
        try:
            os.link(self.path, q)
        except OSError:  # a filesystem without hard links: copy
            shutil.copyfile(self.path, q)
            with open(q, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(self.dir)
        return q

    @staticmethod
    def _write_records(fd: int, records: Iterable[tuple[int, bytes]]) -> None:
        with os.fdopen(fd, "wb", buffering=CHUNK, closefd=False) as f:
            for kind, payload in records:
                head, payload = frame_parts(kind, payload)
                f.write(head)
                f.write(payload)

    # ------------------------------------------------------------------ online compaction

    @property
    def compacting(self) -> bool:
        return self._compaction is not None

    def may_compact(self) -> bool:
        """No compaction running, none refused for damage, none failed since the log was half its size."""
        return self._compaction is None and self.compaction_error is None and self.offset >= self._retry_at

    def start_compaction(self, records: list[tuple[int, bytes]], keep_batches: set[int]) -> None:
        """Begin writing a compacted log on a helper thread: first the PUT and SERVE records of the
        served, uncommitted batches `keep_batches` (copied from the log), then `records` (the live state,
        taken now: `BufferState.snapshot_records`). `finish_compaction` completes it."""
        if self._fd is None or self._compaction is not None:
            raise WalError("compaction needs an open log and none running")
        fd = os.open(self.dir / COMPACT_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        if self._compactor is None:
            self._compactor = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-wal-compact")
        x = self.offset
        self._compaction = _Compaction(x, fd, self._compactor.submit(self._write_compacted, fd, x, records, keep_batches))

    def _write_compacted(self, fd: int, upto: int, records: list, keep_batches: set[int]) -> None:
        if keep_batches:  # streamed: the copied batches are never all in memory
            self._write_records(fd, self._outstanding_records(upto, keep_batches))
        self._write_records(fd, records)

    def _outstanding_records(self, upto: int, keep: set[int]) -> Iterator[tuple[int, bytes]]:
        """The PUT and SERVE records of batches `keep` in the log's first `upto` bytes, in log order
        (two streaming passes: the SERVE records name the uids, their PUTs come before them)."""
        uids: set[str] = set()
        for item in scan(self.path, 0, upto):
            if isinstance(item, BadRange):
                raise _Damaged(f"bytes [{item.start}, {item.end}) of {self.path} no longer verify")
            if item.kind == REC_SERVE:
                s = msgspec.msgpack.decode(item.payload, type=_ServeUids)
                if s.batch_id in keep:
                    uids.update(u for g in s.groups for u in g.uids)
        for item in scan(self.path, 0, upto):
            if isinstance(item, BadRange):
                raise _Damaged(f"bytes [{item.start}, {item.end}) of {self.path} no longer verify")
            if item.kind == REC_PUT:
                uid = msgspec.msgpack.decode(item.payload, type=_Uid).uid
                if uid in uids:
                    uids.discard(uid)
                    yield item.kind, item.payload
            elif item.kind == REC_SERVE and msgspec.msgpack.decode(item.payload, type=_ServeUids).batch_id in keep:
                yield item.kind, item.payload

    def compaction_ready(self) -> bool:
        return self._compaction is not None and self._compaction.future.done()

    def finish_compaction(self) -> None:
        """On the writer's thread, once `compaction_ready()`: append the records logged since the start,
        fsync, rename over the log, fsync the directory, and append to the new file from now on. A
        failure before the rename leaves the old log in use and turns online compaction off (WARNING)."""
        c, self._compaction = self._compaction, None
        tmp = self.dir / COMPACT_NAME
        t0 = time.perf_counter()
        try:
            c.future.result()
            self._copy_range(c.fd, c.start_offset, self.offset)
            os.fsync(c.fd)
        except OSError as e:  # e.g. disk full: try again once the log has doubled
            os.close(c.fd)
            tmp.unlink(missing_ok=True)
            self._retry_at = 2 * self.offset
            log.warning("buffer log compaction failed, the log %s stays as it is (next try at %d bytes): %s",
                        self.path, self._retry_at, OSError(e.errno, e.strerror, str(tmp)))
            return
        except (_Damaged, msgspec.MsgspecError) as e:
            os.close(c.fd)
            tmp.unlink(missing_ok=True)
            self.compaction_error = f"{type(e).__name__}: {e}"
            log.warning("buffer log compaction found bytes it does not understand: the log %s stays as it is and "
                        "is not compacted again during this run (a restart reports and quarantines them): %s",
                        self.path, self.compaction_error)
            return
        self._crash_point("compact-written")
        if self._pool is not None:  # let a running fsync of the old file end before that file is closed
            self._pool.submit(lambda: None).result()
        try:
            os.replace(tmp, self.path)
            fsync_dir(self.dir)
        except OSError as e:
            os.close(c.fd)
            raise _io_error("compaction rename", e, self.path) from e
        self._crash_point("compact-renamed")
        old, self._fd = self._fd, c.fd
        os.close(old)
        before, self.offset = self.offset, os.fstat(c.fd).st_size
        self._dirty = False
        self.compactions += 1
        log.info("compacted the buffer log %s: %d -> %d bytes (the final step held the writer %.3f s)", self.path,
                 before, self.offset, time.perf_counter() - t0)

    def _copy_range(self, fd: int, start: int, end: int) -> None:
        rfd = os.open(self.path, os.O_RDONLY)
        try:
            pos = start
            while pos < end:
                data = os.pread(rfd, min(CHUNK, end - pos), pos)
                if not data:
                    raise OSError(f"{self.path} ended at {pos}, expected {end} bytes")
                view = memoryview(data)
                while len(view):
                    view = view[os.write(fd, view):]
                pos += len(data)
        finally:
            os.close(rfd)

    def _crash_point(self, step: str) -> None:
        if self.crash_at == step:
            log.warning("%s=%s: exiting at this step of the compaction (test hook)", CRASH_ENV, step)
            os._exit(CRASH_EXIT)

    # ------------------------------------------------------------------ appending

    def open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.offset = os.fstat(self._fd).st_size

    def end(self) -> int:
        """Byte offset of the log's end (where the next record goes)."""
        return os.fstat(self._fd).st_size

    def cut(self, offset: int) -> None:
        """Cut the log back to `offset`: a write that failed part-way (disk full) leaves no torn record.
        Records appended after `offset` by this write are gone with it, so `offset` is the log's size again."""
        os.ftruncate(self._fd, offset)
        self.offset = offset

    def append(self, kind: int, payload) -> None:
        """Write one record; under ``each`` it is on disk when this returns."""
        self.append_many([frame_parts(kind, payload)])

    def append_many(self, frames: list) -> None:
        """Write records with one gathered write (group commit); fsync under ``each``. Each item is a
        framed record (bytes) or a (header, payload) pair from `frame_parts`."""
        if self._fd is None:
            raise WalError("write-ahead log is not open")
        try:
            total = self._write(frames)
        except OSError as e:
            raise _io_error("write", e, self.path) from e
        if self.policy == "each" and total:
            self.sync(force=True)

    def _write(self, frames: list) -> int:
        bufs = [b for f in frames for b in ((f,) if isinstance(f, bytes) else f)]
        total = sum(len(b) for b in bufs)
        for i in range(0, len(bufs), _IOV_MAX):
            chunk = bufs[i:i + _IOV_MAX]
            want = sum(len(b) for b in chunk)
            done = os.writev(self._fd, chunk)
            if done < want:  # a short write: finish the rest contiguously
                rest = memoryview(b"".join(bytes(b) for b in chunk))[done:]
                while len(rest):
                    rest = rest[os.write(self._fd, rest):]
        self.bytes_written += total
        self.offset += total
        if total:
            self._dirty = True
        return total

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-wal")
        return self._pool

    def sync(self, force: bool = False) -> None:
        """Make appended records durable if the policy asks for it (``batched``; ``each`` does it per record)."""
        if self._fd is not None and self._dirty and (force or self.policy == "batched"):
            self._fsync()
            self.fsyncs += 1
            self._dirty = False

    def sync_async(self) -> Future:
        """Start an fsync of everything written so far on a helper thread and return its future: the caller keeps working meanwhile and releases the acks of the records written before
        this call once the future is done (pipelined group commit)."""
        if self._fd is None:
            raise WalError("write-ahead log is not open")
        self._dirty = False
        self.fsyncs += 1
        return self._executor().submit(self._fsync)

    def _fsync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise _io_error("fsync", e, self.path) from e

    def close(self) -> None:
        if self._compaction is not None:  # abandon a running compaction: the log stays as it is
            c, self._compaction = self._compaction, None
            wait([c.future])
            os.close(c.fd)
            (self.dir / COMPACT_NAME).unlink(missing_ok=True)
        if self._compactor is not None:
            self._compactor.shutdown(wait=True)
            self._compactor = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd is not None:
            try:
                if self._dirty and self.policy != "off":
                    self._fsync()
            finally:
                os.close(self._fd)
                self._fd = None
