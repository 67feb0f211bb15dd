"""The run store: atomic writes recorded with sha256, verification, corruption detection."""

import hashlib
import json

import pyarrow as pa
import pytest

from trajflow.errors import StoreError
from trajflow.store import RunStore


def _table(n=4):
    return pa.table({"sample_id": [f"s{i}" for i in range(n)], "score": pa.array([0.5] * n, pa.float32())})


def test_write_stage_records_sha256_and_rows(tmp_path):
    store = RunStore(tmp_path, "run-a")
    ref = store.write_stage(3, "reward", _table(), policy_version=2)
    path = tmp_path / "run-a" / "iterations" / "000003" / "reward.parquet"
    assert ref.path == str(path)
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["files"]["reward"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["files"]["reward"]["rows"] == 4
    assert manifest["policy_version"] == 2
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert store.read_stage(3, "reward").column("score").to_pylist() == [0.5] * 4


def test_corrupted_file_is_not_verified(tmp_path, caplog):
    store = RunStore(tmp_path, "run-b")
    store.write_stage(1, "rollout", _table(), 0)
    path = store.stage_path(1, "rollout")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    assert store.verified_stage(1, "rollout") is None
    assert "rollout.parquet" in caplog.text
    with pytest.raises(StoreError, match="rollout.parquet"):
        store.read_stage(1, "rollout")


def test_duplicate_sample_ids_are_refused(tmp_path):
    store = RunStore(tmp_path, "run-c")
    t = pa.table({"sample_id": ["a", "a"], "score": [1.0, 2.0]})
    with pytest.raises(StoreError, match="repeats a sample_id"):
        store.write_stage(1, "reward", t, 0)
    assert not store.stage_path(1, "reward").exists()


def test_bad_run_id(tmp_path):
    with pytest.raises(StoreError, match="not a valid folder name"):
        RunStore(tmp_path, "../escape")


def _rollout_v2(n=2):
    """A rollout table as schema 2 wrote it: the behaviour log-probs as ``old_logprobs``, no sampling columns."""
    return pa.table({"sample_id": [f"s{i}" for i in range(n)], "prompt_ids": pa.array([[1, 2]] * n, pa.list_(pa.int32())),
                     "response_ids": pa.array([[5, 6]] * n, pa.list_(pa.int32())),
                     "old_logprobs": pa.array([[-0.5, -1.5]] * n, pa.list_(pa.float32()))})


def test_a_rollout_written_in_schema_2_reads_with_todays_names_and_the_configs_temperature(tmp_path):
    from trajflow.stages.policy_update import update_batch

    store = RunStore(tmp_path, "old-run")
    ref = store.write_stage(0, "rollout", _rollout_v2(), 0)
    for table in (store.read_stage(0, "rollout"), store.read_ref(ref)):
        assert "old_logprobs" not in table.column_names
        assert table.column("rollout_logprobs").to_pylist() == [[-0.5, -1.5]] * 2
    adv = pa.table({"sample_id": ["s0", "s1"], "advantages": pa.array([[1.0, 1.0], [-1.0, -1.0]], pa.list_(pa.float32()))})
    from trajflow.batch import join_stages

    joined = join_stages([store.read_ref(ref), adv])
    batch = update_batch(joined, 0, seed=1, n=2, ppo_mini_batch_size=1, use_ref_logprobs=False, temperature=0.7)
    assert batch.rows.rollout_logprobs == [[-0.5, -1.5]] * 2
    assert batch.settings.temperature == 0.7  # nothing stored: the run config's applies


def test_the_stored_sampling_temperature_wins_over_a_later_config():
    from trajflow.stages.policy_update import update_batch
    from trajflow.stages.rollout import SamplingParams, rollout_temperature, with_sampling_columns

    t = _rollout_v2().rename_columns(["sample_id", "prompt_ids", "response_ids", "rollout_logprobs"])
    t = with_sampling_columns(t, SamplingParams(temperature=0.6, top_p=0.9, top_k=5))
    assert t.column("temperature").to_pylist() == [0.6, 0.6] and t.column("top_p").to_pylist() == [0.9, 0.9]
    assert t.column("top_k").to_pylist() == [5, 5]
    joined = t.append_column("advantages", pa.array([[1.0, 1.0]] * 2, pa.list_(pa.float32())))
    assert update_batch(joined, 0, seed=1, n=2, ppo_mini_batch_size=1, use_ref_logprobs=False,
                        temperature=1.3).settings.temperature == 0.6  # a replay's rollout.temperature=1.3 loses
    mixed = t.set_column(t.column_names.index("temperature"), "temperature", pa.array([0.6, 1.0], pa.float64()))
    with pytest.raises(ValueError, match="several temperatures"):
        rollout_temperature(mixed, 1.0)


def test_the_trajectory_comparison_reads_both_schemas_and_finds_a_changed_value(tmp_path):
    import pyarrow.parquet as pq

    from benchmarks.same_trajectories import compare_file
    from trajflow.stages.rollout import SamplingParams, with_sampling_columns

    old = _rollout_v2()
    new = with_sampling_columns(old.rename_columns(["sample_id", "prompt_ids", "response_ids", "rollout_logprobs"]),
                                SamplingParams())
    pq.write_table(old, tmp_path / "before.parquet")
    pq.write_table(new, tmp_path / "after.parquet")
    ok, line = compare_file(tmp_path / "before.parquet", tmp_path / "after.parquet", "rollout")
    assert ok and "4 shared columns equal" in line and "added ['temperature', 'top_k', 'top_p']" in line
    changed = new.set_column(3, "rollout_logprobs", pa.array([[-0.5, -1.5], [-0.5, -1.25]], pa.list_(pa.float32())))
    pq.write_table(changed, tmp_path / "changed.parquet")
    ok, line = compare_file(tmp_path / "before.parquet", tmp_path / "changed.parquet", "rollout")
    assert not ok and "differ ['rollout_logprobs']" in line
    ok, line = compare_file(tmp_path / "after.parquet", tmp_path / "before.parquet", "reward")
    assert not ok and "lost ['temperature', 'top_k', 'top_p']" in line
