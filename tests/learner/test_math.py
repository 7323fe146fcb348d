"""The learner's pure functions against hand-computed values (asyncrl.learner public API)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.engine.sampling import token_logprobs
from asyncrl.learner import (
    aggregate,
    compute_advantages,
    grpo_advantages,
    importance_weights,
    kl_penalty,
    logprobs_and_entropy,
    policy_loss,
    ppo_clip_terms,
    reinforce_pp_advantages,
    rloo_advantages,
)

L = math.log


def close(t, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(t, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                          atol=tol, rtol=0), (t, expected)


# ----------------------------------------------------------------------------- advantages

def test_grpo_hand_values_mixed_group_sizes():
    # group a: [1,0,0,0] mean .25, unbiased std .5 -> [1.5,-.5,-.5,-.5]; group b has one member; group c all equal
    r = [1, 0, 0, 0, 2.0, 3, 3]
    g = ["a", "a", "a", "a", "b", "c", "c"]
    close(grpo_advantages(r, g), [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, 0, 0, 0])
    close(grpo_advantages(r, g, norm_by_std=False), [0.75, -0.25, -0.25, -0.25, 0, 0, 0])
    close(compute_advantages("drgrpo", r, g), [0.75, -0.25, -0.25, -0.25, 0, 0, 0])


def test_all_equal_rewards_give_exact_zero_not_rounding_residue():
    r = [0.1, 0.1, 0.1, 0.7, 0.7]  # mean of three 0.1s is not exactly 0.1 in floating point
    g = [0, 0, 0, 1, 1]
    for fn in (lambda: grpo_advantages(r, g), lambda: rloo_advantages(r, g), lambda: reinforce_pp_advantages([0.1] * 3)):
        a = fn()
        assert torch.isfinite(a).all()
    assert torch.equal(grpo_advantages(r, g), torch.zeros(5))
    assert torch.equal(rloo_advantages(r, g), torch.zeros(5))
    assert torch.equal(reinforce_pp_advantages([0.1] * 3), torch.zeros(3))
    assert torch.equal(grpo_advantages([5.0], [0]), torch.zeros(1))
    assert torch.equal(rloo_advantages([5.0], [0]), torch.zeros(1))


def test_rloo_hand_values():
    # [1,0,0,0]: 1 - 0, 0 - 1/3 ; [2,4]: 2-4, 4-2 ; group of one: 0
    close(rloo_advantages([1, 0, 0, 0, 2, 4, 9], torch.tensor([0, 0, 0, 0, 1, 1, 2])),
          [1, -1 / 3, -1 / 3, -1 / 3, -2, 2, 0])


def test_reinforce_pp_hand_values():
    s = math.sqrt(5 / 3)  # unbiased std of [0,1,2,3]
    close(reinforce_pp_advantages([0, 1, 2, 3]), [(x - 1.5) / (s + 1e-6) for x in (0, 1, 2, 3)])
    # baseline variant: group means removed first: [.5,-.5,0,0], unbiased std sqrt(1/6)
    s2 = math.sqrt(1 / 6)
    close(reinforce_pp_advantages([1, 0, 5, 5], [0, 0, 1, 1], group_baseline=True),
          [0.5 / (s2 + 1e-6), -0.5 / (s2 + 1e-6), 0, 0])


def test_advantage_input_errors_name_the_problem():
    with pytest.raises(ValueError, match="group_ids has 2 entries, rewards has 3"):
        grpo_advantages([1, 2, 3], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages([1, float("nan")], [0, 0])
    with pytest.raises(ValueError, match="'ppo'"):
        compute_advantages("ppo", [1], [0])


def test_any_finite_rewards_give_finite_advantages_or_a_refusal_naming_the_bound():
    """Rewards of 1.7e308 are finite, but their squares (a group's std) are not: GRPO gave NaN. The
    std-normalized estimators are scale-free, so they now equal the same rewards scaled down; the others
    (whose advantages are rewards' differences) refuse rewards float32 cannot hold, naming the bound."""
    huge = [1.7e308, 1.7e308, 0.0, -1.7e308, 1.0]
    g = [0, 0, 0, 1, 1]
    small = [x / 1.7e308 for x in huge]
    close(grpo_advantages(huge, g), grpo_advantages(small, g).tolist())  # up to eps's share of the std
    close(grpo_advantages(huge, g), [0.57735, 0.57735, -1.1547, -0.70711, 0.70711])
    close(reinforce_pp_advantages(huge, g), reinforce_pp_advantages(small, g).tolist())
    close(reinforce_pp_advantages(huge, g, group_baseline=True),
          reinforce_pp_advantages(small, g, group_baseline=True).tolist())
    for estimator in ("drgrpo", "rloo"):
        with pytest.raises(ValueError, match=rf"{estimator} advantages of rewards up to 1.7e\+308 do not fit "
                                             r"float32; bound the rewards at their source \(env.reward.max_abs\)"):
            compute_advantages(estimator, huge, g)
    # at the default bound (1e6) every estimator's advantages are finite
    for estimator in ("grpo", "drgrpo", "rloo", "reinforce_pp"):
        assert torch.isfinite(compute_advantages(estimator, [1e6, -1e6, 0.0, 1e6], [0, 0, 0, 0])).all()


def test_ordinary_rewards_give_exactly_the_plain_formula():
    """Below 1e150 the estimators do not rescale: the results are bit for bit the textbook formulas."""
    torch.manual_seed(0)
    r = (torch.randn(12, dtype=torch.float64) * 1e3)
    g = torch.arange(12) // 4
    mean = torch.stack([r[g == k].mean() for k in range(3)])[g]
    std = torch.stack([r[g == k].std() for k in range(3)])[g]
    assert torch.equal(grpo_advantages(r, g), ((r - mean) / (std + 1e-6)).float())
    assert torch.equal(rloo_advantages(r, g), (4 / 3 * (r - mean)).float())


# ----------------------------------------------------------------------------- importance weights

PROX = torch.tensor([[L(0.5), L(0.2), L(0.9)], [L(0.4), L(0.3), L(0.3)]])
BEHAV = torch.tensor([[L(0.25), L(0.4), L(0.1)], [L(0.1), L(0.3), -float("inf")]])  # ratios 2, .5, (9) / 4, 1, (masked)
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.float32)


def test_token_level_weights_truncation_and_diagnostics():
    w, keep, d = importance_weights(PROX, BEHAV, MASK, level="token", threshold=3.0)
    close(w, [[2, 0.5, 0], [3, 1, 0]])
    close(keep, [[1, 1, 0], [1, 1, 0]])
    r = [2, 0.5, 4, 1]
    wt = [2, 0.5, 3, 1]
    assert d["is_mean"] == pytest.approx(sum(wt) / 4)
    assert d["is_max"] == pytest.approx(4)
    assert d["is_ess"] == pytest.approx(sum(wt) ** 2 / (4 * sum(x * x for x in wt)))  # 42.25 / 57
    assert d["is_frac_truncated"] == pytest.approx(0.25)
    assert d["is_frac_rejected"] == 0
    assert d["is_kl_k1"] == pytest.approx(sum(-L(x) for x in r) / 4)
    assert d["is_kl_k3"] == pytest.approx(sum(x - 1 - L(x) for x in r) / 4)


def test_mismatch_by_staleness_splits_k3_and_the_weight_spread_by_level():
    from asyncrl.learner.importance import mismatch_by_staleness

    # ratios 2, .5 at staleness 0; 4 at staleness 1; 1 at staleness 3, counted in the last level (2);
    # the masked third column (and its -inf behaviour logprob) counts nowhere
    stale = torch.tensor([[0, 0, 1], [1, 3, 0]])
    d = mismatch_by_staleness(PROX, BEHAV, MASK, stale, max_level=2)
    assert set(d) == {f"mismatch_s{s}_{k}" for s in (0, 1, 2) for k in ("kl_k3", "is_std", "token_frac")}
    assert d["mismatch_s0_kl_k3"] == pytest.approx(((2 - 1 - L(2)) + (0.5 - 1 - L(0.5))) / 2)
    assert d["mismatch_s0_is_std"] == pytest.approx(0.75)  # population std of (2, .5)
    assert d["mismatch_s1_kl_k3"] == pytest.approx(4 - 1 - L(4)) and d["mismatch_s1_is_std"] == 0
    assert d["mismatch_s2_kl_k3"] == pytest.approx(0, abs=1e-12)
    assert [d[f"mismatch_s{s}_token_frac"] for s in (0, 1, 2)] == [0.5, 0.25, 0.25]
    # a level without tokens is left out; nothing masked in: nothing at all
    assert "mismatch_s1_kl_k3" not in mismatch_by_staleness(PROX, BEHAV, MASK, torch.zeros(2, 3, dtype=torch.long), 1)
    assert mismatch_by_staleness(PROX, BEHAV, torch.zeros(2, 3), stale, 2) == {}
    with pytest.raises(ValueError, match="max_level must be >= 0, got -1"):
        mismatch_by_staleness(PROX, BEHAV, MASK, stale, -1)


def test_token_level_rejection_bounds():
    w, keep, d = importance_weights(PROX, BEHAV, MASK, threshold=3.0, reject_low=0.6, reject_high=3.5)
    close(keep, [[1, 0, 0], [0, 1, 0]])  # ratio .5 below, ratio 4 above
    assert d["is_frac_rejected"] == pytest.approx(0.5)


def test_sequence_level_sum_and_mean():
    # row 0: log w = ln2 + ln.5 = 0 -> 1 ; row 1: ln4 + 0 -> 4, truncated at 3 (sum) ; mean: ln4 / 2 -> 2
    w, keep, d = importance_weights(PROX, BEHAV, MASK, level="sequence", threshold=3.0, seq_mode="sum")
    close(w, [[1, 1, 0], [3, 3, 0]])
    assert d["is_max"] == pytest.approx(4) and d["is_frac_truncated"] == pytest.approx(0.5)
    assert d["is_ess"] == pytest.approx(16 / (2 * 10))
    w, keep, d = importance_weights(PROX, BEHAV, MASK, level="sequence", threshold=3.0, seq_mode="mean")
    close(w, [[1, 1, 0], [2, 2, 0]])
    w, keep, d = importance_weights(PROX, BEHAV, MASK, level="sequence", threshold=3.0, reject_high=3.0)
    close(keep, [[1, 1, 0], [0, 0, 0]])  # the whole second sequence is rejected
    assert d["is_frac_rejected"] == pytest.approx(0.5)


def test_extreme_ratios_stay_finite():
    prox = torch.tensor([[0.0, -300.0, 0.0]])
    behav = torch.tensor([[-300.0, 0.0, float("nan")]])  # NaN on a masked position must not leak
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for level in ("token", "sequence"):
        w, keep, d = importance_weights(prox, behav, mask, level=level, threshold=2.0)
        assert torch.isfinite(w).all() and all(math.isfinite(v) for v in d.values()), (level, w, d)
    w, _, d = importance_weights(prox, behav, mask, threshold=2.0)
    assert w[0, 0] == 2.0 and 0 < w[0, 1] < 1e-30 and w[0, 2] == 0
    assert d["is_frac_truncated"] == 0.5


def test_proximal_equal_to_behavior_gives_weights_of_exactly_one():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g) * 4
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    for level in ("token", "sequence"):
        w, keep, d = importance_weights(lp, lp.clone(), mask, level=level, threshold=1.5)
        assert torch.equal(w, mask) and torch.equal(keep, mask)
        assert d["is_mean"] == 1 and d["is_ess"] == 1 and d["is_kl_k1"] == 0 and d["is_kl_k3"] == 0


# ----------------------------------------------------------------------------- losses

def test_aggregation_modes_hand_values_and_masked_nan():
    v = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(v, m, "token_mean").item() == pytest.approx(7 / 3)
    assert aggregate(v, m, "seq_mean_token_mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(v, m, "seq_sum_norm", max_response_tokens=4).item() == pytest.approx(7 / 8)
    # split in two micro-batches with the whole minibatch's normalizers: the parts sum to the whole
    for mode in ("token_mean", "seq_mean_token_mean", "seq_sum_norm"):
        kw = dict(num_tokens=3, num_seqs=2, max_response_tokens=4)
        parts = aggregate(v[:1], m[:1], mode, **kw) + aggregate(v[1:], m[1:], mode, **kw)
        assert parts.item() == pytest.approx(aggregate(v, m, mode, max_response_tokens=4).item())
    with pytest.raises(ValueError, match="max_response_tokens"):
        aggregate(v, m, "seq_sum_norm")
    with pytest.raises(ValueError, match="'sum'"):
        aggregate(v, m, "sum")


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([L(0.5)]), torch.tensor([L(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(L(2))
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + L(2))  # x = -ln2: e^x - 1 - x
    assert kl_penalty(ref, ref, "k3").item() == 0


def test_ppo_clip_asymmetric_bounds_hand_values():
    logp = torch.tensor([L(1.5), L(0.5), L(0.5), L(1.5), L(1.1)])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    loss, r, clipped = ppo_clip_terms(logp, torch.zeros(5), adv, clip_low=0.2, clip_high=0.28)
    # A>0,r=1.5: max(-1.5,-1.28) ; A<0,r=.5: max(.5,.8) ; A>0,r=.5: max(-.5,-.8) ; A<0,r=1.5: max(1.5,1.28) ; inside
    close(loss, [-1.28, 0.8, -0.5, 1.5, -2.2])
    assert clipped.tolist() == [True, True, False, False, False]


def test_extreme_policy_ratio_gives_finite_loss_and_grad():
    logp = torch.tensor([[100.0, -100.0]], requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert loss.item() == pytest.approx((math.exp(20) + 0.8) / 2, rel=1e-5)  # log ratio clamped at 20


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(3, 4, generator=g) * 3
    logp = behav + 0.3 * torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    return logp, behav, mask, adv


def test_proximal_equal_to_behavior_is_the_plain_ppo_loss():
    logp, behav, mask, adv = _case()
    for agg in ("token_mean", "seq_mean_token_mean", "seq_sum_norm"):
        kw = dict(agg=agg, max_response_tokens=6, clip_low=0.2, clip_high=0.28)
        a = logp.clone().requires_grad_()
        b = logp.clone().requires_grad_()
        la, _ = policy_loss(a, behav, adv, mask, prox_logp=behav.clone(), **kw)
        lb, _ = policy_loss(b, behav, adv, mask, prox_logp=None, **kw)
        la.backward()
        lb.backward()
        assert torch.equal(la, lb) and torch.equal(a.grad, b.grad), agg
    # and the plain PPO loss, token-mean, by hand
    r = torch.exp(logp - behav)
    tok = torch.maximum(-adv[:, None] * r, -adv[:, None] * r.clamp(0.8, 1.28))
    lb, _ = policy_loss(logp, behav, adv, mask)
    assert lb.item() == pytest.approx(float((tok * mask).sum() / mask.sum()), rel=1e-6)


@pytest.mark.parametrize("is_level", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
@pytest.mark.parametrize("extras", ["none", "kl_entropy", "reject_bounds"])
def test_decoupled_loss_always_applies_the_behavior_weight(is_level, agg, extras):
    """pi_theta == pi_prox (ratio 1, no clipping), A = 1, pi_prox / pi_behav = 2 on every token:
    every token's pg term is -w, w = 2 (token) or 2^n (sequence, sum mode), truncated at 3."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    behav = torch.full((2, 3), -2.0)
    prox = behav + L(2)
    logp = prox.clone().requires_grad_()
    kw = dict(agg=agg, max_response_tokens=3, is_level=is_level, is_threshold=3.0)
    if extras == "kl_entropy":
        kw.update(ref_logp=prox.clone(), kl_coef=0.5, entropy=torch.zeros(2, 3), entropy_coef=0.1)
    if extras == "reject_bounds":
        kw.update(is_reject_low=1e-3, is_reject_high=10.0)  # bounds that reject nothing here
    loss, m = policy_loss(logp, behav, torch.tensor([1.0, 1.0]), mask, prox_logp=prox, **kw)
    w = torch.tensor([[2.0, 2.0, 0], [2.0, 0, 0]]) if is_level == "token" else torch.tensor([[3.0, 3.0, 0], [2.0, 0, 0]])
    expected = aggregate(-w, mask, agg, max_response_tokens=3)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    coef = torch.autograd.functional.jacobian(lambda v: aggregate(v, mask, agg, max_response_tokens=3), -w)
    grad_expected = coef * -w  # d(-w * A * r)/d logp = -w at r = 1, A = 1, times the aggregation coefficient
    assert torch.allclose(logp.grad, grad_expected, atol=1e-6)
    assert m["is_mean"] > 1.9  # the diagnostics see the weight too


def test_rejected_tokens_drop_out_of_the_pg_term_but_not_the_normalizer():
    mask = torch.ones(1, 2)
    behav = torch.tensor([[-2.0, -2.0]])
    prox = torch.tensor([[-2.0, -2.0 + L(5)]])  # second token: ratio 5, rejected above 4
    loss, m = policy_loss(prox.clone(), behav, torch.tensor([1.0]), mask, prox_logp=prox, is_threshold=10.0,
                          is_reject_high=4.0)
    assert loss.item() == pytest.approx(-1.0 / 2)
    assert m["is_frac_rejected"] == 0.5


def test_kl_and_entropy_terms_enter_with_their_signs():
    logp = torch.tensor([[L(0.5), L(0.5)]])
    ref = torch.tensor([[L(0.25), L(0.25)]])
    ent = torch.tensor([[1.0, 3.0]])
    mask = torch.ones(1, 2)
    base, _ = policy_loss(logp, logp, torch.tensor([1.0]), mask)  # ratio 1: pg = -1
    loss, m = policy_loss(logp, logp, torch.tensor([1.0]), mask, ref_logp=ref, kl_coef=0.1, kl_estimator="k1",
                          entropy=ent, entropy_coef=0.01)
    assert base.item() == pytest.approx(-1.0)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * L(2) - 0.01 * 2.0)
    assert m["kl"] == pytest.approx(L(2)) and m["entropy"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, torch.tensor([1.0]), mask, kl_coef=0.1)


# ----------------------------------------------------------------------------- logprobs

def test_logprobs_match_the_engine_definition_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 7, 50, generator=g) * 3
    ids = torch.randint(0, 50, (4, 7), generator=g)
    for t in (0.0, 0.7, 1.0, 1.3):
        lp, ent = logprobs_and_entropy(logits, ids, t)
        assert torch.equal(lp, token_logprobs(logits, ids, t)), t
        assert lp.dtype == torch.float32 and ent.shape == (4, 7)


def test_logprob_and_entropy_hand_values():
    logits = torch.tensor([[0.0, L(3)]])  # p = [.25, .75]
    lp, ent = logprobs_and_entropy(logits, torch.tensor([1]), 1.0)
    assert lp.item() == pytest.approx(L(0.75))
    assert ent.item() == pytest.approx(-(0.25 * L(0.25) + 0.75 * L(0.75)))
    lp, ent = logprobs_and_entropy(torch.zeros(1, 8), torch.tensor([3]), 0.5)  # uniform at any T
    assert lp.item() == pytest.approx(-L(8)) and ent.item() == pytest.approx(L(8))
    lp2, _ = logprobs_and_entropy(torch.tensor([[0.0, L(3)]]), torch.tensor([1]), 2.0)  # logits / 2: p1 = sqrt3/(1+sqrt3)
    assert lp2.item() == pytest.approx(L(math.sqrt(3) / (1 + math.sqrt(3))))


def test_mismatch_kl_is_reported_without_a_proximal_forward():
    """decoupled=false: the loss still measures the engine/learner mismatch, against the policy it trains."""
    import torch

    from asyncrl.learner.losses import policy_loss

    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    behav = torch.log(torch.tensor([[0.25, 0.25, 0.1]]))
    mask = torch.tensor([[True, True, False]])  # the third token is not the policy's: left out
    _, m = policy_loss(logp, behav, torch.ones(1), mask)
    r = [2.0, 1.0]  # p_policy / p_behav on the two masked tokens
    assert m["is_kl_k1"] == pytest.approx(sum(-math.log(x) for x in r) / 2)
    assert m["is_kl_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 2)
