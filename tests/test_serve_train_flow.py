"""``rollout.agent``: an agent written against the OpenAI SDK trains through the real flow (Prefect,
Ray, MLflow on SQLite); its rows are token-exact multi-turn rows with the agent's errors recorded
per row, and the stages after the rollout (reward, gate, advantage, update) run on them."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_overrides
from tests.mt_envs import make_eos_model

pytestmark = pytest.mark.usefixtures("ray_local")


def test_agent_rows_train_through_the_flow(tmp_path):
    from trajflow.flows.train import train

    model = make_eos_model(tmp_path / "eos-model")
    over = tiny_overrides(model, tmp_path / "runs", **{
        "data.dataset": "basic_arithmetic_tool", "rollout.max_new_tokens": 64,
        "rollout.multi_turn.max_tokens_per_turn": 16, "rollout.agent": "tests.serve_agents:every_fourth_crashes",
        "rollout.agent_timeout_s": 120, "trainer.total_iterations": 1, "trainer.test_freq": 1,
        "trainer.val_before_train": False,
        "trainer.log_samples": 0, "trainer.save_freq": 1})
    summary = train("grpo_tool_calculator", over)
    run_dir = Path(summary["run_dir"])
    m = summary["metrics"]
    assert m["rollout/agent_error_frac"] == 0.25  # one episode in four crashed, the iteration went on
    assert "actor/pg_loss" in m and m["val-aux/response_length/mean"] > 0
    for it in ("000001",):
        rows = pq.read_table(run_dir / "iterations" / it / "rollout.parquet").to_pylist()
        assert len(rows) == 4
        errors = [r for r in rows if r["agent_error"] is not None]
        assert len(errors) == 1 and errors[0]["agent_error"] == "RuntimeError: the agent fell over"
        assert errors[0]["loss_mask"] == [0] and errors[0]["env_reward_source"] == "agent_error"
        for r in rows:
            n = len(r["response_ids"])
            assert len(r["loss_mask"]) == len(r["rollout_logprobs"]) == n <= 64
            assert all(lp == 0.0 for lp, k in zip(r["rollout_logprobs"], r["loss_mask"]) if k == 0)
            if r["agent_error"] is None:
                assert r["agent_calls"] >= 1 and r["num_turns"] >= 1 and r["loss_mask"][0] == 1
                # The prompt is the agent's first request: its system prompt, the worked example, the task.
                assert [p["role"] for p in r["prompt"]][:3] == ["system", "user", "assistant"]
                assert r["agent_answer"] is not None
        reward = pq.read_table(run_dir / "iterations" / it / "reward.parquet").to_pylist()
        assert len(reward) == 4
    assert m["rollout/tito_drift_tokens"] >= 0
