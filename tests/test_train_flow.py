"""A 2-iteration `train` run with a tiny model on a real local Ray, real Prefect and MLflow on SQLite."""

import hashlib
import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import tiny_overrides

EXPECTED_METRICS = ["critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean",
                    "timing_s/gen", "timing_s/update_actor", "perf/throughput",
                    "val-core/reasoning_gym/basic_arithmetic/acc/mean_at_1"]


@pytest.fixture(scope="module")
def run(tiny_model_dir, ray_local, tmp_path_factory):
    from trajflow.flows.train import train

    root = tmp_path_factory.mktemp("store")
    summary = train(None, tiny_overrides(tiny_model_dir, root, **{"gates.enabled": True,
                                                                  "tracking.system_metrics_interval_s": 0.5,
                                                                  "tracking.model_copy": True,
                                                                  "trainer.logger": "[console,mlflow,tensorboard,wandb]"}))
    return summary, root


def test_stage_files_match_their_manifests(run):
    summary, _ = run
    run_dir = Path(summary["run_dir"])
    for it in (1, 2):
        d = run_dir / "iterations" / f"{it:06d}"
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["status"] == "complete"
        for stage, rows in (("rollout", 4), ("reward", 4), ("advantage", 4)):
            entry = manifest["files"][stage]
            data = (d / f"{stage}.parquet").read_bytes()
            assert hashlib.sha256(data).hexdigest() == entry["sha256"]
            assert entry["rows"] == rows
        update = json.loads((d / "update.json").read_text())
        assert update["policy_version"] == it
        assert (d / "gate.json").exists()


def test_each_stage_writes_only_its_columns(run):
    summary, _ = run
    d = Path(summary["run_dir"]) / "iterations" / "000001"
    rollout = pq.read_table(d / "rollout.parquet")
    reward = pq.read_table(d / "reward.parquet")
    adv = pq.read_table(d / "advantage.parquet")
    assert {"sample_id", "prompt_ids", "response_ids", "rollout_logprobs", "finish_reason", "policy_version",
            "temperature", "top_p", "top_k"} <= set(rollout.column_names)
    assert set(reward.column_names) == {"sample_id", "score", "reward_extra", "reward_error", "token_rewards"}
    assert set(adv.column_names) == {"sample_id", "advantages", "returns"}
    assert rollout.column("sample_id").equals(reward.column("sample_id"))
    # Ragged columns line up with the responses, token by token.
    for r, lp, a in zip(rollout.column("response_ids").to_pylist(), rollout.column("rollout_logprobs").to_pylist(),
                        adv.column("advantages").to_pylist()):
        assert len(r) == len(lp) == len(a)
    # GRPO outcome advantages are constant along a response.
    for a in adv.column("advantages").to_pylist():
        assert len(set(a)) <= 1


def test_checkpoints_and_final_model(run):
    from transformers import AutoModelForCausalLM

    summary, _ = run
    run_dir = Path(summary["run_dir"])
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["000001", "000002"]
    state = json.loads((run_dir / "checkpoints" / "000002" / "trainer_state.json").read_text())
    assert state["iteration"] == 2 and state["policy_version"] == 2 and "sampler" in state
    assert (run_dir / "checkpoints" / "000002" / "actor" / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.config.num_hidden_layers == 2


def test_mlflow_run_has_verl_metrics_and_params(run):
    summary, root = run
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    mlrun = client.get_run(summary["mlflow_run_id"])
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["actor.lr"] == "1e-05"
    assert mlrun.data.params["rollout.n"] == "2"
    for name in EXPECTED_METRICS:
        assert name in mlrun.data.metrics, name
    steps = [m.step for m in client.get_metric_history(mlrun.info.run_id, "critic/score/mean")]
    assert steps == [1, 2]
    val_steps = [m.step for m in client.get_metric_history(mlrun.info.run_id, EXPECTED_METRICS[-1])]
    assert val_steps == [0, 1, 2]
    # verl's step counters and per-token timings; both iterations draw from the first pass over the prompts
    hist = {k: [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, k)]
            for k in ("training/global_step", "training/epoch", "timing_s/gen", "timing_per_token_ms/gen")}
    assert hist["training/global_step"] == [(1, 1.0), (2, 2.0)]
    assert [v for _, v in hist["training/epoch"]] == [0.0, 0.0]
    for it in (1, 2):
        tokens = sum(len(r) for r in pq.read_table(Path(summary["run_dir"]) / "iterations" / f"{it:06d}" /
                                                   "rollout.parquet").column("response_ids").to_pylist())
        gen_s = dict(hist["timing_s/gen"])[it]
        assert dict(hist["timing_per_token_ms/gen"])[it] == pytest.approx(gen_s * 1000 / tokens, rel=1e-6)
    # The sample table of iteration 2: the first trainer.log_samples (2) rows of its stored outputs.
    d = Path(summary["run_dir"]) / "iterations" / "000002"
    rollout, reward = pq.read_table(d / "rollout.parquet"), pq.read_table(d / "reward.parquet")
    local = client.download_artifacts(mlrun.info.run_id, "samples/iteration_000002.json", str(root / "dl"))
    table = pd.read_json(local, orient="split")
    assert table["sample_id"].tolist() == rollout.column("sample_id").to_pylist()[:2]
    assert table["response_text"].tolist() == rollout.column("response_text").to_pylist()[:2]
    assert table["score"].tolist() == pytest.approx(reward.column("score").to_pylist()[:2])


def test_mlflow_record_has_model_system_metrics_datasets_links_and_validation_samples(run):
    import mlflow.transformers
    import torch
    from safetensors.torch import load_file

    from trajflow.config import load_config
    from trajflow.prompts.loading import load_prompt_dataset

    summary, root = run
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    mlrun = client.get_run(summary["mlflow_run_id"])
    tags = mlrun.data.tags
    assert tags["trajflow.sessions"] == "1" and tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.user"]
    assert tags["prefect.flow_run_name"] == f"train-{summary['run_id']}" and len(tags["prefect.flow_run_id"]) == 36
    assert any(k.startswith("system/cpu_utilization") for k in mlrun.data.metrics)
    # The prompt sets as dataset inputs, with the rows the run drew from.
    cfg = load_config(None, [])
    data = load_prompt_dataset(cfg.data.dataset)
    rows = {[t.value for t in i.tags if t.key == "mlflow.data.context"][0]: json.loads(i.dataset.profile)["num_rows"]
            for i in mlrun.inputs.dataset_inputs}
    assert rows == {"training": len(data.train), "validation": len(data.validation)}
    # The final model: the run's LoggedModel, READY, copied (tracking.model_copy) as a transformers-flavour
    # MLflow model with the weights of final/, linked to the run's metrics.
    model = client.get_logged_model(tags["trajflow.model_id"])
    assert str(model.status) == "READY" and model.source_run_id == mlrun.info.run_id
    assert "critic/score/mean" in {m.key for m in model.metrics}
    loaded = mlflow.transformers.load_model(model.artifact_location, return_type="components")
    final = load_file(str(Path(summary["run_dir"]) / "final" / "model.safetensors"))
    state = loaded["model"].state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.items())
    # Validation generations with their prompts, every time validation ran (steps 0, 1, 2).
    files = [f.path for f in client.list_artifacts(mlrun.info.run_id, "validation")]
    assert files == [f"validation/iteration_{s:06d}.json" for s in (0, 1, 2)]
    table = pd.read_json(client.download_artifacts(mlrun.info.run_id, files[-1], str(root / "dl-val")), orient="split")
    n_val = min(4, len(data.validation)) * cfg.rollout.val_n  # data.val_max_prompts=4 in the tiny overrides
    assert len(table) == min(cfg.trainer.log_val_generations, n_val)
    by_id = {p.prompt_id: p for p in data.validation}
    for _, r in table.iterrows():
        assert r["prompt"] == by_id[r["prompt_id"]].messages[-1]["content"]
        assert str(r["ground_truth"]) == str(by_id[r["prompt_id"]].ground_truth) and r["score"] in (0.0, 1.0)
    # Training samples carry their prompts too.
    d = Path(summary["run_dir"]) / "iterations" / "000002"
    prompts = [json.loads(p)[-1]["content"] if isinstance(p, str) else p[-1]["content"]
               for p in pq.read_table(d / "rollout.parquet").column("prompt").to_pylist()[:2]]
    samples = pd.read_json(client.download_artifacts(mlrun.info.run_id, "samples/iteration_000002.json",
                                                     str(root / "dl-samples")), orient="split")
    assert samples["prompt"].tolist() == prompts


def test_prefect_graph_each_stage_waits_for_exactly_what_it_uses(run):
    """The Prefect run graph, read back from Prefect's API: each stage task run's upstream (its task_inputs,
    wait_for included) is exactly what it waits for, rollout -> reward -> gate -> advantage -> update, the
    next rollout and the validation after the update: no edge more, none less (flows/graph.py)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    rid = run[0]["run_id"]
    with get_client(sync_client=True) as client:
        flows = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"train-{rid}"])))
        assert len(flows) == 1
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flows[0].id])))
    names = {t.id: t.name.replace(f"-{rid}-", "-") for t in tasks}
    graph = {names[t.id]: {names.get(i.id, f"outside:{i.id}") for inputs in t.task_inputs.values() for i in inputs
                           if getattr(i, "input_type", "") == "task_run"} for t in tasks}
    expected = {"validate-step0": set()}
    for it in (1, 2):
        before = {f"update-it{it - 1}"} if it > 1 else set()
        r, w, g, a, u = (f"{s}-it{it}" for s in ("rollout", "reward", "gate", "advantage", "update"))
        expected |= {r: before, w: {r}, g: {r, w}, a: {r, w, g}, u: {r, w, g, a}, f"validate-step{it}": {u}}
    assert graph == expected


def test_tensorboard_and_wandb_hold_the_mlflow_metrics_and_validation_generations(run):
    """trainer.logger's mirrors on a real run: every MLflow point (validation at step 0 included) in
    TensorBoard (float32) and offline W&B, and each validation's generations as verl's val/generations,
    the rows of MLflow's validation table."""
    import numpy as np

    from tests.mirror_readers import (mlflow_points, tensorboard_points, tensorboard_texts, wandb_points,
                                      wandb_tables)

    summary, root = run
    run_dir = Path(summary["run_dir"])
    meta = json.loads((run_dir / "run.json").read_text())
    want = mlflow_points(f"sqlite:///{root / 'mlflow.db'}", summary["mlflow_run_id"])
    assert set(EXPECTED_METRICS) <= set(want) and want[EXPECTED_METRICS[-1]][0][0] == 0
    tb = tensorboard_points(run_dir / "tensorboard")
    assert {k: sorted(v) for k, v in tb.items()} == {k: [(s, float(np.float32(v))) for s, v in p]
                                                     for k, p in want.items()}
    wb, runs = wandb_points(run_dir / "wandb", meta["wandb_run_id"])
    assert {k: sorted(v) for k, v in wb.items()} == want
    assert [(r["project"], r["display_name"]) for r in runs] == [("trajflow-grpo_default", summary["run_id"])]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    logged = {s: json.loads(Path(client.download_artifacts(summary["mlflow_run_id"], f"validation/iteration_{s:06d}.json",
                                                            str(root / f"dl-gen-{s}"))).read_text())
              for s in (0, 1, 2)}
    assert wandb_tables(run_dir / "wandb", meta["wandb_run_id"], "val/generations") == sorted(logged.items())
    texts = tensorboard_texts(run_dir / "tensorboard", "val/generations")
    assert [s for s, _ in texts] == [0, 1, 2]
    for step, text in texts:
        assert text.splitlines()[0] == "| " + " | ".join(logged[step]["columns"]) + " |"
        assert len(text.splitlines()) == 2 + len(logged[step]["data"])
