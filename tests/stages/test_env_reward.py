"""The ``env`` scorer: a multi-turn episode's own reward as its score, its combination with a reward
model and overlong shaping, and the errors for rows without one (values worked out by hand)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from trajflow.stages.reward import check_env_rewards, compute_scores, final_scores, rollout_env_rewards, score_rows
from trajflow.stages.scorers import SCORERS
from trajflow.errors import ConfigError, DataError

SRC = "reasoning_gym/basic_arithmetic"


def test_env_scorer_is_registered_and_returns_the_reward():
    assert "env" in SCORERS.names()
    assert SCORERS.get("env")("x", "any text", "7", None, env_reward=0.75) == 0.75
    with pytest.raises(ValueError, match="no env_reward"):
        SCORERS.get("env")("x", "any text", "7", None)


def test_env_scorer_ignores_the_text():
    # "Answer: 7" is right for the text scorer (1.0 + 0.1 format bonus); env reads only the rewards.
    res = score_rows([SRC] * 3, ["Answer: 7", "Answer: 7", "nothing"], ["7"] * 3, [None] * 3,
                     {"scorer": "env"}, env_rewards=[0.25, -1.5, 2.0], row_prompt_ids=["a", "b", "c"])
    np.testing.assert_array_equal(res.scores, np.array([0.25, -1.5, 2.0], np.float32))
    assert res.num_errors == 0 and res.extras == [{}, {}, {}]
    text = score_rows([SRC], ["Answer: 7"], ["7"], [None], {}, env_rewards=[0.25])
    np.testing.assert_allclose(text.scores, [1.1])  # the dataset's scorer when env is not selected


def test_default_scorer_env_applies_to_unmapped_sources_only():
    res = compute_scores([SRC, "my/env"], ["Answer: 7", "x"], ["7", "7"], [None, None],
                         default_scorer="env", env_rewards=[None, 0.5])
    np.testing.assert_allclose(res.scores, [1.1, 0.5])  # the reasoning_gym row needs no env_reward


def test_null_env_reward_is_refused_naming_the_key_row_and_prompt():
    with pytest.raises(DataError) as e:
        compute_scores([SRC] * 3, ["a", "b", "c"], ["1"] * 3, [None] * 3, scorer="env",
                       env_rewards=[1.0, 0.0, None], row_prompt_ids=["p0", "p1", "p2"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("reward.scorer=env: row 2 (prompt_id 'p2') has env_reward null")
    assert "StepResult(reward=...)" in msg
    with pytest.raises(DataError, match=r"^reward.default_scorer=env: row 0 \(prompt_id 'q'\)"):
        check_env_rewards(["my/env"], [None], ["q"], {"default_scorer": "env"})


def test_single_turn_rows_are_refused():
    with pytest.raises(DataError, match=r"^reward.scorer=env: row 0 \(prompt_id '5'\) is single-turn"):
        check_env_rewards([SRC], None, ["5"], {"scorer": "env"})
    with pytest.raises(DataError, match="single-turn"):
        compute_scores([SRC], ["a"], ["1"], [None], scorer="env")


def test_check_env_rewards_passes_other_scorers_and_custom_functions():
    check_env_rewards([SRC], None, ["5"], {})
    check_env_rewards([SRC], [None], ["5"], {"scorer": "exact_match"})
    check_env_rewards([SRC], [None], ["5"], {"scorer": "env", "custom_function": "f.py:g"})  # it wins


def test_custom_function_gets_env_reward_when_it_declares_it():
    def mixed(data_source, solution_str, ground_truth, extra_info=None, env_reward=None):
        return (1.0 if solution_str == ground_truth else 0.0) + 0.5 * (env_reward or 0.0)

    def plain(data_source, solution_str, ground_truth, extra_info=None):
        return 2.0

    res = compute_scores(["s", "s"], ["7", "8"], ["7", "7"], [None, None], custom_function=mixed,
                         env_rewards=[0.4, None])
    np.testing.assert_allclose(res.scores, [1.0 + 0.2, 0.0])
    res = compute_scores(["s"], ["7"], ["7"], [None], custom_function=plain, env_rewards=[0.4])
    assert res.num_errors == 0 and float(res.scores[0]) == 2.0


def test_env_score_combines_like_a_rule_score():
    env = np.array([1.0, 0.25], np.float32)
    cfg = {"reward_model": {"enable": True, "rule_weight": 2.0, "rm_weight": 0.5},
           "overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 1.0}}
    # lengths 4 and 10 with max_new_tokens 10, buffer 4: no penalty, then (6 - 10) / 4 = -1
    score, metrics = final_scores(env, np.array([0.2, -0.4]), np.array([4, 10]), cfg, 10)
    np.testing.assert_allclose(score, [2.0 * 1.0 + 0.5 * 0.2, 2.0 * 0.25 + 0.5 * -0.4 - 1.0], rtol=1e-6)
    assert metrics["reward/rule_score/mean"] == pytest.approx(0.625)


def test_rollout_env_rewards_reads_the_column():
    t = pa.table({"sample_id": ["a", "b"], "env_reward": pa.array([0.5, None], pa.float32())})
    assert rollout_env_rewards(t) == [0.5, None]
    assert rollout_env_rewards(t.drop(["env_reward"])) is None


def test_scorer_env_needs_multi_turn_in_the_config():
    from trajflow.config import load_config

    with pytest.raises(ConfigError, match=r"reward.scorer='env' .*rollout.multi_turn.enable=true"):
        load_config("grpo_default", ["reward.scorer=env"])
    with pytest.raises(ConfigError, match=r"reward.default_scorer='env'"):
        load_config("grpo_default", ["reward.default_scorer=env"])
    cfg = load_config("grpo_tool_calculator", ["reward.scorer=env"])
    assert cfg.reward.scorer == "env"
