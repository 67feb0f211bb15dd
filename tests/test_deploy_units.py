"""Fast checks of the deployment definitions, retry policy, stage timeouts, reports and evaluation lookup."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pytest

from trajflow.errors import ConfigError
from trajflow.config import load_config
from trajflow.infra.deploy import (DeployError, DeploymentSpec, load_deployments, load_pools, resolve_placeholders,
                                   schedule_create, skip_reason)

# ---------------------------------------------------------------- definitions (infra/prefect)


def test_shipped_deployments_pools_and_schedule(tmp_path):
    deps = {d.name: d for d in load_deployments(source=tmp_path, env={})}
    assert set(deps) == {"train", "evaluate", "replay"}
    assert deps["train"].entrypoint == "trajflow.flows.train.train_recipe"
    assert deps["train"].parameters == {"recipe": "grpo_default", "overrides": []}
    assert (deps["train"].work_pool, deps["train"].work_queue) == ("trajflow-cpu", "training")
    assert (deps["replay"].work_pool, deps["replay"].work_queue) == ("trajflow-cpu", "training")
    assert deps["evaluate"].schedules == [{"cron": "0 3 * * *", "timezone": "UTC", "active": True}]
    # workers change into the source folder and import from it, and from this checkout (not installed)
    src = str(tmp_path.resolve())
    checkout = str(Path(__file__).resolve().parents[1])
    for d in deps.values():
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": src}}]
        assert d.job_variables == {"env": {"PYTHONPATH": f"{src}{os.pathsep}{checkout}"}}
    (pool,) = load_pools()
    assert (pool.name, pool.type) == ("trajflow-cpu", "process")
    assert {q.name: q.concurrency_limit for q in pool.queues} == {"training": 1, "evaluation": 1}


def test_pool_override_and_source_from_environment(tmp_path):
    deps = load_deployments(source=tmp_path, pool="gpu-node-a", env={"TRAJFLOW_SOURCE": "/opt/trajflow"})
    assert {d.work_pool for d in deps} == {"gpu-node-a"}
    assert deps[0].pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"] == "/opt/trajflow"
    assert load_pools(pool="gpu-node-a")[0].name == "gpu-node-a"


def test_placeholder_without_variable_names_it():
    with pytest.raises(DeployError, match=r"x\.y: environment variable NOPE is not set"):
        resolve_placeholders({"x": {"y": "a{{ $NOPE }}b"}}, {})
    assert resolve_placeholders({"x": ["{{ $A }}/{{$A}}", 3]}, {"A": "q"}) == {"x": ["q/q", 3]}


def test_schedules_are_validated():
    s = schedule_create({"cron": "30 2 * * 1", "timezone": "Europe/Berlin", "active": False})
    assert (s.schedule.cron, s.schedule.timezone, s.active) == ("30 2 * * 1", "Europe/Berlin", False)
    assert schedule_create({"interval": 3600}).schedule.interval.total_seconds() == 3600
    with pytest.raises(DeployError, match="evaluate.schedules\\[0\\]"):
        schedule_create({"cron": "not a cron"}, "evaluate.schedules[0]")
    with pytest.raises(DeployError, match="needs 'cron' or 'interval'"):
        schedule_create({"rrule": "FREQ=DAILY"})


def test_source_defaults_to_the_callers_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (train,) = [d for d in load_deployments(env={}) if d.name == "train"]
    assert train.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(tmp_path.resolve())


def test_optional_replay_is_skipped_until_its_flow_exists(tmp_path, monkeypatch):
    (replay,) = [d for d in load_deployments(source=tmp_path, env={}) if d.name == "replay"]
    assert replay.entrypoint == "trajflow.flows.replay.replay_flow"
    assert skip_reason(replay) is None  # the shipped flow exists
    monkeypatch.syspath_prepend(str(tmp_path))
    late = DeploymentSpec(name="replay", entrypoint="late_replay.replay_flow", work_pool="p")
    assert skip_reason(late) == "module late_replay does not exist"
    (tmp_path / "late_replay.py").write_text("def replay(x):\n    pass\n")
    assert skip_reason(late) == "late_replay.py does not define replay_flow"
    (tmp_path / "late_replay.py").write_text("@flow\ndef replay_flow(run_id: str):\n    pass\n")
    assert skip_reason(late) is None
    (train,) = [d for d in load_deployments(source=tmp_path, env={}) if d.name == "train"]
    assert skip_reason(train) is None  # never optional


def test_deploy_without_a_server_is_an_error(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from trajflow.infra.deploy import api_url

    assert api_url("http://10.0.0.5:4200") == "http://10.0.0.5:4200/api"
    assert api_url("http://h:4200/api/") == "http://h:4200/api"
    with temporary_settings(updates={PREFECT_API_URL: None}):
        with pytest.raises(DeployError, match="pass --server URL"):
            api_url(None)


# ---------------------------------------------------------------- retries and timeouts


def test_only_transient_failures_are_retried():
    import ray.exceptions as rex
    from prefect.states import Failed

    from trajflow.errors import GateFailed
    from trajflow.run.recovery import retry_on_transient

    def retried(exc: BaseException) -> bool:
        return retry_on_transient(None, None, Failed(data=exc))

    assert retried(rex.ActorDiedError())
    assert retried(rex.GetTimeoutError("stage deadline"))
    assert retried(TimeoutError("Prefect task-run timeout"))
    assert retried(rex.WorkerCrashedError())
    assert not retried(ValueError("bad row 3"))
    assert not retried(ConfigError("config: actor.lr=-1 is out of range"))
    assert not retried(GateFailed("reward/score_range failed"))
    assert not retried(rex.RayTaskError("update_actor", "Traceback ...", ValueError("nan loss")))


def test_stage_timeouts_and_retries_come_from_config():
    from trajflow.flows.tasks import stages_for
    from trajflow.run.recovery import stage_timeout

    cfg = load_config(None, ["trainer.stage_timeout_s=600", "trainer.stage_timeouts={update_actor: 30, gate: 0}",
                             "trainer.stage_retries=4", "trainer.stage_retry_delay_s=2.5"])
    assert stage_timeout(cfg, "rollout") == 600
    assert stage_timeout(cfg, "update_actor") == 30
    assert stage_timeout(cfg, "gate") is None  # 0 = no limit
    s = stages_for(cfg)
    assert (s.update.retries, s.update.retry_delay_seconds, s.update.timeout_seconds) == (4, 2.5, 30)
    assert (s.rollout.timeout_seconds, s.gate.timeout_seconds) == (600, None)
    assert s.update.task_run_name == "update-{run_id}-it{iteration}"


@pytest.mark.parametrize("override, message", [
    ("trainer.stage_timeouts={rollot: 5}", "trainer.stage_timeouts.rollot is not a stage: choose from rollout"),
    ("trainer.stage_timeouts={rollout: -5}", "trainer.stage_timeouts.rollout=-5 must be a number of seconds >= 0"),
    ("trainer.stage_retries=-1", "trainer.stage_retries=-1 is out of range: must be >= 0"),
])
def test_bad_retry_and_timeout_config_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_config(None, [override])


def test_stage_deadline_drops_a_stuck_worker_and_keeps_a_healthy_one(tmp_path, ray_local):
    import ray

    import trajflow.run.recovery as runtime
    from trajflow.errors import StageTimeoutError
    from trajflow.run.context import RunContext
    from trajflow.run.recovery import stage_guard, wait
    from trajflow.store import RunStore

    @ray.remote(num_cpus=0)
    class Worker:
        def pid(self) -> int:
            import os

            return os.getpid()

        def work(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    cfg = load_config(None, ["trainer.stage_timeouts={reward: 1.5}"])
    ctx = RunContext(cfg=cfg, store=RunStore(tmp_path, "r"), model_path="")
    ctx.reference = Worker.remote()
    assert wait(ctx, ctx.reference.work.remote(0.0)) == 0.0  # no deadline outside a stage
    with stage_guard(ctx, "reward"):
        assert wait(ctx, ctx.reference.work.remote(0.1)) == 0.1
    assert ctx.reference is not None and ctx.state.deadline is None
    stuck = ctx.reference
    old = runtime.PING_TIMEOUT_S
    runtime.PING_TIMEOUT_S = 2.0
    t0 = time.monotonic()
    try:
        # One line naming the stage, the limit and its key (a TimeoutError still: the task is retried)
        with pytest.raises(StageTimeoutError, match=r"stage reward did not finish within 1\.5 s "
                                                    r"\(trainer\.stage_timeouts\.reward") as e:
            with stage_guard(ctx, "reward"):
                wait(ctx, ctx.reference.work.remote(60.0))
    finally:
        runtime.PING_TIMEOUT_S = old
    assert time.monotonic() - t0 < 20  # 1.5 s deadline + 2 s ping, not the 60 s call
    assert isinstance(e.value, TimeoutError) and "\n" not in str(e.value)
    assert ctx.reference is None and ctx.state.workers_lost == ["reference"]
    with pytest.raises(ray.exceptions.RayActorError):  # it was killed, not left computing
        ray.get(stuck.pid.remote(), timeout=30)


# ---------------------------------------------------------------- update batches (retries re-apply them)


def test_update_batch_and_loss_mask_match_the_formulas():
    from trajflow.stages.policy_update import update_batch, with_loss_mask
    from trajflow.stages.seeds import iteration_seed

    joined = pa.table({"sample_id": ["a", "b", "c"], "prompt_ids": [[1, 2], [1, 2], [3]],
                       "response_ids": [[5, 6, 7], [8], [9, 9]],
                       "rollout_logprobs": [[-1.0, -1.0, -1.0], [-2.0], [-0.5, -0.5]],
                       "advantages": [[0.5, 0.5, 0.5], [-1.0], [0.0, 0.0]],
                       "ref_logprobs": [[-1.1, -1.1, -1.1], [-2.1], [-0.6, -0.6]]})
    masked = with_loss_mask(joined, {"quarantined_sample_ids": ["b"]})
    assert masked.column("loss_mask").to_pylist() == [[1.0, 1.0, 1.0], [0.0], [1.0, 1.0]]
    assert with_loss_mask(joined, None) is joined
    b = update_batch(masked, 7, seed=42, n=3, ppo_mini_batch_size=2, use_ref_logprobs=False)
    assert b.settings.mini_batch_rows == 6
    assert b.settings.shuffle_seed == (42 * 1_000_003 + 7 * 7919 + 1) % (2**31 - 1) == 42_055_560
    assert iteration_seed(42, 7, 1) == 42_055_560
    assert b.rows.loss_mask == [[1.0, 1.0, 1.0], [0.0], [1.0, 1.0]] and b.rows.ref_logprobs is None
    assert update_batch(joined, 7, seed=42, n=3, ppo_mini_batch_size=2, use_ref_logprobs=True).rows.ref_logprobs[1] \
        == pytest.approx([-2.1])


# ---------------------------------------------------------------- reports


def test_metrics_markdown_table_and_mlflow_link():
    from trajflow.flows.reporting import artifact_key, metrics_markdown, mlflow_run_url

    assert artifact_key("grpo_default-20261129-151146-e145", "metrics") == "grpo-default-20261129-151146-e145-metrics"
    url = mlflow_run_url("http://mlflow:5000/", "3", "abc123")
    assert url == "http://mlflow:5000/#/experiments/3/runs/abc123"
    assert mlflow_run_url(None, "3", "abc123") is None
    md = metrics_markdown("run r: iteration 2/5", {"critic/score/mean": 0.53125, "actor/pg_loss": -0.0123456,
                                                   "val-core/basic_arithmetic/acc/mean@1": 0.25,
                                                   "perf/cpu_memory_used_gb": 3.2},
                          mlflow_url=url, mlflow_run_id="abc123")
    lines = md.splitlines()
    assert lines[0] == "### run r: iteration 2/5"
    assert "- **MLflow**: [run abc123](http://mlflow:5000/#/experiments/3/runs/abc123)" in lines
    assert "| `critic/score/mean` | 0.5312 |" in lines
    assert "| `actor/pg_loss` | -0.01235 |" in lines
    assert "| `val-core/basic_arithmetic/acc/mean_at_1` | 0.25 |" in lines  # one spelling, as in MLflow
    assert not any("cpu_memory" in line for line in lines)  # not a headline metric
    md = metrics_markdown("t", {"x/y": 1.0}, mlflow_run_id="abc", tracking_uri="sqlite:///m.db", all_metrics=True)
    assert "run `abc` at `sqlite:///m.db` (set `tracking.ui_url` for a link)" in md and "| `x/y` | 1 |" in md


# ---------------------------------------------------------------- which run and checkpoint to evaluate


def _fake_run(root: Path, run_id: str, recipe: str, created: float, checkpoints: list[int]) -> None:
    d = root / run_id
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("recipe: x\n")
    (d / "run.json").write_text(json.dumps({"recipe": recipe, "created": created}))
    for c in checkpoints:
        (d / "checkpoints" / f"{c:06d}").mkdir(parents=True)
        (d / "checkpoints" / f"{c:06d}" / "trainer_state.json").write_text("{}")
    (d / "checkpoints" / ".tmp-000099").mkdir(parents=True, exist_ok=True)  # an interrupted save


def test_evaluate_picks_the_newest_run_and_checkpoint(tmp_path):
    from trajflow.flows.evaluate import find_run, pick_checkpoint
    from trajflow.errors import StoreError

    _fake_run(tmp_path, "a-old", "grpo_default", 100.0, [5, 10])
    _fake_run(tmp_path, "b-new", "grpo_default", 300.0, [2])
    _fake_run(tmp_path, "c-nockpt", "grpo_default", 400.0, [])
    _fake_run(tmp_path, "d-other", "ppo", 350.0, [1])
    assert find_run(tmp_path).run_id == "d-other"
    assert find_run(tmp_path, recipe="grpo_default").run_id == "b-new"
    assert find_run(tmp_path, "a-old").run_id == "a-old"
    with pytest.raises(StoreError, match="no run 'zzz'"):
        find_run(tmp_path, "zzz")
    with pytest.raises(StoreError, match="no run of recipe 'dpo' with a checkpoint"):
        find_run(tmp_path, recipe="dpo")
    store = find_run(tmp_path, "a-old")
    assert pick_checkpoint(store, None) == 10
    assert pick_checkpoint(store, 5) == 5
    assert pick_checkpoint(store, 0) == 0
    with pytest.raises(StoreError, match="has no checkpoint 7; it has: 5, 10"):
        pick_checkpoint(store, 7)
    with pytest.raises(StoreError, match="pass checkpoint=0"):
        pick_checkpoint(find_run(tmp_path, "c-nockpt"), None)
