"""Durability on POSIX file systems: the one helper that makes a rename or a new file's name survive a crash,
which failures mean "disk full" and how much room is left."""

from __future__ import annotations

import errno
import os
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: str | Path) -> None:
    """fsync the directory `path`, so that entries created, renamed or removed in it are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def full_errno(e: BaseException) -> int | None:
    """The errno of a disk-full failure (ENOSPC, EDQUOT) behind `e`: an OSError, an error raised from or
    while handling one (`WalError`; torch's writer errors), or DCP's CheckpointException whose rank failures
    hold one. None for anything else (EIO, EFBIG, EBADF, ...)."""
    seen: set[int] = set()
    todo: list[object] = [e]
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in FULL_ERRNOS:
            return x.errno
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]  # (exception, its stack)
    return None


def free_bytes(directory: str | Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `directory`."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
