"""The learner's numeric guard on the real tiny model: a non-finite loss or gradient norm skips the
optimizer step (weights, optimizer state and version untouched, counted); K in a row stop the run."""

from __future__ import annotations

import math

import pytest
import torch

from tests.learner.helpers import make_batch, make_cfg


class _Poisoned:
    """The final norm's weight set to inf: every logit, hence the loss and the gradients, is not finite
    (what a diverged model gives). Restored on exit."""

    def __init__(self, worker):
        self.p = worker.model.model.norm.weight

    def __enter__(self):
        self.saved = self.p.detach().clone()
        with torch.no_grad():
            self.p.fill_(math.inf)

    def __exit__(self, *exc):
        with torch.no_grad():
            self.p.copy_(self.saved)


@pytest.mark.timeout(180)
def test_non_finite_steps_are_skipped_counted_and_k_in_a_row_stop(tiny_model_dir):
    from asyncrl.learner.worker import LearnerWorker, NonFiniteTrainingError

    w = LearnerWorker(make_cfg(tiny_model_dir, decoupled=False, max_nonfinite_steps=3))
    good = w.train_step(make_batch(seed=3, batch_id=1))
    assert good["learner/skipped_steps_nonfinite"] == 0 and w.version == 1 and w.optimizer_steps == 1
    before = {k: v.detach().clone() for k, v in w.model.named_parameters()}
    opt_state = {k: v.clone() for k, v in w.optimizer.state[next(iter(w.model.parameters()))].items()}

    with _Poisoned(w):
        m = w.train_step(make_batch(seed=4, batch_id=2))
    assert not (math.isfinite(m["learner/loss"]) and math.isfinite(m["learner/grad_norm"]))
    assert m["learner/skipped_steps_nonfinite"] == 1
    assert w.version == 1 and w.optimizer_steps == 1  # no update: the version does not move
    for k, v in w.model.named_parameters():
        assert torch.equal(v, before[k]), k  # (the poison was taken back; nothing else moved)
        assert v.grad is None, k  # the poisoned gradients were dropped
    for k, v in w.optimizer.state[next(iter(w.model.parameters()))].items():
        assert torch.equal(v, opt_state[k]), k

    # a good step in between resets the run of skips
    assert w.train_step(make_batch(seed=5, batch_id=3))["learner/skipped_steps_nonfinite"] == 1
    assert w.version == 2
    with _Poisoned(w):
        w.train_step(make_batch(seed=6, batch_id=4))
        w.train_step(make_batch(seed=7, batch_id=5))
        with pytest.raises(NonFiniteTrainingError, match=r"3 optimizer steps in a row had a non-finite loss or "
                                                         r"gradient norm \(last: loss=.*batch 6; "
                                                         r"algorithm.max_nonfinite_steps=3\)"):
            w.train_step(make_batch(seed=8, batch_id=6))
    assert w.skipped_nonfinite == 4 and w.version == 2
