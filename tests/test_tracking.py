"""Tracker.log_table on a real MLflow SQLite store: many iterations, content that reads back."""

import json
import re

import pandas as pd
import pytest

from trajflow.config import load_config
from trajflow.tracking import Tracker


@pytest.fixture()
def tracker(tmp_path):
    cfg = load_config(None, [f"store.root={tmp_path}", "trainer.project_name=tracking-test"])
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


def _logged(tracker):
    """{MLflow name: [(step, value), ...]} as the store holds it."""
    run = tracker.client.get_run(tracker.run_id)
    return {k: sorted((m.step, m.value) for m in tracker.client.get_metric_history(tracker.run_id, k))
            for k in run.data.metrics}


def test_metric_names_mlflow_rejects_are_rewritten_and_kept_apart(tracker):
    # verl issue 119: 'timing(s)/gen' made MLflow reject the whole batch; '@' and '_at_' merged two
    # series; a data_source with '+' ends up in the validation metric names.
    reported = {"timing(s)/gen": 1.5, "val/acc@1": 0.5, "val/acc_at_1": 0.25,
                "val-core/gsm8k+math/acc/mean@4": 0.75, "actor/pg_loss": -0.125}
    tracker.log_metrics(reported, step=0)
    tracker.log_metrics(dict(reversed(list({k: v + 1 for k, v in reported.items()}.items()))), step=1)
    logged = _logged(tracker)
    assert len(logged) == len(reported)  # nothing lost, nothing merged
    names = {k: tracker.metric_name(k) for k in reported}
    assert len(set(names.values())) == len(reported)
    assert names["actor/pg_loss"] == "actor/pg_loss" and names["val/acc_at_1"] == "val/acc_at_1"
    assert names["timing(s)/gen"] == "timing_s_/gen"
    assert names["val-core/gsm8k+math/acc/mean@4"] == "val-core/gsm8k_math/acc/mean_at_4"
    assert names["val/acc@1"].startswith("val/acc_at_1.") and len(names["val/acc@1"]) == len("val/acc_at_1.") + 8
    for k, v in reported.items():
        assert logged[names[k]] == [(0, v), (1, v + 1)], k


def test_colliding_names_get_the_same_mlflow_names_whatever_the_key_order(tmp_path):
    def names(order):
        cfg = load_config(None, [f"store.root={tmp_path}", "trainer.project_name=tracking-order"])
        tr = Tracker(cfg, "order")
        tr.log_metrics({k: 1.0 for k in order}, step=0)
        out = {k: tr.metric_name(k) for k in order}
        tr.finish()
        return out

    keys = ["val/acc@1", "val/acc_at_1", "val/acc(1)", "val/acc_1_"]
    first, second = names(keys), names(list(reversed(keys)))
    assert first == second and len(set(first.values())) == 4
    assert first["val/acc_at_1"] == "val/acc_at_1" and first["val/acc_1_"] == "val/acc_1_"


def test_overlong_names_and_empty_path_segments_are_made_valid(tracker):
    long_name = "x/" + "y" * 400  # over MLflow's 250-character limit: cut, with a hash of the full name
    tracker.log_metrics({long_name: 2.0, "actor/lr": 1e-5, "a//b": 3.0}, step=4)
    logged = _logged(tracker)
    assert logged["actor/lr"] == [(4, 1e-5)]
    assert logged[tracker.metric_name(long_name)] == [(4, 2.0)] and len(tracker.metric_name(long_name)) == 250
    assert logged["a/_/b"] == [(4, 3.0)]


def test_verl_project_and_experiment_names_are_the_mlflow_experiment_and_run_name(tmp_path):
    """verl's trainer.project_name / trainer.experiment_name (the same keys in trajflow): the MLflow experiment
    and the MLflow run's name, as verl's MLflow logger uses them; the run stays findable by its trajflow id."""
    from trajflow.compare import resolve_run
    from trajflow.dashboards.data import list_runs

    cfg = load_config(None, [f"store.root={tmp_path}", "trainer.project_name=gsm8k-grpo",
                             "trainer.experiment_name=qwen-lr1e-6", "tracking.system_metrics=false"])
    tr = Tracker(cfg, "trajflow-run-1", logged_model=False)
    tr.finish("FINISHED")
    run = tr.client.get_run(tr.run_id)
    assert tr.client.get_experiment(run.info.experiment_id).name == "gsm8k-grpo"
    assert run.info.run_name == "qwen-lr1e-6" and run.data.tags["trajflow.run_id"] == "trajflow-run-1"
    assert resolve_run(tr.client, "trajflow-run-1").info.run_id == tr.run_id
    assert [r["run"] for r in list_runs(tr.client)] == ["trajflow-run-1"]  # the dashboard's key: the run folder
    # defaults: experiment trajflow/<recipe>, run name = the trajflow run id
    plain = Tracker(load_config(None, [f"store.root={tmp_path}", "tracking.system_metrics=false"]), "run-2",
                    logged_model=False)
    plain.finish("FINISHED")
    r2 = plain.client.get_run(plain.run_id)
    assert r2.info.run_name == "run-2"
    assert plain.client.get_experiment(r2.info.experiment_id).name == "trajflow/grpo_default"


@pytest.mark.parametrize("value, needle", [
    ("[console,swanlab]", "'swanlab' is one of verl's loggers that trajflow does not write"),
    ("[console,clearml]", "'clearml' is one of verl's loggers"),
    ("[console]", "'mlflow' cannot be left out"),
    ("[console,mlfow]", "unknown logger 'mlfow'"),
])
def test_verl_logger_key_is_checked(value, needle):
    from trajflow.errors import ConfigError
    from trajflow.run.progress import console_logger

    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, [f"trainer.logger={value}"])
    assert console_logger(load_config(None, ["trainer.logger=[console,mlflow]"]))
    assert not console_logger(load_config(None, ["trainer.logger=[mlflow]"]))  # no step:N lines
    assert not console_logger(load_config(None, ["trainer.logger=mlflow"]))
    both = load_config(None, ["trainer.logger=[console,mlflow,tensorboard,wandb]"])  # tests/test_loggers.py
    assert list(both.trainer.logger) == ["console", "mlflow", "tensorboard", "wandb"]
