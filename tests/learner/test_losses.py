"""The registered policy losses and advantage estimators: hand-computed values and gradients, the
behavior weight applied to every loss, the off-policy guardrail, and user plugins trained by name.

Expected values are written out from each loss's formula with `math`, never computed by the
function under test."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import AlgorithmConfig, ConfigError
from asyncrl.learner.advantages import compute_advantages
from asyncrl.learner.losses import (
    LossInputs,
    PolicyTerms,
    check_off_policy_correction,
    policy_loss,
    resolve_loss,
)


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _run(name: str, logp_values, adv: float, *, old=None, **cfg):
    """Loss value and d loss / d logp for loss `name` on one sequence (token_mean, not decoupled)."""
    logp = torch.tensor([logp_values], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp) if old is None else torch.tensor([old], dtype=torch.float64)
    algo = AlgorithmConfig(loss=name, **cfg)
    fn = resolve_loss(name)
    loss, metrics = policy_loss(logp, old, torch.tensor([adv], dtype=torch.float64),
                                torch.ones_like(logp, dtype=torch.bool), loss_fn=lambda i: fn(i, algo))
    loss.backward()
    return float(loss.detach()), logp.grad[0].tolist(), metrics


def _verl_vanilla(old_logp, logp, adv, mask, clip_low, clip_high, clip_c):
    """verl 0.9.1 `compute_policy_loss_vanilla` (trainer/ppo/core_algos.py), transcribed: the per-token losses
    before aggregation, and its pg_clipfrac_lower (verl is not installable here: it needs tensordict)."""
    ratio = torch.exp(torch.clamp(logp - old_logp, min=-20.0, max=20.0))
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    lower = (torch.gt(clip_pg_losses1, pg_losses3) * (adv < 0).float() * mask).sum() / mask.sum()
    return torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1), float(lower)


def test_ppo_dual_clip_equals_verls_and_stops_the_gradient_of_far_off_negative_tokens():
    """algorithm.clip_ratio_c=3 (verl's default): the per-token loss equals verl's on seeded ratios from 0.05
    to 20 with advantages of both signs; a token with A < 0 and a ratio above 3 has no gradient; the
    plain clip (null); a value <= 1 or not finite is refused at load."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 40, generator=g, dtype=torch.float64)
    logp = (old + torch.empty(6, 40, dtype=torch.float64).uniform_(-3.0, 3.0, generator=g)).requires_grad_()
    adv = torch.randn(6, 1, generator=g, dtype=torch.float64).expand(6, 40)
    mask = torch.ones(6, 40, dtype=torch.bool)
    algo = AlgorithmConfig(clip_ratio_c=3.0)
    terms = resolve_loss("ppo")(LossInputs(logp, old, adv, mask), algo)
    want, lower = _verl_vanilla(old, logp.detach(), adv, mask.double(), algo.clip_low, algo.clip_high, 3.0)
    assert torch.allclose(terms.loss.detach(), want, atol=1e-12, rtol=0)
    far = (adv < 0) & (torch.exp(logp.detach() - old) > 3.0)
    assert far.any() and lower > 0
    assert terms.clipped[far].all()
    terms.loss.sum().backward()
    assert torch.all(logp.grad[far] == 0) and torch.any(logp.grad[~far] != 0)
    plain = resolve_loss("ppo")(LossInputs(logp, old, adv, mask), AlgorithmConfig(clip_ratio_c=None)).loss.detach()
    assert torch.all(plain[far] > want[far]) and torch.equal(plain[~far], want[~far])
    for bad in (0.0, 1.0, -3.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"algorithm.clip_ratio_c: must be null \(off\) or a finite number > 1"):
            AlgorithmConfig(clip_ratio_c=bad)


def test_the_sapo_preset_aggregates_as_sapos_objective():
    from asyncrl.config import load_config

    algo = load_config(["algorithm=sapo"]).algorithm
    assert (algo.loss, algo.loss_agg) == ("sapo", "seq_mean_token_mean")


def test_gspo_clips_the_whole_sequence_on_its_length_normalised_ratio():
    # in range: s = exp((0.1 + 0.1) / 2); loss = -A s; d/d logp_t = -A s / T (token_mean over T = 2)
    s = math.exp(0.1)
    loss, grad, m = _run("gspo", [0.1, 0.1], 1.0, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-s) and grad == pytest.approx([-s / 2, -s / 2])
    assert m["clip_frac"] == 0 and m["ratio_mean"] == pytest.approx(s)
    # s = exp((0.5 - 0.1) / 2) = exp(0.2) > 1.2: BOTH tokens are clipped (token-level PPO would clip only
    # the first, whose own ratio exp(0.5) is out of range, and keep the second, exp(-0.1))
    loss, grad, m = _run("gspo", [0.5, -0.1], 1.0, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-1.2) and grad == pytest.approx([0.0, 0.0])
    assert m["clip_frac"] == 1.0
    _, ppo_grad, ppo_m = _run("ppo", [0.5, -0.1], 1.0, clip_low=0.2, clip_high=0.2)
    assert ppo_grad == pytest.approx([0.0, -math.exp(-0.1) / 2]) and ppo_m["clip_frac"] == 0.5


def test_cispo_clips_the_weight_never_the_gradient():
    # r = (exp(0.5), exp(-0.1)); weights sg(clip(r, 0.8, 1.28)) = (1.28, exp(-0.1)); A = 2
    loss, grad, m = _run("cispo", [0.5, -0.1], 2.0, clip_low=0.2, clip_high=0.28)
    w1, w2 = 1.28, math.exp(-0.1)
    assert loss == pytest.approx((-2 * w1 * 0.5 - 2 * w2 * -0.1) / 2)
    # the clipped token still gets a gradient (PPO gives it 0): -A w / T
    assert grad == pytest.approx([-2 * w1 / 2, -2 * w2 / 2])
    assert m["clip_frac"] == 0.5


@pytest.mark.parametrize("adv,tau", [(1.0, 1.0), (-1.0, 1.05)])
def test_sapo_soft_gate_values_and_gradient(adv, tau):
    a = [0.0, 0.4]  # r = 1 (on-policy) and exp(0.4)
    loss, grad, m = _run("sapo", a, adv, sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    want = sum(-adv * 4 / tau * _sig(tau * (math.exp(x) - 1)) for x in a) / 2
    assert loss == pytest.approx(want)
    # d/dx of -A (4/tau) sig(tau (e^x - 1)) = -A * 4 g (1 - g) * e^x, g = sig(tau (e^x - 1)); / T
    want_grad = [-adv * 4 * _sig(tau * (math.exp(x) - 1)) * (1 - _sig(tau * (math.exp(x) - 1))) * math.exp(x) / 2
                 for x in a]
    assert grad == pytest.approx(want_grad)
    assert grad[0] == pytest.approx(-adv / 2)  # on-policy the gate's weight is exactly 1: the plain gradient
    assert abs(grad[1]) < abs(adv) * math.exp(0.4) / 2  # off-policy it is damped below the plain ratio's
    assert m["clip_frac"] == 0


def test_reinforce_is_the_plain_gradient_whatever_the_ratio():
    loss, grad, _ = _run("reinforce", [-0.5, -2.0], 3.0, old=[5.0, -9.0])
    assert loss == pytest.approx(-3 * (-0.5 - 2.0) / 2) and grad == pytest.approx([-1.5, -1.5])


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "sapo", "reinforce"])
def test_every_loss_gets_the_behavior_weight_when_decoupled(name):
    """prox = behav + log 1.5 on every token: w = 1.5 (below the threshold 2), so the decoupled loss and its
    gradient are 1.5 times those of the same loss anchored at prox without the weight."""
    algo = AlgorithmConfig(loss=name)
    fn = resolve_loss(name)
    behav = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    prox = behav + math.log(1.5)
    mask = torch.tensor([[True, True, False]])
    out = []
    for decoupled in (True, False):
        logp = (prox + torch.tensor([[0.05, -0.1, 0.3]], dtype=torch.float64)).requires_grad_(True)
        loss, m = policy_loss(logp, behav if decoupled else prox, torch.tensor([0.7], dtype=torch.float64), mask,
                              prox_logp=prox if decoupled else None, loss_fn=lambda i: fn(i, algo))
        loss.backward()
        out.append((float(loss.detach()), logp.grad.clone()))
    (ld, gd), (lp, gp) = out
    assert ld == pytest.approx(1.5 * lp) and torch.allclose(gd, 1.5 * gp)
    assert gd[0, 2] == 0  # a masked token gets nothing


def test_icepop_masking_without_truncation():
    """is_threshold=None keeps w untruncated; tokens whose w leaves [0.5, 5] drop out of the pg term."""
    behav = torch.zeros(1, 4, dtype=torch.float64)
    prox = torch.log(torch.tensor([[0.4, 1.0, 3.0, 6.0]], dtype=torch.float64))  # w = 0.4, 1, 3, 6
    logp = prox.clone().requires_grad_(True)
    loss, m = policy_loss(logp, behav, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 4, dtype=torch.bool),
                          prox_logp=prox, is_threshold=None, is_reject_low=0.5, is_reject_high=5.0)
    loss.backward()
    # ratio to prox is 1: per token -A * w, kept tokens 1 and 2 only, normalised by all 4 tokens
    assert float(loss) == pytest.approx(-(1.0 + 3.0) / 4)
    assert logp.grad[0].tolist() == pytest.approx([0.0, -1.0 / 4, -3.0 / 4, 0.0])
    assert m["is_frac_truncated"] == 0 and m["is_frac_rejected"] == 0.5 and m["is_max"] == pytest.approx(6.0)


def test_a_loss_returning_the_wrong_shape_is_named():
    def bad(inp: LossInputs) -> PolicyTerms:
        return PolicyTerms(inp.logp.sum(-1), inp.mask, inp.logp)

    with pytest.raises(ValueError, match=r"shape \(1,\).*expected \(1, 2\)"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool), loss_fn=bad)


# ----------------------------------------------------------------------------- the guardrail and the config


def test_stale_tokens_with_nothing_correcting_them_are_refused_unless_allowed():
    reinforce = resolve_loss("reinforce")
    msg = check_off_policy_correction(AlgorithmConfig(loss="reinforce", decoupled=False, max_staleness=2), reinforce)
    assert msg and "algorithm.max_staleness=2" in msg and "allow_uncorrected_off_policy" in msg
    for ok in (dict(max_staleness=0), dict(decoupled=True), dict(allow_uncorrected_off_policy=True)):
        cfg = AlgorithmConfig(**{"loss": "reinforce", "decoupled": False, "max_staleness": 2, **ok})
        assert check_off_policy_correction(cfg, reinforce) is None, ok
    # the ratio-based losses correct staleness against the behavior policy themselves
    for name in ("ppo", "gspo", "cispo", "sapo"):
        assert check_off_policy_correction(AlgorithmConfig(loss=name, decoupled=False), resolve_loss(name)) is None

    def undeclared(inp, cfg):  # a user loss that says nothing is taken as correcting nothing
        return PolicyTerms(-inp.advantages * inp.logp, inp.mask & False, inp.logp)

    assert check_off_policy_correction(AlgorithmConfig(loss="mine", decoupled=False), undeclared)


def test_preflight_names_an_unknown_loss_or_estimator_and_the_guardrail(tmp_path):
    from asyncrl.config import Config
    from asyncrl.run.preflight import check_names

    problems = check_names(Config(algorithm=AlgorithmConfig(loss="gspoo", adv_estimator="grpoo")))
    text = "\n".join(problems)
    assert "algorithm.loss: unknown loss 'gspoo' (did you mean 'gspo'?)" in text, text
    assert "algorithm.adv_estimator: unknown advantage 'grpoo' (did you mean 'grpo'?)" in text, text
    problems = check_names(Config(algorithm=AlgorithmConfig(loss="reinforce", decoupled=False)))
    assert any("corrects nothing for staleness" in p for p in problems), problems


@pytest.mark.parametrize("field,value,match", [
    ("is_threshold", float("nan"), "algorithm.is_threshold"),
    ("is_threshold", 0.0, "algorithm.is_threshold"),
    ("sapo_tau_neg", -1.0, "algorithm.sapo_tau_pos/sapo_tau_neg"),
    ("sapo_tau_pos", float("nan"), "algorithm.sapo_tau_pos/sapo_tau_neg"),
    ("is_reject_high", float("inf"), "algorithm.is_reject_high"),
    ("is_reject_low", -0.5, "algorithm.is_reject_low"),
])
def test_bad_loss_settings_are_refused_at_load(field, value, match):
    with pytest.raises(ConfigError, match=match):
        AlgorithmConfig(**{field: value})
    with pytest.raises(ConfigError, match="low must be below high"):
        AlgorithmConfig(is_reject_low=5.0, is_reject_high=0.5)
    assert AlgorithmConfig(is_threshold=None).is_threshold is None


# ----------------------------------------------------------------------------- advantage plugins


def test_a_user_advantage_estimator_is_called_by_name_and_its_answer_checked(plugin_registry):
    seen = {}

    @plugin_registry.register("advantage", "best_of_group")
    def best_of_group(rewards, group_ids, cfg):
        seen["dtypes"] = (rewards.dtype, group_ids.dtype)
        best = torch.zeros(int(group_ids.max()) + 1, dtype=torch.float64).scatter_reduce(
            0, group_ids, rewards, "amax", include_self=False)
        return (rewards == best[group_ids]).double()

    assert compute_advantages("best_of_group", [0.1, 0.9, 0.5, 0.2], [0, 0, 1, 1]).tolist() == [0, 1, 1, 0]
    assert seen["dtypes"] == (torch.float64, torch.long)

    plugin_registry.add("advantage", "short", lambda r, g, cfg: r[:1])
    with pytest.raises(ValueError, match="'short' returned 1 values for 2 trajectories"):
        compute_advantages("short", [1.0, 2.0], [0, 0])
    plugin_registry.add("advantage", "nan", lambda r, g, cfg: r * float("nan"))
    with pytest.raises(ValueError, match="'nan' returned non-finite"):
        compute_advantages("nan", [1.0, 2.0], [0, 0])
    with pytest.raises(ValueError, match="registered advantages: .*best_of_group.*grpo"):
        compute_advantages("nope", [1.0], [0])


# ----------------------------------------------------------------------------- a user loss, trained by name


@pytest.mark.timeout(120)
def test_a_registered_user_loss_trains_the_real_model_through_algorithm_loss(plugin_registry, tiny_model_dir):
    from asyncrl.learner.worker import LearnerWorker
    from tests.learner.helpers import make_batch, make_cfg

    calls = []

    @plugin_registry.register("loss", "scaled_ppo")
    def scaled_ppo(inp: LossInputs, cfg) -> PolicyTerms:
        calls.append(tuple(inp.logp.shape))
        r = torch.exp(inp.log_ratio)
        return PolicyTerms(-inp.advantages * r * 0.5, torch.zeros_like(inp.mask), r)

    scaled_ppo.corrects_off_policy = True
    worker = LearnerWorker(make_cfg(tiny_model_dir, loss="scaled_ppo"))
    before = {k: v.detach().clone() for k, v in worker.model.named_parameters()}
    m = worker.train_step(make_batch(seed=3))
    assert calls and all(len(s) == 2 for s in calls)
    assert m["learner/grad_norm"] > 0 and m["learner/version"] == 1
    assert any(not torch.equal(v, before[k]) for k, v in worker.model.named_parameters())

    with pytest.raises(ValueError, match="corrects nothing for staleness"):
        plugin_registry.add("loss", "undeclared", lambda inp, cfg: scaled_ppo(inp, cfg))
        LearnerWorker(make_cfg(tiny_model_dir, loss="undeclared", decoupled=False))
