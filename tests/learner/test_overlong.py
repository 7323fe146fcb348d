"""Responses the token budget cut (asyncrl/learner/overlong.py): DAPO's soft penalty's values, and the
learner keeping, masking or penalising them on the real tiny model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.learner.overlong import shape, soft_penalty
from asyncrl.learner.worker import LearnerWorker
from tests.learner.helpers import make_batch, make_cfg


def test_the_soft_penalty_is_zero_then_falls_linearly_to_the_factor_at_the_budget():
    # budget 100, buffer 20: free up to 80 tokens, -f at 100 (DAPO eq. 13; verl's overlong_buffer)
    assert [soft_penalty(n, 100, 20, 1.0) for n in (0, 50, 80, 90, 100)] == [0.0, 0.0, 0.0, -0.5, -1.0]
    assert soft_penalty(100, 100, 20, 2.0) == -2.0 and soft_penalty(110, 100, 20, 1.0) == -1.5


def test_the_modes_need_a_buffer_within_the_budget():
    with pytest.raises(ConfigError, match=r"algorithm.overlong_buffer_tokens: overlong=penalty needs a buffer > 0"):
        load_config(["algorithm.overlong=penalty"])
    with pytest.raises(ConfigError, match=r"algorithm.overlong_buffer_tokens: 768 must be below "
                                          r"agent.max_response_tokens=768"):
        load_config(["algorithm.overlong=penalty", "algorithm.overlong_buffer_tokens=768",
                     "agent.max_response_tokens=768"])
    with pytest.raises(ConfigError, match="algorithm.overlong_penalty"):
        load_config(["algorithm.overlong=penalty", "algorithm.overlong_buffer_tokens=8",
                     "algorithm.overlong_penalty=nan"])
    with pytest.raises(ConfigError, match="algorithm.overlong"):
        load_config(["algorithm.overlong=drop"])


@pytest.mark.parametrize("mode", ["keep", "mask", "penalty"])
def test_the_learner_keeps_masks_or_penalises_a_cut_response(tiny_model_dir, mode):
    """One response of a batch of 4 was cut (finish_reason length): keep trains it as any other; mask trains
    none of its tokens; penalty lowers every response's reward by its length's penalty (budget 16, buffer 8)."""
    batch = make_batch(seed=1)
    trajs = batch.trajectories()
    trajs[0].finish_reason = "length"
    cfg = make_cfg(tiny_model_dir)
    cfg = replace(cfg, algorithm=replace(cfg.algorithm, overlong=mode, overlong_buffer_tokens=8))
    m = LearnerWorker(cfg).train_step(batch)
    every = float(sum(int(t.loss_mask.numpy().sum()) for t in trajs))
    cut = float(trajs[0].loss_mask.numpy().sum())
    assert m["learner/overlong_frac"] == 0.25
    assert m["learner/tokens"] == (every - cut if mode == "mask" else every)
    shaped = shape(trajs, mode, 16, 8, 1.0)
    if mode == "penalty":
        pens = [soft_penalty(len(t.response_ids), 16, 8, 1.0) for t in trajs]
        assert any(p < 0 for p in pens) and m["learner/overlong_penalty_mean"] == pytest.approx(sum(pens) / 4)
        assert shaped.rewards == [t.reward + p for t, p in zip(trajs, pens)]
    else:
        assert "learner/overlong_penalty_mean" not in m and shaped.rewards == [t.reward for t in trajs]
    assert shaped.masked == [mode == "mask", False, False, False]
