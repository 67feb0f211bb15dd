"""Tracker.log_table on a real MLflow SQLite store: many iterations, content that reads back."""

import json

import pandas as pd
import pytest

from trajflow.config import load_config
from trajflow.tracking import Tracker


@pytest.fixture()
def tracker(tmp_path):
    cfg = load_config(None, [f"store.root={tmp_path}", "trainer.experiment_name=tracking-test"])
    tr = Tracker(cfg, "run-under-test")
    yield tr
    tr.finish("FINISHED")


def test_a_table_per_iteration_for_hundreds_of_iterations(tracker, tmp_path):
    # MlflowClient.log_table registers each table in an 8000-character run tag; per-iteration
    # tables broke it at iteration 135 (truncated tag, then a JSON error). 300 must all land.
    for it in range(1, 301):
        tracker.log_table({"sample_id": [f"s{it}-0", f"s{it}-1"], "score": [0.5, float(it)]},
                          f"samples/iteration_{it:06d}.json")
    client = tracker.client
    files = [f.path for f in client.list_artifacts(tracker.run_id, "samples")]
    assert len(files) == 300 and "samples/iteration_000300.json" in files
    local = client.download_artifacts(tracker.run_id, "samples/iteration_000300.json", str(tmp_path / "dl"))
    frame = pd.read_json(local, orient="split")  # the layout MlflowClient.log_table writes
    assert frame["sample_id"].tolist() == ["s300-0", "s300-1"]
    assert frame["score"].tolist() == [0.5, 300.0]
    tags = client.get_run(tracker.run_id).data.tags
    assert all(len(v) <= 8000 for v in tags.values())
    json.loads(tags.get("mlflow.loggedArtifacts", "[]"))


def test_ragged_columns_are_named(tracker):
    with pytest.raises(ValueError, match=r"columns of different lengths \{'a': 2, 'b': 1\}"):
        tracker.log_table({"a": [1, 2], "b": [3]}, "samples/bad.json")
