"""Per-turn credit: turn and tool rewards placed where they arose reach the advantage of the tokens
before them only. Expected values are written out by hand from the formulas in advantages.py."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from asyncrl.config import AlgorithmConfig, ConfigError
from asyncrl.data.schema import NonFiniteRewardError, SchemaError, Trajectory, make_trajectory
from asyncrl.learner.advantages import earned_before, turn_credit_advantages

EPS = 1e-6


def test_earned_before_counts_rewards_strictly_before_each_token():
    # rewards after token 1 (0.5), after token 3 (1.0), and one unplaced (-1: after the last token)
    got = earned_before(6, [(1, 0.5), (3, 1.0), (-1, 2.0)]).tolist()
    assert got == [0.0, 0.0, 0.5, 0.5, 1.5, 1.5]
    with pytest.raises(ValueError, match="position 6 is outside the response"):
        earned_before(6, [(6, 1.0)])


def test_grpo_turn_credit_hand_values():
    """a: final 0, a tool reward of 1 after its token 1 -> total 1; b: final 0, nothing -> total 0.
    mean 0.5, unbiased std sqrt(0.5); a's tokens after the reward lose 1 / std."""
    std = math.sqrt(0.5)
    adv, per_token = turn_credit_advantages("grpo", [0.0, 0.0], [0, 0], [[(1, 1.0)], []], [4, 3])
    hi, lo = 0.5 / (std + EPS), -0.5 / (std + EPS)
    assert adv.tolist() == pytest.approx([hi, lo])
    assert per_token[0].tolist() == pytest.approx([hi, hi, hi - 1 / (std + EPS), hi - 1 / (std + EPS)])
    assert per_token[0][2].item() == pytest.approx(lo)  # after its reward, a is no better than b
    assert per_token[1].tolist() == pytest.approx([lo] * 3)


def test_rloo_and_drgrpo_turn_credit_hand_values():
    """Totals: a = 1 + 1 (turn reward after token 0) = 2, b = 0, c = 1.
    RLOO: a's leave-one-out baseline is mean(0, 1) = 0.5 -> 1.5 before the reward, 0.5 after."""
    placed = [[(0, 1.0)], [], []]
    adv, per_token = turn_credit_advantages("rloo", [1.0, 0.0, 1.0], [0, 0, 0], placed, [3, 2, 2])
    assert adv.tolist() == pytest.approx([1.5, -1.5, 0.0])
    assert per_token[0].tolist() == pytest.approx([1.5, 0.5, 0.5])
    assert per_token[1].tolist() == pytest.approx([-1.5, -1.5]) and per_token[2].tolist() == pytest.approx([0, 0])
    # Dr. GRPO: G - mean_g G with mean 1
    _, per_token = turn_credit_advantages("drgrpo", [1.0, 0.0, 1.0], [0, 0, 0], placed, [3, 2, 2])
    assert per_token[0].tolist() == pytest.approx([1.0, 0.0, 0.0]) and per_token[1].tolist() == pytest.approx([-1, -1])


def test_huge_finite_rewards_give_the_same_normalized_credit_and_never_overflow():
    """env.reward.max_abs may be any finite number: rewards near 1e300 (and turn rewards beside them, whose sums
    and squares overflow float64 in the plain formula) give exactly the credit of the same rewards scaled down,
    for the std-normalized estimators; the others' advantages cannot be float32 and are refused, naming the
    bound to set, never returned as inf or NaN."""
    placed = [[(1, 1.0)], [], [(0, -0.5)], []]
    finals = [0.0, 1.0, 0.25, -1.0]
    for est in ("grpo", "reinforce_pp"):
        small_adv, small_tok = turn_credit_advantages(est, finals, [0, 0, 0, 0], placed, [3, 2, 2, 3])
        big = [[(p, x * 1e300) for p, x in pl] for pl in placed]
        adv, tok = turn_credit_advantages(est, [x * 1e300 for x in finals], [0, 0, 0, 0], big, [3, 2, 2, 3])
        assert torch.isfinite(adv).all() and all(torch.isfinite(t).all() for t in tok)
        assert adv.tolist() == pytest.approx(small_adv.tolist(), rel=1e-5)
        assert [t.tolist() for t in tok] == [pytest.approx(t.tolist(), rel=1e-5, abs=1e-6) for t in small_tok]
    with pytest.raises(ValueError, match=r"do not fit float32.*env.reward.max_abs"):
        turn_credit_advantages("drgrpo", [1.7e308, -1.7e308], [0, 0], [[(0, 1.7e308)], []], [2, 2])
    with pytest.raises(ValueError, match="turn rewards must be finite"):
        turn_credit_advantages("grpo", [0.0, 1.0], [0, 0], [[(0, float("inf"))], []], [2, 2])


def test_a_group_with_equal_totals_carries_no_signal_however_its_rewards_were_placed():
    # both total 1: one from a turn reward, one from the final reward
    adv, per_token = turn_credit_advantages("grpo", [0.0, 1.0], ["g", "g"], [[(0, 1.0)], []], [3, 3])
    assert adv.tolist() == [0.0, 0.0] and [t.tolist() for t in per_token] == [[0.0] * 3, [0.0] * 3]


def test_turn_credit_is_refused_for_an_estimator_without_a_per_token_form():
    with pytest.raises(ConfigError, match="algorithm.turn_credit"):
        AlgorithmConfig(turn_credit=True, adv_estimator="my_plugin")
    with pytest.raises(ValueError, match="needs adv_estimator in"):
        turn_credit_advantages("my_plugin", [1.0], [0], [[]], [1])


def _traj(**kw) -> Trajectory:
    base = dict(uid="u", group_id="g", prompt_ids=[1, 2], response_ids=[3, 4, 5, 6], loss_mask=[1, 1, 0, 1],
                behavior_logprobs=[-0.1, -0.2, 0.0, -0.3], versions=[0, 0, -1, 0], reward=1.0)
    base.update(kw)
    return make_trajectory(**base)


def test_reward_positions_are_checked_and_survive_the_wire():
    t = _traj(turn_rewards=[0.5], turn_reward_positions=[1], tool_rewards=[0.25, 1.0],
              tool_reward_positions=[-1, 3]).validate()
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(t), type=Trajectory).validate()
    assert (back.turn_reward_positions, back.tool_rewards, back.tool_reward_positions) == ([1], [0.25, 1.0], [-1, 3])
    with pytest.raises(SchemaError, match="turn_reward_positions has 2 entries, turn_rewards has 1"):
        _traj(turn_rewards=[0.5], turn_reward_positions=[0, 1]).validate()
    with pytest.raises(SchemaError, match=r"tool_reward_positions\[0\]=2 is not the index of a generated token"):
        _traj(tool_rewards=[1.0], tool_reward_positions=[2]).validate()  # token 2 was inserted (a tool reply)
    with pytest.raises(SchemaError, match=r"tool_reward_positions\[0\]=99"):
        _traj(tool_rewards=[1.0], tool_reward_positions=[99]).validate()
    with pytest.raises(NonFiniteRewardError, match=r"tool_rewards\[1\] is nan"):
        _traj(tool_rewards=[0.0, float("nan")]).validate()


@pytest.mark.timeout(120)
def test_turn_credit_trains_the_real_model_with_per_token_advantages(tiny_model_dir):
    """One train_step with turn_credit on: the advantage of the tokens before a placed reward differs from
    the tokens after it, and the step runs (forward, backward, optimizer) on the real tiny model."""
    from asyncrl.data.schema import Batch, Group
    from asyncrl.learner.worker import LearnerWorker, placed_rewards
    from tests.learner.helpers import make_batch, make_cfg

    batch = make_batch(seed=4, groups=2, per_group=2)
    groups = []
    for g in batch.groups:
        trajs = []
        for k, t in enumerate(g.trajectories):
            mask = t.loss_mask.numpy()
            first = int(mask.nonzero()[0][0])
            trajs.append(msgspec.structs.replace(t, reward=0.0, tool_rewards=[float(k)], tool_reward_positions=[first]))
        groups.append(Group(group_id=g.group_id, trajectories=trajs, expected=len(trajs)))
    batch = Batch(batch_id=batch.batch_id, groups=groups)
    assert placed_rewards(groups[0].trajectories[1]) == [(int(groups[0].trajectories[1].loss_mask.numpy().nonzero()[0][0]), 1.0)]
    worker = LearnerWorker(make_cfg(tiny_model_dir, turn_credit=True))
    m = worker.train_step(batch)
    assert m["learner/grad_norm"] > 0 and m["learner/version"] == 1
    assert m["learner/adv_max"] > 0 > m["learner/adv_min"]
