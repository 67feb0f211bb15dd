"""What a run leaves in MLflow, on a real SQLite store: resumed sessions as segments with one value
per metric and step, system metrics, dataset inputs, source and Prefect tags, the final model."""

from pathlib import Path

import pandas as pd
import pytest

from trajflow.compare import resolve_run
from trajflow.config import load_config
from trajflow.prompts.spec import PromptRecord
from trajflow.tracking import (TAG_PREVIOUS_SEGMENT, TAG_SEGMENT, TAG_SUPERSEDED_BY, Tracker, prompt_text,
                               session_tags)


def _cfg(tmp_path, *extra):
    return load_config(None, [f"store.root={tmp_path}", "trainer.experiment_name=record-test",
                              "tracking.system_metrics=false", *extra])


def _history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_resumed_session_keeps_the_checkpointed_steps_and_relogs_the_rest_once(tmp_path):
    cfg = _cfg(tmp_path)
    first = Tracker(cfg, "seg")
    for step in range(0, 4):  # iterations 1..3 after validation at step 0; killed after logging 3
        first.log_metrics({"critic/score/mean": 0.1 * step, "val@1": 10.0 + step}, step=step)
        first.log_table({"score": [float(step)]}, f"samples/iteration_{step:06d}.json")
    first.log_text("gate", "gates/iteration_000001/gate.json")
    first.log_text("gate", "gates/iteration_000003/gate.json")
    # Killed: the run still says RUNNING. The checkpoint was after iteration 1.
    second = Tracker(cfg, "seg", continue_from=first.run_id, keep_step=lambda s: s <= 1)
    for step in (2, 3):
        second.log_metrics({"critic/score/mean": 0.5 + step, "val@1": 20.0 + step}, step=step)
    second.finish("FINISHED")
    client = second.client
    # One point per step: the kept ones copied (0, 1), the re-run ones from this session (2, 3).
    assert _history(client, second.run_id, "critic/score/mean") == [(0, 0.0), (1, 0.1), (2, 2.5), (3, 3.5)]
    assert _history(client, second.run_id, "val_at_1") == [(0, 10.0), (1, 11.0), (2, 22.0), (3, 23.0)]
    latest = client.get_run(second.run_id).data.metrics
    assert latest["critic/score/mean"] == 3.5 and latest["val_at_1"] == 23.0
    # Artifacts of the kept iterations only.
    assert [f.path for f in client.list_artifacts(second.run_id, "samples")] == \
        ["samples/iteration_000000.json", "samples/iteration_000001.json"]
    assert [f.path for f in client.list_artifacts(second.run_id, "gates")] == ["gates/iteration_000001"]
    assert [f.path for f in client.list_artifacts(second.run_id, "gates/iteration_000001")] == \
        ["gates/iteration_000001/gate.json"]
    old, new = client.get_run(first.run_id), client.get_run(second.run_id)
    assert old.info.status == "KILLED" and old.data.tags[TAG_SUPERSEDED_BY] == second.run_id
    assert new.data.tags[TAG_SEGMENT] == "2" and new.data.tags[TAG_PREVIOUS_SEGMENT] == first.run_id
    assert old.data.tags[TAG_SEGMENT] == "1"
    # The run's name now means its newest segment, for compare (and the dashboard).
    assert resolve_run(client, "seg").info.run_id == second.run_id
    # A third session from the second: segment 3, nothing kept (no checkpoint), the second stays FINISHED.
    third = Tracker(cfg, "seg", continue_from=second.run_id, keep_step=lambda s: False)
    third.finish("FINISHED")
    assert client.get_run(third.run_id).data.tags[TAG_SEGMENT] == "3"
    assert client.get_run(third.run_id).data.metrics == {}
    assert client.get_run(second.run_id).info.status == "FINISHED"
    assert resolve_run(client, "seg").info.run_id == third.run_id


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


def test_final_model_is_an_mlflow_transformers_model_and_registers_new_versions(tmp_path, tiny_model_dir):
    import mlflow.transformers
    import torch
    from safetensors.torch import load_file

    tr = Tracker(_cfg(tmp_path), "model")
    uri = tr.log_model(tiny_model_dir, registered_name="tiny-policy", description="test")
    assert uri == "models:/tiny-policy/1"
    again = Tracker(_cfg(tmp_path), "model-2").log_model(tiny_model_dir, registered_name="tiny-policy")
    assert again == "models:/tiny-policy/2"
    tr.finish("FINISHED")
    # Where the registry says version 1 lives (file:// in this store), loaded by MLflow's flavour.
    source = tr.client.get_model_version_download_uri("tiny-policy", "1")
    loaded = mlflow.transformers.load_model(source, return_type="components")
    expected = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    state = loaded["model"].state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    version = tr.client.get_model_version("tiny-policy", "1")
    assert version.run_id == tr.run_id
    assert tr.client.get_run(tr.run_id).data.tags["trajflow.registered_model"] == "tiny-policy/1"


def test_register_model_without_log_model_is_a_config_error(tmp_path):
    from trajflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tracking.register_model='p' needs tracking.log_model=true"):
        _cfg(tmp_path, "tracking.register_model=p", "tracking.log_model=false")


def test_prompt_text_reads_chat_lists_json_and_plain_text():
    assert prompt_text('[{"role": "user", "content": "a"}]') == "a"
    assert prompt_text([{"role": "user", "content": "b"}]) == "b"
    assert prompt_text("just text") == "just text"
    assert pd.isna(None) and prompt_text(None) == ""
