"""Rollout importance-sampling correction (truncated IS), checked against values worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trajflow.stages.policy_losses import PolicyLossConfig, compute_policy_loss
from trajflow.stages.rollout_correction import rollout_is_kept_metrics, rollout_is_weights, rollout_rs_mask

# Row 0: old - rollout = [ln 1.5, ln 0.5, ln 4]   -> token weights 1.5, 0.5, min(4, 2) = 2
# Row 1: old - rollout = [ln 3, (masked garbage)] -> token weight min(3, 2) = 2
OLD = torch.tensor([[math.log(0.3), math.log(0.1), math.log(0.8)], [math.log(0.6), 5.0, 0.0]], dtype=torch.float64)
ROLLOUT = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.2)], [math.log(0.2), float("nan"), -90.0]],
                       dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_token_level_weights_by_hand():
    w, m = rollout_is_weights(OLD, ROLLOUT, MASK, "token", 2.0)
    expected = torch.tensor([[1.5, 0.5, 2.0], [2.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=1e-6)
    assert w.dtype == torch.float32 and not w.requires_grad
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((1.5 + 0.5 + 2 + 2) / 4)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(4.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_clipfrac"] == pytest.approx(2 / 4)
    # before truncation: ratios 0.3/0.2, 0.1/0.2, 0.8/0.2, 0.6/0.2 = 1.5, 0.5, 4, 3
    assert m["rollout_corr/rollout_is_raw_mean"] == pytest.approx((1.5 + 0.5 + 4 + 3) / 4)
    assert m["rollout_corr/rollout_is_raw_max"] == pytest.approx(4.0)
    # after rejection masks out row 0's third token and row 1: the weights applied are 1.5 and 0.5
    keep = torch.tensor([[True, True, False], [False, True, True]])
    kept = rollout_is_kept_metrics(w, keep, MASK)
    assert kept == {"rollout_corr/rollout_is_kept_mean": pytest.approx(1.0),
                    "rollout_corr/rollout_is_kept_max": pytest.approx(1.5)}
    log_ratio_mean = (math.log(1.5) + math.log(0.5) + math.log(4) + math.log(3)) / 4
    assert m["rollout_corr/log_ratio_mean"] == pytest.approx(log_ratio_mean)


def test_sequence_level_weights_by_hand():
    # row 0: 1.5 * 0.5 * 4 = 3 -> min(3, 5) = 3 on each of its 3 tokens; row 1: 3 on its one token
    w, m = rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", 5.0)
    torch.testing.assert_close(w, torch.tensor([[3.0, 3.0, 3.0], [3.0, 0.0, 0.0]]), rtol=1e-6, atol=1e-6)
    assert m["rollout_corr/rollout_is_clipfrac"] == 0.0
    # threshold 2 truncates both rows
    w2, m2 = rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", 2.0)
    torch.testing.assert_close(w2, torch.tensor([[2.0, 2.0, 2.0], [2.0, 0.0, 0.0]]), rtol=1e-6, atol=1e-6)
    assert m2["rollout_corr/rollout_is_clipfrac"] == 1.0
    assert m2["rollout_corr/rollout_is_mean"] == pytest.approx(2.0)


def test_identical_log_probs_give_weight_one():
    lp = -torch.rand(3, 4, dtype=torch.float64)
    w, m = rollout_is_weights(lp, lp.clone(), torch.ones(3, 4), "token", 2.0)
    assert torch.equal(w, torch.ones(3, 4))
    assert m["rollout_corr/rollout_is_clipfrac"] == 0.0 and m["rollout_corr/log_ratio_mean"] == 0.0


def test_huge_log_ratio_is_clamped_not_inf():
    w, m = rollout_is_weights(torch.tensor([[0.0]]), torch.tensor([[-500.0]]), torch.ones(1, 1), "token", 2.0)
    assert w.item() == 2.0 and m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(20.0))


def test_errors_name_the_config_key():
    with pytest.raises(ValueError, match="algorithm.rollout_is must be one of"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "bogus", 2.0)
    with pytest.raises(ValueError, match="algorithm.rollout_is_threshold"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "token", 0.0)
    with pytest.raises(ValueError, match="rollout_log_prob must have the shape"):
        rollout_is_weights(OLD, ROLLOUT[:, :2], MASK, "token", 2.0)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "gpg"])
def test_weights_multiply_each_token_loss_before_aggregation(name):
    # On-policy data (ratio 1, nothing clipped), the per-token losses are, by the papers' formulas:
    #   vanilla, gspo: l = -A * ratio = -A;   cispo, gpg: l = -A * log pi (IS weight 1 for cispo).
    # seq-mean-token-sum over 2 rows then gives sum_{i,t} m_it w_it l_it / 2.
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 3, generator=gen, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach().clone()
    adv = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.3, 0.3]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = torch.tensor([[0.5, 2.0, 1.0], [0.0, 1.5, 9.0]], dtype=torch.float64)
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum")
    loss, _ = compute_policy_loss(name, old, logp, adv, mask, cfg, rollout_is_weights=w)
    lp = old.numpy()
    expected = 0.0
    for i in range(2):
        for t in range(3):
            if mask[i, t]:
                l_it = -adv[i, t].item() if name in ("vanilla", "gspo") else -adv[i, t].item() * lp[i, t]
                expected += w[i, t].item() * l_it / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # the weight is a constant: no gradient where it is 0, none through masked tokens
    loss.backward()
    assert logp.grad[1, 0].item() == 0.0
    assert logp.grad[1, 2].item() == 0.0
    if name == "gpg":  # d/dlogp of -w A logp / 2 = -w A / 2
        assert logp.grad[0, 1].item() == pytest.approx(-2.0 * -2.0 / 2, abs=1e-12)


def test_vanilla_weighted_loss_literal():
    # ratio 1, A = [1, -1], weights [2, 0.5], token-mean: (-(1)(1)(2) + (1)(1)(0.5)) / 2 = -0.75
    lp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    loss, _ = compute_policy_loss("vanilla", lp, lp.clone(), torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                                  torch.ones(1, 2), rollout_is_weights=torch.tensor([[2.0, 0.5]], dtype=torch.float64))
    assert loss.item() == pytest.approx(-0.75, abs=1e-12)
    with pytest.raises(ValueError, match="rollout_is_weights must have the shape"):
        compute_policy_loss("vanilla", lp, lp.clone(), torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2),
                            rollout_is_weights=torch.ones(1, 3))


def test_geometric_level_weights_by_hand():
    # GSPO's length-normalised ratio (Zheng et al. 2025, Eq. 7): the geometric mean of the token ratios.
    # row 0: (1.5 * 0.5 * 4)^(1/3) = 3^(1/3) = 1.44225; row 1: 3 (one token) -> min(3, 2) = 2
    w, m = rollout_is_weights(OLD, ROLLOUT, MASK, "geometric", 2.0)
    g0 = 3.0 ** (1 / 3)
    torch.testing.assert_close(w, torch.tensor([[g0, g0, g0], [2.0, 0.0, 0.0]], dtype=torch.float32))
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(g0)
    assert m["rollout_corr/rollout_is_clipfrac"] == pytest.approx(1 / 2)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((g0 + 2.0) / 2)


# Rejection sampling. Token ratios r = pi_old / pi_rollout: row 0 [1.5, 0.5, 4], row 1 [3].
def test_icepop_token_mask_by_hand():
    # IcePop (Ling Team 2025, Sec. 2.2): keep r in [1/beta, beta]; beta = 2 -> [0.5, 2]
    keep, m = rollout_rs_mask(OLD, ROLLOUT, MASK, "token", 2.0)
    assert keep.tolist() == [[True, True, False], [False, False, False]]
    assert m["rollout_corr/rollout_rs_mean"] == pytest.approx((1.5 + 0.5 + 4 + 3) / 4)
    assert m["rollout_corr/rollout_rs_max"] == pytest.approx(4.0)
    assert m["rollout_corr/rollout_rs_min"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_ratio_fraction_high"] == pytest.approx(2 / 4)
    assert m["rollout_corr/rollout_rs_ratio_fraction_low"] == 0.0  # 0.5 is on the bound: kept
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 4)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 2)
    # corrected: the kept ratios 1.5 and 0.5; KL estimate -mean(log r) over them
    assert m["rollout_corr/rollout_rs_kept_mean"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_rs_kept_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 2)
    # an asymmetric band [0.6, 5]: 0.5 is now too low, 4 and 3 are kept
    keep, m = rollout_rs_mask(OLD, ROLLOUT, MASK, "token", 5.0, 0.6)
    assert keep.tolist() == [[True, False, True], [True, False, False]]
    assert m["rollout_corr/rollout_rs_ratio_fraction_low"] == pytest.approx(1 / 4)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)


def test_sequence_mask_by_hand():
    # products: row 0 1.5 * 0.5 * 4 = 3, row 1 3. TRL's sequence_mask: one-sided (lower 0), cap 2.5 -> both out
    keep, m = rollout_rs_mask(OLD, ROLLOUT, MASK, "sequence", 2.5, 0.0)
    assert not keep.any()
    assert m["rollout_corr/rollout_rs_mean"] == pytest.approx(3.0)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert m["rollout_corr/rollout_rs_kept_mean"] == 1.0 and m["rollout_corr/rollout_rs_kept_kl"] == 0.0
    keep, m = rollout_rs_mask(OLD, ROLLOUT, MASK, "sequence", 3.5)  # band [1/3.5, 3.5]: both kept
    assert keep.tolist() == [[True, True, True], [True, False, False]]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert m["rollout_corr/rollout_rs_kept_mean"] == pytest.approx(3.0)


def test_geometric_mask_by_hand():
    # geometric means: row 0 3^(1/3) = 1.442, row 1 3. Upper 2 (lower 1/2): row 0 kept, row 1 out.
    keep, m = rollout_rs_mask(OLD, ROLLOUT, MASK, "geometric", 2.0)
    assert keep.tolist() == [[True, True, True], [False, False, False]]
    assert m["rollout_corr/rollout_rs_mean"] == pytest.approx((3 ** (1 / 3) + 3) / 2)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 4)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_corr/rollout_rs_kept_mean"] == pytest.approx(3 ** (1 / 3))
    assert m["rollout_corr/rollout_rs_kept_kl"] == pytest.approx(-math.log(3) / 3)


def test_rejection_errors_name_the_config_key():
    with pytest.raises(ValueError, match="algorithm.rollout_rs must be one of"):
        rollout_rs_mask(OLD, ROLLOUT, MASK, "bogus", 2.0)
    with pytest.raises(ValueError, match="algorithm.rollout_rs_threshold must"):
        rollout_rs_mask(OLD, ROLLOUT, MASK, "token", -1.0)
    with pytest.raises(ValueError, match="algorithm.rollout_rs_threshold_lower"):
        rollout_rs_mask(OLD, ROLLOUT, MASK, "token", 2.0, 3.0)


def test_rejected_tokens_weigh_nothing_in_the_loss():
    """A rejected token's term is multiplied by 0, the token-mean denominator keeps it (TRL's masking)."""
    lp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    keep, _ = rollout_rs_mask(lp, lp - torch.tensor([[0.0, math.log(8.0)]], dtype=torch.float64), torch.ones(1, 2),
                              "token", 2.0)
    loss, _ = compute_policy_loss("vanilla", lp, lp.clone(), torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                                  torch.ones(1, 2), rollout_is_weights=keep.double())
    assert loss.item() == pytest.approx(-1.0 / 2, abs=1e-12)
