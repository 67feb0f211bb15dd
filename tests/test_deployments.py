"""Deployments on a real Prefect server: ``trajflow deploy``, a process worker, a train run through the API.

Starts ``prefect server start`` on loopback with a fresh SQLite ``PREFECT_HOME`` and a process
worker, registers the deployments with the real CLI, triggers ``train-recipe/train`` through the
Prefect API with the tiny model, waits for it, then checks the run store, the flow run's state and
name, the per-iteration artifacts, the task-run names, the evaluate schedule's cron and the training
queue's concurrency limit (a second training run stays scheduled while the first one runs).
Everything started is stopped in the fixture's finalizer (whole process trees). Takes ~3 minutes
on 2 CPU cores (~7 when the machine is heavily shared).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides

pytestmark = pytest.mark.timeout(600)

POOL = "trajflow-cpu"
RUN_TIMEOUT_S = 360
HELD_POLLS = 6  # polls (2 s apart) during which a second training run must stay scheduled


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """Start ``cmd`` in its own process group (so that it can be stopped with everything it starts)."""
    f = open(log, "wb")
    return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process group, then SIGKILL whatever of it (and of its descendants) is left."""
    import psutil

    tree: list[psutil.Process] = []
    for p in procs:
        try:
            tree += [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for p in reversed(procs):  # the worker (and its flow runs) before the server
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    _, alive = psutil.wait_procs(tree, timeout=15)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=5)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    """A Prefect server + process worker on loopback with trajflow's deployments registered."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("prefect-stack")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    base_env.update({"PREFECT_HOME": str(tmp / "prefect-home"), "PYTHONPATH": str(REPO),
                     "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_UI_ENABLED": "false",
                     "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
    client_env = {**base_env, "PREFECT_API_URL": url, "PREFECT_WORKER_QUERY_SECONDS": "2",
                  "PREFECT_WORKER_PREFETCH_SECONDS": "2"}
    logs = {"server": tmp / "server.log", "worker": tmp / "worker.log"}
    procs: list[subprocess.Popen] = []
    prefect = str(Path(sys.executable).with_name("prefect"))
    t0 = time.monotonic()
    try:
        procs.append(_spawn([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            base_env, logs["server"]))
        _wait_healthy(url, procs[0], logs["server"])
        t_server = time.monotonic() - t0
        # Register with the real CLI, as a user would, from their own project folder: the flow runs
        # work there (their runs/ store), not in trajflow's folder.
        project = tmp / "project"
        project.mkdir()
        out = subprocess.run([sys.executable, "-m", "trajflow.cli", "deploy", "--server", f"http://127.0.0.1:{port}"],
                             env=client_env, cwd=str(project), capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, f"trajflow deploy failed:\n{out.stdout}\n{out.stderr}"
        procs.append(_spawn([prefect, "worker", "start", "--pool", POOL, "--type", "process"],
                            client_env, logs["worker"]))
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield {"url": url, "tmp": tmp, "project": project, "logs": logs, "deploy_output": out.stdout,
                   "model": tiny_model_dir,
                   "t_server": t_server}
    finally:
        _stop(procs)


def test_deploy_registers_pool_queues_and_nightly_evaluate_schedule(stack):
    from prefect import get_client

    assert "deployment train" in stack["deploy_output"], stack["deploy_output"]
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(POOL)
        assert pool.type == "process"
        training = client.read_work_queue_by_name("training", work_pool_name=POOL)
        assert training.concurrency_limit == 1  # two training runs never share the device pool
        train = client.read_deployment_by_name("train-recipe/train")
        assert (train.work_pool_name, train.work_queue_name) == (POOL, "training")
        assert train.parameters == {"recipe": "grpo_default", "overrides": []}
        project = str(stack["project"].resolve())
        assert train.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": project}}]
        assert f"flow runs work in {project} on the workers" in stack["deploy_output"]
        evaluate = client.read_deployment_by_name("evaluate/evaluate")
        assert evaluate.work_queue_name == "evaluation"
        assert len(evaluate.schedules) == 1
        sched = evaluate.schedules[0]
        assert sched.active
        assert sched.schedule.cron == "0 3 * * *"
        assert sched.schedule.timezone == "UTC"
        replay_file = REPO / "flows" / "replay.py"
        if replay_file.exists() and "def replay_flow" in replay_file.read_text():
            assert client.read_deployment_by_name("replay/replay").work_queue_name == "training"
        else:
            assert "skipped deployment replay" in stack["deploy_output"]


def test_train_deployment_runs_through_the_worker(stack):
    from prefect import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, FlowRunFilter,
                                                FlowRunFilterParentFlowRunId, TaskRunFilter, TaskRunFilterFlowRunId)
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Cancelled

    from trajflow.flows.reporting import artifact_key

    store_root = stack["project"] / "runs"  # store.root's default, in the deployments' working directory
    overrides = tiny_overrides(stack["model"], "runs", **{"trainer.val_before_train": False,
                                                               "trainer.stage_retry_delay_s": 1})
    t0 = time.monotonic()
    flow_run = run_deployment("train-recipe/train", parameters={"recipe": "grpo_default", "overrides": overrides},
                              timeout=0)
    second, held = None, 0
    with get_client(sync_client=True) as client:
        while True:
            flow_run = client.read_flow_run(flow_run.id)
            if flow_run.state is not None and flow_run.state.is_final():
                break
            if time.monotonic() - t0 > RUN_TIMEOUT_S:
                pytest.fail(f"train run still {flow_run.state_name} after {RUN_TIMEOUT_S} s; worker log:\n"
                            f"{_tail(stack['logs']['worker'])}")
            if flow_run.state_type == StateType.RUNNING and held < HELD_POLLS:
                # A second training run on the same pool must wait while the first one runs (the
                # `training` queue's concurrency limit), although the worker is idle otherwise.
                if second is None:
                    second = run_deployment("train-recipe/train", timeout=0, parameters={
                        "recipe": "grpo_default", "overrides": tiny_overrides(stack["model"], stack["tmp"] / "runs-2")})
                state = client.read_flow_run(second.id).state
                assert state.type == StateType.SCHEDULED, f"second training run is {state.name} beside the first"
                held += 1
                if held == HELD_POLLS:  # held long enough (the worker polls every 2 s): withdraw it
                    client.set_flow_run_state(second.id, Cancelled(), force=True)
            time.sleep(2)
        elapsed = time.monotonic() - t0
        assert flow_run.state.is_completed(), (f"state {flow_run.state_name}: {flow_run.state.message}\n"
                                               f"{_tail(stack['logs']['worker'])}")
        print(f"server healthy after {stack['t_server']:.0f} s; train run completed in {elapsed:.0f} s")
        assert held == HELD_POLLS, "the first run finished before the second could be observed waiting"
        assert client.read_flow_run(second.id).state.type == StateType.CANCELLED
        assert not (stack["tmp"] / "runs-2").exists()

        # The run store: one finished run with both iterations complete, checkpoints and the final model.
        runs = [d for d in store_root.iterdir() if d.is_dir() and (d / "config.yaml").exists()]
        assert len(runs) == 1, runs
        run_dir = runs[0]
        run_id = run_dir.name
        meta = json.loads((run_dir / "run.json").read_text())
        assert meta["status"] == "finished"
        for it in (1, 2):
            manifest = json.loads((run_dir / "iterations" / f"{it:06d}" / "manifest.json").read_text())
            assert manifest["status"] == "complete"
            assert set(manifest["files"]) >= {"rollout", "reward", "advantage", "update"}
        assert (run_dir / "checkpoints" / "000002" / "trainer_state.json").exists()
        assert (run_dir / "final" / "config.json").exists()

        # Flow-run and task-run names carry the run id (and the iteration).
        assert flow_run.name == f"train-recipe-{run_id}"
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id])))
        train_runs = [r for r in children if r.name == f"train-{run_id}"]
        assert len(train_runs) == 1 and train_runs[0].state.is_completed()
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(
            flow_run_id=TaskRunFilterFlowRunId(any_=[train_runs[0].id])))
        names = {t.name for t in tasks}
        for it in (1, 2):
            assert {f"rollout-{run_id}-it{it}", f"reward-{run_id}-it{it}", f"advantage-{run_id}-it{it}",
                    f"update-{run_id}-it{it}"} <= names, names

        # One markdown artifact per iteration: the metrics table and the MLflow run.
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[artifact_key(run_id, "metrics")])))
        assert sorted(a.description for a in arts) == [f"trajflow run {run_id}, iteration {i}" for i in (1, 2)]
        for a in arts:
            assert a.type == "markdown"
            assert "| `critic/score/mean` |" in a.data
            assert meta["mlflow_run_id"] in a.data
