"""Advantage estimators against values worked by hand from each paper's formula.

Expected numbers are literals or tiny numpy computations of the formula, never the code's output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trajflow.stages.advantage import ADV_ESTIMATORS, AdvantageConfig, compute_advantage, masked_whiten

GROUP_ESTIMATORS = ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline", "grpo_passk"]


def outcome_rewards(scores, mask):
    """Token rewards with each row's score on its last valid token."""
    mask = torch.as_tensor(mask, dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    for i, s in enumerate(scores):
        last = int(mask[i].nonzero().max())
        rewards[i, last] = s
    return rewards


def np_whiten(x):
    """(x - mean) / sqrt(unbiased var + 1e-8), the whitening the docs promise."""
    x = np.asarray(x, dtype=np.float64)
    return (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8)


# ---------------------------------------------------------------------------------------------
# GRPO / Dr. GRPO
# ---------------------------------------------------------------------------------------------


def test_grpo_by_hand_with_gap_and_no_eos_rows():
    # group rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.5 / (0.57735 + 1e-6)
    mask = torch.tensor(
        [
            [1, 1, 1, 1],  # no EOS: mask all ones
            [1, 0, 1, 0],  # a gap in the middle
            [1, 1, 0, 0],
            [1, 1, 1, 0],
        ],
        dtype=torch.float32,
    )
    rewards = outcome_rewards([1.0, 0.0, 0.0, 1.0], mask)
    rewards[1, 3] = 5.0  # garbage after EOS must not count
    rewards[1, 1] = 7.0  # garbage inside the gap must not count either
    adv, ret = compute_advantage("grpo", rewards, mask, ["p"] * 4, AdvantageConfig())
    a = 0.8660239037870368
    expected = torch.tensor([[a, a, a, a], [-a, 0, -a, 0], [-a, -a, 0, 0], [a, a, a, 0]], dtype=torch.float32)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, expected, rtol=0, atol=1e-6)
    # numpy check of the same formula
    r = np.array([1.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(adv[:, 0].numpy(), (r - r.mean()) / (r.std(ddof=1) + 1e-6), atol=1e-6)


def test_dr_grpo_does_not_divide_by_std():
    mask = torch.ones(4, 3)
    rewards = outcome_rewards([1.0, 0.0, 0.0, 1.0], mask)
    adv, _ = compute_advantage("grpo", rewards, mask, [0, 0, 0, 0], AdvantageConfig(norm_adv_by_std_in_grpo=False))
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]).unsqueeze(-1).expand(4, 3)
    torch.testing.assert_close(adv, expected, rtol=0, atol=0)


def test_grpo_interleaved_string_groups_and_sum_of_token_rewards():
    # group a: scores 2 and 0 (row 0's score is spread over two tokens: 1.5 + 0.5)
    # group b: scores 1 and 1 -> exactly 0
    mask = torch.ones(4, 3, dtype=torch.bool)
    rewards = torch.tensor([[1.5, 0, 0.5], [0, 0, 1.0], [0, 0, 0], [0, 1.0, 0]])
    adv, _ = compute_advantage("grpo", rewards, mask, np.array(["a", "b", "a", "b"]), AdvantageConfig())
    a = 1.0 / (math.sqrt(2.0) + 1e-6)  # (2 - 1) / (std([2, 0]) + eps)
    torch.testing.assert_close(adv[:, 0], torch.tensor([a, 0.0, -a, 0.0]), rtol=0, atol=1e-6)
    assert torch.equal(adv[1], torch.zeros(3)) and torch.equal(adv[3], torch.zeros(3))


@pytest.mark.parametrize("n", [8, 3, 7])
@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_equal_float32_group_gets_exactly_zero(name, n):
    # float32 0.35 is not exactly representable; a naive float32 mean of n copies drifts
    mask = torch.ones(n, 5)
    mask[0, 3:] = 0
    rewards = outcome_rewards([0.35] * n, mask)
    adv, ret = compute_advantage(name, rewards, mask, ["g"] * n, AdvantageConfig())
    assert torch.equal(adv, torch.zeros(n, 5))
    assert torch.equal(ret, torch.zeros(n, 5))
    adv_dr, _ = compute_advantage(name, rewards, mask, ["g"] * n, AdvantageConfig(norm_adv_by_std_in_grpo=False))
    assert torch.equal(adv_dr, torch.zeros(n, 5))


def test_naive_float32_mean_of_equal_rewards_is_inexact_for_some_sizes():
    # documents why exactness needs care: the float32 mean of three 0.35s is not 0.35
    x = torch.full((3,), 0.35, dtype=torch.float32)
    drift = [float(torch.full((k,), 0.35).mean() - torch.tensor(0.35)) for k in range(2, 12)]
    assert any(d != 0.0 for d in drift), drift
    assert x.dtype == torch.float32


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_group_of_one_gets_exactly_zero(name):
    mask = torch.ones(3, 2)
    rewards = outcome_rewards([0.7, 1.0, 0.0], mask)
    adv, _ = compute_advantage(name, rewards, mask, ["solo", "pair", "pair"], AdvantageConfig())
    assert torch.equal(adv[0], torch.zeros(2))
    assert torch.isfinite(adv).all()
    adv_all_single, _ = compute_advantage(name, rewards, mask, ["x", "y", "z"], AdvantageConfig())
    assert torch.equal(adv_all_single, torch.zeros(3, 2))


def test_float_and_bool_masks_agree():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=torch.float32)
    rewards = outcome_rewards([1.0, 0.25, 0.0], mask)
    for name in GROUP_ESTIMATORS:
        a_f, _ = compute_advantage(name, rewards, mask, [0, 0, 0], AdvantageConfig())
        a_b, _ = compute_advantage(name, rewards, mask.bool(), [0, 0, 0], AdvantageConfig())
        assert torch.equal(a_f, a_b), name


# ---------------------------------------------------------------------------------------------
# RLOO, OPO, GPG, pass@k, REINFORCE++, ReMax
# ---------------------------------------------------------------------------------------------


def test_rloo_by_hand():
    # group x: [1, 0, 0.5] -> baselines (0+0.5)/2, (1+0.5)/2, (1+0)/2 -> [0.75, -0.75, 0]
    # group y: [3, 1] -> [2, -2]
    mask = torch.ones(5, 2)
    rewards = outcome_rewards([1.0, 3.0, 0.0, 0.5, 1.0], mask)
    adv, _ = compute_advantage("rloo", rewards, mask, ["x", "y", "x", "x", "y"], AdvantageConfig())
    torch.testing.assert_close(adv[:, 1], torch.tensor([0.75, 2.0, -0.75, 0.0, -2.0]), rtol=0, atol=1e-7)


def test_opo_length_weighted_baseline_by_hand():
    # lengths [1, 3], rewards [1, 0]: b = (1*1 + 3*0) / 4 = 0.25 -> [0.75, -0.25]
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    rewards = outcome_rewards([1.0, 0.0], mask)
    adv, _ = compute_advantage("opo", rewards, mask, [7, 7], AdvantageConfig())
    expected = torch.tensor([[0.75, 0, 0], [-0.25, -0.25, -0.25]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_gpg_alpha_by_hand():
    # group A [1, 0, 0, 1] centred -> +-0.5; group B [1, 1] -> 0 (two zero-gradient rows)
    # alpha = B / (B - M) = 6 / (6 - 2) = 1.5 -> +-0.75
    mask = torch.ones(6, 2)
    rewards = outcome_rewards([1, 0, 0, 1, 1, 1], mask)
    adv, _ = compute_advantage("gpg", rewards, mask, list("AAAABB"), AdvantageConfig())
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.75, -0.75, -0.75, 0.75, 0.0, 0.0]), rtol=0, atol=1e-7)
    # every group degenerate: alpha has no signal rows, advantages stay exactly 0
    adv0, _ = compute_advantage("gpg", outcome_rewards([1, 1, 0, 0], torch.ones(4, 2)), torch.ones(4, 2), list("AABB"), AdvantageConfig())
    assert torch.equal(adv0, torch.zeros(4, 2))


def test_grpo_passk_only_best_gets_gap_over_std():
    r = np.array([0.2, 0.9, 0.5, 0.1])
    mask = torch.ones(4, 2)
    rewards = outcome_rewards(r.tolist(), mask)
    adv, _ = compute_advantage("grpo_passk", rewards, mask, ["q"] * 4, AdvantageConfig())
    expected = np.zeros(4)
    expected[1] = (0.9 - 0.5) / (r.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv[:, 0].numpy(), expected, atol=1e-6)
    assert torch.equal(adv[:, 0] == 0, torch.tensor([True, False, True, True]))
    # Dr. GRPO flavour: the raw gap
    adv_raw, _ = compute_advantage("grpo_passk", rewards, mask, ["q"] * 4, AdvantageConfig(norm_adv_by_std_in_grpo=False))
    np.testing.assert_allclose(adv_raw[:, 1].numpy(), [0, 0.4, 0, 0], atol=1e-6)


def test_grpo_passk_blocks_ties_and_errors():
    mask = torch.ones(4, 1)
    rewards = outcome_rewards([0.2, 0.9, 0.5, 0.1], mask)
    cfg = AdvantageConfig(pass_k=2, norm_adv_by_std_in_grpo=False)
    adv, _ = compute_advantage("grpo_passk", rewards, mask, ["q"] * 4, cfg)
    # blocks [0.2, 0.9] and [0.5, 0.1]
    np.testing.assert_allclose(adv[:, 0].numpy(), [0, 0.7, 0.4, 0], atol=1e-6)
    # tie for the maximum -> no advantage at all
    tie = outcome_rewards([1.0, 0.0, 1.0], torch.ones(3, 1))
    adv_tie, _ = compute_advantage("grpo_passk", tie, torch.ones(3, 1), [0, 0, 0], AdvantageConfig())
    assert torch.equal(adv_tie, torch.zeros(3, 1))
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantage("grpo_passk", rewards[:1], mask[:1], ["lonely"], AdvantageConfig())
    with pytest.raises(ValueError, match="pass_k=3"):
        compute_advantage("grpo_passk", rewards, mask, ["q"] * 4, AdvantageConfig(pass_k=3))


def test_reinforce_plus_plus_returns_to_go_by_hand():
    # gamma 0.9, rewards [0.5, 0, 1]: G2 = 1, G1 = 0.9, G0 = 0.5 + 0.81 = 1.31
    # second row has a gap: rewards [0.5, (3 masked), 0, 1] -> [1.31, 0, 0.9, 1]
    rewards = torch.tensor([[0.5, 0.0, 1.0, 9.0], [0.5, 3.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, None, AdvantageConfig(gamma=0.9))
    expected_ret = torch.tensor([[1.31, 0.9, 1.0, 0.0], [1.31, 0.0, 0.9, 1.0]])
    torch.testing.assert_close(ret, expected_ret, rtol=0, atol=1e-6)
    w = np_whiten([1.31, 0.9, 1.0, 1.31, 0.9, 1.0])
    expected_adv = np.array([[w[0], w[1], w[2], 0], [w[3], 0, w[4], w[5]]])
    np.testing.assert_allclose(adv.numpy(), expected_adv, atol=1e-5)


def test_reinforce_plus_plus_baseline_by_hand():
    # group g: [1, 0] -> centred [0.5, -0.5]; group h: [1, 1] -> degenerate, exactly 0
    # whitening over all 8 valid tokens [.5, .5, -.5, -.5, 0, 0, 0, 0]: mean 0, var = 1/7
    mask = torch.ones(4, 2)
    rewards = outcome_rewards([1.0, 0.0, 1.0, 1.0], mask)
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, list("gghh"), AdvantageConfig())
    a = 0.5 / math.sqrt(1 / 7 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[a, a], [-a, -a], [0, 0], [0, 0]]), rtol=0, atol=1e-6)
    assert torch.equal(adv[2:], torch.zeros(2, 2))
    assert torch.equal(adv, ret)


def test_remax_by_hand():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0.5, 0.5], [0.0, 1.0, 4.0]])  # 4.0 is after EOS
    adv, ret = compute_advantage("remax", rewards, mask, None, AdvantageConfig(), reward_baselines=torch.tensor([0.4, 1.0]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.5], [1.0, 1.0, 0.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(adv, torch.tensor([[0.6, 0.6, 0.1], [0.0, 0.0, 0.0]]), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", rewards, mask, None, AdvantageConfig())


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------


def test_gae_three_tokens_by_hand():
    # gamma 0.9, lam 0.8, rewards [0, 0, 1], values [0.5, 0.6, 0.7]
    # d2 = 1 - 0.7 = 0.3                    A2 = 0.3
    # d1 = 0 + 0.9*0.7 - 0.6 = 0.03         A1 = 0.03 + 0.72*0.3 = 0.246
    # d0 = 0 + 0.9*0.6 - 0.5 = 0.04         A0 = 0.04 + 0.72*0.246 = 0.21712
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = compute_advantage("gae", rewards, mask, None, AdvantageConfig(gamma=0.9, lam=0.8), values=values)
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(adv.numpy()[0], np_whiten([0.21712, 0.246, 0.3]), atol=1e-5)


def test_gae_gamma_one_lambda_one_is_monte_carlo_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    _, ret = compute_advantage("gae", rewards, torch.ones(1, 3), None, AdvantageConfig(), values=values)
    torch.testing.assert_close(ret, torch.ones(1, 3), rtol=0, atol=1e-7)


def test_gae_skips_gap_tokens():
    # mask [1, 0, 1]: token 0's next state is token 2; the gap's reward/value never enter
    # A2 = 1 - 0.7 = 0.3; d0 = 0 + 0.9*0.7 - 0.5 = 0.13; A0 = 0.13 + 0.72*0.3 = 0.346
    rewards = torch.tensor([[0.0, 7.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.7]])
    mask = torch.tensor([[1, 0, 1]])
    adv, ret = compute_advantage("gae", rewards, mask, None, AdvantageConfig(gamma=0.9, lam=0.8), values=values)
    torch.testing.assert_close(ret, torch.tensor([[0.846, 0.0, 1.0]]), rtol=0, atol=1e-6)
    w = np_whiten([0.346, 0.3])
    np.testing.assert_allclose(adv.numpy()[0], [w[0], 0.0, w[1]], atol=1e-5)


def test_gae_garbage_after_eos_does_not_leak():
    cfg = AdvantageConfig(gamma=0.95, lam=0.9)
    rewards = torch.tensor([[0.1, 0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.2, 0.3, 0.4, 0.0, 0.0], [0.1, 0.2, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    clean_adv, clean_ret = compute_advantage("gae", rewards, mask, None, cfg, values=values)
    dirty_r, dirty_v = rewards.clone(), values.clone()
    dirty_r[0, 3:] = torch.tensor([100.0, float("nan")])
    dirty_v[0, 3:] = torch.tensor([1e6, float("inf")])
    dirty_r[1, 2:] = 55.0
    dirty_v[1, 2:] = -3e4
    adv, ret = compute_advantage("gae", dirty_r, mask, None, cfg, values=dirty_v)
    assert torch.equal(adv, clean_adv) and torch.equal(ret, clean_ret)
    assert torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum())))
    # and equal to running on the truncated tensors
    short_adv, short_ret = compute_advantage("gae", rewards[:, :3], mask[:, :3], None, cfg, values=values[:, :3])
    torch.testing.assert_close(adv[:, :3], short_adv, rtol=0, atol=1e-7)
    torch.testing.assert_close(ret[:, :3], short_ret, rtol=0, atol=1e-7)


def test_gae_requires_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", torch.zeros(1, 2), torch.ones(1, 2), None, AdvantageConfig())
    with pytest.raises(ValueError, match="values must be a tensor of shape"):
        compute_advantage("gae", torch.zeros(1, 2), torch.ones(1, 2), None, AdvantageConfig(), values=torch.zeros(1, 3))


# ---------------------------------------------------------------------------------------------
# robustness, validation, registry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_no_nan_and_zero_outside_mask_on_random_inputs(name):
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        batch, length = 8, 6
        mask = torch.rand(batch, length, generator=gen) > 0.3
        mask[0] = False  # an empty response
        mask[1] = True  # no EOS
        rewards = torch.randn(batch, length, generator=gen)
        rewards[~mask] = float("nan")  # garbage outside the mask
        if trial % 2:
            rewards = torch.where(mask, torch.randint(0, 2, (batch, length), generator=gen).float(), rewards)
        index = [i // 2 for i in range(batch)] if trial % 3 else list(range(batch))
        if name == "grpo_passk":
            index = [i // 2 for i in range(batch)]
        extra = {"values": torch.randn(batch, length, generator=gen), "reward_baselines": torch.randn(batch, generator=gen)}
        if name == "opd":  # log-probs with garbage outside the mask; the task advantage mixed in
            lp = [torch.where(mask, -torch.rand(batch, length, generator=gen), torch.tensor(float("nan")))
                  for _ in range(2)]
            extra = {"teacher_log_probs": lp[0], "rollout_log_probs": lp[1], "opd_coef": 1.0, "opd_task_coef": 0.5}
        adv, ret = compute_advantage(name, rewards, mask, index, AdvantageConfig(gamma=0.9, lam=0.95), **extra)
        assert adv.shape == (batch, length) and adv.dtype == torch.float32
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), (name, trial)
        assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum()))), name
        assert torch.equal(ret[~mask], torch.zeros(int((~mask).sum()))), name


def test_outcome_advantage_broadcast_to_every_valid_token():
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    rewards = outcome_rewards([2.0, 1.0], mask)
    for name in ["grpo", "rloo", "opo", "gpg"]:
        adv, _ = compute_advantage(name, rewards, mask, [0, 0], AdvantageConfig())
        for i in range(2):
            vals = adv[i][mask[i]]
            assert torch.equal(vals, vals[0].expand_as(vals)) and vals[0] != 0, name


def test_single_valid_token_batch_whitening_is_finite():
    rewards = torch.tensor([[2.0, 0.0]])
    mask = torch.tensor([[1, 0]])
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, None, AdvantageConfig())
    assert torch.equal(adv, torch.zeros(1, 2))
    assert torch.equal(ret, torch.tensor([[2.0, 0.0]]))
    assert torch.equal(masked_whiten(torch.ones(2, 2), torch.zeros(2, 2)), torch.zeros(2, 2))


def test_input_validation_names_the_problem():
    mask = torch.ones(2, 2)
    rewards = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="expected length 2, got 3"):
        compute_advantage("grpo", rewards, mask, [0, 0, 0], AdvantageConfig())
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", rewards, mask, None, AdvantageConfig())
    bad = rewards.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match="row 1, token 0"):
        compute_advantage("grpo", bad, mask, [0, 0], AdvantageConfig())
    with pytest.raises(ValueError, match="response_mask must be bool or hold only 0 and 1"):
        compute_advantage("grpo", rewards, mask * 2, [0, 0], AdvantageConfig())
    with pytest.raises(ValueError, match="shape"):
        compute_advantage("grpo", rewards, torch.ones(2, 3), [0, 0], AdvantageConfig())
    with pytest.raises(ValueError, match="AdvantageConfig.gamma"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(ValueError, match="AdvantageConfig.pass_k"):
        AdvantageConfig(pass_k=1)


def test_unknown_estimator_lists_registered_names():
    with pytest.raises(ValueError) as err:
        compute_advantage("grpoo", torch.zeros(1, 1), torch.ones(1, 1), [0], AdvantageConfig())
    msg = str(err.value)
    assert "advantage estimator" in msg and "'grpoo'" in msg and "Did you mean 'grpo'?" in msg
    assert str(sorted(ADV_ESTIMATORS.names())) in msg
    assert set(ADV_ESTIMATORS.names()) >= {
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "grpo_passk",
    }


def test_registry_refuses_silent_replacement():
    from trajflow.stages.registry import Registry

    reg = Registry("thing")

    @reg.register("a")
    def first():
        return 1

    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda: 2)
    assert reg.get("a") is first and reg.names() == ["a"] and "a" in reg


def test_config_accepts_numpy_scalars():
    cfg = AdvantageConfig(gamma=np.float32(0.5), lam=np.float64(1.0), pass_k=np.int64(2))
    adv, ret = compute_advantage("reinforce_plus_plus", torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), None, cfg)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0]]))
