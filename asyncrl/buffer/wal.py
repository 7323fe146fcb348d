"""The buffer's write-ahead log: one append-only file of framed, checksummed records.

Record layout (little-endian): ``u32 length | u32 crc32(kind + payload) | u8 kind | payload`` where
``length = 1 + len(payload)``. A crash (``kill -9``, power loss) can leave a torn last record; on open,
the log is read up to the first short or checksum-failing record and truncated there, so everything
before it (everything that was acknowledged) survives and nothing half-written is replayed.

Durability policy (``fsync``): ``each`` fsyncs after every record, ``batched`` once per group of
records (the server writes each drained round of requests with one syscall and starts one fsync with
`sync_async`; the acks of those records wait for it, new requests do not: pipelined group commit),
``off`` never (data written with ``os.write`` is in the page cache, so it survives a killed
process but not a machine crash).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

_HEADER = struct.Struct("<IIB")
WAL_NAME = "buffer.wal"
_IOV_MAX = 512
FSYNC_POLICIES = ("each", "batched", "off")


class WalError(RuntimeError):
    """The log cannot be opened or written (bad directory, bad policy, a failed write or fsync)."""


def _io_error(what: str, e: OSError, path: Path) -> WalError:
    """`e` as a WalError naming the log file and the errno: 'buffer log write failed: [Errno 28] No space
    left on device: '/out/buffer/buffer.wal''."""
    return WalError(f"buffer log {what} failed: {OSError(e.errno, e.strerror, str(path))}")


def frame_parts(kind: int, payload) -> tuple[bytes, object]:
    """One record as (header, payload): header = length, crc32 over kind byte + payload, kind. The
    payload may be any bytes-like object; it is written as is (no copy) by `append_many`."""
    crc = zlib.crc32(payload, zlib.crc32(bytes((kind,))))
    return _HEADER.pack(1 + len(payload), crc, kind), payload


def frame(kind: int, payload) -> bytes:
    """One record as contiguous bytes."""
    header, payload = frame_parts(kind, payload)
    return header + bytes(payload)


def read_records(path: Path) -> tuple[list[tuple[int, bytes]], int]:
    """All intact records of `path` in order, and the byte offset where the intact prefix ends."""
    records: list[tuple[int, bytes]] = []
    data = path.read_bytes() if path.exists() else b""
    view, pos, n = memoryview(data), 0, len(data)
    while pos + _HEADER.size <= n:
        length, crc, kind = _HEADER.unpack_from(view, pos)
        end = pos + 4 + 4 + length
        if length < 1 or end > n:
            break
        payload = bytes(view[pos + _HEADER.size:end])
        if zlib.crc32(payload, zlib.crc32(bytes((kind,)))) != crc:
            break
        records.append((kind, payload))
        pos = end
    return records, pos


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
        self.bytes_written = 0
        self.fsyncs = 0

    def replay(self) -> Iterator[tuple[int, bytes]]:
        """Intact records of the existing log (a torn tail is cut off on disk before returning)."""
        records, good = read_records(self.path)
        if self.path.exists() and self.path.stat().st_size > good:
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return iter(records)

    def rewrite(self, records: list[tuple[int, bytes]]) -> None:
        """Atomically replace the log by `records` (compaction): write a temp file, fsync, rename."""
        self.close()
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.writelines(frame(kind, payload) for kind, payload in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def end(self) -> int:
        """Byte offset of the log's end (where the next record goes)."""
        return os.fstat(self._fd).st_size

    def cut(self, offset: int) -> None:
        """Cut the log back to `offset`: a write that failed part-way (disk full) leaves no torn record."""
        os.ftruncate(self._fd, offset)

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
