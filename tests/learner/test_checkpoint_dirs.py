"""Checkpoint directory naming: one spelling (`step_dir`), the newest found, old ones pruned."""

from __future__ import annotations

import pytest

from asyncrl.learner.checkpoint import checkpoints_root, latest_checkpoint, prune_checkpoints, step_dir


def test_naming_latest_and_prune(tmp_path):
    root = checkpoints_root(tmp_path)
    assert root == tmp_path / "checkpoints" and latest_checkpoint(root) is None  # no directory yet
    for step in (2, 10, 4):
        step_dir(root, step).mkdir(parents=True)
    (root / "step_000012.tmp").mkdir()  # debris of a crashed save: never a checkpoint
    (root / "step_000099").write_text("a file, not a checkpoint")
    assert step_dir(root, 4).name == "step_000004"
    assert latest_checkpoint(root) == step_dir(root, 10)  # by step, not by name order or mtime
    prune_checkpoints(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000010", "step_000012.tmp", "step_000099"]
    prune_checkpoints(root, keep=0)  # 0: keep all
    assert latest_checkpoint(root) == step_dir(root, 10)


def test_negative_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        step_dir(tmp_path, -1)
