"""KL estimators, straight-through variants, controllers and KL-in-reward, checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trajflow.stages.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    kl_penalty,
    make_kl_controller,
)

LN2 = math.log(2.0)

# logprob, ref_logprob: (log 0.5, log 0.25) gives log-ratio +ln 2; (log 0.25, log 0.5) gives -ln 2
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
REF = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)

# k3 = exp(d) - d - 1 with d = ref - logp: d = -ln2 -> 0.5 + ln2 - 1; d = +ln2 -> 2 - ln2 - 1
BY_HAND = {
    "k1": [LN2, -LN2],
    "abs": [LN2, LN2],
    "k2": [0.5 * LN2**2, 0.5 * LN2**2],
    "k3": [0.5 + LN2 - 1.0, 2.0 - LN2 - 1.0],
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


@pytest.mark.parametrize("name", list(BY_HAND) + list(ALIASES))
def test_estimators_by_hand(name):
    expected = torch.tensor([BY_HAND[ALIASES.get(name, name)]], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(LOGP, REF, name), expected, rtol=0, atol=1e-12)
    # the straight-through variant has the same value
    torch.testing.assert_close(kl_penalty(LOGP, REF, name + "+"), expected, rtol=0, atol=1e-12)


def test_literal_values():
    assert kl_penalty(LOGP, REF, "k3")[0, 0].item() == pytest.approx(0.1931471805599454, abs=1e-12)
    assert kl_penalty(LOGP, REF, "k3")[0, 1].item() == pytest.approx(0.3068528194400546, abs=1e-12)
    assert kl_penalty(LOGP, REF, "k2")[0, 0].item() == pytest.approx(0.2402265069591007, abs=1e-12)


def test_identical_distributions_give_zero():
    x = torch.randn(3, 4)
    for name in ("k1", "abs", "k2", "k3"):
        assert torch.equal(kl_penalty(x, x.clone(), name), torch.zeros(3, 4)), name


@pytest.mark.parametrize("gap", [15.0, 25.0, -30.0])
def test_k3_clamp_has_zero_gradient(gap):
    # d = ref - logp = 15: exp(15) - 16 >> 10 -> value clamped to 10, gradient 0
    # d = 25 also hits the [-20, 20] clamp on d; d = -30: exp(-20) + 20 - 1 > 10 -> clamped too
    logp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 1), gap, dtype=torch.float64)
    value = kl_penalty(logp, ref, "k3")
    assert value.item() == 10.0
    value.sum().backward()
    assert logp.grad.item() == 0.0


def test_k3_gradient_inside_the_clamp():
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = -exp(ref - logp) + 1
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    kl_penalty(logp, ref, "k3").sum().backward()
    assert logp.grad.item() == pytest.approx(1.0 - 0.5, abs=1e-12)


@pytest.mark.parametrize("name", ["k1+", "k3+", "abs+", "low_var_kl+", "kl+"])
def test_straight_through_has_k2_gradient(name):
    # grad of k2 = 0.5 (logp - ref)^2 w.r.t. logp is (logp - ref) = [+ln2, -ln2]
    logp = LOGP.clone().requires_grad_(True)
    out = kl_penalty(logp, REF, name)
    out.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[LN2, -LN2]], dtype=torch.float64), rtol=0, atol=1e-12)
    # while the plain estimator's gradient differs (k1: 1 everywhere)
    if name in ("k1+", "kl+"):
        plain = LOGP.clone().requires_grad_(True)
        kl_penalty(plain, REF, "k1").sum().backward()
        assert torch.equal(plain.grad, torch.ones(1, 2, dtype=torch.float64))


def test_unknown_kl_type_lists_names():
    with pytest.raises(ValueError) as err:
        kl_penalty(LOGP, REF, "k4")
    msg = str(err.value)
    assert "KL estimator" in msg and "'k4'" in msg and str(KL_ESTIMATORS.names()) in msg
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(LOGP, REF[:, :1], "k1")


# ---------------------------------------------------------------------------------------------
# controllers
# ---------------------------------------------------------------------------------------------


def test_fixed_controller():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=100.0, n_steps=64)
    assert ctrl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_by_hand():
    # Ziegler et al. eq. 2: e = clip(KL/target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)  # e = 0.5 -> clipped 0.2; mult 1.00512
    assert ctrl.value == pytest.approx(0.100512, rel=1e-12)
    ctrl.update(current_kl=3.0, n_steps=256)  # e = -0.5 -> -0.2; mult 0.99488
    assert ctrl.value == pytest.approx(0.09999737856, rel=1e-12)
    ctrl.update(current_kl=6.6, n_steps=1000)  # e = 0.1 (inside the clip); mult 1.01
    assert ctrl.value == pytest.approx(0.1009973523456, rel=1e-12)
    ctrl.update(current_kl=6.0, n_steps=1000)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.1009973523456, rel=1e-12)

    restored = AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=1)
    restored.load_state_dict(ctrl.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (ctrl.value, 6.0, 10000.0)


def test_make_kl_controller_and_errors():
    assert isinstance(make_kl_controller("fixed", 0.01, None, None), FixedKLController)
    adaptive = make_kl_controller("adaptive", 0.01, 6.0, 10000)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.01
    with pytest.raises(ValueError, match="kl_ctrl.type 'adaptve'"):
        make_kl_controller("adaptve", 0.01, 6.0, 10000)
    with pytest.raises(ValueError, match="kl_ctrl.horizon"):
        make_kl_controller("adaptive", 0.01, 6.0, 0)
    with pytest.raises(ValueError, match="kl_ctrl.target_kl"):
        make_kl_controller("adaptive", 0.01, None, 10)
    with pytest.raises(ValueError, match="'value'"):
        FixedKLController(0.1).load_state_dict({"coef": 1})


# ---------------------------------------------------------------------------------------------
# KL in reward
# ---------------------------------------------------------------------------------------------


def test_apply_kl_penalty_to_rewards_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # k1 per token = logprob - ref
    ref = torch.zeros(2, 3)
    logprob = torch.tensor([[0.2, -0.4, 0.6], [0.1, 0.3, 9.0]])
    rewards, mean_kl = apply_kl_penalty_to_rewards(scores, logprob, ref, mask, kl_coef=0.5, kl_type="k1")
    expected = torch.tensor([[-0.1, 0.2, 0.7], [-0.05, 1.85, 0.0]])
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-6)
    # row token-means: (0.2 - 0.4 + 0.6) / 3 = 0.13333, (0.1 + 0.3) / 2 = 0.2 -> mean 0.166667
    assert mean_kl == pytest.approx((0.4 / 3 + 0.2) / 2, abs=1e-6)
    assert not rewards.requires_grad


def test_apply_kl_penalty_ignores_garbage_and_empty_rows():
    scores = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[True, False], [False, False]])
    logprob = torch.tensor([[-1.0, float("nan")], [float("inf"), 0.0]])
    ref = torch.tensor([[-1.0, 0.0], [0.0, 0.0]])
    rewards, mean_kl = apply_kl_penalty_to_rewards(scores, logprob, ref, mask, kl_coef=0.1, kl_type="k3")
    assert torch.equal(rewards, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert mean_kl == 0.0
