"""A real full disk for tests: python code run in a user + mount namespace of its own (`unshare -rm`, as the
sandbox makes) with a small tmpfs mounted over a directory. The tmpfs lives as long as the namespace, so
the code checks what it wrote before it exits and prints its findings."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MOUNT_FAILED = 97


def python_on_tmpfs(mount: Path, size: str, code: str, *args: str,
                    timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -c code mount *args` with a `size` tmpfs over `mount` (created if missing); skips the
    test where unshare or an unprivileged tmpfs mount is not available."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    mount.mkdir(parents=True, exist_ok=True)
    script = f'mount -t tmpfs -o size={size} tmpfs "$0" || exit {MOUNT_FAILED}; exec "$@"'
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mount), sys.executable, "-c", code, str(mount),
                          *args], capture_output=True, text=True, timeout=timeout)
    if res.returncode == MOUNT_FAILED:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {res.stderr[-500:]}")
    return res
