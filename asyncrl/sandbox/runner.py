"""Host side of the sandbox: episode directories, the capability probe, and one run.

An episode directory holds `files/` (what the program sees as its working directory /tmp/work, kept
between the calls of one episode) and `root/` (the mount point of the sandbox's view). A run writes
`files/main.py`, starts `nsinit.py` (see there for what is built), waits for it (a backstop kills its
process group if it overruns its own wall clock), and replaces `files/` by the `out/` copy the init
made once every process of the run was dead.
"""

from __future__ import annotations

import asyncio
import functools
import marshal
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

NSINIT = Path(__file__).with_name("nsinit.py")
SETUP_FAILED = 97
BACKSTOP_S = 30.0  # beyond the run's own wall clock: the copy back of the files, a loaded machine
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# The host paths a job keeps from every sandboxed program, os.pathsep-joined: `asyncrl train`, `eval` and
# `generate` set it for themselves and the processes they start (`job_paths`: their output dir, the buffer's
# WAL and keys, the data files, ...), so a tool needs no config to hide them.
HIDE_ENV = "ASYNCRL_SANDBOX_HIDE"


def job_paths(cfg: Any, *dirs: str | Path | None) -> list[str]:
    """The paths of a job that no sandboxed program may read: `dirs` (its output dir: config, trajectories
    or episodes with their rewards, checkpoints), the buffer's WAL and CURVE keys, the weight-sync dir, and
    the files the user gave it: data (answers included), tool YAML and reward code. Absolute; a path not
    there yet is kept (the sandbox skips what does not exist when a program runs). `cfg`: the job's Config."""
    given = [cfg.buffer.wal_dir, cfg.buffer.keys_dir, cfg.trainer.weight_sync.disk_dir, cfg.env.train_file,
             cfg.env.val_file, cfg.env.tools_config, cfg.env.reward.path, *dirs]
    return sorted({str(Path(p).expanduser().resolve()) for p in given if p})


def hide_job_paths(cfg: Any, *dirs: str | Path | None) -> str:
    """Set HIDE_ENV in this process's environment (inherited by what it starts) to `job_paths`; returns it."""
    os.environ[HIDE_ENV] = os.pathsep.join(job_paths(cfg, *dirs))
    return os.environ[HIDE_ENV]


def hidden_by_run() -> tuple[list[str], list[str]]:
    """The directories and the files named in HIDE_ENV, at their real paths. A path that does not exist
    is skipped, and so is a directory that cannot be covered without hiding the system (`can_hide`):
    its files are then covered one by one."""
    dirs: set[str] = set()
    files: set[str] = set()
    for p in filter(None, os.environ.get(HIDE_ENV, "").split(os.pathsep)):
        real = os.path.realpath(p)
        if os.path.isdir(real) and can_hide(real):
            dirs.add(real)
        elif os.path.isdir(real):
            with os.scandir(real) as entries:
                files.update(os.path.realpath(e.path) for e in entries if e.is_file(follow_symlinks=True))
        elif os.path.isfile(real):
            files.add(real)
    return sorted(dirs), sorted(files)


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up here; the message says what is missing."""


class SandboxError(RuntimeError):
    """One run could not be set up or did not report back."""


@dataclass
class Limits:
    timeout_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512  # per process (RLIMIT_AS)
    memory_total_mb: int = 1024  # resident, all of the call's processes together
    max_file_mb: int = 16
    max_processes: int = 16
    max_output_bytes: int = 8192
    scratch_mb: int = 64
    scratch_inodes: int = 4096
    hide: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "memory_total_mb", "max_file_mb", "max_processes",
                     "max_output_bytes", "scratch_mb", "scratch_inodes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name}={getattr(self, name)!r}: must be > 0")
        for p in self.hide:
            if not (isinstance(p, str) and os.path.isabs(p) and os.path.isdir(p)):
                raise ValueError(f"sandbox hide: {p!r} is not the absolute path of an existing directory")
        self.hide = [os.path.realpath(p) for p in self.hide]  # the view is masked at real paths only


@dataclass
class RunResult:
    stdout: bytes
    stderr: bytes
    returncode: int
    killed: Optional[str]  # None, "timeout", "output" or "memory" (the call's resident total)


SYSTEM_TREES = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/opt", "/proc", "/sys", "/dev")


def can_hide(path: str) -> bool:
    """Whether covering `path` leaves a working system: not /, a top-level directory or a system tree
    (the interpreter's own trees are bound back into the view either way)."""
    real = os.path.realpath(path)
    return real.count("/") >= 2 and not any(real == t or real.startswith(t + "/") for t in SYSTEM_TREES)


def new_episode_dir() -> str:
    d = os.path.realpath(tempfile.mkdtemp(prefix="asyncrl-py-"))
    os.mkdir(os.path.join(d, "files"), 0o700)
    os.mkdir(os.path.join(d, "root"), 0o700)
    return d


def _expose(interpreter: str) -> list[str]:
    """The install trees the interpreter needs inside the view."""
    return sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                                  os.path.dirname(os.path.realpath(interpreter)))})


def _config(episode_dir: str, limits: Limits, isolate: bool, interpreter: str) -> dict:
    cwd = "/tmp/work" if isolate else os.path.join(episode_dir, "files")
    run_dirs, run_files = hidden_by_run()
    return {"isolate": isolate, "episode_dir": episode_dir, "cwd": cwd, "hide": sorted({*limits.hide, *run_dirs}),
            "hide_files": run_files,
            "expose": _expose(interpreter), "scratch_mb": int(limits.scratch_mb),
            "scratch_inodes": int(limits.scratch_inodes), "timeout_s": float(limits.timeout_s),
            "max_output_bytes": int(limits.max_output_bytes),
            "argv": [interpreter, "-I", "-B", "main.py"],
            "env": {**SANDBOX_ENV, "HOME": cwd, "TMPDIR": cwd},
            "limits": {"cpu_s": int(limits.cpu_s), "as_bytes": int(limits.memory_mb) << 20,
                       "total_bytes": int(limits.memory_total_mb) << 20,
                       "fsize_bytes": int(limits.max_file_mb) << 20, "nproc": int(limits.max_processes)}}


def _prepare(episode_dir: str, code: str) -> None:
    files = os.path.join(episode_dir, "files")
    for name in ("out", "status"):
        p = os.path.join(episode_dir, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)
    main = os.path.join(files, "main.py")
    if os.path.isdir(main) and not os.path.islink(main):
        shutil.rmtree(main)
    elif os.path.lexists(main):
        os.unlink(main)
    with open(main, "w") as f:
        f.write(code)


def _finish(episode_dir: str, isolate: bool, rc: int, err: bytes) -> dict:
    if rc == SETUP_FAILED:
        lines = [ln for ln in err.decode("utf-8", "replace").splitlines() if ln.startswith("sandbox: ")]
        raise SandboxError(lines[-1][len("sandbox: "):] if lines else f"sandbox setup failed: {err[-500:]!r}")
    try:
        with open(os.path.join(episode_dir, "status"), "rb") as f:
            status = marshal.load(f)
    except FileNotFoundError:
        raise SandboxError(f"the sandbox ended (status {rc}) without reporting; stderr: {err[-500:]!r}") from None
    if isolate:
        files, out = os.path.join(episode_dir, "files"), os.path.join(episode_dir, "out")
        shutil.rmtree(files)
        os.rename(out, files)
    return status


def _command(episode_dir: str, limits: Limits, isolate: bool, interpreter: str) -> list[str]:
    return [interpreter, "-I", "-S", str(NSINIT),
            marshal.dumps(_config(episode_dir, limits, isolate, interpreter)).hex()]


async def run(episode_dir: str, code: str, limits: Limits, isolate: bool = True,
              interpreter: str = sys.executable) -> RunResult:
    """Run `code` as main.py of the episode; isolate=False is the unisolated mode (no namespaces)."""
    _prepare(episode_dir, code)
    proc = await asyncio.create_subprocess_exec(
        *_command(episode_dir, limits, isolate, interpreter), env=dict(SANDBOX_ENV),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=float(limits.timeout_s) + BACKSTOP_S)
    except (asyncio.CancelledError, asyncio.TimeoutError):  # killing the launcher kills the whole namespace
        _kill_group(proc.pid)
        await proc.wait()
        raise
    status = _finish(episode_dir, isolate, proc.returncode, err)
    return RunResult(out, err, int(status["returncode"]), status["killed"])


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@functools.lru_cache(maxsize=8)
def probe(interpreter: str = sys.executable) -> Optional[str]:
    """None when a trivial program runs isolated here, else what is missing (cached per interpreter)."""
    if not sys.platform.startswith("linux"):
        return f"namespaces need Linux, this is {sys.platform}"
    d = new_episode_dir()
    try:
        _prepare(d, "")
        p = subprocess.run(_command(d, Limits(timeout_s=30), True, interpreter), env=dict(SANDBOX_ENV),
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        status = _finish(d, True, p.returncode, p.stderr)
        if status["returncode"] != 0:
            return f"a trivial program failed in the sandbox: {p.stderr[-500:]!r}"
        return None
    except (SandboxError, OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        shutil.rmtree(d, ignore_errors=True)
