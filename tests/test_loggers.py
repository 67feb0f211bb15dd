"""trainer.logger's TensorBoard and W&B (offline) mirrors of the MLflow record, on the real libraries:
two sessions of one run (the second a resume that re-runs a step), read back with TensorBoard's
EventAccumulator and W&B's own .wandb reader, compared with MLflow's history. The same on a real
killed-and-resumed CLI run: tests/test_resume_replay_audit.py."""

import re
import sys

import numpy as np
import pytest

from tests.mirror_readers import (mlflow_points, tensorboard_points, tensorboard_texts, wandb_points,
                                  wandb_tables)
from trajflow.config import load_config
from trajflow.errors import ConfigError, StoreError
from trajflow.loggers import open_mirrors, stored_wandb_id
from trajflow.store import RunStore
from trajflow.tracking import Tracker


def _session(cfg, store, continue_from=None, keep_step=None):
    tr = Tracker(cfg, store.run_id, continue_from=continue_from, keep_step=keep_step, logged_model=False)
    tr.mirrors = open_mirrors(cfg, store, store.run_id)
    return tr


def test_tensorboard_and_wandb_hold_what_mlflow_holds_across_a_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(None, [f"store.root={tmp_path}", "trainer.logger=[console,mlflow,tensorboard,wandb]",
                             "trainer.project_name=gsm8k/grpo", "trainer.experiment_name=lr1e-6",
                             "tracking.system_metrics=false", "actor.lr=3e-6"])
    store = RunStore(cfg.store.root, "run-a")
    store.run_dir.mkdir(parents=True)
    first = _session(cfg, store)
    # verl's names, one MLflow rejects as it is ('@'): every surface gets MLflow's name.
    for step in (0, 1, 2):
        first.log_metrics({"actor/pg_loss": 0.1 + step, "val-core/words/acc/mean@2": step / 3}, step=step)
    first.log_metrics({"critic/score/mean": 0.7}, step=2)  # a second call at the same step
    first.mirror_generations(_generations("first"), step=2)  # verl's val/generations
    first.finish("KILLED")
    lines = capsys.readouterr().out
    assert f"tensorboard: writing to {store.run_dir / 'tensorboard'}" in lines
    run_id = store.read_run_meta()["wandb_run_id"]
    assert re.fullmatch(r"[0-9a-f]{8}", run_id) and f"wandb: offline run {run_id} (project gsm8k-grpo" in lines

    # The resume restarts from checkpoint 1: step 2 is re-run (MLflow keeps its earlier values), 3 is new.
    second = _session(cfg, store, continue_from=first.run_id, keep_step=lambda s: s <= 1)
    for step in (2, 3):
        second.mirror_generations(_generations(f"second-{step}"), step=step)  # not at re-run step 2: kept
        second.log_metrics({"actor/pg_loss": 10.0 + step, "val-core/words/acc/mean@2": 0.5,
                            "critic/score/mean": 0.25}, step=step)
    second.finish("FINISHED")
    assert store.read_run_meta()["wandb_run_id"] == run_id  # the same W&B run

    want = mlflow_points(first.uri, first.run_id)
    assert set(want) == {"actor/pg_loss", "val-core/words/acc/mean_at_2", "critic/score/mean"}
    assert want["actor/pg_loss"] == [(0, 0.1), (1, 1.1), (2, 2.1), (3, 13.0)]
    assert want["critic/score/mean"] == [(2, 0.7), (3, 0.25)]

    tb_dir = store.run_dir / "tensorboard"
    assert len(list(tb_dir.glob("events.out.tfevents.*"))) == 2  # one file per session, one folder
    tb = tensorboard_points(tb_dir)
    assert set(tb) == set(want)
    for key, points in want.items():  # same steps, once each; TensorBoard keeps float32
        assert [s for s, _ in tb[key]] == [s for s, _ in points], key
        assert [v for _, v in tb[key]] == [float(np.float32(v)) for _, v in points], key

    texts = tensorboard_texts(tb_dir, "val/generations")  # markdown tables, '|' and newlines escaped
    assert texts == [(2, "| prompt | response_text | score |\n|---|---|---|\n| 2 \\| 3 | first<br>5 | 1.0 |"),
                     (3, "| prompt | response_text | score |\n|---|---|---|\n| 2 \\| 3 | second-3<br>5 | 1.0 |")]
    tables = wandb_tables(store.run_dir / "wandb", run_id, "val/generations")
    assert tables == [(2, {"columns": ["prompt", "response_text", "score"], "data": [["2 | 3", "first\n5", 1.0]]}),
                      (3, {"columns": ["prompt", "response_text", "score"], "data": [["2 | 3", "second-3\n5", 1.0]]})]
    wb, runs = wandb_points(store.run_dir / "wandb", run_id)
    assert {k: sorted(v) for k, v in wb.items()} == want
    assert len(runs) == 2 and {(r["run_id"], r["project"], r["display_name"]) for r in runs} == \
        {(run_id, "gsm8k-grpo", "lr1e-6")}
    config = runs[0]["config"]["update"]  # the resolved config
    assert config["actor"]["lr"] == 3e-6 and config["trainer"]["logger"] == ["console", "mlflow", "tensorboard",
                                                                             "wandb"]


def _generations(response: str) -> dict:
    return {"prompt": ["2 | 3"], "response_text": [f"{response}\n5"], "score": [1.0]}


def test_a_log_dir_of_an_earlier_session_is_named_not_used(tmp_path, monkeypatch, capsys):
    """TENSORBOARD_DIR of the first session is recorded in run.json; a resume without it writes
    into the run folder and says where the earlier points are (a run folder picks no directory)."""
    cfg = load_config(None, [f"store.root={tmp_path}", "trainer.logger=[mlflow,tensorboard]",
                             "tracking.system_metrics=false"])
    store = RunStore(cfg.store.root, "run-b")
    store.run_dir.mkdir(parents=True)
    elsewhere = tmp_path / "tb-elsewhere"
    monkeypatch.setenv("TENSORBOARD_DIR", str(elsewhere))
    first = _session(cfg, store)
    first.log_metrics({"actor/pg_loss": 1.0}, step=1)
    first.finish()
    monkeypatch.delenv("TENSORBOARD_DIR")
    second = _session(cfg, store, continue_from=first.run_id)
    second.log_metrics({"actor/pg_loss": 2.0}, step=2)
    second.finish()
    err = capsys.readouterr().err
    assert f"earlier sessions wrote to tensorboard_dir={str(elsewhere)!r}" in err and "set TENSORBOARD_DIR" in err
    assert tensorboard_points(elsewhere) == {"actor/pg_loss": [(1, 1.0)]}
    assert tensorboard_points(store.run_dir / "tensorboard") == {"actor/pg_loss": [(2, 2.0)]}


@pytest.mark.parametrize("value", ["../../etc", "", "a" * 65, 12345678, "id with space"])
def test_a_stored_wandb_id_is_only_an_id(value):
    with pytest.raises(StoreError, match=r"run\.json: wandb_run_id=.* is not a W&B run id"):
        stored_wandb_id({"wandb_run_id": value}, "runs/x/run.json")
    assert stored_wandb_id({"wandb_run_id": "1a2b3c4d"}, "run.json") == "1a2b3c4d"
    assert stored_wandb_id({}, "run.json") is None


@pytest.mark.parametrize("name, package", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_a_logger_without_its_package_is_one_line_at_config_time(name, package, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # what importlib sees when it is not installed
    with pytest.raises(ConfigError, match=re.escape(f"trainer.logger: {name!r} needs the {package} package, which "
                                                    f"is not installed: pip install 'trajflow[loggers]'")):
        load_config(None, [f"trainer.logger=[console,mlflow,{name}]"])
