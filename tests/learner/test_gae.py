"""GAE, the clipped value loss and the critic on the real tiny model. Expected values are worked out by
hand from the formulas in asyncrl/learner/gae.py (never through the function under test)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import ConfigError, CriticConfig
from asyncrl.learner.gae import gae, place_rewards, value_loss, whiten


def test_gae_multi_turn_with_inserted_tokens_and_a_turn_reward_hand_values():
    """Generated tokens 0, 1 | inserted 2, 3 (a tool reply) | generated 4, 5. A turn reward 0.5 at token 1
    (the end of turn 1), the final reward 1.0 at token 5; gamma 0.9, lambda 0.8 (gamma * lambda = 0.72).
      t5: delta = 1.0 - 0.4 = 0.6                      A = 0.6
      t4: delta = 0.9 * 0.4 - 0.3 = 0.06              A = 0.06 + 0.72 * 0.6 = 0.492
      t1: delta = 0.5 + 0.9 * 0.3 - 0.2 = 0.57        A = 0.57 + 0.72 * 0.492 = 0.92424
      t0: delta = 0.9 * 0.2 - 0.1 = 0.08              A = 0.08 + 0.72 * 0.92424 = 0.7454528
    returns = A + V; the inserted tokens get 0 and 0."""
    mask = torch.tensor([1, 1, 0, 0, 1, 1], dtype=torch.bool)
    values = torch.tensor([0.1, 0.2, 7.0, 7.0, 0.3, 0.4])  # values at inserted tokens are ignored
    rewards = place_rewards(6, mask, 1.0, [(1, 0.5)])
    assert rewards.tolist() == [0, 0.5, 0, 0, 0, 1.0]
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert adv.tolist() == pytest.approx([0.7454528, 0.92424, 0, 0, 0.492, 0.6], abs=1e-6)
    assert ret.tolist() == pytest.approx([0.8454528, 1.12424, 0, 0, 0.792, 1.0], abs=1e-6)


def test_gae_with_gamma_and_lambda_one_is_the_reward_to_go_minus_the_value():
    mask = torch.tensor([1, 0, 1, 1], dtype=torch.bool)
    rewards = place_rewards(4, mask, 2.0, [(0, 1.0), (-1, -0.5)])  # -1: at the last generated token
    assert rewards.tolist() == [1.0, 0, 0, 1.5]
    adv, ret = gae(rewards, torch.tensor([0.5, 0.0, 1.0, 1.0]), mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == pytest.approx([2.5 - 0.5, 0, 1.5 - 1.0, 1.5 - 1.0])
    assert ret.tolist() == pytest.approx([2.5, 0, 1.5, 1.5])


def test_rewards_placed_on_inserted_tokens_or_outside_are_refused():
    mask = torch.tensor([1, 0, 1], dtype=torch.bool)
    with pytest.raises(ValueError, match="position 1 is not a generated token"):
        place_rewards(3, mask, 1.0, [(1, 1.0)])
    with pytest.raises(ValueError, match="position 9"):
        place_rewards(3, mask, 1.0, [(9, 1.0)])
    assert place_rewards(2, torch.zeros(2, dtype=torch.bool), 1.0, []).tolist() == [0, 0]  # nothing generated
    with pytest.raises(ValueError, match="same 1-D shape"):
        gae(torch.zeros(3), torch.zeros(2), torch.ones(3, dtype=torch.bool), 1.0, 1.0)


def test_clipped_value_loss_hand_values_and_gradients():
    # token 0: v = old = 1, R = 2: both terms 1 -> 0.5; token 1: v = 3 (old 1, clipped to 1.5), R = 2:
    # (3-2)^2 = 1 > (1.5-2)^2 = 0.25 -> 0.5. Mean 0.5; gradient (v - R) / n from the unclipped terms.
    v = torch.tensor([[1.0, 3.0]], requires_grad=True)
    loss, m = value_loss(v, torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 2.0]]), torch.ones(1, 2, dtype=torch.bool), 0.5)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.5) and v.grad.tolist() == [[-0.5, 0.5]] and m["vf_clip_frac"] == 0
    # v = 1.8 moved 1.8 from old 0 -> clipped to 0.5: (0.5-2)^2 = 2.25 > (1.8-2)^2 = 0.04, the clipped term
    # wins and carries no gradient; a masked token (NaN) contributes nothing
    v = torch.tensor([[1.8, float("nan")]], requires_grad=True)
    loss, m = value_loss(v, torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 2.0]]), torch.tensor([[True, False]]), 0.5)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(1.125) and v.grad[0, 0].item() == 0 and m["vf_clip_frac"] == 1.0


def test_whiten_over_all_masked_entries_together():
    a, b = torch.tensor([1.0, 99.0, 3.0]), torch.tensor([5.0])
    ma, mb = torch.tensor([True, False, True]), torch.tensor([True])
    wa, wb = whiten([a, b], [ma, mb])
    # masked values 1, 3, 5: mean 3, unbiased std 2
    assert wa.tolist() == pytest.approx([-1.0, 0.0, 0.0]) and wb.tolist() == pytest.approx([1.0])


@pytest.mark.parametrize("field,value", [("lr", 0.0), ("gamma", 1.5), ("lam", float("nan")),
                                         ("cliprange_value", float("inf")), ("warmup_steps", -1)])
def test_bad_critic_settings_are_refused_at_load(field, value):
    with pytest.raises(ConfigError, match=f"algorithm.critic.{field}"):
        CriticConfig(**{field: value})


# ----------------------------------------------------------------------------- the critic, real model


def _ppo_worker(model_dir, **critic):
    from asyncrl.learner.worker import LearnerWorker
    from tests.learner.helpers import make_cfg

    return LearnerWorker(make_cfg(model_dir, adv_estimator="gae", critic=CriticConfig(**critic)))


@pytest.mark.timeout(180)
def test_the_critic_lowers_its_value_loss_and_its_values_start_at_zero(tiny_model_dir):
    from tests.learner.helpers import make_batch

    worker = _ppo_worker(tiny_model_dir, lr=3e-3, lam=1.0)
    batch = make_batch(seed=9)
    losses = []
    for _ in range(6):
        m = worker.train_step(batch)
        losses.append(m["critic/value_loss"])
        if len(losses) == 1:  # the head starts at zero: every first value is 0, every return the reward
            assert m["critic/values_mean"] == 0.0
            assert m["critic/returns_mean"] == pytest.approx(
                sum(t.reward * int(t.loss_mask.numpy().sum()) for t in batch.trajectories())
                / sum(int(t.loss_mask.numpy().sum()) for t in batch.trajectories()), rel=1e-5)
    assert losses[-1] < 0.5 * losses[0], losses
    assert m["critic/version"] == 6 and m["learner/version"] == 6 and m["critic/explained_var"] > 0


@pytest.mark.timeout(180)
def test_critic_warmup_trains_only_the_critic_then_checkpoints_and_resumes_it(tiny_model_dir, tmp_path):
    from asyncrl.learner.checkpoint import CheckpointError
    from asyncrl.learner.worker import LearnerWorker
    from tests.learner.helpers import make_batch, make_cfg

    worker = _ppo_worker(tiny_model_dir, lr=1e-3, warmup_steps=1)
    policy = {k: v.detach().clone() for k, v in worker.model.named_parameters()}
    m = worker.train_step(make_batch(seed=2))
    assert m["critic/policy_updated"] == 0 and m["learner/version"] == 0 and m["critic/version"] == 1
    assert all(torch.equal(v, policy[k]) for k, v in worker.model.named_parameters())
    m = worker.train_step(make_batch(seed=2))
    assert m["critic/policy_updated"] == 1 and m["learner/version"] == 1
    worker.save_checkpoint(str(tmp_path / "ck"), {"step": 2})
    critic = {k: v.detach().clone() for k, v in worker.critic.model.named_parameters()}

    resumed = _ppo_worker(tiny_model_dir, lr=1e-3, warmup_steps=1)
    assert resumed.load_checkpoint(str(tmp_path / "ck")) == {"step": 2}
    assert resumed.critic.steps == 2
    for k, v in resumed.critic.model.named_parameters():
        assert torch.equal(v, critic[k]), k
    # the next step of the resumed critic equals the original's (optimizer state restored too)
    a, b = worker.train_step(make_batch(seed=5)), resumed.train_step(make_batch(seed=5))
    assert a["critic/value_loss"] == pytest.approx(b["critic/value_loss"], rel=1e-6)

    grpo = LearnerWorker(make_cfg(tiny_model_dir))
    grpo.save_checkpoint(str(tmp_path / "no_critic"), {})
    with pytest.raises(CheckpointError, match="holds no critic state"):
        _ppo_worker(tiny_model_dir).load_checkpoint(str(tmp_path / "no_critic"))


@pytest.mark.timeout(240)
def test_two_rank_critic_matches_one_rank(tiny_model_dir, tmp_path):
    from asyncrl.learner.distributed import spawn
    from tests.learner.rank_fns import critic_train_and_dump

    critic_train_and_dump(0, 1, str(tiny_model_dir), str(tmp_path))
    spawn(critic_train_and_dump, 2, str(tiny_model_dir), str(tmp_path))
    one, two = torch.load(tmp_path / "critic_w1.pt"), torch.load(tmp_path / "critic_w2.pt")
    for key in ("critic/value_loss", "critic/returns_mean", "learner/loss", "critic/grad_norm"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-4, abs=1e-7), key
    assert one["critic"].keys() == two["critic"].keys() and "value_head.weight" in one["critic"]
    for k, v in one["critic"].items():
        assert torch.allclose(two["critic"][k], v, rtol=0, atol=1e-5), (k, (two["critic"][k] - v).abs().max())
    assert not torch.equal(one["critic"]["value_head.weight"], torch.zeros_like(one["critic"]["value_head.weight"]))


def test_kl_estimators_hand_values():
    from asyncrl.learner.losses import kl_penalty

    logp, ref = torch.tensor([-1.0, -2.0, 0.0]), torch.tensor([-1.5, -1.0, -30.0])
    x = [-0.5, 1.0, -30.0]  # ref - logp (the last one clamped to -20 inside k3)
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0, 30.0])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5, 450.0])
    import math
    k3 = [math.exp(v) - 1 - v for v in (-0.5, 1.0, -20.0)]
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(k3)
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx(k3[:2] + [10.0])  # clamped at 10
    assert x  # (documenting the inputs)
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "k4")


def test_kl_in_reward_needs_gae_and_a_coefficient():
    from asyncrl.config import AlgorithmConfig

    with pytest.raises(ConfigError, match="algorithm.kl_in_reward"):
        AlgorithmConfig(kl_in_reward=True, kl_coef=0.1)  # grpo has no per-token rewards
    with pytest.raises(ConfigError, match="algorithm.kl_in_reward"):
        AlgorithmConfig(kl_in_reward=True, adv_estimator="gae")  # kl_coef 0
    assert AlgorithmConfig(kl_in_reward=True, adv_estimator="gae", kl_coef=0.1).kl_in_reward


@pytest.mark.timeout(180)
def test_kl_as_a_reward_penalty_enters_gae_not_the_loss(tiny_model_dir):
    from asyncrl.learner.worker import LearnerWorker
    from tests.learner.helpers import make_batch, make_cfg

    worker = LearnerWorker(make_cfg(tiny_model_dir, adv_estimator="gae", kl_coef=0.5, kl_in_reward=True,
                                    kl_estimator="k1", critic=CriticConfig(lr=1e-3, whiten_advantages=False)))
    first = worker.train_step(make_batch(seed=6))
    # step 1: the policy IS the reference: no penalty; the reference forward was timed
    assert first["learner/kl_reward"] == 0.0 and first["learner/ref_seconds"] > 0 and first["learner/kl"] == 0.0
    second = worker.train_step(make_batch(seed=6))
    assert second["learner/kl_reward"] != 0.0 and second["learner/kl"] == 0.0  # in the reward, not the loss


def test_the_kl_penalty_lowers_each_gae_return_by_the_penalty_to_go(tiny_model_dir):
    """gamma = lambda = 1: a return is the reward-to-go whatever the values, so a penalty of 0.1 per generated
    token at kl_coef 0.5 lowers token t's return by 0.05 x (generated tokens from t on)."""
    from asyncrl.learner.packing import SeqSpec
    from asyncrl.learner.worker import LearnerWorker
    from tests.learner.helpers import make_batch, make_cfg

    worker = LearnerWorker(make_cfg(tiny_model_dir, adv_estimator="gae", kl_coef=0.5, kl_in_reward=True,
                                    critic=CriticConfig(gamma=1.0, lam=1.0, whiten_advantages=False)))
    trajs = make_batch(seed=8).trajectories()
    masks = [torch.from_numpy(t.loss_mask.numpy().astype(bool)) for t in trajs]
    specs = [SeqSpec(torch.cat([torch.from_numpy(t.prompt_ids.numpy()), torch.from_numpy(t.response_ids.numpy())]).long(),
                     len(t.prompt_ids), m) for t, m in zip(trajs, masks)]
    local = list(range(len(trajs)))
    penalty = [torch.where(m, torch.full((m.numel(),), 0.1), torch.zeros(m.numel())) for m in masks]
    _, _, plain, _ = worker._gae(trajs, [t.reward for t in trajs], specs, masks, local, {}, None)
    _, _, penalised, _ = worker._gae(trajs, [t.reward for t in trajs], specs, masks, local, {}, penalty)
    for m, r0, r1 in zip(masks, plain, penalised):
        to_go = torch.flip(torch.cumsum(torch.flip(m.double(), [0]), 0), [0])  # generated tokens from t on
        want = torch.where(m, r0.double() - 0.05 * to_go, torch.zeros_like(to_go))
        assert torch.allclose(r1.double(), want, atol=1e-5)


def test_a_critic_on_its_own_ranks_gives_the_colocated_critics_step(tiny_model_dir):
    """placement=separate: values from a CriticWorker, the learner's GAE targets back to it for its update;
    the policy's step and the critic's update equal the colocated critic's on the same batch (warm-up too)."""
    from asyncrl.learner.critic import CriticWorker
    from asyncrl.learner.worker import LearnerWorker
    from tests.learner.helpers import make_batch, make_cfg

    def cfg(placement):
        return make_cfg(tiny_model_dir, adv_estimator="gae", critic=CriticConfig(lr=1e-3, placement=placement,
                                                                                  warmup_steps=1))

    colocated = LearnerWorker(cfg("colocated"))
    learner, critic = LearnerWorker(cfg("separate")), CriticWorker(cfg("separate"))
    assert learner.critic is None and learner.separate_critic
    with pytest.raises(ValueError, match="needs the critic's values"):
        learner.train_step(make_batch(seed=1))
    for seed in (1, 2):  # step 1: critic warm-up (the policy is not updated); step 2: both update
        batch = make_batch(seed=seed)
        want = colocated.train_step(batch)
        got = learner.train_step(batch, critic.values(batch), critic.steps)
        got.update(critic.update(batch, *learner.critic_targets))
        for k in ("learner/loss", "critic/values_mean", "critic/returns_mean", "critic/value_loss",
                  "critic/policy_updated", "critic/version"):
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (seed, k)
    assert learner.version == colocated.version == 1
    for (n, a), (_, b) in zip(colocated.model.named_parameters(), learner.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n
    for (n, a), (_, b) in zip(colocated.critic.model.named_parameters(), critic.critic.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n
