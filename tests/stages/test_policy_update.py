"""Policy/critic losses, aggregation modes and the actor objective, checked against values worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trajflow.stages.policy_losses import AGG_MODES, POLICY_LOSSES, PolicyLossConfig, agg_loss, compute_policy_loss
from trajflow.stages.policy_update import (
    ACTOR_LOSS_SHARES,
    ActorLossConfig,
    UpdateRows,
    actor_loss,
    entropy_from_logits,
    kl_loss,
    value_loss,
)


def logps_with_ratio(ratios, new_logp=None):
    """(old, new) log-probs whose ratio exp(new - old) is `ratios`; `new` carries the gradient."""
    ratios = torch.tensor(ratios, dtype=torch.float64)
    new = torch.full_like(ratios, math.log(0.5)) if new_logp is None else torch.tensor(new_logp, dtype=torch.float64)
    old = new - torch.log(ratios)
    return old, new.clone().requires_grad_(True)


# ---------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------

LOSS_2x3 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK_2x3 = torch.tensor([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, (1 + 2 + 4 + 5 + 6) / 5),  # 3.6
        ("seq-mean-token-sum", {}, ((1 + 2) + (4 + 5 + 6)) / 2),  # 9
        ("seq-mean-token-mean", {}, ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2),  # 3.25
        ("seq-mean-token-sum-norm", {}, ((1 + 2) / 3 + (4 + 5 + 6) / 3) / 2),  # 3
        ("seq-mean-token-sum-norm", {"horizon": 4}, ((1 + 2) / 4 + (4 + 5 + 6) / 4) / 2),  # 2.25
        ("token-mean", {"global_num_tokens": 10}, 18 / 10),
        ("seq-mean-token-mean", {"global_num_seqs": 4}, (1.5 + 5.0) / 4),
    ],
)
def test_agg_modes_by_hand(mode, kwargs, expected):
    out = agg_loss(LOSS_2x3, MASK_2x3, mode, **kwargs)
    assert out.dim() == 0
    assert out.item() == pytest.approx(expected, abs=1e-6)


def test_agg_ignores_garbage_outside_mask_and_handles_empty():
    loss = LOSS_2x3.clone()
    loss[0, 2] = float("nan")
    assert agg_loss(loss, MASK_2x3.bool(), "token-mean").item() == pytest.approx(3.6, abs=1e-6)
    for mode in AGG_MODES:
        out = agg_loss(loss, torch.zeros(2, 3), mode)
        assert out.item() == 0.0, mode
    with pytest.raises(ValueError, match="Unknown loss_agg_mode 'token_mean'"):
        agg_loss(LOSS_2x3, MASK_2x3, "token_mean")
    with pytest.raises(ValueError, match="global_num_tokens must be a number > 0"):
        agg_loss(LOSS_2x3, MASK_2x3, "token-mean", global_num_tokens=0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradient_accumulation_with_global_denominators_is_exact(mode):
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=gen) > 0.4
    mask[:, 0] = True
    mask[4] = False  # a row with no valid token counts as a sequence but adds nothing
    param = torch.ones(6, 5, dtype=torch.float64, requires_grad=True)

    full = agg_loss(loss * param, mask, mode)
    (full_grad,) = torch.autograd.grad(full, param)

    kwargs = {"global_num_tokens": float(mask.sum()), "global_num_seqs": 6.0, "horizon": 5}
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        total = total + agg_loss((loss * param)[rows], mask[rows], mode, **kwargs)
    (acc_grad,) = torch.autograd.grad(total, param)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(acc_grad, full_grad, rtol=1e-12, atol=1e-12)

    # without the global denominators, per-micro-batch means would not add up
    naive = sum(agg_loss(loss[r], mask[r], mode) for r in (slice(0, 2), slice(2, 3), slice(3, 6)))
    assert not torch.allclose(naive, full)


# ---------------------------------------------------------------------------------------------
# vanilla PPO
# ---------------------------------------------------------------------------------------------


def test_ppo_ratio_above_high_clip_with_positive_advantage_is_clipped():
    # ratio 1.5 > 1 + 0.2, A = +1: loss = -A * 1.2 and no gradient
    old, new = logps_with_ratio([[1.5]])
    loss, metrics = compute_policy_loss("vanilla", old, new, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1), PolicyLossConfig())
    assert loss.item() == pytest.approx(-1.2, abs=1e-12)
    loss.backward()
    assert new.grad.item() == 0.0
    assert metrics["actor/pg_clipfrac"] == 1.0 and metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(1.5), abs=1e-12)


def test_ppo_ratio_above_clip_with_negative_advantage_keeps_gradient():
    # ratio 1.5, A = -1: max(1.5, 1.2) = 1.5 (unclipped); d(-A * r)/dlogp = r = 1.5
    old, new = logps_with_ratio([[1.5]])
    loss, metrics = compute_policy_loss("vanilla", old, new, -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    assert loss.item() == pytest.approx(1.5, abs=1e-12)
    loss.backward()
    assert new.grad.item() == pytest.approx(1.5, abs=1e-12)
    assert metrics["actor/pg_clipfrac"] == 0.0


def test_ppo_ratio_below_low_clip_with_negative_advantage_is_clipped():
    # ratio 0.5, A = -1: max(0.5, 0.8) = 0.8, no gradient
    old, new = logps_with_ratio([[0.5]])
    loss, metrics = compute_policy_loss("vanilla", old, new, -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.8, abs=1e-12)
    loss.backward()
    assert new.grad.item() == 0.0
    assert metrics["actor/pg_clipfrac"] == 1.0


def test_dual_clip_caps_negative_advantage_loss_at_c_times_abs_a():
    # ratio 5, A = -2: PPO term max(10, 2.4) = 10; dual clip min(10, 3 * 2) = 6, no gradient
    old, new = logps_with_ratio([[5.0, 2.0]])
    adv = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("vanilla", old, new, adv, torch.ones(1, 2), PolicyLossConfig(clip_ratio_c=3.0))
    # token 2: ratio 2 -> max(4, 2.4) = 4 < 6, not dual-clipped; token-mean (6 + 4) / 2
    assert loss.item() == pytest.approx(5.0, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 2.0 * 2.0 / 2]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac_lower"] == 0.5
    # an astronomically large ratio is clamped at exp(20) and the loss stays c * |A|
    old, new = logps_with_ratio([[1.0]])
    old = old - 50.0
    loss, _ = compute_policy_loss("vanilla", old, new, -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    assert loss.item() == pytest.approx(3.0, abs=1e-12)


def test_asymmetric_clip_higher():
    # eps_low 0.2, eps_high 0.28: ratio 1.25 with A = +1 stays unclipped; ratio 0.75 with A = -1 is clipped at 0.8
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    old, new = logps_with_ratio([[1.25, 0.75]])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("vanilla", old, new, adv, torch.ones(1, 2), cfg, global_num_tokens=1.0)
    assert loss.item() == pytest.approx(-1.25 + 0.8, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.25, 0.0]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac"] == 0.5
    # the symmetric 0.2 clip would clip the 1.25 as well
    old, new = logps_with_ratio([[1.25]])
    loss_sym, _ = compute_policy_loss("vanilla", old, new, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    assert loss_sym.item() == pytest.approx(-1.2, abs=1e-12)
    # None falls back to clip_ratio
    cfg_fb = PolicyLossConfig(clip_ratio_low=None, clip_ratio_high=None, clip_ratio=0.3)
    assert (cfg_fb.low, cfg_fb.high) == (0.3, 0.3)


def test_ppo_masked_tokens_do_not_count():
    old, new = logps_with_ratio([[1.0, 1.0]])
    old = old.clone()
    old[0, 1] = float("nan")  # garbage after EOS
    adv = torch.tensor([[2.0, 100.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("vanilla", old, new, adv, torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(-2.0, abs=1e-12)
    assert math.isfinite(metrics["actor/ppo_kl"]) and metrics["actor/ppo_kl"] == 0.0


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "gpg"])
def test_on_policy_ratio_is_exactly_one_and_nothing_is_clipped(name):
    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 6, generator=gen) * 3
    adv = torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.2
    new = logp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(name, logp.clone(), new, adv, mask, PolicyLossConfig())
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == 0.0
    n = int(mask.sum())
    if name in ("vanilla", "gspo"):
        # ratio == 1 exactly: loss is -mean(A), gradient -A / n on valid tokens
        assert torch.equal(loss, agg_loss(-adv, mask, "token-mean"))
    else:
        # cispo (weight 1) and gpg: -A * log_prob
        assert torch.equal(loss, agg_loss(-adv * logp, mask, "token-mean"))
    loss.backward()
    expected_grad = torch.where(mask, -adv / n, torch.zeros(()))
    torch.testing.assert_close(new.grad, expected_grad, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# GSPO, CISPO, GPG
# ---------------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_by_hand():
    # row 0: A = +1, log-ratios [0.1, 0.3, (masked)] -> s = exp(0.2) = 1.2214 > 1.2 -> clipped: -1.2 per token
    # row 1: A = +0.5, log-ratios [0.05, -0.05, 0] -> s = exp(0) = 1 -> -0.5 per token
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2)
    new_v = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]], dtype=torch.float64)
    log_ratio = torch.tensor([[0.1, 0.3, 42.0], [0.05, -0.05, 0.0]], dtype=torch.float64)
    old = new_v - log_ratio
    new = new_v.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])

    loss, metrics = compute_policy_loss("gspo", old, new, adv, mask, cfg)
    assert loss.item() == pytest.approx((-1.2 * 2 - 0.5 * 3) / 5, abs=1e-12)  # token-mean: -0.78
    loss.backward()
    # clipped row: no gradient; row 1: d(-A * s_it)/dlogp_it = -A * s = -0.5, / 5 tokens
    torch.testing.assert_close(new.grad, torch.tensor([[0, 0, 0], [-0.1, -0.1, -0.1]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.1 + 0.3 + 0.05 - 0.05 + 0.0) / 5, abs=1e-12)

    # the paper's sequence-level aggregation
    cfg_seq = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="seq-mean-token-mean")
    loss_seq, _ = compute_policy_loss("gspo", old, new_v, adv, mask, cfg_seq)
    assert loss_seq.item() == pytest.approx((-1.2 - 0.5) / 2, abs=1e-12)


def test_gspo_uses_the_sequence_ratio_not_the_token_ratio():
    # one sequence, A = -1, log-ratios [+0.1, -0.1]: s = 1 so both tokens give loss 1 (token ratios would differ)
    cfg = PolicyLossConfig(clip_ratio_low=0.5, clip_ratio_high=0.5)
    new = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    old = new - torch.tensor([[0.1, -0.1]], dtype=torch.float64)
    loss, _ = compute_policy_loss("gspo", old, new, -torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2), cfg)
    assert loss.item() == pytest.approx(1.0, abs=1e-12)
    # default GSPO clip range is tiny (3e-4 / 4e-4): s = exp(0.001) is already clipped for A > 0
    old2 = new - 0.001
    loss2, m2 = compute_policy_loss("gspo", old2, new, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2))
    assert loss2.item() == pytest.approx(-(1 + 4e-4), abs=1e-12)
    assert m2["actor/pg_clipfrac"] == 1.0


def test_cispo_by_hand_keeps_gradient_of_clipped_tokens():
    # ratios [1.5, 0.5], A = 1, upper bound 1.2, no lower bound:
    # loss = mean(-sg(min(r, 1.2)) * A * logp) ; grad = [-1.2, -0.5] / 2
    cfg = PolicyLossConfig(clip_ratio_high=0.2)
    new_v = [[math.log(0.3), math.log(0.2)]]
    old, new = logps_with_ratio([[1.5, 0.5]], new_logp=new_v)
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, metrics = compute_policy_loss("cispo", old, new, adv, torch.ones(1, 2), cfg)
    expected = (-1.2 * math.log(0.3) - 0.5 * math.log(0.2)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-0.6, -0.25]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac"] == 0.5 and metrics["actor/pg_clipfrac_lower"] == 0.0

    # with a lower bound of 1 - 0.2 the 0.5 weight becomes 0.8
    cfg_low = PolicyLossConfig(clip_ratio_high=0.2, cispo_clip_ratio_low=0.2)
    old, new = logps_with_ratio([[1.5, 0.5]], new_logp=new_v)
    loss, metrics = compute_policy_loss("cispo", old, new, adv, torch.ones(1, 2), cfg_low)
    assert loss.item() == pytest.approx((-1.2 * math.log(0.3) - 0.8 * math.log(0.2)) / 2, abs=1e-12)
    assert metrics["actor/pg_clipfrac_lower"] == 0.5

    # the same token under PPO has no gradient: CISPO's point
    old, new = logps_with_ratio([[1.5]])
    ppo, _ = compute_policy_loss("vanilla", old, new, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    ppo.backward()
    assert new.grad.item() == 0.0


def test_gpg_loss_by_hand():
    # loss = mean(-A * logp) = (-(2)(-0.5) - (-1)(-1.0)) / 2 = (1 - 1) / 2 = 0; grad = -A / 2
    new = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.7, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("gpg", old, new, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.0, 0.5]], dtype=torch.float64))
    assert metrics["actor/ppo_kl"] == pytest.approx((-0.7 + 0.5) / 2, abs=1e-12)


def test_policy_loss_registry_and_config_errors():
    assert set(POLICY_LOSSES.names()) >= {"vanilla", "gspo", "cispo", "gpg"}
    with pytest.raises(ValueError, match=r"Unknown policy loss 'vanila'\. Did you mean 'vanilla'\?"):
        compute_policy_loss("vanila", torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="clip_ratio_c must be a number > 1"):
        PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="advantages must have the shape of log_prob"):
        compute_policy_loss("vanilla", torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


# ---------------------------------------------------------------------------------------------
# value loss, entropy, KL loss
# ---------------------------------------------------------------------------------------------


def test_value_clipping_takes_the_max_of_both_losses():
    # token 0: vpred 1.5, old 1.0, R 2.0: unclipped .25, clipped (1.2 - 2)^2 = .64 -> .64 (clipped, no grad)
    # token 1: vpred 0.1, old 0.0, R 1.0: inside the range, both .81
    # token 2: vpred 1.5, old 1.0, R 1.1: unclipped .16, clipped (1.2 - 1.1)^2 = .01 -> .16 (unclipped)
    vpreds = torch.tensor([[1.5, 0.1, 1.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 1.0, 1.1]], dtype=torch.float64)
    loss, metrics = value_loss(vpreds, old, returns, torch.ones(1, 3), cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 0.16) / 3, abs=1e-12)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    assert vpreds.grad[0, 0].item() == 0.0
    assert vpreds.grad[0, 2].item() == pytest.approx(0.5 * 2 * (1.5 - 1.1) / 3, abs=1e-12)
    # aggregation mode is honoured
    loss_seq, _ = value_loss(vpreds.detach(), old, returns, torch.tensor([[1, 1, 0]]), 0.2, "seq-mean-token-sum")
    assert loss_seq.item() == pytest.approx(0.5 * (0.64 + 0.81), abs=1e-12)


def test_entropy_from_logits():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
            [0.0, math.log(3.0), -math.inf, -math.inf],  # p = [.25, .75]
            [1000.0, 0.0, 0.0, 0.0],  # near one-hot, must stay finite
        ],
        dtype=torch.float64,
    )
    h = entropy_from_logits(logits)
    p = np.array([0.25, 0.75])
    np.testing.assert_allclose(h[:2].numpy(), [math.log(4.0), -(p * np.log(p)).sum()], atol=1e-12)
    assert torch.isfinite(h).all() and 0.0 <= h[2].item() < 1e-12
    assert entropy_from_logits(torch.randn(2, 3, 7)).shape == (2, 3)


def test_kl_loss_aggregates_kl_penalty():
    logp = torch.tensor([[0.2, -0.4, 0.6], [0.1, 0.3, 9.0]])
    ref = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = kl_loss(logp, ref, mask, "k1", "token-mean")
    assert out.item() == pytest.approx((0.2 - 0.4 + 0.6 + 0.1 + 0.3) / 5, abs=1e-6)
    out_k2 = kl_loss(logp, ref, mask, "k2", "seq-mean-token-mean")
    assert out_k2.item() == pytest.approx((0.5 * (0.04 + 0.16 + 0.36) / 3 + 0.5 * (0.01 + 0.09) / 2) / 2, abs=1e-6)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "gpg"])
def test_garbage_outside_mask_reaches_neither_loss_nor_gradient(name):
    gen = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    new_v = -torch.rand(2, 5, generator=gen, dtype=torch.float64)
    old_v = new_v + 0.1 * torch.randn(2, 5, generator=gen, dtype=torch.float64)
    adv_v = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    cfg = PolicyLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.05)

    def run(new, old, adv):
        leaf = new.clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(name, old, leaf, adv, mask, cfg)
        loss.backward()
        return loss, leaf.grad, metrics

    clean = run(new_v, old_v, adv_v)
    dirty_new, dirty_old, dirty_adv = new_v.clone(), old_v.clone(), adv_v.clone()
    dirty_new[~mask] = -math.inf
    dirty_old[~mask] = float("nan")
    dirty_adv[~mask] = math.inf
    dirty = run(dirty_new, dirty_old, dirty_adv)
    assert torch.equal(dirty[0], clean[0])
    assert torch.isfinite(dirty[1]).all() and torch.equal(dirty[1], clean[1])
    assert torch.equal(dirty[1][~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64))
    assert dirty[2] == clean[2]


def test_value_and_kl_loss_ignore_garbage_outside_mask():
    mask = torch.tensor([[1, 1, 0]])
    vpreds = torch.tensor([[0.5, 0.1, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.4, 0.0, float("nan")]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 0.0, math.inf]], dtype=torch.float64)
    loss, metrics = value_loss(vpreds, old, returns, mask, 0.2)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(vpreds.grad).all() and vpreds.grad[0, 2].item() == 0.0
    logp = torch.tensor([[-1.0, -2.0, -math.inf]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, float("nan")]])
    out = kl_loss(logp, ref, mask, "k3")
    out.backward()
    assert math.isfinite(out.item()) and torch.isfinite(logp.grad).all()


def test_denominators_and_config_accept_numpy_and_tensor_scalars():
    out = agg_loss(LOSS_2x3, MASK_2x3, "token-mean", global_num_tokens=torch.tensor(10.0))
    assert out.item() == pytest.approx(1.8, abs=1e-6)
    out = agg_loss(LOSS_2x3, MASK_2x3, "seq-mean-token-sum-norm", global_num_seqs=np.float32(2), horizon=np.int64(4))
    assert out.item() == pytest.approx(2.25, abs=1e-6)
    assert PolicyLossConfig(clip_ratio_high=np.float64(0.28), clip_ratio_c=np.float32(3.0)).high == pytest.approx(0.28)


# ---------------------------------------------------------------------------------------------
# critic metrics
# ---------------------------------------------------------------------------------------------


def test_explained_variance_by_hand():
    from trajflow.stages.policy_update import explained_variance

    # valid tokens: R = [1, 2, 3, 4], V = [1, 2, 2, 5] -> R - V = [0, 0, 1, -1]
    # unbiased Var[R] = 5/3, Var[R - V] = (0 + 0 + 1 + 1) / 3 = 2/3 -> 1 - (2/3) / (5/3 + 1e-5)
    returns = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 0.0]])
    values = torch.tensor([[1.0, 2.0, float("nan")], [2.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert explained_variance(values, returns, mask) == pytest.approx(1 - (2 / 3) / (5 / 3 + 1e-5), abs=1e-9)
    # a perfect critic explains everything; predicting the mean explains nothing
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0, abs=1e-5)
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask) == pytest.approx(0.0, abs=1e-5)
    assert explained_variance(values, returns, torch.tensor([[1, 0, 0], [0, 0, 0]])) == 0.0


# ------------------------------------------------------------------------------------------ actor_loss

# 2 rows x 3 tokens; the last token of row 1 is padding (mask 0) and holds values that must not count.
RATIO = np.array([[1.5, 0.7, 1.0], [0.9, 1.3, 5.0]])
ADVS = np.array([[1.0, -1.0, 0.5], [-2.0, 1.0, 7.0]])
MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ENT = np.array([[0.5, 1.0, 1.5], [2.0, 0.25, 9.0]])
LOGP = np.log(np.array([[0.5, 0.25, 0.8], [0.1, 0.6, 0.3]]))
REF = LOGP - np.array([[0.1, -0.2, 0.0], [0.3, 0.05, 4.0]])  # logp - ref = the log-ratio to the reference
EPS_LOW, EPS_HIGH, C_DUAL, C_ENT, C_KL = 0.2, 0.28, 3.0, 0.01, 0.1


def _cfg(entropy_coeff=C_ENT, kl_loss_coef=C_KL, mode="token-mean"):
    loss = PolicyLossConfig(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=C_DUAL, loss_agg_mode=mode)
    return ActorLossConfig("vanilla", loss, entropy_coeff, kl_loss_coef, "low_var_kl")


def _tensors():
    logp = torch.tensor(LOGP, requires_grad=True)
    old = torch.tensor(LOGP - np.log(RATIO))
    ent = torch.tensor(ENT, requires_grad=True)
    return logp, old, torch.tensor(ADVS), torch.tensor(MASK), ent, torch.tensor(REF)


def _by_hand(weights=None):
    """PPO eq. 7 with clip-higher and dual clip, token-mean over the 5 valid tokens, in numpy."""
    unclipped = -ADVS * RATIO
    clipped = -ADVS * np.clip(RATIO, 1 - EPS_LOW, 1 + EPS_HIGH)
    ppo = np.maximum(unclipped, clipped)
    pg_tok = np.where(ADVS < 0, np.minimum(ppo, -ADVS * C_DUAL), ppo)
    if weights is not None:
        pg_tok = pg_tok * weights
    n = MASK.sum()
    pg = (pg_tok * MASK).sum() / n
    ent = (ENT * MASK).sum() / n
    lr = LOGP - REF
    kl = ((np.exp(-lr) + lr - 1) * MASK).sum() / n  # k3: exp(-x) - (-x) - 1
    return pg, ent, kl, {
        "actor/pg_clipfrac": ((clipped > unclipped) * MASK).sum() / n,
        "actor/ppo_kl": (-np.log(RATIO) * MASK).sum() / n,
        "actor/pg_clipfrac_lower": (((ppo > -ADVS * C_DUAL) & (ADVS < 0)) * MASK).sum() / n,
    }


def test_actor_loss_combines_ppo_entropy_and_kl_by_hand():
    logp, old, adv, mask, ent, ref = _tensors()
    loss, m = actor_loss(logp, old, adv, mask, entropy=ent, ref_logp=ref, cfg=_cfg(), agg_kw={})
    pg, h, kl, pg_m = _by_hand()
    assert loss.item() == pytest.approx(pg - C_ENT * h + C_KL * kl, rel=1e-12)
    assert m["actor/pg_loss"] == pytest.approx(pg, rel=1e-12)
    assert m["actor/entropy"] == pytest.approx(h, rel=1e-12)
    assert m["actor/kl_loss"] == pytest.approx(kl, rel=1e-12)
    assert m["actor/kl_coef"] == C_KL
    for k, v in pg_m.items():
        assert m[k] == pytest.approx(v, rel=1e-12), k
    assert set(ACTOR_LOSS_SHARES) <= set(m)
    # The entropy bonus's gradient: -c_H / 5 on every valid token, nothing on padding.
    loss.backward()
    np.testing.assert_allclose(ent.grad.numpy(), -C_ENT * MASK / MASK.sum(), rtol=1e-12)


def test_actor_loss_without_entropy_bonus_or_reference():
    logp, old, adv, mask, ent, ref = _tensors()
    pg, h, _, _ = _by_hand()
    loss, m = actor_loss(logp, old, adv, mask, entropy=ent, ref_logp=None, cfg=_cfg(entropy_coeff=0.0), agg_kw={})
    assert loss.item() == pytest.approx(pg, rel=1e-12)
    assert m["actor/entropy"] == pytest.approx(h, rel=1e-12)  # still reported, as a metric
    assert "actor/kl_loss" not in m and "actor/kl_coef" not in m
    loss.backward()
    assert ent.grad is None  # detached: no gradient through the entropy
    # A reference with kl_loss_coef = 0 adds no KL term either.
    _, m0 = actor_loss(logp, old, adv, mask, entropy=ent, ref_logp=ref, cfg=_cfg(kl_loss_coef=0.0), agg_kw={})
    assert "actor/kl_loss" not in m0


def test_actor_loss_rollout_is_weights_scale_the_policy_gradient_only():
    logp, old, adv, mask, ent, ref = _tensors()
    w = np.array([[2.0, 1.0, 0.5], [1.5, 1.0, 100.0]])
    loss, m = actor_loss(logp, old, adv, mask, entropy=ent, ref_logp=ref, cfg=_cfg(), agg_kw={},
                         rollout_is_weights=torch.tensor(w))
    pg, h, kl, _ = _by_hand(weights=w)
    assert m["actor/pg_loss"] == pytest.approx(pg, rel=1e-12)
    assert loss.item() == pytest.approx(pg - C_ENT * h + C_KL * kl, rel=1e-12)


def test_actor_loss_micro_batches_add_up_with_global_denominators():
    # seq-mean-token-sum-norm with horizon H = 4 over N = 2 rows: sum_i sum_t l_it / H / N. Each row as its
    # own micro-batch, given the whole batch's denominators, contributes its share; the shares add up.
    logp, old, adv, mask, ent, ref = _tensors()
    cfg = _cfg(mode="seq-mean-token-sum-norm")
    kw = dict(global_num_tokens=5.0, global_num_seqs=2.0, horizon=4)
    whole, _ = actor_loss(logp, old, adv, mask, entropy=ent, ref_logp=ref, cfg=cfg, agg_kw=kw)
    parts = [actor_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], entropy=ent[i:i + 1],
                        ref_logp=ref[i:i + 1], cfg=cfg, agg_kw=kw)[0] for i in range(2)]
    unclipped = -ADVS * RATIO
    ppo = np.maximum(unclipped, -ADVS * np.clip(RATIO, 1 - EPS_LOW, 1 + EPS_HIGH))
    pg_tok = np.where(ADVS < 0, np.minimum(ppo, -ADVS * C_DUAL), ppo)
    lr = LOGP - REF
    tok = pg_tok - C_ENT * ENT + C_KL * (np.exp(-lr) + lr - 1)
    assert whole.item() == pytest.approx((tok * MASK).sum() / 4 / 2, rel=1e-12)
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-12)


def test_update_rows_need_one_entry_per_row():
    UpdateRows([[1]], [[2, 3]], [[-1.0, -1.0]], [[0.5, 0.5]])
    with pytest.raises(ValueError, match="one entry per row"):
        UpdateRows([[1], [1]], [[2, 3]], [[-1.0, -1.0]], [[0.5, 0.5]])


def test_value_clipfrac_is_zero_inside_the_clip_range_in_float32():
    # |vpred - old| = 0.1046 < 0.2: v_clip = vpred, so nothing is clipped (PPO value clipping).
    # old + clamp(vpred - old) rounded in fp32 came out 1 ulp off vpred and counted as clipped.
    v, old, ret, c = -0.0247745402, -0.1293911636, -0.4875271022, 0.2
    vpreds = torch.tensor([[v]], dtype=torch.float32, requires_grad=True)
    loss, metrics = value_loss(vpreds, torch.tensor([[old]]), torch.tensor([[ret]]), torch.ones(1, 1), c)
    assert metrics["critic/vf_clipfrac"] == 0.0
    v32, old32, ret32 = (float(np.float32(x)) for x in (v, old, ret))
    v_clip = min(max(v32, old32 - c), old32 + c)
    expected = 0.5 * max((v32 - ret32) ** 2, (v_clip - ret32) ** 2)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert vpreds.grad.item() == pytest.approx(v32 - ret32, rel=1e-6)  # the unclipped branch's gradient


def _actor_section(**over):
    base = dict(policy_loss="vanilla", clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.0, kl_loss_coef=0.0, kl_loss_type="k3+")
    return __import__("types").SimpleNamespace(**(base | over))


def _gspo_by_hand(log_ratios, advs, eps_low, eps_high):
    """GSPO (Zheng et al. 2025, eq. 5-7) in numpy: s_i = exp(mean_t log-ratio), the clipped sequence
    term -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), averaged over sequences."""
    terms = []
    for lr, a in zip(log_ratios, advs):
        s = np.exp(np.mean(lr))
        terms.append(-min(s * a, np.clip(s, 1 - eps_low, 1 + eps_high) * a))
    return float(np.mean(terms))


# two sequences of lengths 1 and 3 (padding of row 0 holds garbage that must not count)
GSPO_LR = [[0.05], [0.3, -0.1, 0.1]]
GSPO_ADV = [1.0, -1.0]


def _gspo_tensors():
    new_v = torch.tensor([[-0.4, -1.0, -2.0], [-0.5, -0.7, -0.9]], dtype=torch.float64)
    lr = torch.tensor([[0.05, 7.0, 7.0], [0.3, -0.1, 0.1]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    return new_v - lr, new_v, adv, torch.tensor([[1, 0, 0], [1, 1, 1]])


@pytest.mark.parametrize("low, high", [(0.02, 0.03), (0.2, 0.2)])
def test_gspo_clip_bounds_come_from_actor_clip_ratio_low_high(low, high):
    old, new, adv, mask = _gspo_tensors()
    cfg = ActorLossConfig.from_actor(_actor_section(policy_loss="gspo", clip_ratio_low=low, clip_ratio_high=high))
    loss, _ = compute_policy_loss("gspo", old, new, adv, mask, cfg.loss)
    assert loss.item() == pytest.approx(_gspo_by_hand(GSPO_LR, GSPO_ADV, low, high), abs=1e-12)


def test_gspo_and_cispo_keep_their_own_bounds_when_unset():
    old, new, adv, mask = _gspo_tensors()
    cfg = ActorLossConfig.from_actor(_actor_section(policy_loss="gspo"))
    loss, _ = compute_policy_loss("gspo", old, new, adv, mask, cfg.loss)
    assert loss.item() == pytest.approx(_gspo_by_hand(GSPO_LR, GSPO_ADV, 3e-4, 4e-4), abs=1e-12)
    assert cfg.loss.low == cfg.loss.high == 0.2  # PPO still falls back to clip_ratio
    # CISPO: the IS weight is capped at 1 + actor.clip_ratio_high, or at 5 when it is unset
    old_c, new_c = logps_with_ratio([[7.0, 2.0]], new_logp=[[math.log(0.3), math.log(0.2)]])
    for high, cap in ((None, 5.0), (0.5, 1.5)):
        loss_cfg = ActorLossConfig.from_actor(_actor_section(policy_loss="cispo", clip_ratio_high=high)).loss
        loss, _ = compute_policy_loss("cispo", old_c, new_c.detach(), torch.ones(1, 2, dtype=torch.float64),
                                      torch.ones(1, 2), loss_cfg)
        expected = (-min(7.0, cap) * math.log(0.3) - min(2.0, cap) * math.log(0.2)) / 2
        assert loss.item() == pytest.approx(expected, abs=1e-12), high


def test_gspo_with_a_length_weighted_aggregation_is_rejected_by_the_config():
    from trajflow.config import load_config
    from trajflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"actor.policy_loss=gspo needs actor.loss_agg_mode=seq-mean-token-mean"):
        load_config(None, ["actor.policy_loss=gspo"])  # default token-mean
    cfg = load_config(None, ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"])
    # the accepted mode is the paper's mean over sequences; token-mean would weight row 1 three times
    old, new, adv, mask = _gspo_tensors()
    loss_cfg = ActorLossConfig.from_actor(cfg.actor).loss
    loss, _ = compute_policy_loss("gspo", old, new, adv, mask, loss_cfg)
    assert loss.item() == pytest.approx(_gspo_by_hand(GSPO_LR, GSPO_ADV, 3e-4, 4e-4), abs=1e-12)


# ------------------------------------------------------------------------------- KL loss gradient

PI = np.array([0.5, 0.25, 0.25])
PI_REF = np.array([0.25, 0.5, 0.25])


def _reverse_kl_grad(pi, ref):
    """d KL(pi || ref) / d theta for pi = softmax(theta): pi_j * (log(pi_j / ref_j) - KL)."""
    kl = float(np.sum(pi * np.log(pi / ref)))
    return pi * (np.log(pi / ref) - kl)


def _expected_kl_loss_grad(cfg, sample_probs, old_probs=None):
    """E_{x ~ sample_probs}[grad_theta of actor_loss's KL term on the one-token sample x], by
    enumerating the vocabulary: sum_x sample_probs[x] * grad loss(x). pi = softmax(theta)."""
    total = np.zeros(len(PI))
    for x in range(len(PI)):
        theta = torch.tensor(np.log(PI), dtype=torch.float64, requires_grad=True)
        logp = torch.log_softmax(theta, dim=0)[x].reshape(1, 1)
        old = logp.detach() if old_probs is None else torch.tensor([[math.log(old_probs[x])]], dtype=torch.float64)
        ref = torch.tensor([[math.log(PI_REF[x])]], dtype=torch.float64)
        loss, _ = actor_loss(logp, old, torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1),
                             entropy=torch.zeros(1, 1, dtype=torch.float64), ref_logp=ref, cfg=cfg, agg_kw={})
        loss.backward()
        total += sample_probs[x] * theta.grad.numpy()
    return total


def test_default_kl_loss_has_the_reverse_kl_gradient():
    expected = _reverse_kl_grad(PI, PI_REF)
    np.testing.assert_allclose(expected, [0.2599, -0.2166, -0.0433], atol=1e-4)
    cfg = ActorLossConfig(kl_loss_coef=1.0)  # the default actor.kl_loss_type
    np.testing.assert_allclose(_expected_kl_loss_grad(cfg, PI), expected, atol=1e-12)
    from trajflow.config import load_config

    assert load_config(None, []).actor.kl_loss_type == cfg.kl_loss_type
    # plain k3 as a loss: expected gradient pi - ref, the bias the default avoids
    np.testing.assert_allclose(_expected_kl_loss_grad(ActorLossConfig(kl_loss_coef=1.0, kl_loss_type="low_var_kl"), PI),
                               PI - PI_REF, atol=1e-12)


@pytest.mark.parametrize("kl_type", ["k2", "low_var_kl+"])
def test_off_policy_k2_gradient_is_importance_weighted(kl_type):
    # later mini-batches / epochs: the tokens came from pi_old != pi; with w = pi / pi_old the
    # expectation over pi_old's samples is still grad KL(pi || ref)
    pi_old = np.array([0.4, 0.3, 0.3])
    cfg = ActorLossConfig(kl_loss_coef=1.0, kl_loss_type=kl_type)
    got = _expected_kl_loss_grad(cfg, pi_old, old_probs=pi_old)
    np.testing.assert_allclose(got, _reverse_kl_grad(PI, PI_REF), atol=1e-12)
