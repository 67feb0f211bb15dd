"""A policy worker killed mid-update: the stage retries, the worker is recreated, the run completes.

The run uses an instrumented :class:`PolicyWorker` subclass that records its pid, policy version and
a digest of its weights at the start of every update, and holds iteration 2's first update until the
test has SIGKILLed its process. There is no checkpoint before the end (``save_freq=2`` of 2 iterations), so the
retry must rebuild the policy from the initial model plus iteration 1's stored update: the weights
at the start of the retried update must equal, bit for bit, those the killed worker had.

Then the ``evaluate`` flow validates the run's final checkpoint in a fresh worker; its metrics must
equal the train flow's own validation after the same iteration (same policy, same prompts, same seed).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides

pytestmark = pytest.mark.timeout(600)


def _instrumented_worker(log: Path):
    """A PolicyWorker subclass that logs each update's start and stalls iteration 2's first attempt."""
    from trajflow.workers.policy import PolicyWorker

    class RecordingPolicyWorker(PolicyWorker):
        def update_actor(self, batch) -> dict:
            seen = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            first_attempt = not any(e["version"] == self.policy_version for e in seen)
            with open(log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "version": self.policy_version,
                                    "digest": self.weights_digest()}) + "\n")
            if self.policy_version == 1 and first_attempt:
                time.sleep(120)  # killed by the test long before this ends
            return super().update_actor(batch)

    return RecordingPolicyWorker


def _kill_when_update_starts(log: Path, version: int, killed: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        entries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        hit = [e for e in entries if e["version"] == version]
        if hit:
            time.sleep(0.5)  # well inside update_actor's sleep
            os.kill(hit[0]["pid"], signal.SIGKILL)
            killed["pid"] = hit[0]["pid"]
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, tiny_model_dir, ray_local):
    import trajflow.run.workers as runtime
    from trajflow.flows.train import train

    tmp = tmp_path_factory.mktemp("retry")
    log = tmp / "updates.jsonl"
    killed: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_when_update_starts, args=(log, 1, killed, stop), daemon=True)
    killer.start()
    runtime.policy_worker_cls = _instrumented_worker(log)
    t0 = time.monotonic()
    try:
        summary = train(None, tiny_overrides(tiny_model_dir, tmp / "runs", **{
            "trainer.save_freq": 2, "trainer.test_freq": 2, "trainer.val_before_train": False,
            "trainer.stage_retries": 2, "trainer.stage_retry_delay_s": 1}))
    finally:
        runtime.policy_worker_cls = None
        stop.set()
        killer.join(timeout=5)
    print(f"run with a killed worker completed in {time.monotonic() - t0:.0f} s")
    return {"summary": summary, "log": log, "killed": killed, "root": tmp / "runs"}


def test_killed_policy_worker_is_recreated_and_the_flow_completes(killed_run):
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    summary, killed = killed_run["summary"], killed_run["killed"]
    assert "pid" in killed, "the update never started, or the test never killed the worker"
    run_dir = Path(summary["run_dir"])
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "finished"
    assert meta["policy_version"] == 2  # two updates, not three: the killed one left no trace
    for it in (1, 2):
        manifest = json.loads((run_dir / "iterations" / f"{it:06d}" / "manifest.json").read_text())
        assert manifest["status"] == "complete"

    entries = [json.loads(line) for line in killed_run["log"].read_text().splitlines()]
    # killed worker: update 1, update 2 (killed); new worker: update 1 re-applied from the store, update 2
    assert [e["version"] for e in entries] == [0, 1, 0, 1]
    old, new = entries[:2], entries[2:]
    assert {e["pid"] for e in old} == {killed["pid"]}
    assert len({e["pid"] for e in new}) == 1 and new[0]["pid"] != killed["pid"]
    assert new[0]["digest"] == old[0]["digest"]  # both start from the initial model
    assert new[1]["digest"] == old[1]["digest"]  # the rebuilt policy equals the lost one, bit for bit

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(task_run_filter=TaskRunFilter(
            name=TaskRunFilterName(any_=[f"update-{summary['run_id']}-it2"])))
    assert len(runs) == 1
    assert runs[0].state.is_completed()
    assert runs[0].run_count == 2  # the first attempt failed with the dead worker, the retry succeeded


def test_evaluate_flow_reproduces_the_runs_validation(killed_run):
    from mlflow.tracking import MlflowClient

    from trajflow.flows.evaluate import evaluate_flow

    run_id = killed_run["summary"]["run_id"]
    meta = json.loads((Path(killed_run["summary"]["run_dir"]) / "run.json").read_text())
    result = evaluate_flow(run_id=run_id, store_root=str(killed_run["root"]))
    assert result["checkpoint"] == 2 and result["policy_version"] == 2
    # Same policy (checkpoint 2 = the policy validated after iteration 2), prompts and seed.
    in_run = meta["validation_000002"]
    core = [k for k in in_run if k.startswith("val-core/")]
    assert core
    for k in core + ["val-aux/response_length/mean"]:
        assert result["metrics"][k] == in_run[k], k
    stored = json.loads(Path(result["path"]).read_text())
    assert stored["metrics"] == result["metrics"]

    client = MlflowClient(tracking_uri=meta["tracking_uri"])
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["trajflow.evaluated_run_id"] == run_id
    assert run.data.tags["trajflow.checkpoint"] == "2"
    assert run.data.tags["mlflow.parentRunId"] == meta["mlflow_run_id"]
    assert run.info.experiment_id == client.get_run(meta["mlflow_run_id"]).info.experiment_id
    name = core[0]
    assert "@" not in name  # the one spelling: what run.json and the console say is what MLflow has
    assert run.data.metrics[name] == pytest.approx(in_run[core[0]])


def test_evaluate_releases_its_policy_ranks_and_placement_groups(killed_run):
    """On a Ray the flow did not start (here the test session's; in production a cluster), the
    evaluation must kill its policy ranks and remove its placement groups when it ends."""
    import ray

    from trajflow.flows.evaluate import evaluate_flow

    def live_policy_actors() -> set[str]:
        return {a["ActorID"] for a in ray._private.state.actors().values()
                if a["State"] != "DEAD" and a["ActorClassName"].endswith("PolicyWorker")}

    def live_placement_groups() -> set[str]:
        return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}

    actors_before, groups_before = live_policy_actors(), live_placement_groups()
    pool = "resources.pools={evalpool: {nodes: 1, devices_per_node: 1, device: cpu, num_cpus_per_worker: 1}}"
    result = evaluate_flow(run_id=killed_run["summary"]["run_id"], store_root=str(killed_run["root"]),
                           overrides=[pool, "actor.pool=evalpool"])
    assert result["checkpoint"] == 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (live_policy_actors() - actors_before
                                           or live_placement_groups() - groups_before):
        time.sleep(0.5)
    assert live_policy_actors() - actors_before == set()
    assert live_placement_groups() - groups_before == set()


def test_evaluate_command_reports_majority_and_best_of_n(killed_run):
    """``trajflow evaluate`` with rollout.val_n=3 at temperature 1: the printed lines are the stored
    result, and the metrics keep the order any n samples must have (best@n >= maj@n, best@n >= mean@n)."""
    from typer.testing import CliRunner

    from trajflow.cli import app

    run_id = killed_run["summary"]["run_id"]
    res = CliRunner().invoke(app, ["evaluate", run_id, "--checkpoint", "0", "--store", str(killed_run["root"]),
                                   "rollout.val_n=3", "rollout.val_temperature=1.0"])
    assert res.exit_code == 0, res.output
    printed = dict(line.rsplit(": ", 1) for line in res.output.splitlines() if line.startswith("val-"))
    path = res.output.strip().splitlines()[-1].rsplit(": ", 1)[1]
    stored = json.loads(Path(path).read_text())
    assert stored["checkpoint"] == 0 and stored["policy_version"] == 0
    src = "reasoning_gym/basic_arithmetic"
    keys = [f"val-core/{src}/acc/mean_at_3", f"val-core/{src}/acc/maj_at_3/mean", f"val-core/{src}/acc/best_at_3/mean"]
    for k in keys:
        assert float(printed[k]) == pytest.approx(stored["metrics"][k], abs=5e-5), k
    mean, maj, best = (stored["metrics"][k] for k in keys)
    assert best >= maj and best >= mean

    missing = CliRunner().invoke(app, ["evaluate", "no-such-run", "--store", str(killed_run["root"])])
    assert missing.exit_code == 2
    assert "no-such-run" in missing.output
