"""One run owns its directory, end to end: while a real `asyncrl train` runs, a second one on its dir exits 2
at once naming it; once the first is killed (no checkpoint yet), `trainer.resume=auto` says it found none,
moves the killed run's files aside and trains a new run on its own data only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.run_dir import RUN_STATE, layout_entry

from .test_train import _check_layout, _kill_tree, _overrides, _tree

pytestmark = [pytest.mark.timeout(600)]


def _args(model_dir: Path, out: Path, **extra: object) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "train", *_overrides(model_dir, out, **extra)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}


def _trained(out: Path) -> list[dict]:
    p = out / "trained_uids.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


@pytest.mark.heavy(75)
def test_a_live_run_keeps_its_dir_and_a_killed_one_is_set_aside_by_resume_auto(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    with open(tmp_path / "first.log", "w") as log:
        # steps and checkpoint_every far beyond what it can reach (50 steps once ended before the second run
        # was refused); once it has trained a step its whole tree is stopped (SIGSTOP): alive, holding the
        # dir, with no checkpoint, and taking no CPU from the refused run or the tests beside it
        first = subprocess.Popen(_args(tiny_model_dir, out, **{"trainer.total_steps": 100000,
                                                               "trainer.checkpoint_every": 100000}), stdout=log,
                                 stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    try:
        deadline = time.time() + 300
        while not _trained(out):  # the first run holds the dir and has trained a step (no checkpoint yet)
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.time() < deadline, "no step trained within 300 s"
            time.sleep(0.3)
        tree = [psutil.Process(first.pid), *_tree(first)]
        for p in tree:
            p.suspend()
        second = subprocess.run(_args(tiny_model_dir, out, **{"trainer.total_steps": 2}), capture_output=True,
                                text=True, env=_env(), timeout=200)
        assert first.poll() is None  # the refused run touched nothing of the live one
    finally:
        _kill_tree(first)
    old_id = json.loads((out / "run.json").read_text())["run_id"]
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert second.stderr.strip().splitlines()[-1].startswith(
        f"asyncrl train: {out} is in use by run {old_id} (pid {first.pid} on host {socket.gethostname()}"), \
        second.stderr[-2000:]
    old_uids = {u for rec in _trained(out) for u in rec["uids"]}
    assert old_uids and all(u.startswith(f"{old_id}-g") for u in old_uids)
    assert not (out / "checkpoints").exists()

    res = subprocess.run(_args(tiny_model_dir, out, **{"trainer.total_steps": 2, "trainer.resume": "auto"}),
                         capture_output=True, text=True, env=_env(), timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    new_id = json.loads((out / "run.json").read_text())["run_id"]
    assert new_id != old_id
    assert "took over the lock of run " + old_id in res.stderr  # the killed run's lock, named
    assert f"no checkpoint in {out}: starting run {new_id} fresh; the previous run {old_id}'s files" in res.stderr
    trained = _trained(out)
    assert [rec["step"] for rec in trained] == [1, 2]  # the old run's trained_uids.jsonl was moved aside
    new_uids = [u for rec in trained for u in rec["uids"]]
    assert len(new_uids) == len(set(new_uids)) == 8 and all(u.startswith(f"{new_id}-g") for u in new_uids)
    [aside] = out.glob(f"discarded-{old_id}-*")
    assert {u for rec in _trained(aside) for u in rec["uids"]} == old_uids and (aside / "buffer").is_dir()
    # every name both runs wrote is declared, and what was moved aside is the killed run's state, all of it:
    # the new run's console log and overrides are its own, the old ones went with the old run
    _check_layout(out)
    assert all(layout_entry(p.name) in RUN_STATE for p in aside.iterdir()), sorted(p.name for p in aside.iterdir())
    assert {"train.log", "overrides.yaml", "config.json", "metrics.jsonl", "engines"} <= {p.name for p in aside.iterdir()}
    for log_file in (out / "train.log", aside / "train.log"):
        assert log_file.read_text().count("==== asyncrl train started") == 1, log_file
