"""Reward gates through the real `train` flow, with real (broken) reward functions."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_overrides
from trajflow.errors import GateFailed
from trajflow.store import RunStore

SCORERS = '''
import math
_calls = [0]

def _next():
    _calls[0] += 1
    return _calls[0]

def nan_some(data_source, solution_str, ground_truth, extra_info):
    return float("nan") if _next() % 2 == 0 else 0.5

def constant(data_source, solution_str, ground_truth, extra_info):
    return 0.35

def out_of_range(data_source, solution_str, ground_truth, extra_info):
    return 100.0 if _next() % 2 == 0 else 1.0

def raise_some(data_source, solution_str, ground_truth, extra_info):
    if _next() % 2 == 0:
        raise RuntimeError("scorer exploded")
    return {"score": 1.0, "acc": 1.0}
'''


@pytest.fixture(scope="module")
def scorer_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("scorers") / "scorers.py"
    p.write_text(SCORERS)
    return p


def _train(tiny_model_dir, root, scorer_file, fn, **extra):
    from trajflow.flows.train import train

    over = tiny_overrides(tiny_model_dir, root, **{"gates.enabled": True, "reward.custom_function": f"{scorer_file}:{fn}",
                                                    "trainer.test_freq": 0, **extra})
    return train(None, over)


def _only_run(root: Path) -> RunStore:
    (run_dir,) = [p for p in root.iterdir() if p.is_dir() and (p / "config.yaml").exists()]
    return RunStore(root, run_dir.name)


def test_nan_scores_fail_the_gate_and_keep_everything_written(tiny_model_dir, ray_local, tmp_path, scorer_file):
    with pytest.raises(GateFailed) as e:
        _train(tiny_model_dir, tmp_path, scorer_file, "nan_some")
    assert "score_not_null" in str(e.value) or "score_finite" in str(e.value)
    assert "2" in str(e.value)  # 2 of 4 rows
    store = _only_run(tmp_path)
    manifest = store.read_manifest(1)
    assert manifest["status"] == "gated"
    assert store.verified_stage(1, "rollout") is not None and store.verified_stage(1, "reward") is not None
    assert not store.stage_path(1, "advantage").exists()
    assert not (store.iteration_dir(1) / "update.json").exists()
    gate = json.loads((store.iteration_dir(1) / "gate.json").read_text())
    assert gate["success"] is False
    assert store.read_run_meta()["status"] == "failed"


def test_quarantine_excludes_nan_rows_from_the_update(tiny_model_dir, ray_local, tmp_path, scorer_file):
    summary = _train(tiny_model_dir, tmp_path, scorer_file, "nan_some",
                     **{"gates.policies.score_not_null": "quarantine", "gates.policies.score_finite": "quarantine"})
    d = Path(summary["run_dir"]) / "iterations" / "000001"
    gate = json.loads((d / "gate.json").read_text())
    reward = pq.read_table(d / "reward.parquet")
    nan_ids = {s for s, v in zip(reward.column("sample_id").to_pylist(), reward.column("score").to_pylist()) if v != v}
    assert len(nan_ids) == 2 and set(gate["quarantined_sample_ids"]) == nan_ids
    adv = pq.read_table(d / "advantage.parquet")
    for sid, a in zip(adv.column("sample_id").to_pylist(), adv.column("advantages").to_pylist()):
        if sid in nan_ids:
            assert set(a) == {0.0}
    assert json.loads((d / "manifest.json").read_text())["status"] == "complete"


def test_constant_rewards_warn_and_continue(tiny_model_dir, ray_local, tmp_path, scorer_file, capfd):
    summary = _train(tiny_model_dir, tmp_path, scorer_file, "constant")
    # the console says so too, each iteration, not only gate.json: 2 prompts x 2 samples, all 0.35
    err = capfd.readouterr().err
    for it in (1, 2):
        assert (f"warning: iteration {it}: all 4 scores are 0.350, so with grpo's group baseline every advantage is "
                f"0 and nothing is learnt from this batch. Likely: the reward never matches") in err, err[-3000:]
    gate = json.loads((Path(summary["run_dir"]) / "iterations" / "000002" / "gate.json").read_text())
    assert gate["success"] is True
    assert gate["metrics"]["gate/equal_reward_group_frac/success"] == 0.0
    assert gate["metrics"]["gate/equal_reward_group_frac/observed"] == 1.0
    adv = pq.read_table(Path(summary["run_dir"]) / "iterations" / "000002" / "advantage.parquet")
    assert all(set(a) <= {0.0} for a in adv.column("advantages").to_pylist())


def test_out_of_range_scores_fail(tiny_model_dir, ray_local, tmp_path, scorer_file):
    with pytest.raises(GateFailed, match="score_in_range"):
        _train(tiny_model_dir, tmp_path, scorer_file, "out_of_range", **{"gates.score_max": 10.0})


def test_raising_scorer_is_counted_and_gated_by_error_rate(tiny_model_dir, ray_local, tmp_path, scorer_file):
    with pytest.raises(GateFailed, match="scorer_error_rate"):
        _train(tiny_model_dir, tmp_path / "a", scorer_file, "raise_some", **{"gates.max_error_rate": 0.25})
    summary = _train(tiny_model_dir, tmp_path / "b", scorer_file, "raise_some",
                     **{"gates.max_error_rate": 0.25, "gates.policies.scorer_error_rate": "warn"})
    reward = pq.read_table(Path(summary["run_dir"]) / "iterations" / "000001" / "reward.parquet")
    errors = [e for e in reward.column("reward_error").to_pylist() if e]
    assert len(errors) == 2 and all("scorer exploded" in e for e in errors)
    assert summary["metrics"]["reward/scorer_errors"] == 2.0


def test_gate_command_revalidates_with_a_stricter_suite(tiny_model_dir, ray_local, tmp_path, scorer_file):
    import subprocess
    import sys

    summary = _train(tiny_model_dir, tmp_path, scorer_file, "constant", **{"trainer.total_iterations": 1})
    cli = str(Path(sys.executable).parent / "trajflow")
    ok = subprocess.run([cli, "gate", summary["run_id"], "--store", str(tmp_path)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "iteration      1: ok" in ok.stdout
    # a constant scorer makes every group's rewards equal: 1.0 > 0.9, a warning under the default suite
    assert ("equal_reward_group_frac: warn (policy warn, expected <= 0.9 (gates.max_equal_group_frac), "
            "observed 1") in ok.stdout
    stored = json.loads((Path(summary["run_dir"]) / "iterations" / "000001" / "gate.json").read_text())
    equal = next(e for e in stored["expectations"] if e["name"] == "equal_reward_group_frac")
    assert (equal["status"], equal["threshold"], equal["observed"]) == ("warn", "<= 0.9 (gates.max_equal_group_frac)", 1.0)
    # MLflow's tags say what happened: the warned expectation, the passed ones, the run's worst
    from mlflow import MlflowClient

    tags = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(summary["mlflow_run_id"]).data.tags
    assert (tags["trajflow.gate"], tags["trajflow.gate.equal_reward_group_frac"]) == ("warned", "warned")
    assert tags["trajflow.gate.score_in_range"] == "passed"
    assert tags["trajflow.gate_rule.equal_reward_group_frac"] == "warn: <= 0.9 (gates.max_equal_group_frac)"
    # a warning writes no HTML data docs by default (gates.data_docs=on_failure): gate.json holds the results
    assert stored["data_docs"] is None and not (Path(summary["run_dir"]) / "iterations" / "000001" / "data_docs").exists()
    suite = json.loads((Path(__file__).parents[1] / "datasets/expectations/reward_default.json").read_text())
    for e in suite["expectations"]:
        if e["meta"]["name"] == "equal_reward_group_frac":
            e["meta"]["policy"] = "fail"
    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps(suite))
    bad = subprocess.run([cli, "gate", summary["run_id"], "--store", str(tmp_path), "--suite", str(strict)],
                         capture_output=True, text=True)
    assert bad.returncode == 3, bad.stderr
    assert "FAILED" in bad.stdout and "equal_reward_group_frac: FAIL (policy fail" in bad.stdout
    missing = subprocess.run([cli, "gate", "nope", "--store", str(tmp_path)], capture_output=True, text=True)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr
