"""What a run leaves in MLflow, on a real SQLite store: one MLflow run per trajflow run across
resumes with one value per metric and step, a model-training experiment, the policy as a LoggedModel
linked to the metrics (by reference or copied), system metrics, dataset inputs, source and Prefect tags."""

from pathlib import Path

import pandas as pd
import pytest

from trajflow.compare import resolve_run
from trajflow.config import load_config
from trajflow.mlflow_model import TAG_MODEL_ID, TAG_MODEL_PATH
from trajflow.prompts.spec import PromptRecord
from trajflow.tracking import TAG_KEPT_RERUN_STEPS, TAG_SESSIONS, Tracker, prompt_text, session_tags


def _cfg(tmp_path, *extra):
    return load_config(None, [f"store.root={tmp_path}", "trainer.project_name=record-test",
                              "tracking.system_metrics=false", *extra])


def _history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_a_resumed_run_continues_its_mlflow_run_with_one_value_per_metric_and_step(tmp_path):
    cfg = _cfg(tmp_path)
    first = Tracker(cfg, "seg")
    for step in range(0, 4):  # iterations 1..3 after validation at step 0; killed after logging 3
        first.log_metrics({"critic/score/mean": step / 10, "val@1": 10.0 + step}, step=step)
    # Killed: the run still says RUNNING. The checkpoint was after iteration 1; 2 and 3 are re-run.
    second = Tracker(_cfg(tmp_path, "actor.lr=2e-5", "trainer.total_iterations=5"), "seg",
                     continue_from=first.run_id, keep_step=lambda s: s <= 1)
    assert second.run_id == first.run_id and second.model_id == first.model_id
    for step in (2, 3, 4):
        second.log_metrics({"critic/score/mean": 0.5 + step, "val@1": 20.0 + step}, step=step)
    second.finish("FINISHED")
    client = second.client
    # One point per (key, step): 0..3 as the first session logged them, 4 from the resumed one.
    assert _history(client, first.run_id, "critic/score/mean") == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3), (4, 4.5)]
    assert _history(client, first.run_id, "val_at_1") == [(0, 10.0), (1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0)]
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags[TAG_SESSIONS] == "2"
    assert run.data.tags[TAG_KEPT_RERUN_STEPS] == "2,3"
    # params are immutable in MLflow: a changed one is a tag, a new one would be logged
    assert run.data.params["actor.lr"] == "1e-05"
    assert run.data.tags["trajflow.param_changed.actor.lr"] == "1e-05 -> 2e-05"
    assert len(client.search_runs([run.info.experiment_id], "attributes.run_name = 'seg'")) == 1
    assert resolve_run(client, "seg").info.run_id == first.run_id
    # the experiment is filed as model training, not GenAI
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    # every point is linked to the run's LoggedModel (PENDING until the final model is logged)
    model = client.get_logged_model(run.data.tags[TAG_MODEL_ID])
    assert model.source_run_id == first.run_id and str(model.status) == "PENDING"
    assert sorted((m.key, m.step) for m in model.metrics if m.key == "val_at_1") == [("val_at_1", s) for s in range(5)]


def test_system_metrics_are_logged_by_default(tmp_path):
    cfg = load_config(None, [f"store.root={tmp_path}", "tracking.system_metrics_interval_s=0.2"])
    assert cfg.tracking.system_metrics is True
    tr = Tracker(cfg, "sys")
    import time

    time.sleep(1.0)
    tr.finish("FINISHED")
    metrics = tr.client.get_run(tr.run_id).data.metrics
    assert 0.0 <= metrics["system/cpu_utilization_percentage"] <= 100.0
    assert metrics["system/system_memory_usage_megabytes"] > 0


def test_datasets_are_logged_as_inputs_with_their_rows(tmp_path):
    tr = Tracker(_cfg(tmp_path), "data")
    train = [PromptRecord(f"t:{i}", "openai/gsm8k", [{"role": "user", "content": f"q{i}"}], str(i)) for i in range(5)]
    val = [PromptRecord("v:0", "openai/gsm8k", [{"role": "system", "content": "s"}, {"role": "user", "content": "vq"}],
                        "7")]
    tr.log_datasets(train, val, "gsm8k_sample", "datasets/gsm8k_sample.yaml")
    tr.finish("FINISHED")
    inputs = tr.client.get_run(tr.run_id).inputs.dataset_inputs
    by_context = {[t.value for t in i.tags if t.key == "mlflow.data.context"][0]: i.dataset for i in inputs}
    assert set(by_context) == {"training", "validation"}
    assert by_context["training"].name == "gsm8k_sample/training"
    import json

    assert json.loads(by_context["training"].profile)["num_rows"] == 5
    assert json.loads(by_context["validation"].profile)["num_rows"] == 1
    assert "datasets/gsm8k_sample.yaml" in by_context["training"].source
    assert prompt_text(val[0].messages) == "vq"


def test_session_tags_name_user_source_commit_and_the_prefect_flow_run(tmp_path):
    from prefect import flow
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL, temporary_settings

    cfg = _cfg(tmp_path)
    outside = session_tags(cfg)
    assert outside["mlflow.source.type"] == "LOCAL" and outside["mlflow.user"]
    assert "prefect.flow_run_id" not in outside

    @flow(name="tags-probe")
    def probe():
        return session_tags(cfg), str(flow_run.get_id())

    tags, _ = probe()  # the temporary local server has no UI URL: no URL tag
    assert "prefect.flow_run_url" not in tags and tags["prefect.flow_run_id"]
    with temporary_settings(updates={PREFECT_UI_URL: "http://prefect.example:4200/"}):
        tags, fid = probe()
    assert tags["prefect.flow_run_id"] == fid
    assert tags["prefect.flow_run_url"] == f"http://prefect.example:4200/flow-runs/flow-run/{fid}"


def test_final_model_is_a_logged_model_by_reference_or_copied_and_registered(tmp_path, tiny_model_dir):
    import mlflow.transformers
    import torch
    from safetensors.torch import load_file

    tr = Tracker(_cfg(tmp_path), "by-ref")
    tr.log_metrics({"critic/score/mean": 0.5}, step=3)
    assert tr.log_model(tiny_model_dir, 3) == f"models:/{tr.model_id}"
    tr.finish("FINISHED")
    model = tr.client.get_logged_model(tr.model_id)
    assert str(model.status) == "READY" and model.tags[TAG_MODEL_PATH] == str(Path(tiny_model_dir).resolve())
    assert [(m.key, m.value, m.step) for m in model.metrics] == [("critic/score/mean", 0.5, 3)]
    assert tr.client.get_run(tr.run_id).outputs.model_outputs[0].model_id == tr.model_id
    art = Path(model.artifact_location.removeprefix("file://"))
    assert not art.exists() or not any(art.rglob("*.safetensors"))  # no second copy of the weights

    tr = Tracker(_cfg(tmp_path), "model")
    uri = tr.log_model(tiny_model_dir, 2, registered_name="tiny-policy", description="test", copy=True)
    assert uri == "models:/tiny-policy/1"
    again = Tracker(_cfg(tmp_path), "model-2").log_model(tiny_model_dir, 2, registered_name="tiny-policy", copy=True)
    assert again == "models:/tiny-policy/2"
    with pytest.raises(ValueError, match="copy=True"):
        Tracker(_cfg(tmp_path), "model-3").log_model(tiny_model_dir, 2, registered_name="tiny-policy")
    tr.finish("FINISHED")
    # Where the registry says version 1 lives (the LoggedModel's artifacts), loaded by MLflow's flavour.
    source = tr.client.get_model_version_download_uri("tiny-policy", "1")
    loaded = mlflow.transformers.load_model(source, return_type="components")
    expected = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    state = loaded["model"].state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    version = tr.client.get_model_version("tiny-policy", "1")
    assert version.run_id == tr.run_id and tr.model_id in version.source  # the LoggedModel's artifacts
    assert tr.client.get_run(tr.run_id).data.tags["trajflow.registered_model"] == "tiny-policy/1"


def test_register_model_without_log_model_is_a_config_error(tmp_path):
    from trajflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tracking.register_model='p' needs tracking.log_model=true and "
                                          r"tracking.model_copy=true"):
        _cfg(tmp_path, "tracking.register_model=p", "tracking.log_model=false")
    with pytest.raises(ConfigError, match=r"tracking.model_copy=true"):
        _cfg(tmp_path, "tracking.register_model=p")
    assert _cfg(tmp_path, "tracking.register_model=p", "tracking.model_copy=true").tracking.model_copy


def test_prompt_text_reads_chat_lists_json_and_plain_text():
    assert prompt_text('[{"role": "user", "content": "a"}]') == "a"
    assert prompt_text([{"role": "user", "content": "b"}]) == "b"
    assert prompt_text("just text") == "just text"
    assert pd.isna(None) and prompt_text(None) == ""
