"""`asyncrl train -m`: a real two-point sweep on the tiny model (asyncrl/sweep.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.e2e.test_train import _overrides

pytestmark = [pytest.mark.timeout(420)]


def test_a_two_point_sweep_runs_both_in_their_own_dirs_and_summarizes(tiny_model_dir, tmp_path):
    base = [o for o in _overrides(tiny_model_dir, tmp_path / "unused", **{"trainer.total_steps": 1})
            if not o.startswith("trainer.output_dir=")]
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "-m", f"hydra.sweep.dir={sweep}", *base, "seed=1,2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert runs == ["0_seed=1", "1_seed=2"]
    for name, seed in (("0_seed=1", 1), ("1_seed=2", 2)):
        assert json.loads((sweep / name / "config.json").read_text())["seed"] == seed
        assert json.loads((sweep / name / "summary.json").read_text())["exit_code"] == 0
        assert yaml.safe_load((sweep / name / "overrides.yaml").read_text())[-2:] == [
            f"seed={seed}", f"trainer.output_dir='{sweep / name}'"]
    summary = json.loads((sweep / "summary.json").read_text())
    assert [(s["run"], s["exit_code"], s["steps_trained"]) for s in summary] == [("0_seed=1", 0, 1), ("1_seed=2", 0, 1)]
    assert all(isinstance(s["last_reward_mean"], float) for s in summary)
    assert "| 0_seed=1 | 0 | 1 |" in (sweep / "summary.md").read_text() and "| 1_seed=2 | 0 | 1 |" in r.stdout
    assert json.loads((sweep / "sweep.json").read_text())["runs"][1][-1] == "seed=2"
