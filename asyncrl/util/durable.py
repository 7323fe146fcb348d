"""Durability on POSIX file systems: the one helper that makes a rename or a new file's name survive a crash."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """fsync the directory `path`, so that entries created, renamed or removed in it are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
