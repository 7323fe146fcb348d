"""A run owns its directory: the lock, the run record, and what a start does with what it finds there.

- `RunLock`: `fcntl.flock` on `<dir>/run.lock`, held by `asyncrl train` for its whole life (the kernel
  releases it when the process ends, however it ends). The file holds a JSON line naming the holder
  (pid, host, start time, run id), for the message of a second run that finds it taken: that run exits
  at once (`RunDirBusy`). A lock file whose flock is free belongs to a dead holder: it is taken over,
  saying so.
- `RunRecord` (`<dir>/run.json`, written atomically): the run's id, made on a fresh start and kept on
  resume, and the highest policy version the run ever published (recorded before any engine holds the
  weights: a resumed run numbers its new weights above it, never reusing a discarded policy's number).
- `prepare_run`: what `trainer.resume` does with the directory's state (record, checkpoints, buffer log):
  `off` refuses a directory holding another run's state, `auto` resumes the newest checkpoint or, with
  none, moves the previous run's files aside and starts a new run, so that no data of the old run
  trains the new learner.

Run ids are `[0-9a-z]{1,16}` (8 random base36 characters when made here); they prefix every training
group id (asyncrl/rollout/prompts.py), so two runs' trajectories never share a uid.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import msgspec

from asyncrl.util.durable import fsync_dir

log = logging.getLogger("asyncrl")

LOCK_FILE = "run.lock"
RECORD_FILE = "run.json"
CHECKPOINTS = "checkpoints"  # asyncrl/learner/checkpoint.py names what lies below it
_RUN_ID = re.compile(r"[0-9a-z]{1,16}")
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
# a previous run's files, moved aside by `resume=auto` when it finds no checkpoint (nothing else is touched)
RUN_FILES = ("run.json", "checkpoints", "buffer", "metrics.jsonl", "trained_uids.jsonl", "dropped_groups.jsonl",
             "summary.json", "config.json", "engines", "engine_restart_weights", "weight_sync", "final", "wandb")
RUN_FILE_GLOBS = ("trajectories-w*.jsonl",)


class RunDirError(Exception):
    """The directory cannot host this start (another run's state, a busy lock): `asyncrl train` exits 2."""


class RunDirBusy(RunDirError):
    """A live run holds the directory's lock."""


def new_run_id() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(8))


def check_run_id(run_id: object, where: str) -> str:
    if not isinstance(run_id, str) or _RUN_ID.fullmatch(run_id) is None:
        raise ValueError(f"{where}: {run_id!r} is not a run id (1 to 16 characters of [0-9a-z])")
    return run_id


def check_run_name(name: str) -> str:
    """A run name is one path component: letters, digits, `.`, `_`, `-`, not starting with `.` or `-`."""
    if _RUN_NAME.fullmatch(name) is None:
        raise ValueError(f"trainer.run_name {name!r} is not a run name (1 to 100 of [A-Za-z0-9._-], starting "
                         f"with a letter or digit: it names the directory outputs/<run_name>)")
    return name


def timestamp_name(now: Optional[float] = None) -> str:
    """The default run name: the start time, as the output dirs were always named."""
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now))


def run_dir(output_dir: Optional[str], run_name: Optional[str], now: Optional[float] = None) -> Path:
    """The run's directory, absolute: `output_dir` when set, else `outputs/<run_name>` (default name: a timestamp)."""
    if output_dir:
        return Path(output_dir).resolve()
    name = check_run_name(run_name) if run_name is not None else timestamp_name(now)
    return (Path("outputs") / name).resolve()


# ---------------------------------------------------------------------------------------------- the lock


class RunLock:
    """The directory's lock (see the module doc). `acquire` raises `RunDirBusy` when a live process holds it."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self.fd: Optional[int] = None
        self.started = time.time()

    def acquire(self) -> Optional[dict]:
        """Take the lock; returns the dead previous holder's record when a stale lock was taken over."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # never truncated before we hold it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusy(f"{self.path.parent} is in use by {describe_holder(holder)}; a second run may not "
                             f"share its directory: pick another (trainer.run_name=NAME or "
                             f"trainer.output_dir=DIR) or stop that run first") from None
        except BaseException:
            os.close(fd)
            raise
        previous = _read_holder(fd)
        self.fd = fd
        self._write(run_id=None)
        return previous

    def set_run_id(self, run_id: str) -> None:
        self._write(run_id=run_id)

    def _write(self, run_id: Optional[str]) -> None:
        assert self.fd is not None
        rec = {"pid": os.getpid(), "host": socket.gethostname(), "started": self.started, "run_id": run_id}
        data = (json.dumps(rec) + "\n").encode()
        os.pwrite(self.fd, data, 0)  # then cut: a reader never finds the file empty while we hold it
        os.ftruncate(self.fd, len(data))
        os.fsync(self.fd)

    def release(self) -> None:
        """Give the lock back, emptied first (the file stays): a holder's record left in it means its holder died."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.ftruncate(fd, 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)


def _read_holder(fd: int) -> Optional[dict]:
    try:
        raw = os.pread(fd, 4096, 0)
        rec = json.loads(raw.decode())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def describe_holder(holder: Optional[dict]) -> str:
    if not holder:
        return "another process (its lock file names no holder yet)"
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started"))))
    except (TypeError, ValueError, OverflowError, OSError):  # the file is not to be trusted
        when = "?"
    run = f"run {holder['run_id']} " if holder.get("run_id") else ""
    return f"{run}(pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when})"


# ---------------------------------------------------------------------------------------------- the record


class RunRecord(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    created: float
    highest_version: int = 0  # the highest policy version this run ever sent to an engine


def read_record(directory: Path) -> Optional[RunRecord]:
    p = Path(directory) / RECORD_FILE
    if not p.exists():
        return None
    try:
        rec = msgspec.json.decode(p.read_bytes(), type=RunRecord)
    except msgspec.DecodeError as e:
        raise RunDirError(f"{p} is not a run record ({e}): move it away or pick another dir") from None
    try:
        check_run_id(rec.run_id, str(p))
    except ValueError as e:
        raise RunDirError(str(e)) from None
    return rec


def write_record(directory: Path, rec: RunRecord) -> None:
    """Atomically: a crash leaves the old record or the new one, never a torn one."""
    p = Path(directory) / RECORD_FILE
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(rec))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    fsync_dir(p.parent)


class VersionLog:
    """Records in the run record each new version before any engine is sent its weights."""

    def __init__(self, directory: Path, rec: RunRecord):
        self.directory, self.rec = Path(directory), rec

    def publishing(self, version: int) -> None:
        if version > self.rec.highest_version:
            self.rec = msgspec.structs.replace(self.rec, highest_version=version)
            write_record(self.directory, self.rec)


# ---------------------------------------------------------------------------------------------- a start


@dataclass(frozen=True)
class RunStart:
    run_id: str
    record: RunRecord
    resume_from: Optional[Path]  # the checkpoint to load, None: a fresh start


def _latest_checkpoint(directory: Path) -> Optional[Path]:
    from asyncrl.learner.checkpoint import checkpoints_root, latest_checkpoint

    return latest_checkpoint(checkpoints_root(directory))


def _state(directory: Path, wal_dir: Path) -> list[str]:
    """What of a run's state the directory holds (empty: none)."""
    found = []
    if (directory / RECORD_FILE).exists():
        found.append(RECORD_FILE)
    if _latest_checkpoint(directory) is not None:
        found.append("checkpoints")
    if wal_dir.is_dir() and any(wal_dir.iterdir()):
        found.append(f"a buffer log ({wal_dir})")
    return found


def prepare_run(directory: Path, wal_dir: Path, resume: str, now: Optional[float] = None) -> RunStart:
    """Decide (and prepare on disk) how this start uses `directory`; call it holding the directory's lock.
    Raises `RunDirError` for a start the directory cannot host; says what it did in one log line."""
    directory, wal_dir = Path(directory), Path(wal_dir)
    old = read_record(directory)
    if resume == "auto":
        ckpt = _latest_checkpoint(directory)
        if ckpt is not None:
            if old is None:
                raise RunDirError(f"{directory} holds checkpoints but no {RECORD_FILE} (written by an asyncrl "
                                  f"without run ids): its buffer log cannot be resumed; start a new run in "
                                  f"another dir (trainer.run_name=NAME or trainer.output_dir=DIR)")
            return RunStart(old.run_id, old, ckpt)
        state = _state(directory, wal_dir)
        rec = RunRecord(run_id=new_run_id(), created=time.time() if now is None else now)
        if state:  # said first, then done: a move cut short leaves the line saying where things went
            dest = aside_dir(directory, old.run_id if old else "unknown", now)
            log.warning("no checkpoint in %s: starting run %s fresh; the previous run%s's files (%s) are moved to "
                        "%s and none of its data will be trained", directory, rec.run_id,
                        f" {old.run_id}" if old else "", ", ".join(state), dest)
            move_aside(directory, wal_dir, dest)
        else:
            log.info("no checkpoint in %s: starting run %s fresh", directory, rec.run_id)
        write_record(directory, rec)
        return RunStart(rec.run_id, rec, None)
    state = _state(directory, wal_dir)
    if state:
        who = f"run {old.run_id}" if old else "a previous run"
        raise RunDirError(f"{directory} holds {who}'s state ({', '.join(state)}) and trainer.resume=off: pick "
                          f"another dir (trainer.run_name=NAME or trainer.output_dir=DIR) or continue it with "
                          f"trainer.resume=auto")
    rec = RunRecord(run_id=new_run_id(), created=time.time() if now is None else now)
    write_record(directory, rec)
    return RunStart(rec.run_id, rec, None)


def aside_dir(directory: Path, old_run_id: str, now: Optional[float] = None) -> Path:
    """A new `<directory>/discarded-<old run id>-<time>[-n]/` for a previous run's files."""
    dest = directory / f"discarded-{old_run_id}-{timestamp_name(now)}"
    n = 1
    while dest.exists():
        n += 1
        dest = directory / f"discarded-{old_run_id}-{timestamp_name(now)}-{n}"
    dest.mkdir()
    return dest


def move_aside(directory: Path, wal_dir: Path, dest: Path) -> None:
    """Move a previous run's files (`RUN_FILES`, `RUN_FILE_GLOBS`, and its buffer log wherever it lies) into
    `dest`; nothing else in the directory is touched."""
    names = [directory / f for f in RUN_FILES] + [p for g in RUN_FILE_GLOBS for p in sorted(directory.glob(g))]
    for p in names:
        if p.exists() or p.is_symlink():
            os.replace(p, dest / p.name)
    if wal_dir.exists():  # an explicit buffer.wal_dir outside the run dir
        os.replace(wal_dir, dest / "buffer-log")
