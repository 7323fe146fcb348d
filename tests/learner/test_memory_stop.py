"""The learner's memory stop (trainer.memory_stop_fraction) on the real tiny model: checked before each
micro-batch, it stops the step before any forward, naming the settings that would lower the step's memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from asyncrl.learner.worker import LearnerWorker
from asyncrl.util.memory import MemoryBudgetExceeded
from tests.learner.helpers import make_batch, make_cfg


def test_a_machine_past_the_memory_stop_stops_the_step_before_its_first_micro_batch(tiny_model_dir):
    cfg = make_cfg(tiny_model_dir)
    w = LearnerWorker(replace(cfg, trainer=replace(cfg.trainer, memory_stop_fraction=0.0001)))
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    with pytest.raises(MemoryBudgetExceeded, match=r"^learner rank 0: the machine's memory is .* lower "
                                                   r"algorithm.micro_batch_tokens \(now 64\), set "
                                                   r"model.gradient_checkpointing=true, or set "
                                                   r"trainer.learner_memory_gb to have the micro-batch chosen$"):
        w.train_step(make_batch(seed=1))
    assert w.version == 0 and not w.optimizer.state
    assert all(torch.equal(p, before[n]) for n, p in w.model.named_parameters())
    w.cfg.trainer.memory_stop_fraction = 1.0  # never: the same worker trains on
    assert w.train_step(make_batch(seed=1))["learner/version"] == 1
