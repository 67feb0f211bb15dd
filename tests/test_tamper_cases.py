"""Bad input and tampered run folders: each is one line naming the file or key (exit 2), found before
Ray starts where it can be, and nothing already written is lost.

Most run the real ``trajflow`` command in a subprocess on hand-made run folders (no model, no Ray);
the rest call the function that guards the case, with real files, a real lock and real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from tests.test_crash_safety import _fake_iteration
from tests.test_stored_run_errors import make_stored_run
from trajflow import checkpoint as ckpt
from trajflow.config import load_config
from trajflow.errors import ConfigError, DataError, ModelLoadError, StoreError
from trajflow.store import RunStore

TRAJFLOW = [str(Path(sys.executable).parent / "trajflow")]


def run_cli(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    p = subprocess.run(TRAJFLOW + list(args), capture_output=True, text=True, timeout=180, cwd=cwd)
    return p.returncode, p.stdout, p.stderr


def one_error(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _save_workers(d: Path) -> None:
    """What a policy worker writes into a checkpoint: weights, optimizer state (safetensors + JSON)."""
    (d / "actor").mkdir()
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(d / "actor" / "model.safetensors"))
    save_file({"exp_avg": torch.zeros(64)}, str(d / "actor" / "actor_state.safetensors"))
    (d / "actor" / "actor_state.json").write_text(json.dumps({"policy_version": 1}))


@pytest.fixture
def stored_run(tmp_path) -> RunStore:
    """A run with a config, two stored iterations and a checkpoint after iteration 1."""
    store = make_stored_run(tmp_path)
    ckpt.save_checkpoint(store, 1, {"policy_version": 1}, _save_workers)
    return store


# ------------------------------------------------------------------ checkpoints: evaluate, forged manifests

@pytest.mark.parametrize("damage", ["truncated", "missing", "forged manifest"])
def test_evaluate_refuses_a_checkpoint_that_does_not_verify_before_ray(stored_run, damage):
    d = ckpt.checkpoint_dir(stored_run, 1)
    weights = d / "actor" / "model.safetensors"
    assert ckpt.verify_checkpoint(stored_run, 1) is None
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "missing":
        weights.unlink()
    else:  # garbage weights, and the manifest rewritten to match them: it verifies, the file does not parse
        weights.write_bytes(b"\x00garbage" * 64)
        (d / "manifest.json").write_text(json.dumps({"files": ckpt._file_hashes(d)}))
    expected = {"truncated": "does not match the checkpoint's manifest", "missing": "is missing",
                "forged manifest": "is not readable"}[damage]
    if damage == "forged manifest":  # the command a user types, once
        rc, _, err = run_cli("evaluate", "r1", "--checkpoint", "1", "--store", str(stored_run.root))
        assert expected in one_error(rc, err, str(weights), "checkpoint 1")
    else:
        from trajflow.flows.evaluate import prepare_evaluation

        with pytest.raises(StoreError, match=rf"run 'r1' checkpoint 1: {weights}.*{expected}"):
            prepare_evaluation(stored_run.root, "r1", 1)
    assert not (stored_run.run_dir / "evaluations").exists()
    assert not (stored_run.root / "mlflow.db").exists()  # nothing started


@pytest.mark.parametrize("forgery", ["files a list", "weights left out", "unlisted file", "policy_version text",
                                     "no manifest, garbage weights"])
def test_a_forged_checkpoint_is_skipped_not_loaded(stored_run, forgery):
    """A manifest is an integrity check, not authentication: what the workers load is checked as data."""
    d = ckpt.checkpoint_dir(stored_run, 1)
    manifest = json.loads((d / "manifest.json").read_text())
    if forgery == "files a list":
        (d / "manifest.json").write_text(json.dumps({"files": list(manifest["files"])}))
    elif forgery == "weights left out":
        (d / "actor" / "model.safetensors").unlink()
        manifest["files"].pop("actor/model.safetensors")
        (d / "manifest.json").write_text(json.dumps(manifest))
    elif forgery == "unlisted file":
        (d / "actor" / "extra.safetensors").write_bytes(b"x")
    elif forgery == "policy_version text":
        (d / ckpt.STATE_FILE).write_text(json.dumps({"policy_version": "1; rm -rf", "iteration": 1}))
    else:
        (d / "manifest.json").unlink()
        (d / "actor" / "model.safetensors").write_bytes(b"not safetensors")
    why = ckpt.verify_checkpoint(stored_run, 1)
    assert why is not None and str(d) in why, why
    assert ckpt.newest_verified_checkpoint(stored_run) == (None, [(1, why)])


# ------------------------------------------------------------------ stored run records

def test_garbage_run_json_on_resume_is_one_line_and_left_as_it_was(stored_run):
    from trajflow.run import resume_config

    meta = stored_run.run_dir / "run.json"
    for garbage in (b"\xff\xfe\x00", b"[1, 2]"):
        meta.write_bytes(garbage)
        with pytest.raises(StoreError, match=rf"{meta}: (not valid JSON|holds a JSON list)"):
            resume_config("r1", [f"store.root={stored_run.root}"])
    meta.write_bytes(b"{not json")
    rc, _, err = run_cli("resume", "r1", f"store.root={stored_run.root}", "trainer.total_iterations=3")
    one_error(rc, err, str(meta), "not valid JSON")
    assert meta.read_bytes() == b"{not json"
    rc, out, err = run_cli("runs", "--store", str(stored_run.root), "--format", "json")
    assert rc == 0 and json.loads(out)[0]["status"] == "unreadable", err


def test_a_run_id_with_a_control_character_is_refused(stored_run, tmp_path):
    rc, _, err = run_cli("audit", "r1\nx", "--store", str(stored_run.root))
    one_error(rc, err, "control character")
    from trajflow.run import resume_config

    for run_id in ("a\nb", "bad\tid", "r1\r"):
        with pytest.raises(StoreError, match="control character"):
            resume_config(run_id, [f"store.root={stored_run.root}"])
    assert sorted(p.name for p in stored_run.root.iterdir()) == ["r1"]


def test_a_lock_that_is_a_folder_is_one_line(stored_run):
    from trajflow.store import run_lock

    (stored_run.run_dir / ".lock").mkdir()
    with pytest.raises(StoreError, match=r"\.lock: the run's lock is a folder, not a file; remove it"):
        with run_lock(stored_run):
            pass


_HOLDER = """
import sys, time
from trajflow.store import RunStore, run_lock
with run_lock(RunStore(sys.argv[1], "r1")):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_runs_shows_a_killed_driver_as_killed_not_running(stored_run):
    from trajflow.runs import list_runs

    stored_run.update_run_meta(status="running")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(stored_run.root)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert list_runs(stored_run.root)[0]["status"] == "running"
        holder.send_signal(signal.SIGKILL)  # as the OOM killer or kill -9 would: no chance to write run.json
        holder.wait(timeout=30)
        assert json.loads((stored_run.run_dir / "run.json").read_text())["status"] == "running"
        assert list_runs(stored_run.root)[0]["status"] == "killed"
    finally:
        if holder.poll() is None:
            holder.kill()


# ------------------------------------------------------------------ config and store root

@pytest.mark.parametrize("override, needles", [
    ("resources.pools={a:{b:1}}", ["resources.pools={a:{b:1}}", "not valid YAML"]),
    ("trainer.seed=1e23", ["trainer.seed"]),
    ("trainer.seed=100000000000000000000000", ["trainer.seed", "<= 4294967295"]),
])
def test_malformed_override_values_are_one_line(override, needles):
    rc, _, err = run_cli("config", override)
    one_error(rc, err, *needles)


def test_store_root_under_proc_is_refused_before_anything_starts():
    from trajflow.run import check_store_root

    with pytest.raises(StoreError, match=r"store\.root='/proc/trajflow-runs': cannot create a folder in /proc"):
        check_store_root(load_config(None, ["store.root=/proc/trajflow-runs"]))


def test_a_model_folder_holding_only_a_pickle_is_refused(tmp_path):
    from trajflow.run import check_model_weights

    model = tmp_path / "pickled"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    torch.save({"w": torch.zeros(2)}, model / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"holds only pytorch_model\.bin \(a pickle\), no safetensors weights"):
        check_model_weights(model)


# ------------------------------------------------------------------ environment factories

ENVS = """
from trajflow.envs.registry import ToolEnvironment

def raises(ctx):
    raise RuntimeError("no such dataset")

def wrong_type(ctx):
    return {"not": "an environment"}

def good(ctx):
    return ToolEnvironment(ctx)
"""


@pytest.mark.parametrize("factory, message", [
    ("os:system", r"'os:system' is a builtin_function_or_method, not a Python function or class"),
    ("user_envs:raises", r"its factory raised RuntimeError: no such dataset"),
    ("user_envs:wrong_type", r"its factory returned a dict, not a trajflow\.envs\.Environment"),
])
def test_bad_environment_factories_are_found_at_config_time(tmp_path, monkeypatch, factory, message):
    (tmp_path / "user_envs.py").write_text(ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["rollout.multi_turn.enable=true", "algorithm.filter_groups.enable=false"]
    with pytest.raises(ConfigError, match=rf"rollout\.multi_turn\.environment='{factory}': {message}"):
        load_config(None, base + [f"rollout.multi_turn.environment={factory}"])
    load_config(None, base + ["rollout.multi_turn.environment=user_envs:good"])


def test_os_system_as_environment_is_one_line_from_the_cli():
    rc, _, err = run_cli("config", "rollout.multi_turn.enable=true", "rollout.multi_turn.environment=os:system")
    one_error(rc, err, "os:system", "not a Python function or class")


# ------------------------------------------------------------------ reward stage: timeouts, NaN, the gate's message

def test_a_stage_timeout_is_one_line_naming_the_key(tmp_path):
    """Ray's GetTimeoutError, bare or inside the SystemError that Prefect's asynchronous timeout
    leaves when it lands in a Ray call, becomes one StageTimeoutError (still a TimeoutError)."""
    from ray.exceptions import GetTimeoutError

    from trajflow.errors import StageTimeoutError, TrajflowError
    from trajflow.run.context import RunContext
    from trajflow.run.recovery import is_transient, stage_guard

    ctx = RunContext(cfg=load_config(None, ["trainer.stage_timeouts={reward: 90}"]), store=RunStore(tmp_path, "r"),
                     model_path="")
    for raised in (GetTimeoutError("Get timed out: some object(s) not ready."), "wrapped"):
        with pytest.raises(StageTimeoutError) as e:
            with stage_guard(ctx, "reward"):
                if raised == "wrapped":
                    try:
                        raise GetTimeoutError("Get timed out")
                    except GetTimeoutError as inner:
                        raise SystemError("<built-in function get> returned a result with an exception set") \
                            from inner
                raise raised
        assert str(e.value) == ("run r: stage reward did not finish within 90 s (trainer.stage_timeouts.reward, else "
                                "trainer.stage_timeout_s); a worker or the scorer is stuck or slower than that: raise "
                                "it (trainer.stage_timeouts.reward=SECONDS, 0 = no limit) or see the run's "
                                "logs/driver.log")
        assert isinstance(e.value, TrajflowError) and is_transient(e.value)  # the CLI's one line; still retried
    assert ctx.state.deadline is None


def _gate_inputs(tmp_path, scores, errors=None, **over):
    from trajflow.run.context import RunContext

    store = RunStore(tmp_path / "runs", "g")
    store.run_dir.mkdir(parents=True)
    _fake_iteration(store, 1, scores, ["a", "b", "c", "d"])
    if errors is not None:  # what compute_scores stores when the custom function raised
        t = store.read_stage(1, "reward")
        t = t.set_column(t.column_names.index("reward_error"), "reward_error", pa.array(errors, pa.string()))
        store.write_stage(1, "reward", t, 0)
    cfg = load_config(None, [f"store.root={store.root}", *[f"{k}={v}" for k, v in over.items()]])
    ctx = RunContext(cfg=cfg, store=store, model_path="")
    return ctx, store.verified_stage(1, "rollout"), store.verified_stage(1, "reward")


def test_a_nan_reward_with_the_gate_off_stops_before_the_update(tmp_path):
    from trajflow.run.gate import run_iteration_gate

    ctx, rollout, reward = _gate_inputs(tmp_path, [0.0, float("nan"), 0.5, float("inf")], **{"gates.enabled": False})
    with pytest.raises(DataError, match=r"iteration 1 of run g: the reward is NaN or infinite on 2 of 4 rows "
                                        r"\(e\.g\. it000001-p0000-s1 \(nan\), it000001-p0001-s1 \(inf\)\); with "
                                        r"gates\.enabled=false"):
        run_iteration_gate(ctx, 1, rollout, reward)
    ok, rollout, reward = _gate_inputs(tmp_path / "ok", [0.0, 1.0, 0.5, 0.5], **{"gates.enabled": False})
    assert run_iteration_gate(ok, 1, rollout, reward)["success"] is True


def test_the_gates_stop_names_what_the_custom_reward_raised(tmp_path):
    from trajflow.errors import GateFailed
    from trajflow.run.gate import run_iteration_gate

    errors = ["KeyError: 'answer'"] * 3 + [None]
    ctx, rollout, reward = _gate_inputs(tmp_path, [0.0, 0.0, 0.0, 1.0], errors, **{"gates.enabled": True})
    with pytest.raises(GateFailed, match=r"scorer_error_rate.*; the scorer raised on 3 of 4 rows, e\.g\. "
                                         r"KeyError: 'answer'$") as e:
        run_iteration_gate(ctx, 1, rollout, reward)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ the dashboard's data layer

@pytest.mark.parametrize("damage", ["corrupt", "symlink to /dev/zero", "symlink to another file"])
def test_dashboard_names_a_damaged_or_symlinked_parquet_file(stored_run, tmp_path, damage):
    from trajflow.dashboards import data
    from trajflow.errors import DashboardError

    reward = stored_run.stage_path(2, "reward")
    if damage == "corrupt":
        reward.write_bytes(reward.read_bytes()[:60])
    else:
        target = Path("/dev/zero") if "dev" in damage else tmp_path / "outside.parquet"
        if "dev" not in damage:
            target.write_bytes(reward.read_bytes())
        reward.unlink()
        reward.symlink_to(target)
    t0 = time.monotonic()
    for read in (lambda: data.find_trajectories(stored_run.root, "r1"),
                 lambda: data.trajectory_facets(stored_run.root, "r1")):
        with pytest.raises(DashboardError, match=str(reward).replace(".", r"\.")) as e:
            read()
        assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 30  # /dev/zero is never read


# ------------------------------------------------------------------ a full disk

@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_does_not_print_a_traceback_per_log_record(tmp_path, capfd):
    """The run's log file on a full disk (``/dev/full`` fails every write with ENOSPC) drops records
    quietly: the store's own write reports the full disk, once (its StoreError, one line)."""
    import logging

    from trajflow.infra.logs import LOG_FILE, RunLogHandler

    (tmp_path / LOG_FILE).parent.mkdir(parents=True)
    (tmp_path / LOG_FILE).symlink_to("/dev/full")
    handler = RunLogHandler()
    handler.attach(tmp_path)
    log = logging.getLogger("trajflow.test_full_disk")
    log.addHandler(handler)
    try:
        for i in range(5):
            log.warning("record %d", i)
    finally:
        log.removeHandler(handler)
        handler.close()
    assert capfd.readouterr().err == ""  # before: "--- Logging error ---" and a traceback per record
