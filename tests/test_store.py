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
