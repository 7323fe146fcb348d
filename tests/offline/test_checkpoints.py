"""What MODEL may name for `asyncrl eval` / `generate`, and the errors for what it may not."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from asyncrl.offline.checkpoints import CheckpointPathError, resolve_model_source


def _hf(dst, tiny_model_dir):
    shutil.copytree(tiny_model_dir, dst)
    return dst


def test_hf_dir_and_run_dir_and_checkpoint(tmp_path, tiny_model_dir):
    hf = _hf(tmp_path / "hf", tiny_model_dir)
    assert resolve_model_source(str(hf)).hf_dir == hf.resolve()

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    (run / "overrides.yaml").write_text("- env=search_r1\n- trainer.total_steps=3\n- model.path=/elsewhere\n"
                                        "- agent.max_turn_tokens=7\n")
    _hf(run / "final", tiny_model_dir)
    src = resolve_model_source(str(run))
    assert src.hf_dir == (run / "final").resolve() and src.run_dir == run.resolve()
    assert src.run_overrides == ["env=search_r1", "agent.max_turn_tokens=7"]  # training-only keys left out
    assert resolve_model_source(str(run / "final")).run_overrides == src.run_overrides

    step = run / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"x")
    (step / "COMPLETE").write_text("ok")
    assert resolve_model_source(str(step)).training_checkpoint == step.resolve()
    shutil.rmtree(run / "final")
    assert resolve_model_source(str(run)).training_checkpoint == step.resolve()  # no final/: the newest step


@pytest.mark.parametrize("case,match", [
    ("missing", "no such file or directory"),
    ("file", "is a file"),
    ("empty", "is not a model.*holds nothing"),
    ("config_only", "is not a model.*config.json"),
    ("incomplete", "incomplete training checkpoint"),
    ("empty_run", "run dir with nothing to evaluate"),
    ("bad_overrides", "overrides.yaml: expected a YAML list"),
])
def test_malformed_model_paths_are_named(tmp_path, case, match):
    p = tmp_path / case
    if case == "file":
        p.write_text("x")
    elif case != "missing":
        p.mkdir()
    if case == "config_only":
        (p / "config.json").write_text("{}")
    if case == "incomplete":
        (p / ".metadata").write_bytes(b"x")
    if case in ("empty_run", "bad_overrides"):
        (p / "run.json").write_text("{}")
    if case == "bad_overrides":
        (p / "overrides.yaml").write_text("{a: 1}")
    with pytest.raises(CheckpointPathError, match=match):
        resolve_model_source(str(p))


def test_eval_cli_names_a_bad_model_before_starting_anything(tmp_path):
    bad = tmp_path / "nothing_here"
    bad.mkdir()
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", str(bad), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is not a model" in r.stderr and str(bad) in r.stderr
    assert not (tmp_path / "o").exists()
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", "-k", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "-k must be >= 1" in r.stderr
