"""Versions are never reused for different weights: a run that published versions past its last checkpoint
and crashed resumes numbering above every version it published (the run record's), on the real tiny model."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.checkpoint import checkpoint_version, checkpoints_root, step_dir
from asyncrl.run_dir import VersionLog, prepare_run, read_record
from tests.learner.helpers import make_batch, make_cfg

pytestmark = pytest.mark.timeout(240)


def test_a_resumed_runs_first_new_version_is_above_every_version_the_crashed_run_published(tiny_model_dir, tmp_path):
    from asyncrl.learner.worker import LearnerWorker

    cfg = make_cfg(tiny_model_dir, minibatches=1, epochs=1)
    start = prepare_run(tmp_path, tmp_path / "buffer", "off")
    versions = VersionLog(tmp_path, start.record)
    crashed = LearnerWorker(cfg)
    published = []
    for step in range(1, 4):  # three steps, a checkpoint after the first, then a crash after the third
        crashed.train_step(make_batch(seed=step, batch_id=step))
        versions.publishing(crashed.version)  # what the controller records before each weight sync
        published.append(crashed.version)
        if step == 1:
            crashed.save_checkpoint(str(step_dir(checkpoints_root(tmp_path), 1)), {"step": 1})
    assert published == [1, 2, 3] and read_record(tmp_path).highest_version == 3
    saved = {k: v.detach().clone() for k, v in crashed.model.state_dict().items()}
    del crashed

    again = prepare_run(tmp_path, tmp_path / "buffer", "auto")
    assert again.run_id == start.run_id and checkpoint_version(again.resume_from) == 1
    resumed = LearnerWorker(cfg)
    resumed.load_checkpoint(str(again.resume_from), again.record.highest_version)
    assert resumed.version == 1  # the checkpoint's weights keep the number they were published under
    assert any(not torch.equal(v, saved[k]) for k, v in resumed.model.state_dict().items())  # not version 3's
    resumed.train_step(make_batch(seed=10, batch_id=10))
    assert resumed.version == 4 > max(published)
    resumed.train_step(make_batch(seed=11, batch_id=11))
    assert resumed.version == 5
    # without the record (what happened before), the resumed run would have numbered these 2 and 3 again
    plain = LearnerWorker(cfg)
    plain.load_checkpoint(str(again.resume_from))
    plain.train_step(make_batch(seed=10, batch_id=10))
    assert plain.version == 2
