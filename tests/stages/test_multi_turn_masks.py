"""Multi-turn rows downstream of the rollout: reward placement, advantages, losses and metrics over
the tokens the policy generated (rollout ``loss_mask`` 1), checked against values worked out by hand.

The running example is the 2-turn episode of the multi-turn design: response tokens
``[a1 a2 | o1 o2 | a3 a4]`` with ``loss_mask [1 1 0 0 1 1]`` (``o1 o2`` are a tool's output), outcome
reward 1 at ``a4``, and a second episode of the same shape with reward 0.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from trajflow.stages.advantage import advantage_table, compute_advantage, AdvantageConfig
from trajflow.stages.policy_update import ActorLossConfig, actor_loss, update_batch, with_loss_mask
from trajflow.stages.policy_losses import PolicyLossConfig
from trajflow.stages.reward import reward_table
from trajflow.batch import trainable_lengths, trainable_mask
from trajflow.gates.iteration import gate_view
from trajflow.metrics import batch_metrics

MASK = [1, 1, 0, 0, 1, 1]
TRAIN = torch.tensor([MASK, MASK], dtype=torch.bool)
REWARD_CFG = {"reward_model": {"enable": False}, "overlong_buffer": {"enable": False}}


def rollout(masks, finish=None, rollout_logprobs=None):
    """A rollout table of multi-turn rows (response tokens 10, 11, ...; int8 loss_mask)."""
    n = len(masks)
    return pa.table({
        "sample_id": [f"s{i}" for i in range(n)],
        "group_id": ["g0"] * n,
        "iteration": pa.array([1] * n, pa.int64()),
        "prompt_ids": pa.array([[1, 2, 3]] * n, pa.list_(pa.int32())),
        "response_ids": pa.array([list(range(10, 10 + len(m))) for m in masks], pa.list_(pa.int32())),
        "rollout_logprobs": pa.array(rollout_logprobs or [[-0.5 * k for k in m] for m in masks], pa.list_(pa.float32())),
        "loss_mask": pa.array(masks, pa.list_(pa.int8())),
        "finish_reason": finish or ["stop"] * n,
        "advantages": pa.array([[1.0] * len(m) for m in masks], pa.list_(pa.float32())),
    })


def whiten(x: np.ndarray) -> np.ndarray:
    """(x - mean) / sqrt(unbiased var + 1e-8) over the given entries (verl's masked_whiten)."""
    return (x - x.mean()) / math.sqrt(x.var(ddof=1) + 1e-8)


# --------------------------------------------------------------------------------------------- reward


def test_outcome_reward_sits_on_the_last_generated_token():
    # Row 0 ends on its own token; row 1 ends inside an observation (the episode ran out of turns),
    # so its reward goes to position 3, the last token with loss_mask 1, not to the last token.
    table = rollout([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]])
    out, _ = reward_table(table, np.array([1.0, 0.5]), [{}, {}], ref_logprobs=None, reward_cfg=REWARD_CFG,
                          algorithm_cfg={}, max_new_tokens=16, kl_coef=0.0)
    assert out.column("token_rewards").to_pylist() == [[0, 0, 0, 0, 0, 1.0], [0, 0, 0, 0.5, 0, 0]]


def test_kl_in_reward_is_shaped_on_generated_tokens_only():
    # k1 KL = old - ref per token; beta = 0.1. Observation tokens get neither reward nor penalty,
    # and critic/kl is the mean over rows of each row's mean over its 4 generated tokens.
    old = [[-1.0, -1.0, 0.0, 0.0, -1.0, -1.0]]
    ref = [np.array([-2.0, -1.5, -9.0, -9.0, -1.0, -3.0], np.float32)]
    table = rollout([MASK], rollout_logprobs=old)
    out, metrics = reward_table(table, np.array([1.0]), [{}], ref_logprobs=ref, reward_cfg=REWARD_CFG,
                                algorithm_cfg={"use_kl_in_reward": True, "kl_penalty": "kl"},
                                max_new_tokens=16, kl_coef=0.1)
    kl = [1.0, 0.5, None, None, 0.0, 2.0]
    expected = [-0.1 * 1.0, -0.1 * 0.5, 0.0, 0.0, -0.1 * 0.0, 1.0 - 0.1 * 2.0]
    assert out.column("token_rewards").to_pylist()[0] == pytest.approx(expected, abs=1e-6)
    assert metrics["critic/kl"] == pytest.approx((1.0 + 0.5 + 0.0 + 2.0) / 4)
    assert kl[2] is None  # the observation tokens' (large) log-ratio never entered


def test_overlong_penalty_counts_generated_tokens():
    # DAPO eq. 13 with L_max = 6, L_cache = 4: 4 generated tokens -> (2 - 4) / 4 = -0.5 (times 1.0);
    # counting all 6 response tokens would give -1.0.
    cfg = {**REWARD_CFG, "overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 1.0}}
    out, _ = reward_table(rollout([MASK]), np.array([1.0]), [{}], ref_logprobs=None, reward_cfg=cfg,
                          algorithm_cfg={}, max_new_tokens=6, kl_coef=0.0)
    assert out.column("score").to_pylist() == [pytest.approx(0.5)]


# --------------------------------------------------------------------------------------------- advantage


def test_reinforce_plus_plus_return_is_not_reset_at_the_observation():
    rewards = torch.tensor([[0, 0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0, 0.0]])
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, TRAIN, None, AdvantageConfig(gamma=1.0))
    assert ret.tolist() == [[1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]]
    # 8 trainable returns: four 1s and four 0s. mean 0.5, unbiased var 8 * 0.25 / 7 = 2 / 7.
    a = 0.5 / math.sqrt(2 / 7 + 1e-8)
    assert a == pytest.approx(0.9354, abs=5e-5)
    assert adv.numpy() == pytest.approx(np.array([[a, a, 0, 0, a, a], [-a, -a, 0, 0, -a, -a]]), abs=1e-6)
    # A return-to-go reset at the observation (G restarting at a3) would give [0 0 . . 1 1] instead:
    buggy = whiten(np.array([0, 0, 1, 1, 0, 0, 0, 0], dtype=np.float64))
    assert buggy[:4] == pytest.approx([-0.5401, -0.5401, 1.6202, 1.6202], abs=5e-5)
    assert not np.allclose(adv[0][TRAIN[0]].numpy(), buggy[:4], atol=1e-3)


def test_gae_bootstraps_across_the_observation_span():
    # gamma 0.9, lambda 0.8. The values on o1 o2 are garbage (9.0): they must not be used.
    # Episode 1 (reward 1 at a4), values a1..a4 = 0.5 0.6 0.7 0.8; next(a2) = a3:
    #   A(a4) = 1 - 0.8                                    = 0.2
    #   A(a3) = 0.9 * 0.8 - 0.7 + 0.72 * 0.2               = 0.164
    #   A(a2) = 0.9 * 0.7 - 0.6 + 0.72 * 0.164             = 0.14808
    #   A(a1) = 0.9 * 0.6 - 0.5 + 0.72 * 0.14808           = 0.1466176
    # Episode 2 (reward 0), values 0.2 0.1 0.3 0.4:
    #   A(a4) = -0.4; A(a3) = 0.9 * 0.4 - 0.3 - 0.72 * 0.4 = -0.228
    #   A(a2) = 0.9 * 0.3 - 0.1 + 0.72 * -0.228            = 0.00584
    #   A(a1) = 0.9 * 0.1 - 0.2 + 0.72 * 0.00584           = -0.1057952
    rewards = torch.tensor([[0, 0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 9.0, 9.0, 0.7, 0.8], [0.2, 0.1, 9.0, 9.0, 0.3, 0.4]])
    adv, ret = compute_advantage("gae", rewards, TRAIN, None, AdvantageConfig(gamma=0.9, lam=0.8), values=values)
    raw = np.array([0.1466176, 0.14808, 0.164, 0.2, -0.1057952, 0.00584, -0.228, -0.4])
    v = np.array([0.5, 0.6, 0.7, 0.8, 0.2, 0.1, 0.3, 0.4])
    assert ret[TRAIN].numpy() == pytest.approx(raw + v, abs=1e-6)
    assert adv[TRAIN].numpy() == pytest.approx(whiten(raw), abs=1e-5)
    assert adv[~TRAIN].tolist() == [0.0] * 4 and ret[~TRAIN].tolist() == [0.0] * 4


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg"])
def test_outcome_estimators_broadcast_to_generated_tokens_only(name):
    rewards = torch.tensor([[0, 0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0, 0.0]])
    adv, _ = compute_advantage(name, rewards, TRAIN, ["g", "g"], AdvantageConfig())
    assert adv[~TRAIN].tolist() == [0.0] * 4
    assert len(set(adv[0][TRAIN[0]].tolist())) == 1 and adv[0, 0] > 0 > adv[1, 0]


def test_advantage_stage_reads_the_rollout_loss_mask():
    # GRPO with two rows of one group: scores 1 and 0, mean 0.5, unbiased std sqrt(0.5):
    # +/- 0.5 / (sqrt(0.5) + 1e-6) on each generated token.
    table = rollout([MASK, MASK])
    rew, _ = reward_table(table, np.array([1.0, 0.0]), [{}, {}], ref_logprobs=None, reward_cfg=REWARD_CFG,
                          algorithm_cfg={}, max_new_tokens=16, kl_coef=0.0)
    joined = table.append_column("token_rewards", rew.column("token_rewards"))
    out = advantage_table(joined, {"adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0,
                                   "norm_adv_by_std_in_grpo": True})
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert out.column("advantages").to_pylist() == [pytest.approx([a, a, 0, 0, a, a]),
                                                    pytest.approx([-a, -a, 0, 0, -a, -a])]


# --------------------------------------------------------------------------------------------- losses


ADV = torch.tensor([[1.0, 2.0, 100.0, 100.0, 3.0, 4.0], [-2.0, 50.0, 50.0, 50.0, -3.0, -6.0]])
LOSS_MASK = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 1, 1]], dtype=torch.float32)


@pytest.mark.parametrize("mode, expected", [
    # On policy the ratio is 1, so the per-token PPO loss is -A. Trainable sums: row 0 10 (4 tokens),
    # row 1 -11 (3 tokens); 7 trainable tokens of 12.
    ("token-mean", -(10 - 11) / 7),
    ("seq-mean-token-sum", -(10 - 11) / 2),
    ("seq-mean-token-mean", -(10 / 4 - 11 / 3) / 2),
    ("seq-mean-token-sum-norm", -(10 - 11) / 8 / 2),  # horizon 8 (the response cap)
])
def test_every_aggregation_mode_counts_only_trainable_tokens(mode, expected):
    logp = torch.full((2, 6), -1.0)
    logp[:, 2:4] = -50.0  # observation tokens: improbable under the policy, and must not matter
    entropy = torch.tensor([[1.0, 2.0, 99.0, 99.0, 3.0, 4.0], [5.0, 99.0, 99.0, 99.0, 6.0, 7.0]])
    ref = logp.clone()
    ref[0, 0] = -2.0  # k1 KL = logp - ref = 1.0 on one trainable token
    ref[:, 2:4] = 0.0  # a large KL on the observation tokens, masked away
    cfg = ActorLossConfig(loss=PolicyLossConfig(loss_agg_mode=mode), kl_loss_coef=0.5, kl_loss_type="kl")
    agg = {"global_num_tokens": 7.0, "global_num_seqs": 2.0, "horizon": 8}
    loss, metrics = actor_loss(logp, logp.detach(), ADV, LOSS_MASK, entropy=entropy, ref_logp=ref, cfg=cfg,
                               agg_kw=agg)
    assert metrics["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    ent = {"token-mean": (10 + 18) / 7, "seq-mean-token-sum": (10 + 18) / 2,
           "seq-mean-token-mean": (10 / 4 + 18 / 3) / 2, "seq-mean-token-sum-norm": (10 + 18) / 8 / 2}[mode]
    kl = {"token-mean": 1 / 7, "seq-mean-token-sum": 1 / 2, "seq-mean-token-mean": (1 / 4) / 2,
          "seq-mean-token-sum-norm": 1 / 8 / 2}[mode]
    assert metrics["actor/entropy"] == pytest.approx(ent, abs=1e-5)
    assert metrics["actor/kl_loss"] == pytest.approx(kl, abs=1e-6)
    assert float(loss) == pytest.approx(expected + 0.5 * kl, abs=1e-5)


# --------------------------------------------------------------------------------------------- update batch


def test_quarantine_mask_multiplies_the_rollout_mask():
    table = rollout([MASK, [1, 0, 1, 1]])
    joined = with_loss_mask(table, {"quarantined_sample_ids": ["s1"]})
    assert joined.column_names.count("loss_mask") == 1
    assert joined.column("loss_mask").to_pylist() == [[1, 1, 0, 0, 1, 1], [0, 0, 0, 0]]
    assert joined.column("loss_mask").type == pa.list_(pa.float32())
    # Nothing quarantined: the rollout's own mask reaches the update unchanged.
    batch = update_batch(with_loss_mask(table, {"quarantined_sample_ids": []}), 1, seed=0, n=2,
                         ppo_mini_batch_size=1, use_ref_logprobs=False)
    assert batch.rows.loss_mask == [[1, 1, 0, 0, 1, 1], [1, 0, 1, 1]]


def test_single_turn_quarantine_is_unchanged():
    table = rollout([[1, 1, 1], [1, 1]]).drop_columns(["loss_mask"])
    joined = with_loss_mask(table, {"quarantined_sample_ids": ["s0"]})
    assert joined.column("loss_mask").to_pylist() == [[0, 0, 0], [1, 1]]


def test_truncation_mask_applies_on_top_of_the_rollout_mask():
    table = rollout([MASK, [1, 0, 1, 1]], finish=["stop", "length"])
    batch = update_batch(table, 1, seed=0, n=2, ppo_mini_batch_size=1, use_ref_logprobs=False,
                         mask_truncated=True)
    assert batch.rows.loss_mask == [[1, 1, 0, 0, 1, 1], [0.0] * 4]


# --------------------------------------------------------------------------------------------- metrics and gate


def test_trainable_mask_and_lengths():
    table = rollout([MASK, [0, 1]])
    assert trainable_mask(table).tolist() == [[True, True, False, False, True, True],
                                              [False, True, False, False, False, False]]
    assert trainable_lengths(table).tolist() == [4, 1]
    assert trainable_lengths(table.drop_columns(["loss_mask"])).tolist() == [6, 2]
    bad = table.set_column(table.column_names.index("loss_mask"), "loss_mask",
                           pa.array([[1, 1], [0, 1]], pa.list_(pa.int8())))
    with pytest.raises(Exception, match="row 0: loss_mask has 2 entries but response_ids has 6"):
        trainable_mask(bad)


def test_batch_metrics_of_multi_turn_rows():
    table = rollout([MASK, [1, 1, 1, 0]])
    joined = table.append_column("score", pa.array([1.0, 0.0], pa.float32())).set_column(
        table.column_names.index("advantages"), "advantages",
        pa.array([[2, 2, 0, 0, 2, 2], [-1, -1, -1, 0]], pa.list_(pa.float32())))
    m = batch_metrics(joined)
    assert m["response_length/mean"] == 5.0  # every response token, as verl
    assert m["response_length_trainable/mean"] == 3.5 and m["response_length_trainable/max"] == 4.0
    # Over the 7 generated tokens (the observation zeros left out): (4 * 2 - 3) / 7.
    assert m["critic/advantages/mean"] == pytest.approx(5 / 7)
    assert m["critic/advantages/min"] == -1.0


def test_gate_measures_generated_tokens():
    table = rollout([MASK, [1, 1, 1, 0]])
    reward = pa.table({"sample_id": ["s0", "s1"], "score": pa.array([1.0, 0.0], pa.float32()),
                       "reward_error": pa.array([None, None], pa.string())})
    assert gate_view(table, reward).column("response_length").to_pylist() == [4, 3]
