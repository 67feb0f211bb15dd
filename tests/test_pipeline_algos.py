"""Batch-level wiring of the algorithm family (stages): score combination and shaping,
ReMax baselines, truncation masking, critic values in the advantage table, dynamic-sampling helpers.
Expected values are worked by hand."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from trajflow.stages import advantage as advantage_stage
from trajflow.stages import dynamic_sampling, seeds
from trajflow.stages import reward as reward_stage
from trajflow.stages import rollout as rollout_stage
from trajflow.stages.critic_update import critic_batch
from trajflow.stages.policy_update import actor_loss_mask, update_batch, update_batch_options
from trajflow.stages.rollout import Generation

ALGO = {"adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True,
        "use_kl_in_reward": False, "kl_penalty": "kl"}


def reward_cfg(rm=False, overlong=False, rule_weight=1.0, rm_weight=1.0):
    return {"overlong_buffer": {"enable": overlong, "len": 4, "penalty_factor": 1.0},
            "reward_model": {"enable": rm, "rule_weight": rule_weight, "rm_weight": rm_weight}}


def rollout(response_ids, finish=None, group_ids=None, extra=None):
    n = len(response_ids)
    cols = {"sample_id": pa.array([f"s{i}" for i in range(n)]),
            "group_id": pa.array(group_ids or [f"g{i // 2}" for i in range(n)]),
            "prompt_ids": pa.array([[1, 2]] * n, pa.list_(pa.int32())),
            "response_ids": pa.array(response_ids, pa.list_(pa.int32())),
            "finish_reason": pa.array(finish or ["stop"] * n)}
    cols.update(extra or {})
    return pa.table(cols)


def test_final_scores_combine_rule_and_rm_then_shape():
    rule = np.array([1.0, 0.0, 0.5])
    rm = np.array([2.0, -1.0, 0.0])
    lengths = np.array([3, 6, 8])
    # weights 0.5 / 2: [0.5 + 4, 0 - 2, 0.25 + 0]
    s, m = reward_stage.final_scores(rule, rm, lengths, reward_cfg(rm=True, rule_weight=0.5, rm_weight=2.0), 8)
    np.testing.assert_allclose(s, [4.5, -2.0, 0.25])
    assert m["reward/rule_score/mean"] == pytest.approx(0.5) and m["reward/rm_score/mean"] == pytest.approx(1 / 3)
    # overlong buffer 4 of cap 8: lengths 3 -> 0, 6 -> -(6 - 4) / 4 = -0.5, 8 -> -1
    s2, m2 = reward_stage.final_scores(rule, rm, lengths, reward_cfg(rm=True, overlong=True, rule_weight=0.5, rm_weight=2.0), 8)
    np.testing.assert_allclose(s2, [4.5, -2.5, -0.75])
    assert m2["reward/overlong_penalty/mean"] == pytest.approx(-0.5)
    # without a reward model the rule score is the score, rm scores are ignored
    s3, _ = reward_stage.final_scores(rule, None, lengths, reward_cfg(), 8)
    np.testing.assert_allclose(s3, rule)
    with pytest.raises(ValueError, match="reward-model scores are missing"):
        reward_stage.final_scores(rule, None, lengths, reward_cfg(rm=True), 8)


def test_reward_table_stores_rule_rm_and_baseline_columns():
    t = rollout([[5, 6, 7], [5], [8, 9], [8, 9, 10, 11]])
    out, m = reward_stage.reward_table(t, np.array([1.0, 0.0, 1.0, 1.0]), [{}] * 4, ref_logprobs=None,
                                   reward_cfg=reward_cfg(rm=True, rule_weight=1.0, rm_weight=0.5),
                                   algorithm_cfg=ALGO, max_new_tokens=8, kl_coef=0.0,
                                   rm_scores=np.array([2.0, 4.0, -2.0, 0.0]),
                                   reward_baselines=np.array([0.5, 0.5, 1.5, 1.5]))
    assert out.column("score").to_pylist() == [2.0, 2.0, 0.0, 1.0]
    assert out.column("rule_score").to_pylist() == [1.0, 0.0, 1.0, 1.0]
    assert out.column("rm_score").to_pylist() == [2.0, 4.0, -2.0, 0.0]
    assert out.column("reward_baseline").to_pylist() == [0.5, 0.5, 1.5, 1.5]
    # the outcome sits on the last token
    assert out.column("token_rewards").to_pylist() == [[0.0, 0.0, 2.0], [2.0], [0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    assert m["reward/baseline/mean"] == pytest.approx(1.0)


def test_remax_advantage_is_return_minus_greedy_baseline():
    t = rollout([[5, 6, 7], [5, 6]], extra={"token_rewards": pa.array([[0.0, 0.0, 1.0], [0.0, 0.25]], pa.list_(pa.float32()))})
    adv = advantage_stage.advantage_table(t, {**ALGO, "adv_estimator": "remax"}, reward_baselines=np.array([0.75, 0.75]))
    # ReMax: A_t = sum_{s >= t} r_s - b, b = the greedy response's score
    assert adv.column("advantages").to_pylist() == [[0.25, 0.25, 0.25], [-0.5, -0.5]]
    assert adv.column("returns").to_pylist() == [[1.0, 1.0, 1.0], [0.25, 0.25]]


def test_gae_advantage_table_stores_the_critic_values():
    t = rollout([[5, 6], [7]], extra={"token_rewards": pa.array([[0.0, 1.0], [2.0]], pa.list_(pa.float32()))})
    values = [np.array([0.5, 0.25], np.float32), np.array([1.0], np.float32)]
    out = advantage_stage.advantage_table(t, {**ALGO, "adv_estimator": "gae"}, values=values)
    assert out.column("values").to_pylist() == [[0.5, 0.25], [1.0]]
    # gamma = lam = 1: returns = sum of future rewards; raw A = R - V = [0.5, 0.75], [1.0], then whitened
    assert out.column("returns").to_pylist() == [[1.0, 1.0], [2.0]]
    raw = np.array([0.5, 0.75, 1.0])
    whitened = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.concatenate(out.column("advantages").to_pylist()), whitened, rtol=1e-5)


def test_actor_loss_mask_zeroes_truncated_rows_and_keeps_quarantine():
    t = rollout([[5, 6], [7, 8, 9], [1]], finish=["stop", "length", "stop"])
    assert actor_loss_mask(t, False) == (None, {})
    mask, m = actor_loss_mask(t, True)
    assert mask == [[1.0, 1.0], [0.0, 0.0, 0.0], [1.0]]
    assert m == {"batch/masked_truncated": 1.0}
    quarantined = t.append_column("loss_mask", pa.array([[1.0, 1.0], [1.0, 1.0, 1.0], [0.0]], pa.list_(pa.float32())))
    mask, _ = actor_loss_mask(quarantined, True)
    assert mask == [[1.0, 1.0], [0.0, 0.0, 0.0], [0.0]]


def test_filter_metric_prefers_the_scorers_acc():
    scores = np.array([1.1, 0.1, -0.5])
    extras = [{"acc": 1.0}, {"acc": 0.0}, {"error": "boom"}]
    np.testing.assert_allclose(dynamic_sampling.filter_metric(scores, extras, "acc"), [1.0, 0.0, -0.5])
    np.testing.assert_allclose(dynamic_sampling.filter_metric(scores, extras, "score"), scores)


def test_sample_ids_continue_across_generation_batches_and_baseline_columns():
    sids, gids = rollout_stage.sample_ids(3, 2, 2, offset=4)
    assert sids == ["it000003-p0004-s0", "it000003-p0004-s1", "it000003-p0005-s0", "it000003-p0005-s1"]
    assert gids == ["it000003-p0004"] * 2 + ["it000003-p0005"] * 2
    greedy = Generation(response_ids=[[4, 2], [9]], response_text=["a", "b"], finish_reason=["stop", "stop"],
                        rollout_logprobs=None, policy_version=0)
    cols = rollout_stage.baseline_columns([0, 0, 1, 1], greedy)
    assert cols["baseline_response_ids"].to_pylist() == [[4, 2], [4, 2], [9], [9]]
    assert cols["baseline_response_text"].to_pylist() == ["a", "a", "b", "b"]


def test_config_rules_for_the_new_keys():
    from trajflow.errors import ConfigError
    from trajflow.config import load_config

    with pytest.raises(ConfigError, match="reward.reward_model.enable=true needs reward.reward_model.path"):
        load_config(None, ["reward.reward_model.enable=true"])
    with pytest.raises(ConfigError, match="filter_groups.enable=true needs rollout.n >= 2"):
        load_config(None, ["algorithm.filter_groups.enable=true", "rollout.n=1"])
    with pytest.raises(ConfigError, match="overlong_buffer.len=64 must be <= rollout.max_new_tokens=32"):
        load_config(None, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=64",
                           "rollout.max_new_tokens=32"])
    with pytest.raises(ConfigError, match="algorithm.rollout_is='seq' is not allowed"):
        load_config(None, ["algorithm.rollout_is=seq"])
    with pytest.raises(ConfigError, match="algorithm.filter_groups.metric"):
        load_config(None, ["algorithm.filter_groups.metric=seq_reward"])
    cfg = load_config(None, ["algorithm.rollout_is=sequence", "algorithm.rollout_is_threshold=3.5"])
    assert (cfg.algorithm.rollout_is, cfg.algorithm.rollout_is_threshold) == ("sequence", 3.5)
    with pytest.raises(ConfigError, match="algorithm.rollout_rs='icepop' is not allowed"):
        load_config(None, ["algorithm.rollout_rs=icepop"])
    with pytest.raises(ConfigError, match=r"rollout_rs_threshold_lower=3.0 must be <= the upper bound 2.5"):
        load_config(None, ["algorithm.rollout_rs=token", "algorithm.rollout_rs_threshold=2.5",
                           "algorithm.rollout_rs_threshold_lower=3"])


def test_update_and_critic_batches_carry_the_new_options():
    from trajflow.config import load_config

    t = rollout([[5, 6], [7, 8, 9]], finish=["stop", "length"],
                extra={"rollout_logprobs": pa.array([[-1.0, -2.0], [-1.0, -1.0, -1.0]], pa.list_(pa.float32())),
                       "advantages": pa.array([[0.5, 0.5], [-1.0, -1.0, -1.0]], pa.list_(pa.float32())),
                       "values": pa.array([[0.1, 0.2], [0.0, 0.0, 0.3]], pa.list_(pa.float32())),
                       "returns": pa.array([[1.0, 1.0], [0.0, 0.0, 0.0]], pa.list_(pa.float32()))})
    cfg = load_config(None, ["algorithm.mask_truncated_samples=true", "algorithm.rollout_is=sequence",
                             "algorithm.rollout_is_threshold=3", "rollout.n=2", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=2", "trainer.seed=7"])
    b = update_batch(t, 5, **update_batch_options(cfg))
    assert b.rows.loss_mask == [[1.0, 1.0], [0.0, 0.0, 0.0]]  # the truncated row is out of the policy loss
    assert (b.settings.rollout_is, b.settings.rollout_is_threshold) == ("sequence", 3.0)
    assert b.settings.rollout_rs is None
    rs = load_config(None, ["algorithm.rollout_rs=geometric", "algorithm.rollout_is_threshold=3", "rollout.n=2",
                            "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                            "algorithm.rollout_rs_threshold_lower=0"])
    s = update_batch(t, 5, **update_batch_options(rs)).settings
    # the upper bound defaults to rollout_is_threshold; lower 0 = one-sided (TRL's sequence_mask)
    assert (s.rollout_rs, s.rollout_rs_threshold, s.rollout_rs_threshold_lower) == ("geometric", 3.0, 0.0)
    assert b.settings.mini_batch_rows == 4 and b.settings.shuffle_seed == seeds.iteration_seed(7, 5, 1)
    plain = update_batch(t, 5, seed=7, n=2, ppo_mini_batch_size=2, use_ref_logprobs=False)
    assert plain.rows.loss_mask is None and plain.settings.rollout_is is None
    c = critic_batch(t, 5, cfg)
    assert c.rows.values == [[pytest.approx(0.1), pytest.approx(0.2)], [0.0, 0.0, pytest.approx(0.3)]]
    assert c.rows.returns == [[1.0, 1.0], [0.0, 0.0, 0.0]] and c.rows.loss_mask is None  # truncation: actor only
    assert c.settings.mini_batch_rows == 4 and c.settings.shuffle_seed == seeds.iteration_seed(7, 5, 4)



@pytest.mark.parametrize("overrides, match", [
    (["actor.lr=inf"], r"actor\.lr=inf is not a finite number"),
    (["gates.score_min=nan"], r"gates\.score_min=nan is not a finite number"),
    (["actor.betas=[2,3]"], r"actor\.betas=\[2, 3\] must be two numbers in \[0, 1\)"),
    (["rollout.n=1"], r"adv_estimator='grpo' compares the samples of one prompt.*rollout\.n >= 2"),
    (["rollout.n=1", "algorithm.adv_estimator=rloo"], r"'rloo' compares the samples"),
])
def test_config_that_would_train_garbage_is_rejected(overrides, match):
    from trajflow.config import load_config
    from trajflow.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_group_free_estimators_accept_one_sample_per_prompt():
    from trajflow.config import load_config

    for est in ("reinforce_plus_plus", "remax", "gae"):
        assert load_config(None, ["rollout.n=1", f"algorithm.adv_estimator={est}"]).rollout.n == 1


def test_smoke_recipe_and_mini_batch_that_follows_the_train_batch():
    from trajflow.config import load_config

    smoke = load_config("smoke")
    assert (smoke.data.train_batch_size, smoke.actor.ppo_mini_batch_size, smoke.trainer.total_iterations) == (2, 2, 2)
    assert load_config(None, ["data.train_batch_size=2"]).actor.ppo_mini_batch_size == 2  # no coupled override
    assert load_config(None, ["data.train_batch_size=16", "actor.ppo_mini_batch_size=4"]).actor.ppo_mini_batch_size == 4
