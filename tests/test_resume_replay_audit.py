"""End to end: crash `trajflow train` with SIGKILL and resume it bit for bit; epoch-boundary resume and
checkpoint rotation; replay of stored iterations into new runs; the audit table against the Parquet files.

Every run is a real ``python -m trajflow.cli`` subprocess (real Prefect, real Ray, MLflow on SQLite)
with the tiny random model, 2 prompts x 2 samples, 8 new tokens. To keep the module within a few
minutes on 2 cores:

- one real Prefect server is started for the module (``prefect server start``, SQLite, temp
  ``PREFECT_HOME``) and handed to every subprocess through ``PREFECT_API_URL``, instead of each
  subprocess starting a temporary server (11-25 s each);
- the MLflow SQLite schema is created once and copied into each store root;
- the three independent scenarios (reference run + replays, the kill chain, the epoch run) run in
  three threads at once. The kill chain's subprocesses each start their own local Ray (what is
  under test is what a killed driver leaves behind); the other two join the test session's Ray
  (``resources.ray_address``), so that at most one local cluster starts at a time: Ray gives a
  starting node 30 s, which an overloaded 2-core machine can miss.

The kill chain crashes one run at each fault point of :mod:`trajflow.faults`, resuming it in between:

====  =======================================================  ==============================
step  command (``TRAJFLOW_FAULT``)                             dies
====  =======================================================  ==============================
1     ``train`` (``rollout:1``)                                generating iteration 1
2     ``resume`` (``after_reward:2``)                          rewards of it. 2 stored, no advantages
3     ``resume`` (``checkpoint:2``)                            writing checkpoint 2 (it. 2 complete)
4     ``resume`` (``update:3``)                                updating the policy in iteration 3
--    truncate iteration 3's ``reward.parquet``
5     ``resume``                                               finishes
====  =======================================================  ==============================

and then compares every stored Parquet file and the final weights with an uninterrupted run of the
same config and seed (``ref``).

The same holds on FSDP2 (``actor.strategy=fsdp2`` on 2 gloo ranks, its sharded safetensors
checkpoints, the reference policy sharded too): one run is killed while its ranks write checkpoint 2
(the richest point: an update's sharded state half-saved, the previous checkpoint to load), resumed,
and compared with an uninterrupted FSDP2 run. Both run in a fixture of their own (``fsdp_scenarios``,
~2 CLI runs of wall time), so ``-k fsdp2`` runs them alone; all three CLI runs join the test
session's Ray (what a killed driver leaves behind is the kill chain's test, above; a local cluster
started per run is what an overloaded machine fails to start in time).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(1800)

WORDS = ["alpha", "bravo", "zyzzyva", "delta"]  # the 4 training prompts: 2 iterations per epoch
STAGE_FILES = ("rollout.parquet", "reward.parquet", "advantage.parquet")
MARK = "TRAJFLOW_TEST_MARK"
# The kill chain also logs to TensorBoard, the epoch run (sessions that end normally) to W&B as well.
TB = "[console,mlflow,tensorboard]"
TB_WANDB = "[console,mlflow,tensorboard,wandb]"

REWARD_PY = '''
def score(data_source, solution_str, ground_truth, extra_info=None):
    """Share of the response's letters that occur in the ground-truth word: deterministic and varied."""
    letters = [c for c in solution_str.lower() if c.isalpha()]
    return sum(c in ground_truth for c in letters) / len(letters) if letters else 0.0
'''


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Step:
    """One CLI subprocess: what ran, how it ended, and Ray processes it left behind."""

    name: str
    args: list[str]
    fault: str | None
    rc: int = 0
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    leftovers: list = field(default_factory=list)


def _marked_processes(mark: str) -> list[tuple[int, str]]:
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                out.append((p.pid, p.name()))
        except psutil.Error:
            continue
    return out


class Lab:
    """Shared set-up: dataset, reward function, tiny model, Prefect server, MLflow schema template."""

    def __init__(self, root: Path, model_dir: Path, api_url: str, mlflow_template: Path) -> None:
        self.ray_address: str | None = None  # the test session's Ray, for the scenarios that share it
        self.root = root
        self.model_dir = model_dir
        self.api_url = api_url
        self.mlflow_template = mlflow_template
        self.spec = root / "data" / "words.yaml"
        self.reward = root / "data" / "reward.py"

    def store(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(exist_ok=True)
        if not (d / "mlflow.db").exists():
            shutil.copyfile(self.mlflow_template, d / "mlflow.db")
        return d

    def overrides(self, store: Path, shared_ray: bool = True, **extra) -> list[str]:
        base = {"model.path": self.model_dir, "store.root": store, "data.dataset": self.spec,
                "reward.custom_function": f"{self.reward}:score", "data.train_batch_size": 2, "rollout.n": 2,
                "rollout.max_new_tokens": 8, "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size": 2,
                "actor.lr": 1e-3, "trainer.total_iterations": 3, "trainer.save_freq": 1, "trainer.test_freq": 0,
                "trainer.max_checkpoints": 0, "trainer.log_samples": 0, "trainer.progress": False,
                "gates.enabled": False, "trainer.seed": 7,
                "reward.overlong_buffer.enable": False}  # the default recipe's 16-token buffer exceeds the 8-token cap
        if shared_ray and self.ray_address:
            base["resources.ray_address"] = self.ray_address
        base.update(extra)
        return [f"{k}={v}" for k, v in base.items()]

    def named_reward(self) -> str:
        """The reward function named on the command line again, as ``resume``/``replay`` require."""
        return f"reward.custom_function={self.reward}:score"

    def cli(self, name: str, *args: str, fault: str | None = None, timeout: float = 900) -> Step:
        """Run ``python -m trajflow.cli ARGS``; after a SIGKILL, wait for its Ray processes to go."""
        mark = f"{name}-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ)
        env.pop("TRAJFLOW_FAULT", None)
        env.update({"PYTHONPATH": str(REPO), "PREFECT_API_URL": self.api_url,
                    "PREFECT_HOME": str(self.root / "prefect-client"), MARK: mark})
        if fault:
            env["TRAJFLOW_FAULT"] = fault
        step = Step(name, list(args), fault)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "trajflow.cli", *args], env=env, cwd=self.root, capture_output=True,
                           text=True, timeout=timeout)
        step.seconds = time.perf_counter() - t0
        step.rc, step.stdout, step.stderr = r.returncode, r.stdout, r.stderr
        (self.root / "logs").mkdir(exist_ok=True)
        log = f"$ {' '.join(args)}\nrc={r.returncode}\n{r.stdout}\n{r.stderr}"
        (self.root / "logs" / f"{name}.log").write_text(log)
        if r.returncode == -signal.SIGKILL:
            deadline = time.time() + 25
            while (left := _marked_processes(mark)) and time.time() < deadline:
                time.sleep(0.5)
            step.leftovers = left
            for pid, _ in left:  # keep the machine clean whatever the assertion says later
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        return step


@pytest.fixture(scope="module")
def lab(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("rra")
    (root / "data").mkdir()
    with open(root / "data" / "prompts.jsonl", "w") as f:
        for i, w in enumerate(WORDS):
            row = {"data_source": "test/words", "prompt": [{"role": "user", "content": f"Say the word {w}."}],
                   "reward_model": {"style": "rule", "ground_truth": w}, "extra_info": {"index": i}}
            f.write(json.dumps(row) + "\n")
    (root / "data" / "words.yaml").write_text("name: words\nsource: file\npath: prompts.jsonl\nseed: 0\n"
                                             "split:\n  validation_size: 0\n")
    (root / "data" / "reward.py").write_text(REWARD_PY)
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(root / "prefect-server"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="false", DO_NOT_TRACK="1")
    env.pop("PREFECT_API_URL", None)
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
    log = open(root / "prefect-server.log", "w")
    server = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        template = root / "mlflow-template.db"  # schema migrations once, while the server starts
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()
        url = f"http://127.0.0.1:{port}/api"
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"prefect server did not start: {(root / 'prefect-server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield Lab(root, Path(tiny_model_dir), url, template)
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


# ---------------------------------------------------------------------------- scenarios


def scenario_reference(lab: Lab) -> dict:
    """The uninterrupted run, then replays of it, then a replay request that must be refused."""
    store = lab.store("ref")
    root = f"store.root={store}"
    fn = lab.named_reward()  # a run folder's reward function is imported only when named again
    out = {"store": store}
    out["train"] = lab.cli("ref-train", "train", *lab.overrides(store), "--run-id", "ref")
    out["replay_same"] = lab.cli("ref-replay-same", "replay", "ref", "--iteration", "2", "--from-stage", "reward",
                                 root, fn, "--run-id", "ref-same")
    out["replay_rloo"] = lab.cli("ref-replay-rloo", "replay", "ref", "--iteration", "2", "--from-stage", "advantage",
                                 root, fn, "algorithm.adv_estimator=rloo", "--run-id", "ref-rloo")
    out["replay_all"] = lab.cli("ref-replay-all", "replay", "ref", "--iterations", "1:3", "--from-stage", "reward",
                                root, fn, "--run-id", "ref-all")
    out["replay_bad"] = lab.cli("ref-replay-bad", "replay", "ref", "--iteration", "9", "--from-stage", "reward", root)
    # The same run without checkpoint 1: replaying iteration 2 from the advantages still works, the
    # update (which needs the policy that generated iteration 2) is skipped with a note.
    shutil.copytree(store / "ref", store / "refcut")
    shutil.rmtree(store / "refcut" / "checkpoints" / "000001")
    out["replay_cut"] = lab.cli("ref-replay-cut", "replay", "refcut", "--iteration", "2", "--from-stage", "advantage",
                                root, fn, "algorithm.adv_estimator=rloo", "trainer.test_freq=1", "--run-id", "refcut-rloo")
    return out


def scenario_chain(lab: Lab) -> dict:
    """Kill the run at every fault point in turn, resuming in between (see the module docstring)."""
    store = lab.store("chain")
    root = f"store.root={store}"
    fn = lab.named_reward()
    run = store / "k"
    out: dict = {"store": store, "steps": []}
    steps = out["steps"]
    steps.append(lab.cli("k1", "train", *lab.overrides(store, shared_ray=False, **{"trainer.max_checkpoints": 2,
                                                                               "trainer.logger": TB}),
                         "--run-id", "k",
                         fault="rollout:1"))
    steps.append(lab.cli("k2", "resume", "k", root, fn, fault="after_reward:2"))
    steps.append(lab.cli("k3", "resume", "k", root, fn, fault="checkpoint:2"))
    out["tmp_after_k3"] = sorted(p.name for p in (run / "checkpoints").iterdir())
    steps.append(lab.cli("k4", "resume", "k", root, fn, fault="update:3"))
    out["tmp_after_k4"] = sorted(p.name for p in (run / "checkpoints").iterdir())
    it3 = run / "iterations" / "000003"
    out["it3_files_before"] = sorted(p.name for p in it3.iterdir())
    reward = it3 / "reward.parquet"
    data = reward.read_bytes()
    reward.write_bytes(data[: len(data) // 2])  # a truncated Parquet file in a stored iteration
    out["corrupted"] = reward
    out["stat_before"] = {n: (os.stat(it3 / n).st_ino, os.stat(it3 / n).st_mtime_ns)
                          for n in ("rollout.parquet", "advantage.parquet")}
    steps.append(lab.cli("k5", "resume", "k", root, fn))
    out["stat_after"] = {n: (os.stat(it3 / n).st_ino, os.stat(it3 / n).st_mtime_ns)
                         for n in ("rollout.parquet", "advantage.parquet")}
    return out


def scenario_epoch(lab: Lab) -> dict:
    """One epoch (2 iterations) to the end, then ``trainer.resume=auto`` with 4 iterations, then a
    ``resume`` of the finished run, then a ``resume`` of an unknown run."""
    store = lab.store("epoch")
    ov = {"trainer.max_checkpoints": 2, "trainer.logger": TB_WANDB}
    out = {"store": store}
    out["first"] = lab.cli("ep1", "train", *lab.overrides(store, **ov, **{"trainer.total_iterations": 2}),
                           "--run-id", "ep")
    out["auto"] = lab.cli("ep2", "train", *lab.overrides(store, **ov, **{"trainer.total_iterations": 4}),
                          "trainer.run_id=ep", "trainer.resume=auto")
    out["again"] = lab.cli("ep3", "resume", "ep", f"store.root={store}", lab.named_reward())
    out["unknown"] = lab.cli("ep4", "resume", "nope", f"store.root={store}")
    return out


@pytest.fixture(scope="module")
def scenarios(lab, ray_local):
    lab.ray_address = ray_local.get_runtime_context().gcs_address
    t0 = time.perf_counter()
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(fn, lab) for name, fn in
                   (("ref", scenario_reference), ("chain", scenario_chain), ("epoch", scenario_epoch))}
        results = {}
        for name, f in futures.items():
            try:
                results[name] = f.result()
            except Exception as e:  # reported by the tests that need this scenario
                results[name] = e
    results["wall_s"] = time.perf_counter() - t0
    print(f"\nscenarios: {results['wall_s']:.0f} s wall; steps: "
          + ", ".join(f"{s.name} {s.seconds:.0f}s" for r in results.values() if isinstance(r, dict)
                      for s in ([v for v in r.values() if isinstance(v, Step)] + r.get("steps", []))))
    return results


#: FSDP2 on 2 gloo ranks with a KL term (a reference worker group, sharded as well); each rank
#: reserves half a CPU so that both fit the test session's Ray next to nothing else.
FSDP2 = {"actor.strategy": "fsdp2", "actor.world_size": 2, "resources.actor_num_cpus": 0.5,
         "actor.kl_loss_coef": 0.1, "reference.strategy": "fsdp2", "trainer.total_iterations": 2}


def scenario_fsdp2_ref(lab: Lab) -> dict:
    store = lab.store("fsdp2-ref")
    return {"store": store, "train": lab.cli("f-ref", "train", *lab.overrides(store, **FSDP2), "--run-id", "f")}


def scenario_fsdp2_chain(lab: Lab) -> dict:
    """Killed while writing checkpoint 2 (both ranks' shards of it written, not yet complete), then resumed."""
    store = lab.store("fsdp2-chain")
    out: dict = {"store": store}
    out["killed"] = lab.cli("f-k1", "train", *lab.overrides(store, **FSDP2), "--run-id", "f", fault="checkpoint:2")
    out["tmp_after_kill"] = sorted(p.name for p in (store / "f" / "checkpoints").iterdir())
    out["resumed"] = lab.cli("f-k2", "resume", "f", f"store.root={store}", lab.named_reward(),
                             f"resources.ray_address={lab.ray_address}")
    return out


@pytest.fixture(scope="module")
def fsdp_scenarios(lab, ray_local):
    lab.ray_address = ray_local.get_runtime_context().gcs_address
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        futures = {"ref": pool.submit(scenario_fsdp2_ref, lab), "chain": pool.submit(scenario_fsdp2_chain, lab)}
        results: dict = {}
        for name, f in futures.items():
            try:
                results[name] = f.result()
            except Exception as e:  # reported by the test
                results[name] = e
    print(f"\nfsdp2 scenarios: {time.perf_counter() - t0:.0f} s wall; steps: "
          + ", ".join(f"{s.name} {s.seconds:.0f}s" for r in results.values() if isinstance(r, dict)
                      for s in r.values() if isinstance(s, Step)))
    return results


def get(scenarios, name: str) -> dict:
    r = scenarios[name]
    if isinstance(r, Exception):
        raise r
    return r


def ok(step: Step) -> Step:
    assert step.rc == 0, f"{step.name} exited {step.rc}:\n{step.stdout[-3000:]}\n{step.stderr[-5000:]}"
    return step


def stage_hashes(run_dir: Path, iterations=(1, 2, 3)) -> dict:
    return {(it, f): sha(run_dir / "iterations" / f"{it:06d}" / f) for it in iterations for f in STAGE_FILES}


def weights(path: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and wa[k].tobytes() == wb[k].tobytes(), f"tensor {k} differs"


# ---------------------------------------------------------------------------- tests


def test_sigkill_at_each_point_then_resume_is_bit_identical(scenarios):
    ref = get(scenarios, "ref")
    chain = get(scenarios, "chain")
    ok(ref["train"])
    k1, k2, k3, k4, k5 = chain["steps"]
    for step, point in ((k1, "rollout:1"), (k2, "after_reward:2"), (k3, "checkpoint:2"), (k4, "update:3")):
        assert step.rc == -signal.SIGKILL, f"{step.name} exited {step.rc}:\n{step.stderr[-3000:]}"
        assert f"SIGKILL at {point}" in step.stderr
    ok(k5)
    run, ref_run = chain["store"] / "k", ref["store"] / "ref"
    # Every stored trajectory file and the final weights equal the uninterrupted run's, bit for bit.
    assert stage_hashes(run) == stage_hashes(ref_run)
    assert sha(run / "final" / "model.safetensors") == sha(ref_run / "final" / "model.safetensors")
    assert_same_weights(run / "final" / "model.safetensors", ref_run / "final" / "model.safetensors")
    # Where each session restarted: nothing, nothing (killed in iteration 1), checkpoint 1, checkpoint 1
    # again (checkpoint 2 was killed half-written), checkpoint 2.
    sessions = json.loads((run / "run.json").read_text())["sessions"]
    assert [s["resumed_from_checkpoint"] for s in sessions] == [None, None, 1, 1, 2]
    assert [s["first_iteration"] for s in sessions] == [1, 1, 2, 2, 3]
    assert sessions[-1]["trained_iterations"] == [3] and sessions[-1]["status"] == "FINISHED"
    assert "resuming run k from checkpoint 000001: iterations 2..3" in k3.stdout
    # The half-written checkpoint was no checkpoint, and the next session removed it.
    assert chain["tmp_after_k3"] == [".tmp-000002", "000001"]
    assert chain["tmp_after_k4"] == ["000001", "000002"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["000002", "000003"]
    for it in (1, 2, 3):
        assert json.loads((run / "iterations" / f"{it:06d}" / "manifest.json").read_text())["status"] == "complete"
    # Re-run iterations replaced their audit rows instead of adding them again.
    from trajflow.audit import query_audit

    rows = query_audit(chain["store"], "k", limit=1000)
    assert rows.num_rows == 12 and len(set(rows.column("sample_id").to_pylist())) == 12
    _assert_mlflow_history_is_the_uninterrupted_runs(chain["store"], run, ref["store"], ref_run)


def test_fsdp2_sigkill_while_checkpointing_then_resume_is_bit_identical(fsdp_scenarios):
    ref = get(fsdp_scenarios, "ref")
    chain = get(fsdp_scenarios, "chain")
    ok(ref["train"])
    killed = chain["killed"]
    assert killed.rc == -signal.SIGKILL, f"{killed.name} exited {killed.rc}:\n{killed.stderr[-3000:]}"
    assert "SIGKILL at checkpoint:2" in killed.stderr
    # Both ranks had written their shards of checkpoint 2 into its temp folder when the driver died.
    assert chain["tmp_after_kill"] == [".tmp-000002", "000001"]
    resumed = ok(chain["resumed"])
    assert "resuming run f from checkpoint 000001: iterations 2..2" in resumed.stdout
    run, ref_run = chain["store"] / "f", ref["store"] / "f"
    shards = sorted(p.name for p in (run / "checkpoints" / "000002" / "actor").iterdir())
    assert "fsdp_rank00000.safetensors" in shards and "fsdp_rank00001.safetensors" in shards, shards
    # The rollouts, rewards, advantages and final weights equal the uninterrupted FSDP2 run's, bit for bit.
    assert stage_hashes(run, (1, 2)) == stage_hashes(ref_run, (1, 2))
    assert_same_weights(run / "final" / "model.safetensors", ref_run / "final" / "model.safetensors")
    # The updates' metrics (KL to the sharded reference included) are the uninterrupted run's too.
    for it in (1, 2):
        got = json.loads((run / "iterations" / f"{it:06d}" / "update.json").read_text())
        want = json.loads((ref_run / "iterations" / f"{it:06d}" / "update.json").read_text())
        keys = [k for k in want if k.startswith("actor/")]
        assert "actor/kl_loss" in keys and {k: got[k] for k in keys} == {k: want[k] for k in keys}
    sessions = json.loads((run / "run.json").read_text())["sessions"]
    assert [s["resumed_from_checkpoint"] for s in sessions] == [None, 1]
    assert sessions[-1]["trained_iterations"] == [2] and sessions[-1]["status"] == "FINISHED"


def _assert_mlflow_history_is_the_uninterrupted_runs(store: Path, run: Path, ref_store: Path, ref_run: Path) -> None:
    """Five sessions, one MLflow run: one point per metric and step, equal to the uninterrupted run's
    (a re-run iteration's points are the killed session's, which an exact resume reproduces)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    ref_client = MlflowClient(tracking_uri=f"sqlite:///{ref_store / 'mlflow.db'}")
    newest = json.loads((run / "run.json").read_text())["mlflow_run_id"]
    ref_id = json.loads((ref_run / "run.json").read_text())["mlflow_run_id"]
    (only,) = client.search_runs([client.get_run(newest).info.experiment_id], "attributes.run_name = 'k'")
    assert only.info.run_id == newest and only.info.status == "FINISHED"
    assert only.data.tags["trajflow.sessions"] == "5"
    compared = [k for k in ref_client.get_run(ref_id).data.metrics
                if k.startswith(("actor/", "critic/", "response_length/"))]
    assert "actor/pg_loss" in compared and "critic/score/mean" in compared
    for key in compared:
        got = [(m.step, m.value) for m in client.get_metric_history(newest, key)]
        want = [(m.step, m.value) for m in ref_client.get_metric_history(ref_id, key)]
        assert sorted(got) == sorted(want), key


def _assert_mirrors_hold_mlflow(store: Path, run: Path, wandb: bool) -> None:
    """TensorBoard (and W&B) hold every point of the run's MLflow record, once, with its value."""
    from tests.mirror_readers import mlflow_points, tensorboard_points, wandb_points

    meta = json.loads((run / "run.json").read_text())
    want = mlflow_points(f"sqlite:///{store / 'mlflow.db'}", meta["mlflow_run_id"])
    assert {"actor/pg_loss", "critic/score/mean", "response_length/mean", "timing_s/gen"} <= set(want)
    tb = tensorboard_points(run / "tensorboard")
    assert set(tb) == set(want)
    for key, points in want.items():
        steps = [s for s, _ in tb[key]]
        assert len(steps) == len(set(steps)), (key, steps)  # no (name, step) twice across the sessions
        assert sorted(tb[key]) == [(s, float(np.float32(v))) for s, v in points], key  # float32 in TensorBoard
    if wandb:
        wb, runs = wandb_points(run / "wandb", meta["wandb_run_id"])
        assert {k: sorted(v) for k, v in wb.items()} == want
        assert all(len(v) == len(set(s for s, _ in v)) for v in wb.values())
        assert len(runs) == len(meta["sessions"]) and {r["run_id"] for r in runs} == {meta["wandb_run_id"]}


def test_tensorboard_and_wandb_hold_the_mlflow_record_across_kills_and_resumes(scenarios):
    """trainer.logger's mirrors on real CLI runs: the kill chain (five sessions, four of them SIGKILLed,
    re-run iterations whose MLflow points are kept) in TensorBoard; the epoch run (a finished run resumed
    with more iterations) in TensorBoard and offline W&B, one W&B run id throughout."""
    chain = get(scenarios, "chain")
    _assert_mirrors_hold_mlflow(chain["store"], chain["store"] / "k", wandb=False)
    assert "tensorboard: writing to" in chain["steps"][-1].stdout  # the resumed session, from the stored config
    epoch = get(scenarios, "epoch")
    _assert_mirrors_hold_mlflow(epoch["store"], epoch["store"] / "ep", wandb=True)
    assert "wandb: offline run" in epoch["auto"].stdout


def test_killed_driver_leaves_no_ray_processes(scenarios):
    chain = get(scenarios, "chain")
    for step in chain["steps"][:4]:
        assert step.rc == -signal.SIGKILL
        assert step.leftovers == [], f"{step.name} left {step.leftovers} running 25 s after SIGKILL"


def test_corrupted_parquet_is_named_on_resume_and_recomputed(scenarios):
    ref = get(scenarios, "ref")
    chain = get(scenarios, "chain")
    k5 = ok(chain["steps"][4])
    bad = chain["corrupted"]
    assert f"warning: stored {bad} is truncated or does not match its manifest's sha256" in k5.stderr
    assert chain["it3_files_before"] == ["advantage.parquet", "manifest.json", "reward.parquet", "rollout.parquet"]
    assert sha(bad) == sha(ref["store"] / "ref" / "iterations" / "000003" / "reward.parquet")
    # Verified files were not rewritten: the rollout, and the advantages (their inputs came back identical).
    assert chain["stat_after"] == chain["stat_before"]


def test_resume_at_epoch_boundary_trains_the_remaining_iterations(scenarios):
    ep = get(scenarios, "epoch")
    ok(ep["first"])
    auto = ok(ep["auto"])
    run = ep["store"] / "ep"
    assert "config changed since the last session: trainer.total_iterations 2 -> 4" in auto.stdout
    sessions = json.loads((run / "run.json").read_text())["sessions"]
    assert len(sessions) == 2
    assert sessions[0]["trained_iterations"] == [1, 2]
    assert sessions[1]["resumed_from_checkpoint"] == 2 and sessions[1]["trained_iterations"] == [3, 4]
    # Each epoch (2 iterations x 2 prompts) shows each of the 4 prompts exactly once (each with rollout.n=2 samples).
    words = {}
    for it in (1, 2, 3, 4):
        t = pq.read_table(run / "iterations" / f"{it:06d}" / "rollout.parquet")
        words[it] = t.column("ground_truth").to_pylist()
        assert len(words[it]) == 4 and words[it][0::2] == words[it][1::2]
    for epoch in ((1, 2), (3, 4)):
        seen = [w for it in epoch for w in words[it][0::2]]
        assert sorted(seen) == sorted(WORDS), f"epoch {epoch}: {seen}"
    # Training a finished run further logs a second final model: the first stays the output at step 2
    # (MLflow links a model to a run once), the newer one is the output at step 4 and the run's tag.
    assert "final model was not logged" not in auto.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{ep['store'] / 'mlflow.db'}")
    mlflow_run = client.get_run(json.loads((run / "run.json").read_text())["mlflow_run_id"])
    outputs = {o.step: o.model_id for o in mlflow_run.outputs.model_outputs}
    assert sorted(outputs) == [2, 4] and mlflow_run.data.tags["trajflow.model_id"] == outputs[4]
    first = client.get_logged_model(outputs[2])
    assert first.tags["trajflow.superseded_by"] == outputs[4] and str(first.status) == "READY"
    assert str(client.get_logged_model(outputs[4]).status) == "READY"
    # max_checkpoints=2 keeps the two newest.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["000003", "000004"]
    # Resuming the finished run says so, exits 0 and starts no new session.
    again = ok(ep["again"])
    assert "already finished all its iterations" in again.stdout
    assert len(json.loads((run / "run.json").read_text())["sessions"]) == 2
    unknown = ep["unknown"]
    assert unknown.rc == 2 and f"error: no run 'nope' in store root {ep['store']}" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1


def _mlflow_tags(store: Path, run_dir: Path) -> dict:
    from mlflow.tracking import MlflowClient

    mlflow_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    return MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}").get_run(mlflow_id).data.tags


def _mlflow_metric_keys(store: Path, run_id: str) -> set[str]:
    from mlflow.tracking import MlflowClient

    mlflow_id = json.loads((store / run_id / "run.json").read_text())["mlflow_run_id"]
    return set(MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}").get_run(mlflow_id).data.metrics)


def test_replay_with_unchanged_config_reproduces_stored_outputs(scenarios):
    ref = get(scenarios, "ref")
    ok(ref["train"])
    ok(ref["replay_same"])
    store = ref["store"]
    parent, child = store / "ref", store / "ref-same"
    assert stage_hashes(child, (2,)) == stage_hashes(parent, (2,))
    # The update from the parent's checkpoint 1 reproduces its metrics and the weights of its checkpoint 2.
    pm = json.loads((parent / "iterations" / "000002" / "update.json").read_text())
    cm = json.loads((child / "iterations" / "000002" / "update.json").read_text())
    compared = [k for k in pm if k.startswith(("actor/", "critic/", "response_length/")) or k == "policy_version"]
    assert "actor/pg_loss" in compared and "actor/grad_norm" in compared
    assert {k: cm[k] for k in compared} == {k: pm[k] for k in compared}
    assert_same_weights(child / "checkpoints" / "000002" / "actor" / "model.safetensors",
                        parent / "checkpoints" / "000002" / "actor" / "model.safetensors")
    meta = json.loads((child / "run.json").read_text())
    assert (meta["kind"], meta["parent_run_id"], meta["parent_iteration"], meta["from_stage"]) == \
        ("replay", "ref", 2, "reward")
    assert meta["start_checkpoint"] == "ref/checkpoints/000001"
    assert [p.name for p in (child / "iterations").iterdir()] == ["000002"]


def test_replay_with_another_estimator_writes_new_advantages_with_lineage(scenarios):
    ref = get(scenarios, "ref")
    step = ok(ref["replay_rloo"])
    store = ref["store"]
    parent, child = store / "ref", store / "ref-rloo"
    it = Path("iterations") / "000002"
    assert sha(child / it / "rollout.parquet") == sha(parent / it / "rollout.parquet")
    assert sha(child / it / "reward.parquet") == sha(parent / it / "reward.parquet")
    assert sha(child / it / "advantage.parquet") != sha(parent / it / "advantage.parquet")
    rollout = pq.read_table(child / it / "rollout.parquet")
    scores = pq.read_table(child / it / "reward.parquet").column("score").to_numpy().astype(np.float64)
    groups = rollout.column("group_id").to_pylist()
    lens = [len(r) for r in rollout.column("response_ids").to_pylist()]
    new = pq.read_table(child / it / "advantage.parquet").column("advantages").to_pylist()
    old = pq.read_table(parent / it / "advantage.parquet").column("advantages").to_pylist()
    for i in range(len(scores)):
        mates = [j for j in range(len(scores)) if groups[j] == groups[i] and j != i]
        # RLOO (Ahmadian et al. 2024, eq. 6): r_i minus the mean of the other samples of its prompt.
        rloo = scores[i] - np.mean(scores[mates])
        assert np.allclose(new[i], [rloo] * lens[i], atol=1e-6)
        # GRPO in the parent (Shao et al. 2024): (r_i - mean) / (std + 1e-6), unbiased std over the group.
        g = scores[[i] + mates]
        grpo = (scores[i] - g.mean()) / (g.std(ddof=1) + 1e-6) if g.std() > 0 else 0.0
        assert np.allclose(old[i], [grpo] * lens[i], atol=1e-5)
    tags = _mlflow_tags(store, child)
    assert tags["trajflow.parent_run_id"] == "ref"
    assert tags["trajflow.parent_iteration"] == "2"
    assert tags["trajflow.from_stage"] == "advantage"
    params = json.loads((child / "run.json").read_text())
    assert params["overrides"][-1] == "algorithm.adv_estimator=rloo"
    assert "adv_estimator: rloo" in (child / "config.yaml").read_text()
    assert "replay ref-rloo of run ref done" in step.stdout


def test_replay_without_the_starting_checkpoint_skips_only_the_update(scenarios):
    ref = get(scenarios, "ref")
    ok(ref["replay_cut"])
    store = ref["store"]
    it = Path("iterations") / "000002"
    # The advantages need no policy: the same as the replay of the full run with the same estimator.
    assert sha(store / "refcut-rloo" / it / "advantage.parquet") == sha(store / "ref-rloo" / it / "advantage.parquet")
    assert not (store / "refcut-rloo" / it / "update.json").exists()
    meta = json.loads((store / "refcut-rloo" / "run.json").read_text())
    assert meta["status"] == "finished" and meta["start_checkpoint"] == "none (update skipped)"
    assert meta["note"].startswith("policy update skipped: checkpoint 000001 of run 'refcut' is not stored")
    # The worker holds the initial model: neither validated nor checkpointed as the policy after iteration 2
    # (test_freq=1 asks for a validation).
    assert not any(k.startswith("val-") for k in _mlflow_metric_keys(store, "refcut-rloo")), "validated"
    assert not list((store / "refcut-rloo").glob("checkpoints/0*"))


def test_whole_run_replay_retrains_from_checkpoint_on_stored_rollouts(scenarios):
    ref = get(scenarios, "ref")
    ok(ref["replay_all"])
    store = ref["store"]
    parent, child = store / "ref", store / "ref-all"
    # Unchanged config: re-training on the stored rollouts of 1..3 from the initial model gives the
    # parent's data and weights again (the stored rollouts are exactly what it would have sampled).
    assert stage_hashes(child) == stage_hashes(parent)
    assert_same_weights(child / "final" / "model.safetensors", parent / "final" / "model.safetensors")
    meta = json.loads((child / "run.json").read_text())
    assert meta["parent_iterations"] == [1, 3] and meta["start_checkpoint"] == "initial"
    bad = ref["replay_bad"]
    assert bad.rc == 2
    assert "error: iteration 9 of run 'ref' is not stored (stored iterations: 1..3)" in bad.stderr


def test_audit_filter_and_search_match_the_parquet_files(scenarios, tmp_path):
    from typer.testing import CliRunner

    from trajflow.audit import AUDIT_COLUMNS, query_audit
    from trajflow.cli import app

    ref = get(scenarios, "ref")
    ok(ref["train"])
    store, run = ref["store"], ref["store"] / "ref"
    # Independent expectation straight from the Parquet files.
    rows = {}
    for it in (1, 2, 3):
        d = run / "iterations" / f"{it:06d}"
        ro, rw, ad = (pq.read_table(d / f).to_pylist() for f in STAGE_FILES)
        for a, b, c in zip(ro, rw, ad):
            assert a["sample_id"] == b["sample_id"] == c["sample_id"]
            rows[a["sample_id"]] = {**a, "score": b["score"], "advantage_mean": float(np.mean(c["advantages"]))}
    candidates = [r for r in rows.values() if r["iteration"] >= 2 and "zyzzyva" in r["prompt"][0]["content"]]
    assert len(candidates) >= 2
    threshold = float(f"{np.median([r['score'] for r in candidates]):.6f}")
    expected = {r["sample_id"] for r in candidates if np.float32(r["score"]) > threshold}
    assert 0 < len(expected) < len(candidates)
    where = f"iteration >= 2 AND score > {threshold}"
    result = CliRunner().invoke(app, ["audit", "ref", "--store", str(store), "--where", where, "--search",
                                      "zyzzyva", "--limit", "100", "--format", "json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert {r["sample_id"] for r in got} == expected
    checkpoint_of = {1: "initial", 2: "checkpoints/000001", 3: "checkpoints/000002"}
    for r in got:
        src = rows[r["sample_id"]]
        assert list(r) == list(AUDIT_COLUMNS)
        assert r["response_text"] == src["response_text"] and r["prompt_id"] == src["prompt_id"]
        assert r["prompt_text"] == "user: " + src["prompt"][0]["content"]
        assert r["score"] == src["score"] and r["iteration"] == src["iteration"]
        assert r["advantage_mean"] == pytest.approx(src["advantage_mean"], rel=1e-6, abs=1e-7)
        assert r["response_length"] == len(src["response_ids"])
        assert r["policy_version"] == src["iteration"] - 1 == src["policy_version"]
        assert r["checkpoint_id"] == checkpoint_of[src["iteration"]]
    # The Python API returns the same rows as a pyarrow Table; parquet export writes them.
    table = query_audit(store, "ref", where=where, search="zyzzyva", limit=100)
    assert table.column_names == list(AUDIT_COLUMNS)
    assert set(table.column("sample_id").to_pylist()) == expected
    out = store / "audit-export.parquet"
    result = CliRunner().invoke(app, ["audit", "ref", "--store", str(store), "--where", "iteration = 1",
                                      "--format", "parquet", "-o", str(out)])
    assert result.exit_code == 0, result.output
    exported = pq.read_table(out)
    assert exported.num_rows == 4 and set(exported.column("checkpoint_id").to_pylist()) == {"initial"}
    result = CliRunner().invoke(app, ["audit", "ref", "--store", str(store), "--where", "iteration >>= 2"])
    assert result.exit_code == 2 and "is not valid SQL" in result.output
    result = CliRunner().invoke(app, ["audit", "nope", "--store", str(store)])
    assert result.exit_code == 2 and f"no run 'nope' in store root {store}" in result.output
    # The train loop folds new rows into the full-text index only at checkpoints: rows appended
    # without it (here iterations 2 and 3 again, on a copy) must still be found by the search.
    from trajflow.audit import append_iteration
    from trajflow.store import RunStore

    copy_root = tmp_path / "store"
    shutil.copytree(run, copy_root / "ref")
    copy = RunStore(copy_root, "ref")
    for it in (2, 3):
        assert append_iteration(copy, it, checkpoint_of[it], optimize=False) == 4
    table = query_audit(copy_root, "ref", where=where, search="zyzzyva", limit=100)
    assert sorted(table.column("sample_id").to_pylist()) == sorted(expected)
