"""A run owns its directory (asyncrl/run_dir.py): the lock between real processes, the run record, and what
`trainer.resume` does with a directory a previous run left, on real directories made here."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.learner import checkpoint as ckpt
from asyncrl.run_dir import (
    RECORD_FILE,
    RunDirBusy,
    RunDirError,
    RunLock,
    RunRecord,
    VersionLog,
    check_run_id,
    describe_holder,
    prepare_run,
    read_record,
    run_dir,
    write_record,
)

pytestmark = pytest.mark.timeout(180)

HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from asyncrl.run_dir import RunLock
    lock = RunLock(Path(sys.argv[1]))
    lock.acquire()
    lock.set_run_id("holder01")
    print("LOCKED", flush=True)
    sys.stdin.read()  # hold it until the test closes stdin or kills this process
""")


def _hold(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    assert line.strip() == "LOCKED", line
    return proc


@pytest.mark.heavy(16)
def test_a_second_train_on_a_live_runs_dir_exits_at_once_naming_the_holder(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    out.mkdir()
    holder = _hold(out)
    try:
        res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "model=custom",
                              f"model.path={tiny_model_dir}", f"trainer.output_dir={out}", "trainer.wandb=off",
                              "env.num_train=8", "env.num_val=2"], capture_output=True, text=True, timeout=150)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"asyncrl train: {out} is in use by run holder01 (pid {holder.pid} on host "
                           f"{socket.gethostname()}, started "), last
    assert sorted(p.name for p in out.iterdir()) == ["run.lock"]  # stopped before it wrote anything
    RunLock(out).acquire()  # the holder exited: free again (and its cleanly released file names nobody)


def test_a_killed_holders_lock_is_taken_over_and_named(tmp_path):
    holder = _hold(tmp_path)
    with pytest.raises(RunDirBusy, match=f"pid {holder.pid} on host"):
        RunLock(tmp_path).acquire()
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    lock = RunLock(tmp_path)
    dead = lock.acquire()
    assert dead is not None and (dead["pid"], dead["run_id"]) == (holder.pid, "holder01")
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirBusy, match=f"pid {os.getpid()} on host"):  # a flock is per open file, even in one process
        RunLock(tmp_path).acquire()
    lock.release()
    assert RunLock(tmp_path).acquire() is None  # a released lock names no holder: nothing was taken over


def test_run_dir_names_and_hostile_run_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_dir(None, "exp-1.b_2") == tmp_path / "outputs" / "exp-1.b_2"
    assert run_dir(str(tmp_path / "x"), "ignored") == tmp_path / "x"  # output_dir overrides
    assert run_dir(None, None, now=0.0).parent == tmp_path / "outputs"
    for bad in ["../x", "a/b", "", ".hidden", "-x", "a\x00b", "a b", "x" * 101, "\u00e9t\u00e9"]:
        with pytest.raises(ValueError, match="is not a run name"):
            run_dir(None, bad)
        with pytest.raises(ConfigError, match="is not a run name"):
            load_config([f"trainer.run_name='{bad}'"])
    assert load_config(["trainer.run_name=exp1", "trainer.resume=auto"]).trainer.run_name == "exp1"
    cfg = load_config([])
    assert (cfg.trainer.run_name, cfg.trainer.output_dir) == (None, None)


def test_resume_auto_with_a_timestamped_default_dir_is_refused_saying_how_to_name_a_run():
    with pytest.raises(ConfigError, match=r"can never hold one: name the run \(trainer.run_name=NAME"):
        load_config(["trainer.resume=auto"])


def test_run_record_is_written_whole_and_hostile_records_are_refused(tmp_path):
    rec = RunRecord(run_id="ab12", created=1.0)
    write_record(tmp_path, rec)
    versions = VersionLog(tmp_path, rec)
    for v in (1, 2, 2, 1, 5):
        versions.publishing(v)
    assert read_record(tmp_path) == RunRecord(run_id="ab12", created=1.0, highest_version=5)
    assert not list(tmp_path.glob("*.tmp"))
    for bad in [b"", b"{", b"[]", b'{"run_id": "../x", "created": 1}', b'{"run_id": "AB", "created": 1}',
                b'{"created": 1}', b'{"run_id": "ab", "created": 1, "highest_version": "3"}', b"\xff\xfe"]:
        (tmp_path / RECORD_FILE).write_bytes(bad)
        with pytest.raises(RunDirError, match="run.json|is not a run id"):
            read_record(tmp_path)
    with pytest.raises(ValueError, match="is not a run id"):
        check_run_id("a" * 17, "test")


def _checkpoint(out: Path, step: int, version: int) -> Path:
    """A real (tiny) checkpoint as the learner writes it: DCP files, meta with the version, COMPLETE."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    return ckpt.save(ckpt.step_dir(ckpt.checkpoints_root(out), step), model, opt,
                     meta={"version": version, "extra": {"step": step}})


def test_resume_off_refuses_a_dir_holding_another_runs_state(tmp_path):
    first = prepare_run(tmp_path, tmp_path / "buffer", "off")
    assert first.resume_from is None and read_record(tmp_path).run_id == first.run_id
    with pytest.raises(RunDirError, match=f"holds run {first.run_id}'s state .*trainer.resume=auto"):
        prepare_run(tmp_path, tmp_path / "buffer", "off")
    other = tmp_path / "legacy"  # an older asyncrl's dir: no record, but a buffer log
    (other / "buffer").mkdir(parents=True)
    (other / "buffer" / "wal.log").write_bytes(b"x")
    with pytest.raises(RunDirError, match="a previous run's state .*a buffer log"):
        prepare_run(other, other / "buffer", "off")
    empty = tmp_path / "empty"  # leftovers that are no run state (no record, checkpoint or log): a fresh start
    (empty / "buffer").mkdir(parents=True)
    (empty / "notes.txt").write_text("mine")
    assert prepare_run(empty, empty / "buffer", "off").resume_from is None


def test_resume_auto_without_a_checkpoint_moves_the_old_run_aside_and_starts_a_new_one(tmp_path, caplog):
    old = prepare_run(tmp_path, tmp_path / "buffer", "off")
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "wal.log").write_bytes(b"old run's trajectories")
    (tmp_path / "trained_uids.jsonl").write_text("{}\n")
    (tmp_path / "trajectories-w0.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("the user's own file")
    with caplog.at_level(logging.INFO, logger="asyncrl"):
        new = prepare_run(tmp_path, tmp_path / "buffer", "auto")
    assert new.resume_from is None and new.run_id != old.run_id and read_record(tmp_path).run_id == new.run_id
    assert not (tmp_path / "buffer").exists() and not (tmp_path / "trained_uids.jsonl").exists()
    assert (tmp_path / "notes.txt").read_text() == "the user's own file"
    [aside] = tmp_path.glob(f"discarded-{old.run_id}-*")
    assert (aside / "buffer" / "wal.log").read_bytes() == b"old run's trajectories"
    assert sorted(p.name for p in aside.iterdir()) == ["buffer", "run.json", "trained_uids.jsonl",
                                                       "trajectories-w0.jsonl"]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"no checkpoint in {tmp_path}: starting run {new.run_id} fresh; the previous run "
                           f"{old.run_id}'s files") and f"moved to {aside} and none of its data will be trained" in line
    caplog.clear()
    empty = tmp_path / "empty"
    empty.mkdir()
    with caplog.at_level(logging.INFO, logger="asyncrl"):
        fresh = prepare_run(empty, empty / "buffer", "auto")
    assert [r.getMessage() for r in caplog.records] == [f"no checkpoint in {empty}: starting run {fresh.run_id} fresh"]


def test_resume_auto_resumes_the_newest_checkpoint_of_the_same_run(tmp_path):
    first = prepare_run(tmp_path, tmp_path / "buffer", "off")
    VersionLog(tmp_path, first.record).publishing(7)
    _checkpoint(tmp_path, 2, 2)
    newest = _checkpoint(tmp_path, 4, 4)
    again = prepare_run(tmp_path, tmp_path / "buffer", "auto")
    assert (again.run_id, again.resume_from, again.record.highest_version) == (first.run_id, newest, 7)
    assert ckpt.checkpoint_version(again.resume_from) == 4
    with pytest.raises(RunDirError, match="holds run .*trainer.resume=auto"):
        prepare_run(tmp_path, tmp_path / "buffer", "off")
    (tmp_path / RECORD_FILE).unlink()  # checkpoints without a record: an older asyncrl's dir
    with pytest.raises(RunDirError, match="holds checkpoints but no run.json"):
        prepare_run(tmp_path, tmp_path / "buffer", "auto")


@pytest.mark.parametrize("content", [b"", b"garbage", b"[1, 2]", b'"pid"', b"\xff\xfe\x00", b'{"pid": 1' + b" " * 5000 + b"}",
                                     b'{"pid": "x; rm -rf /", "host": null, "started": "soon"}'])
def test_hostile_lock_file_contents_are_never_trusted(tmp_path, content):
    (tmp_path / "run.lock").write_bytes(content)
    lock = RunLock(tmp_path)
    dead = lock.acquire()  # free: taken, whatever the file held
    assert dead is None or isinstance(dead, dict)
    rec = json.loads((tmp_path / "run.lock").read_text())
    assert (rec["pid"], rec["run_id"]) == (os.getpid(), None)  # rewritten whole, nothing of the old bytes left
    lock.release()
    (tmp_path / "run.lock").write_bytes(content)
    holder = _hold(tmp_path)  # a live holder rewrites it; a reader meanwhile gets a message, never a crash
    try:
        with pytest.raises(RunDirBusy, match=f"in use by run holder01 \\(pid {holder.pid} "):
            RunLock(tmp_path).acquire()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert describe_holder({"pid": "x; rm -rf /", "host": None, "started": "soon"}) == "(pid x; rm -rf / on host None, started ?)"
    for started in (1e300, float("nan"), -1e20, [1], None):
        assert describe_holder({"pid": 1, "host": "h", "started": started}).endswith(", started ?)")


def test_resume_auto_without_a_checkpoint_also_sets_aside_a_buffer_log_kept_elsewhere(tmp_path):
    out, wal = tmp_path / "run", tmp_path / "logs" / "wal"
    out.mkdir()
    old = prepare_run(out, wal, "off")
    wal.mkdir(parents=True)
    (wal / "wal.log").write_bytes(b"old")
    with pytest.raises(RunDirError, match=f"holds run {old.run_id}'s state .*a buffer log \\({wal}\\)"):
        prepare_run(out, wal, "off")
    new = prepare_run(out, wal, "auto")
    assert new.run_id != old.run_id and not wal.exists()
    [aside] = out.glob(f"discarded-{old.run_id}-*")
    assert (aside / "buffer-log" / "wal.log").read_bytes() == b"old"


def test_the_runs_sandbox_hidden_paths_are_its_dirs_and_the_users_files(tmp_path):
    """What `asyncrl train` asks the sandbox to hide (asyncrl/sandbox/runner.py HIDE_ENV): the output dir, the
    buffer's WAL and keys, the weight-sync dir, and the data, tool YAML and reward files it was given,
    absolute, each once."""
    from asyncrl.config import load_config
    from asyncrl.sandbox.runner import job_paths

    cfg = load_config(["buffer.keys_dir=keys", f"buffer.wal_dir={tmp_path}/wal", "env.train_file=data/train.parquet",
                       "env.reward.path=rewards.py", "env.reward.name=score", f"trainer.output_dir={tmp_path}/out"])
    out = tmp_path / "out"
    paths = job_paths(cfg, out)
    cwd = Path.cwd().resolve()
    assert paths == sorted({str(out), f"{tmp_path}/wal", str(cwd / "keys"), str(cwd / "data/train.parquet"),
                            str(cwd / "rewards.py")})
