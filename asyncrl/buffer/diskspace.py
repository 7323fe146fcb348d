"""Disk-full handling of the buffer's log directory: the preallocated reserve that keeps room for the
small records of GET, COMMIT, FAIL and VERSION while PUTs are refused (rules: asyncrl/buffer/server.py,
"Disk full"; which failures mean "disk full" and how much is free: asyncrl/util/durable.py)."""

from __future__ import annotations

import os
from pathlib import Path

from asyncrl.util.durable import full_errno

RESERVE_NAME = "buffer.reserve"


class DiskReserve:
    """`nbytes` preallocated in `directory`/buffer.reserve while the disk has room. Released (the file cut
    to 0 bytes) when the log finds the disk full, so the small records that serving and committing write
    still fit; taken again by `try_acquire` when space returns. `nbytes == 0`: no reserve."""

    def __init__(self, directory: str | Path, nbytes: int):
        if nbytes < 0:
            raise ValueError(f"buffer.disk_reserve_bytes must be >= 0, got {nbytes}")
        self.path = Path(directory) / RESERVE_NAME
        self.nbytes = nbytes
        self.held = False

    def try_acquire(self) -> bool:
        """Allocate the reserve; False if the disk has no room for it (nothing is left allocated then)."""
        if self.held or self.nbytes == 0:
            self.held = True
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
            os.fsync(fd)
        except OSError as e:
            if full_errno(e) is None:
                raise
            os.ftruncate(fd, 0)
            return False
        finally:
            os.close(fd)
        self.held = True
        return True

    def release(self) -> bool:
        """Give the reserve's space back to the filesystem; False if it was not held."""
        if not self.held:
            return False
        self.held = False
        if self.nbytes:
            os.truncate(self.path, 0)
        return True
