"""A run owns its directory: its layout, the lock, the run record, and what a start does with what it finds there.

- The layout (`LAYOUT`, `RunLayout`): every file and folder name a run writes at its directory's top level,
  each an `Entry` with a one-line description and whether it is the run's state (moved aside by a fresh
  start, below), and how checkpoint directories below `checkpoints/` are named (`checkpoint_name`,
  `checkpoint_step`). The one place these names are spelled: every other module takes its paths from here
  (tests/core/test_run_layout.py fails on a second spelling under asyncrl/).
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
  none, moves the previous run's files (the layout's run-state entries, `RUN_STATE`) aside and starts a
  new run, so that no data of the old run trains the new learner.

Run ids are `[0-9a-z]{1,16}` (8 random base36 characters when made here); they prefix every training
group id (asyncrl/rollout/prompts.py), so two runs' trajectories never share a uid.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import logging
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import msgspec

from asyncrl.util.durable import fsync_dir

log = logging.getLogger("asyncrl")

# What a run's files deny everyone but their user: group and other, every permission.
PRIVATE_BITS = 0o077


def make_private(out: Path) -> None:
    """A run's files are its user's alone (docs/design.md "Threat model"): this process's umask gains
    PRIVATE_BITS (a stricter umask of the user's stays), so every file and directory the run and every
    process it starts create (Ray's session files, the engines', the buffer's WAL, checkpoints) has no
    group or other permission; the run dir itself is made 0700 whoever created it."""
    os.umask(os.umask(0) | PRIVATE_BITS)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(stat.S_IMODE(out.stat().st_mode) & ~PRIVATE_BITS)


_RUN_ID = re.compile(r"[0-9a-z]{1,16}")
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


# ---------------------------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class Entry:
    """One name at a run directory's top level. A family of names (one per worker, per discarded run) is a
    glob with one `*`; `named` makes its members."""

    name: str
    is_dir: bool
    run_state: bool  # the run's own: moved aside by `trainer.resume=auto` when no checkpoint resumes the run
    what: str  # one line: what it holds, and who writes it

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.name)

    def named(self, part: str) -> str:
        """The member of this family that `part` names (what its `*` stands for)."""
        if self.name.count("*") != 1:
            raise ValueError(f"{self.name!r} is one name, not a family of names: it has no member {part!r}")
        if not part or "/" in part or "*" in part:
            raise ValueError(f"{part!r} cannot name a member of {self.name!r} (empty, or holds '/' or '*')")
        return self.name.replace("*", part)


LOCK = Entry("run.lock", False, False, "the directory's lock (`RunLock`): a JSON line naming its live holder")
RECORD = Entry("run.json", False, True, "the run record (`RunRecord`): run id, creation time, highest published version")
CONFIG = Entry("config.json", False, True, "the run's config as resolved, secrets withheld (asyncrl/run/controller.py)")
OVERRIDES = Entry("overrides.yaml", False, True, "the overrides as typed, secrets redacted (asyncrl/console_log.py)")
TRAIN_LOG = Entry("train.log", False, True, "what `asyncrl train` printed, secrets redacted (asyncrl/console_log.py)")
METRICS = Entry("metrics.jsonl", False, True, "one JSON line per step and per eval (asyncrl/metrics.py)")
TRAINED_UIDS = Entry("trained_uids.jsonl", False, True, "{step, version, uids} per trained step (asyncrl/run/controller.py)")
LEARNER_LOGPROBS = Entry("learner_logprobs.jsonl", False, True,
                         "{step, uid, proximal_logprobs} per trained trajectory of the dump sample: the learner's "
                         "log-probs of its response tokens before the step (decoupled PPO; asyncrl/run/controller.py)")
DROPPED_GROUPS = Entry("dropped_groups.jsonl", False, True,
                       "{step, group_id, reason} per group the buffer closed unserved (asyncrl/run/fleet.py)")
TRAJECTORIES = Entry("trajectories-w*.jsonl", False, True,
                     "rollout worker k's readable trajectories (asyncrl/rollout/trajectory_log.py)")
SUMMARY = Entry("summary.json", False, True, "how the run ended and what it did (asyncrl/run/controller.py)")
SUMMARY_RESERVE = Entry("summary.reserve", False, True, "1 MiB held while the run lives, given back just before "
                        "summary.json is written: a full disk still takes the summary (asyncrl/run/controller.py)")
CHECKPOINTS = Entry("checkpoints", True, True,
                    "the learner's checkpoints, one per `checkpoint_name` (asyncrl/learner/checkpoint.py)")
BUFFER = Entry("buffer", True, True, "the replay buffer's log, unless buffer.wal_dir puts it elsewhere (asyncrl/buffer/wal.py)")
WEIGHT_SYNC = Entry("weight_sync", True, True,
                    "weights sent to the engines through files, unless trainer.weight_sync.disk_dir (asyncrl/weight_sync/)")
ENGINES = Entry("engines", True, True, "one log dir per engine launch (asyncrl/run/engine_actor.py)")
ENGINE_RESTART_WEIGHTS = Entry("engine_restart_weights", True, True,
                               "the weights a relaunched engine starts from (asyncrl/run/supervisor.py)")
FINAL = Entry("final", True, True, "the trained model as a Hugging Face dir, exported at the run's end")
WANDB = Entry("wandb", True, True, "the wandb library's own files, unless trainer.wandb=off (asyncrl/metrics.py)")
REPORT = Entry("report", True, True, "`asyncrl report`'s plots and summary.md of metrics.jsonl (asyncrl/commands/report.py)")
WARM_START = Entry("warm_start", True, False, "the warm start's demonstrations, SFT run and model; kept across starts: "
                   "a start with the same plan reuses or resumes it (asyncrl/sft/warm_start.py)")
WARM_START_DISCARDED = Entry(WARM_START.name + "-discarded-*", True, False,
                             "a warm start made by another plan, moved aside (asyncrl/sft/warm_start.py)")
DISCARDED = Entry("discarded-*", True, False, "a previous run's files, moved aside by trainer.resume=auto (`aside_dir`)")
# every name a run writes at its directory's top level; tests/e2e/test_train.py checks real runs against it
LAYOUT: tuple[Entry, ...] = (LOCK, RECORD, CONFIG, OVERRIDES, TRAIN_LOG, METRICS, TRAINED_UIDS, LEARNER_LOGPROBS,
                             DROPPED_GROUPS,
                             TRAJECTORIES, SUMMARY, SUMMARY_RESERVE, CHECKPOINTS, BUFFER, WEIGHT_SYNC, ENGINES,
                             ENGINE_RESTART_WEIGHTS, FINAL, WANDB, REPORT, WARM_START, WARM_START_DISCARDED, DISCARDED)
# a previous run's files, moved aside by `resume=auto` when it finds no checkpoint (nothing else is touched)
RUN_STATE: tuple[Entry, ...] = tuple(e for e in LAYOUT if e.run_state)
ASIDE_BUFFER_LOG = "buffer-log"  # in a discarded-* dir: the run's buffer log when buffer.wal_dir put it elsewhere
LOCK_FILE, RECORD_FILE = LOCK.name, RECORD.name

# below checkpoints/: one directory `step_NNNNNN` per checkpoint, its critic part (if any) beside it
CHECKPOINT_PREFIX = "step_"
CRITIC_SUFFIX = ".critic"
_CHECKPOINT_NAME = re.compile(re.escape(CHECKPOINT_PREFIX) + r"(\d+)")


def layout_entry(name: str) -> Optional[Entry]:
    """The entry of `LAYOUT` that a top-level name belongs to, or None (a file no run writes)."""
    return next((e for e in LAYOUT if e.matches(name)), None)


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory's files (`LAYOUT`). An `asyncrl sft` output dir, and a run's
    `warm_start/`, hold SFT's `metrics`, `checkpoints` and `final` under the same names."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    def path(self, entry: Entry) -> Path:
        if "*" in entry.name:
            raise ValueError(f"{entry.name!r} is a family of names: name one member (Entry.named)")
        return self.root / entry.name

    lock = property(lambda self: self.path(LOCK))
    record = property(lambda self: self.path(RECORD))
    config = property(lambda self: self.path(CONFIG))
    overrides = property(lambda self: self.path(OVERRIDES))
    train_log = property(lambda self: self.path(TRAIN_LOG))
    metrics = property(lambda self: self.path(METRICS))
    trained_uids = property(lambda self: self.path(TRAINED_UIDS))
    dropped_groups = property(lambda self: self.path(DROPPED_GROUPS))
    learner_logprobs = property(lambda self: self.path(LEARNER_LOGPROBS))
    summary = property(lambda self: self.path(SUMMARY))
    summary_reserve = property(lambda self: self.path(SUMMARY_RESERVE))
    checkpoints = property(lambda self: self.path(CHECKPOINTS))
    buffer = property(lambda self: self.path(BUFFER))
    weight_sync = property(lambda self: self.path(WEIGHT_SYNC))
    engines = property(lambda self: self.path(ENGINES))
    engine_restart_weights = property(lambda self: self.path(ENGINE_RESTART_WEIGHTS))
    final = property(lambda self: self.path(FINAL))
    wandb = property(lambda self: self.path(WANDB))
    report = property(lambda self: self.path(REPORT))
    warm_start = property(lambda self: self.path(WARM_START))

    def trajectories(self, worker_id: int) -> Path:
        """Rollout worker `worker_id`'s trajectory file."""
        return self.root / TRAJECTORIES.named(str(int(worker_id)))

    def trajectory_files(self) -> list[Path]:
        return sorted(self.root.glob(TRAJECTORIES.name))

    def checkpoint(self, step: int) -> Path:
        return step_dir(self.checkpoints, step)


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of `step` (`step_NNNNNN`, six digits or more)."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_step(path: str | os.PathLike) -> Optional[int]:
    """The step that a checkpoint directory's name says, or None for a name that is no checkpoint's."""
    m = _CHECKPOINT_NAME.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The checkpoint of `step` under `root` (a `checkpoints/` dir)."""
    return Path(root) / checkpoint_name(step)


def checkpoint_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, dir) of every checkpoint directory under `root`, by step (not by name order or mtime)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((s, p) for p in root.iterdir() if (s := checkpoint_step(p)) is not None and p.is_dir())


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The newest `step_NNNNNN` directory under `root` (the highest step), or None."""
    found = checkpoint_dirs(root)
    return found[-1][1] if found else None


def critic_dir(step_path: str | os.PathLike) -> Path:
    """Where a critic on its own ranks saves its part of checkpoint `step_path`: beside it (`step_NNNNNN.critic`),
    written BEFORE the learner's part (whose save commits the trained batches to the buffer), so a complete
    learner checkpoint always has its critic (asyncrl/run/fleet.py)."""
    p = Path(step_path)
    return p.with_name(p.name + CRITIC_SUFFIX)


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
        self.path = RunLayout(directory).lock
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
    p = RunLayout(directory).record
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
    p = RunLayout(directory).record
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
    return latest_checkpoint(RunLayout(directory).checkpoints)


def _state(directory: Path, wal_dir: Path) -> list[str]:
    """What of a run's state the directory holds (empty: none)."""
    found = []
    if RunLayout(directory).record.exists():
        found.append(RECORD.name)
    if _latest_checkpoint(directory) is not None:
        found.append(CHECKPOINTS.name)
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
                raise RunDirError(f"{directory} holds checkpoints but no {RECORD.name} (written by an asyncrl "
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
    stamp = f"{old_run_id}-{timestamp_name(now)}"
    dest = directory / DISCARDED.named(stamp)
    n = 1
    while dest.exists():
        n += 1
        dest = directory / DISCARDED.named(f"{stamp}-{n}")
    dest.mkdir()
    return dest


def move_aside(directory: Path, wal_dir: Path, dest: Path) -> None:
    """Move a previous run's files (every name of a `RUN_STATE` entry, and its buffer log wherever it lies) into
    `dest`; nothing else in the directory is touched."""
    for p in sorted(directory.iterdir()):
        if any(e.matches(p.name) for e in RUN_STATE):
            os.replace(p, dest / p.name)
    if wal_dir.exists():  # an explicit buffer.wal_dir outside the run dir
        os.replace(wal_dir, dest / ASIDE_BUFFER_LOG)
