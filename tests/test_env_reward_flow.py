"""``reward.scorer=env`` through the real train and replay flows (Prefect, Ray, MLflow on SQLite) and the
CLI: the stored score is the environment's reward, worked out by hand from the stored messages; a
replay from the reward stage computes it again; an episode without a reward stops the run in one line
and leaves the rollout stored."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_overrides
from tests.mt_envs import make_eos_model, rewarded_turns_expected

TRAJFLOW = str(Path(sys.executable).parent / "trajflow")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory) -> Path:
    return make_eos_model(tmp_path_factory.mktemp("eos-model"))


def _overrides(model: Path, root: Path, environment: str, **extra) -> list[str]:
    # 40 tokens per turn: with EOS at p~0.2 per token a turn is cut with p~1e-4, so nearly every
    # episode stops after its second message (the expected values handle a cut one as well).
    return tiny_overrides(model, root, **{
        "data.dataset": "basic_arithmetic_tool", "rollout.max_new_tokens": 96,
        "rollout.multi_turn.enable": True, "rollout.multi_turn.environment": environment,
        "rollout.multi_turn.max_assistant_turns": 4, "rollout.multi_turn.max_tokens_per_turn": 40,
        "reward.scorer": "env", "trainer.total_iterations": 1, "trainer.log_samples": 0, **extra})


@pytest.mark.usefixtures("ray_local")
def test_env_reward_is_the_score_and_replay_recomputes_it(eos_model, tmp_path):
    from trajflow.flows.replay import replay
    from trajflow.flows.train import train

    root = tmp_path / "runs"
    summary = train("grpo_tool_calculator", _overrides(eos_model, root, "tests.mt_envs:rewarded_turns"))
    it = Path(summary["run_dir"]) / "iterations" / "000001"
    rollout = {r["sample_id"]: r for r in pq.read_table(it / "rollout.parquet").to_pylist()}
    scores = {r["sample_id"]: r["score"] for r in pq.read_table(it / "reward.parquet").to_pylist()}
    assert len(rollout) == 4 and set(scores) == set(rollout)
    expected = {sid: rewarded_turns_expected(row) for sid, row in rollout.items()}
    for sid, row in rollout.items():
        assert row["env_reward"] == pytest.approx(expected[sid], rel=1e-6)
        assert scores[sid] == pytest.approx(expected[sid], rel=1e-6), (sid, row["messages"])
    assert any(row["finish_reason"] == "stop" for row in rollout.values())
    m = summary["metrics"]
    assert m["critic/score/mean"] == pytest.approx(sum(expected.values()) / 4, rel=1e-5)
    # Validation scored its episodes by their rewards too: every episode earns at least 0.5.
    val = [v for k, v in m.items() if k.startswith("val-core/") and k.endswith("/acc/mean_at_1")]
    assert val and all(v >= 0.5 for v in val)

    again = replay(summary["run_id"], "reward", iteration=1,  # the stored environment, named again
                   overrides=[f"store.root={root}", "rollout.multi_turn.environment=tests.mt_envs:rewarded_turns"])
    replayed = {r["sample_id"]: r["score"] for r in
                pq.read_table(Path(again["run_dir"]) / "iterations" / "000001" / "reward.parquet").to_pylist()}
    assert replayed == scores


def test_cli_refuses_an_episode_without_env_reward_and_keeps_the_rollout(eos_model, tmp_path):
    root = tmp_path / "runs"
    over = _overrides(eos_model, root, "tests.mt_envs:unrewarded", **{"trainer.test_freq": 0})
    # The environment lives in tests/, which only the repository root on the path makes importable.
    env = {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + os.environ["PYTHONPATH"]
                                                    if os.environ.get("PYTHONPATH") else "")}
    p = subprocess.run([TRAJFLOW, "train", "--config", "grpo_tool_calculator", "--run-id", "norew", *over],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    rows = pq.read_table(root / "norew" / "iterations" / "000001" / "rollout.parquet").to_pylist()
    first = rows[0]
    assert lines[0].startswith(f"error: reward.scorer=env: row 0 (prompt_id '{first['prompt_id']}') has "
                               f"env_reward null"), lines[0]
    assert [r["env_reward"] for r in rows] == [None] * 4
    assert not (root / "norew" / "iterations" / "000001" / "reward.parquet").exists()


def test_cli_refuses_env_on_a_single_turn_run(tmp_path):
    p = subprocess.run([TRAJFLOW, "train", "reward.scorer=env", f"store.root={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "reward.scorer='env'" in lines[0] and "rollout.multi_turn.enable=true" in lines[0], \
        p.stderr
