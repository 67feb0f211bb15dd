"""Crash safety of the run store and checkpoints, the fault hook, the Ray watcher and the audit table.

Fast tests (no Ray, no Prefect): real files, real subprocesses killed with SIGKILL where a crash is
the point. The end-to-end kill/resume/replay tests are in ``test_resume_replay_audit.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import REPO
from trajflow import checkpoint as ckpt
from trajflow.faults import parse
from trajflow.errors import StoreError
from trajflow.store import RunStore, atomic_write_parquet


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("TRAJFLOW_FAULT", None)
    env.update(extra)
    return env


def _table(n: int = 4, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"sample_id": [f"s{i}" for i in range(n)],
                     "score": pa.array(rng.random(n), pa.float32()),
                     "tokens": pa.array([list(range(i + 1)) for i in range(n)], pa.list_(pa.int32()))})


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ fault hook


def test_fault_spec_parses_points_and_iterations():
    assert parse(None) is None and parse("  ") is None
    assert parse("rollout:1,update:3") == {("rollout", 1), ("update", 3)}
    assert parse("store_write:*") == {("store_write", None)}
    with pytest.raises(ValueError, match="rollout, after_reward, update, checkpoint, store_write"):
        parse("rolout:1")
    with pytest.raises(ValueError, match="not an integer"):
        parse("update:x")
    with pytest.raises(ValueError, match="<point>:<iteration>"):
        parse("update")


def test_fault_point_sigkills_only_at_the_named_iteration():
    code = ("from trajflow.faults import fault_point\n"
            "fault_point('update', 2); print('passed 2', flush=True)\n"
            "fault_point('update', 3); print('passed 3', flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(TRAJFLOW_FAULT="update:3"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL
    assert r.stdout == "passed 2\n"
    assert "SIGKILL at update:3" in r.stderr
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "passed 2\npassed 3\n"


# ------------------------------------------------------------------ atomic writes


def test_parquet_bytes_are_a_function_of_the_table(tmp_path):
    """Equal tables give equal files (pyarrow writes only 'created_by', no time or host)."""
    t = _table()
    atomic_write_parquet(tmp_path / "a.parquet", t)
    atomic_write_parquet(tmp_path / "b.parquet", pa.table(t.to_pydict(), schema=t.schema))
    assert _sha(tmp_path / "a.parquet") == _sha(tmp_path / "b.parquet")


def test_killed_write_leaves_old_file_intact_and_only_a_temp_file(tmp_path):
    store = RunStore(tmp_path, "run")
    store.run_dir.mkdir()
    store.write_stage(1, "reward", _table(seed=1), policy_version=0)
    before = _sha(store.stage_path(1, "reward"))
    code = ("import sys, numpy as np, pyarrow as pa\n"
            "from trajflow.store import RunStore\n"
            "n = 200_000\n"
            "t = pa.table({'sample_id': [f'x{i}' for i in range(n)], 'score': pa.array(np.ones(n), pa.float32())})\n"
            f"RunStore({str(tmp_path)!r}, 'run').write_stage(1, 'reward', t, policy_version=0)\n"
            "print('written')\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(TRAJFLOW_FAULT="store_write:*"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL and "written" not in r.stdout
    # Readers see the old file, whole and verified; the half-done write is a hidden temp file.
    assert _sha(store.stage_path(1, "reward")) == before
    assert store.verified_stage(1, "reward") is not None
    leftovers = [p for p in store.iteration_dir(1).iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".reward.parquet.")
    assert pq.read_table(leftovers[0]).num_rows == 200_000  # complete but never renamed into place
    assert store.cleanup_temp() == leftovers
    assert not leftovers[0].exists()


def test_truncated_or_altered_parquet_is_named_and_not_reused(tmp_path, caplog):
    store = RunStore(tmp_path, "run")
    store.run_dir.mkdir()
    ref = store.write_stage(2, "rollout", _table(50), policy_version=1)
    path = Path(ref.path)
    assert store.verified_stage(2, "rollout") == ref
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with caplog.at_level(logging.WARNING, logger="trajflow.store"):
        assert store.verified_stage(2, "rollout") is None
    assert str(path) in caplog.text and "recomputed" in caplog.text
    with pytest.raises(StoreError, match="rollout.parquet"):
        store.read_stage(2, "rollout")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # same size, one byte changed
    path.write_bytes(bytes(flipped))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trajflow.store"):
        assert store.verified_stage(2, "rollout") is None
    assert str(path) in caplog.text


def test_stage_output_is_reused_only_for_the_inputs_it_was_computed_from(tmp_path):
    store = RunStore(tmp_path, "run")
    store.run_dir.mkdir()
    ref = store.write_stage(1, "advantage", _table(), 0, inputs={"reward": "aa", "settings": "s1"},
                            meta={"metrics": {"critic/kl": 0.5}})
    assert store.verified_stage(1, "advantage", inputs={"reward": "aa", "settings": "s1"}) == ref
    assert store.verified_stage(1, "advantage", inputs={"reward": "bb", "settings": "s1"}) is None
    assert store.verified_stage(1, "advantage", inputs={"reward": "aa", "settings": "s2"}) is None
    assert store.stage_entry(1, "advantage")["meta"] == {"metrics": {"critic/kl": 0.5}}


def test_copy_stage_from_keeps_bytes_hash_and_traces_checkpoint(tmp_path):
    parent, child = RunStore(tmp_path, "p"), RunStore(tmp_path, "c")
    parent.run_dir.mkdir()
    child.run_dir.mkdir()
    ref = parent.write_stage(3, "rollout", _table(), 2, inputs={"prompts": "x"},
                             meta={"checkpoint_id": "checkpoints/000002"})
    copy = child.copy_stage_from(parent, 3, "rollout")
    assert copy.sha256 == ref.sha256 == _sha(Path(copy.path))
    entry = child.stage_entry(3, "rollout")
    assert entry["inputs"] == {"prompts": "x"}
    assert entry["meta"]["checkpoint_id"] == "p/checkpoints/000002"
    assert entry["copied_from"] == "p/iterations/000003/rollout.parquet"
    with pytest.raises(StoreError, match="reward.parquet"):
        child.copy_stage_from(parent, 3, "reward")


# ------------------------------------------------------------------ checkpoints


def _save(store: RunStore, it: int, keep: int) -> Path:
    def workers(d: Path) -> None:
        (d / "actor").mkdir()
        (d / "actor" / "w.bin").write_bytes(bytes([it]) * 16)
        # A loadable checkpoint holds the policy's weights as safetensors (verify_checkpoint checks them as data).
        save_file({"w": torch.full((2,), float(it))}, str(d / "actor" / "model.safetensors"))

    return ckpt.save_checkpoint(store, it, {"policy_version": it}, workers, keep)


def test_rotation_keeps_the_newest_checkpoints(tmp_path):
    store = RunStore(tmp_path, "run")
    for it in range(1, 6):
        _save(store, it, keep=2)
    assert ckpt.list_checkpoints(store) == [4, 5]
    assert (ckpt.checkpoint_dir(store, 5) / "actor" / "w.bin").read_bytes() == bytes([5]) * 16
    _save(store, 6, keep=1)
    assert ckpt.list_checkpoints(store) == [6]
    # Saving an iteration again (a resumed run re-saves it) replaces it whole and keeps it newest.
    _save(store, 6, keep=1)
    assert ckpt.list_checkpoints(store) == [6] and ckpt.latest_checkpoint(store) == 6
    assert sorted(p.name for p in store.checkpoints_dir().iterdir()) == ["000006"]


def test_rotation_after_resuming_from_an_older_checkpoint_keeps_the_new_one(tmp_path):
    """Checkpoints 2 and 5, and 5 fails verification: resume goes back to 2. Saving 3 with
    max_checkpoints=1 must keep 3 (the one just written, loadable) and delete 2; the broken 5 is
    left alone until iteration 5 is saved again."""
    store = RunStore(tmp_path, "run")
    _save(store, 2, keep=0)
    _save(store, 5, keep=0)
    (ckpt.checkpoint_dir(store, 5) / "actor" / "w.bin").write_bytes(b"tampered")
    latest, skipped = ckpt.newest_verified_checkpoint(store)
    assert latest == 2 and [it for it, _ in skipped] == [5]
    _save(store, 3, keep=1)
    assert ckpt.list_checkpoints(store) == [3, 5]
    assert ckpt.verify_checkpoint(store, 3) is None and ckpt.newest_verified_checkpoint(store)[0] == 3
    _save(store, 4, keep=1)
    assert ckpt.list_checkpoints(store) == [4, 5]
    _save(store, 5, keep=1)  # reached again: the broken one is replaced whole
    assert ckpt.list_checkpoints(store) == [5] and ckpt.verify_checkpoint(store, 5) is None


def test_keep_best_keeps_the_best_validated_checkpoint_besides_the_newest(tmp_path):
    """trainer.keep_best: accuracies 0.2, 0.6, -, 0.5, 0.6, 0.1 at iterations 1..6 (3 not validated):
    with max_checkpoints=2 the newest two and the best (iteration 2: the first of the two 0.6s) stay."""
    metric = "val-core/src/acc/mean@1"
    store = RunStore(tmp_path, "run")
    accs = {1: 0.2, 2: 0.6, 4: 0.5, 5: 0.6, 6: 0.1}
    for it in range(1, 7):
        if it in accs:  # what validate_stage stores before the iteration's checkpoint is saved
            store.update_run_meta(**{f"validation_{it:06d}": {metric: accs[it], "val-aux/x": 1.0}})
        ckpt.save_checkpoint(store, it, {"policy_version": it}, lambda d: (d / "actor").mkdir(), 2,
                             keep_best=(metric, "max"))
        newest = list(range(max(1, it - 1), it + 1))
        best = max(sorted(a for a in accs if a <= it), key=lambda a: accs[a])
        assert ckpt.list_checkpoints(store) == sorted(set(newest) | {best}), it
    assert ckpt.list_checkpoints(store) == [2, 5, 6]
    assert ckpt.checkpoint_scores(store, metric) == {2: 0.6, 5: 0.6, 6: 0.1}
    # verl's '@' (as this run.json has it) and trajflow's one spelling '_at_' name the same metric
    assert ckpt.checkpoint_scores(store, "val-core/src/acc/mean_at_1") == {2: 0.6, 5: 0.6, 6: 0.1}
    # min: the lowest value wins (iteration 6's 0.1, also the newest); an unknown metric scores nothing
    assert ckpt.best_checkpoint(store, metric, "min") == 6
    assert ckpt.best_checkpoint(store, "val-core/other", "max") is None
    ckpt.save_checkpoint(store, 7, {"policy_version": 7}, lambda d: (d / "actor").mkdir(), 2,
                         keep_best=("val-core/other", "max"))
    assert ckpt.list_checkpoints(store) == [6, 7]  # no score: plain rotation
    with pytest.raises(ValueError, match="keep_best_mode"):
        ckpt.best_checkpoint(store, metric, "highest")


def test_keep_best_config_rules():
    from trajflow.config import load_config
    from trajflow.errors import ConfigError

    cfg = load_config(None, ["trainer.keep_best=val-core/a/acc/mean@1", "trainer.keep_best_mode=min"])
    assert (cfg.trainer.keep_best, cfg.trainer.keep_best_mode) == ("val-core/a/acc/mean@1", "min")
    with pytest.raises(ConfigError, match="trainer.keep_best='actor/pg_loss' must name a validation metric"):
        load_config(None, ["trainer.keep_best=actor/pg_loss"])
    with pytest.raises(ConfigError, match="trainer.keep_best needs validation: trainer.test_freq > 0"):
        load_config(None, ["trainer.keep_best=val-core/a/acc/mean@1", "trainer.test_freq=0"])


def test_killed_checkpoint_write_is_not_a_checkpoint_and_is_cleaned_up(tmp_path):
    store = RunStore(tmp_path, "run")
    _save(store, 1, keep=0)
    code = ("from pathlib import Path\n"
            "from trajflow import checkpoint as ckpt\nfrom trajflow.store import RunStore\n"
            f"s = RunStore({str(tmp_path)!r}, 'run')\n"
            "def w(d):\n    (d / 'actor').mkdir(); (d / 'actor' / 'w.bin').write_bytes(b'2' * 16)\n"
            "ckpt.save_checkpoint(s, 2, {'policy_version': 2}, w, 2)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(TRAJFLOW_FAULT="checkpoint:2"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL
    assert ckpt.latest_checkpoint(store) == 1
    assert (store.checkpoints_dir() / ".tmp-000002" / "actor" / "w.bin").exists()
    # Killed between swapping an old copy of checkpoint 1 out and the new one in: the old one comes back.
    os.replace(ckpt.checkpoint_dir(store, 1), store.checkpoints_dir() / ".old-000001")
    assert ckpt.latest_checkpoint(store) is None
    removed = ckpt.cleanup(store)
    assert [p.name for p in removed] == [".tmp-000002"]
    assert ckpt.list_checkpoints(store) == [1]
    assert sorted(p.name for p in store.checkpoints_dir().iterdir()) == ["000001"]


# ------------------------------------------------------------------ Ray watcher


def test_watcher_reaps_listed_processes_when_the_pipe_closes():
    import psutil

    from trajflow.infra import raywatch

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ct = raywatch.started_at(psutil.Process(victim.pid))
        w = raywatch.start([(victim.pid, ct), (bystander.pid, ct - 100.0)])  # wrong create time: not reaped
        time.sleep(0.5)
        assert victim.poll() is None
        w.close()
        victim.wait(timeout=30)
        w.proc.wait(timeout=30)
        assert bystander.poll() is None
    finally:
        for p in (victim, bystander):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_wall_clock_step_does_not_hide_a_listed_process(monkeypatch):
    """The wall clock can step between the driver's record and the watcher's reap (NTP, a VM resumed
    from a pause); psutil's create_time() and /proc/stat's btime step with it. A listed process must
    still be recognised by its start time after boot, and reaped."""
    import psutil

    from trajflow.infra import raywatch

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        listed = [(victim.pid, raywatch.started_at(psutil.Process(victim.pid)))]
        wall = psutil.Process(victim.pid).create_time()
        real_btime = psutil._psplatform.boot_time
        monkeypatch.setattr(psutil._psplatform, "boot_time", lambda: real_btime() + 30.0)  # clock stepped 30 s
        assert psutil.Process(victim.pid).create_time() == pytest.approx(wall + 30.0)
        assert raywatch.reap(listed, grace_s=0.0) == [victim.pid]
        victim.wait(timeout=10)  # reap() ran in this process and already collected its exit status
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


def test_watcher_reaps_what_a_raylet_starts_after_it_was_listed(tmp_path):
    """Ray's agents are the raylet's children, started after ``ray.init`` may have returned and
    unmarked in their environment; the watcher must find them by polling the raylet's descendants."""
    import psutil

    from trajflow.infra import raywatch

    raylet_exe = tmp_path / "raylet"  # the process name the watcher recognises a raylet by
    raylet_exe.symlink_to(sys.executable)
    pidfile = tmp_path / "agent.pid"
    script = ("import subprocess, sys, time; time.sleep(1.0); "
              "a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"open({str(pidfile)!r}, 'w').write(str(a.pid)); time.sleep(120)")
    raylet = subprocess.Popen([str(raylet_exe), "-c", script])
    agent = None
    try:
        proc = psutil.Process(raylet.pid)
        assert proc.name() == "raylet"
        w = raywatch.start([(raylet.pid, raywatch.started_at(proc))])
        deadline = time.time() + 30
        while not pidfile.exists() or not pidfile.read_text():
            assert time.time() < deadline, "the fake raylet never started its agent"
            time.sleep(0.1)
        agent = psutil.Process(int(pidfile.read_text()))
        time.sleep(raywatch.POLL_S + 1.0)  # one poll sees the agent
        raylet.kill()  # the raylet dies first, as with a SIGKILLed driver; the agent is orphaned
        raylet.wait()
        assert agent.is_running()
        w.close()
        w.proc.wait(timeout=30)
        agent.wait(timeout=10)
        assert not agent.is_running()
    finally:
        for p in ([raylet] + ([agent] if agent is not None else [])):
            try:
                p.kill()
            except (OSError, psutil.Error):
                pass


def test_watcher_never_lists_itself_when_processes_are_added_later():
    """The watcher is a descendant of the driver whose command line names Ray's module path: a later
    :func:`watch_new_ray_processes` must not hand it to itself (it would SIGTERM itself first)."""
    import psutil

    from trajflow.infra import ray_cluster, raywatch

    def fake_ray() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # ray::fake"])
        deadline = time.time() + 10
        while not psutil.Process(p.pid).cmdline():  # Popen returns inside exec(), before argv is mapped
            assert time.time() < deadline
            time.sleep(0.01)
        return p

    ray_cluster._RAY_WATCH.clear()
    ray_cluster._RAY_WATCH["known"] = raywatch.descendants()
    first = fake_ray()
    second = None
    try:
        ray_cluster.watch_new_ray_processes()  # starts the watcher with the first
        watcher = ray_cluster._RAY_WATCH["watcher"]
        second = fake_ray()
        ray_cluster.watch_new_ray_processes()  # the watcher is new since the last call now
        time.sleep(0.5)
        ray_cluster.stop_ray()
        assert watcher.proc.wait(timeout=30) == 0, "the watcher signalled itself"
        first.wait(timeout=10)
        second.wait(timeout=10)
    finally:
        ray_cluster._RAY_WATCH.clear()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_process_caught_inside_exec_is_judged_at_the_next_call(monkeypatch):
    """Popen returns once exec() has closed the parent's pipe, a moment before the new image's
    arguments are mapped: /proc then shows an empty command line. Such a process must not be filed
    as known and never handed over; here its first reading is made empty, as in that moment."""
    import psutil

    from trajflow.infra import ray_cluster, raywatch

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # ray::fake"])
    real_cmdline = psutil.Process.cmdline
    readings = {"n": 0}

    def cmdline(self):
        if self.pid == proc.pid and readings["n"] == 0:
            readings["n"] += 1
            return []
        return real_cmdline(self)

    ray_cluster._RAY_WATCH.clear()
    ray_cluster._RAY_WATCH["known"] = {d for d in raywatch.descendants() if d[0] != proc.pid}
    try:
        deadline = time.time() + 10
        while not real_cmdline(psutil.Process(proc.pid)):
            assert time.time() < deadline
            time.sleep(0.01)
        monkeypatch.setattr(psutil.Process, "cmdline", cmdline)
        ray_cluster.watch_new_ray_processes()  # reads it empty: not handed over yet
        assert readings["n"] == 1
        watcher = ray_cluster._RAY_WATCH["watcher"]
        ray_cluster.watch_new_ray_processes()  # reads it in full now
        monkeypatch.undo()
        time.sleep(0.5)
        ray_cluster.stop_ray()
        assert watcher.proc.wait(timeout=30) == 0
        proc.wait(timeout=10)
    finally:
        ray_cluster._RAY_WATCH.clear()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_DRIVER = """
import os, sys, time
from prefect import flow
from trajflow.config import load_config
from trajflow.infra.ray_cluster import start_ray, watch_new_ray_processes

@flow
def driver():
    start_ray(load_config(None, ["resources.num_cpus=1"]))
    import ray

    ray.get(ray.remote(lambda: os.getpid()).remote())  # a worker, as a run's first task starts one
    watch_new_ray_processes()
    print("READY", flush=True)
    time.sleep(300)

driver()
"""


def test_sigkilled_driver_leaves_no_ray_or_prefect_server_process(tmp_path):
    """A real driver (a Prefect flow with its temporary server, a real local Ray) killed with SIGKILL:
    every process it started, the Prefect API server and Ray's agents included, is gone soon after."""
    import psutil

    env = _env(PREFECT_HOME=str(tmp_path / "prefect"))
    env.pop("PREFECT_API_URL", None)
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    started: list = []
    try:
        line = driver.stdout.readline()
        assert line.strip() == "READY", f"the driver did not start: {line!r}"
        started = psutil.Process(driver.pid).children(recursive=True)
        cmds = [" ".join(p.cmdline()) for p in started]
        assert any("prefect.server.api.server" in c for c in cmds), cmds
        assert any("raylet" in c for c in cmds), cmds
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, "outlived the driver: " + "; ".join(" ".join(p.cmdline())[:120] for p in alive)
    finally:
        for p in started:
            try:
                p.kill()
            except psutil.Error:
                pass
        if driver.poll() is None:
            driver.kill()


# ------------------------------------------------------------------ audit table


def _fake_iteration(store: RunStore, it: int, scores: list[float], texts: list[str],
                    loss_masks: list[list[int]] | None = None) -> None:
    n = len(scores)
    sids = [f"it{it:06d}-p{j // 2:04d}-s{j % 2}" for j in range(n)]
    resp = [list(range(3 + j)) for j in range(n)]
    multi_turn = {} if loss_masks is None else {"loss_mask": pa.array(loss_masks, pa.list_(pa.int8()))}
    store.write_stage(it, "rollout", pa.table({**multi_turn,
        "sample_id": sids, "prompt_id": [f"p{j // 2}" for j in range(n)], "group_id": [s[:-3] for s in sids],
        "iteration": pa.array([it] * n, pa.int64()), "policy_version": pa.array([it - 1] * n, pa.int64()),
        "prompt": [json.dumps([{"role": "user", "content": f"question {j // 2}"}]) for j in range(n)],
        "prompt_ids": pa.array([[1, 2]] * n, pa.list_(pa.int32())),
        "response_ids": pa.array(resp, pa.list_(pa.int32())), "response_text": texts,
        "rollout_logprobs": pa.array([[0.0] * len(r) for r in resp], pa.list_(pa.float32())),
        "finish_reason": ["stop"] * n, "ground_truth": ["7"] * n, "data_source": ["toy"] * n,
        "extra_info": ["{}"] * n}), it - 1)
    store.write_stage(it, "reward", pa.table({
        "sample_id": sids, "score": pa.array(scores, pa.float32()), "reward_extra": ["{}"] * n,
        "reward_error": pa.nulls(n, pa.string()),
        "token_rewards": pa.array([[0.0] * len(r) for r in resp], pa.list_(pa.float32()))}), it - 1)
    store.write_stage(it, "advantage", pa.table({
        "sample_id": sids,
        "advantages": pa.array([[float(j)] * (len(r) - 1) + [float(j) + 1.0] for j, r in enumerate(resp)],
                               pa.list_(pa.float32())),
        "returns": pa.array([[0.0] * len(r) for r in resp], pa.list_(pa.float32()))}), it - 1)


def test_audit_advantage_mean_counts_only_generated_tokens_of_multi_turn_rows(tmp_path):
    from trajflow.audit import append_iteration, query_audit

    store = RunStore(tmp_path, "run")
    store.run_dir.mkdir()
    store.write_config("recipe: x\n")
    # Row 1: 4 tokens, advantages [1, 1, 1, 2], the middle two a tool result (mask 0).
    _fake_iteration(store, 1, [0.0, 1.0], ["a", "b"], loss_masks=[[1, 1, 1], [1, 0, 0, 1]])
    assert append_iteration(store, 1, "initial") == 2
    rows = {r["sample_id"]: r for r in query_audit(tmp_path, "run", limit=10).to_pylist()}
    assert rows["it000001-p0000-s1"]["advantage_mean"] == pytest.approx((1 + 2) / 2)  # not (1+1+1+2)/4
    assert rows["it000001-p0000-s1"]["response_length"] == 4  # the whole response, as verl counts it
    assert rows["it000001-p0000-s0"]["advantage_mean"] == pytest.approx((0 + 0 + 1) / 3)


def test_audit_append_query_and_idempotent_reappend(tmp_path):
    from trajflow.errors import AuditError
    from trajflow.audit import AUDIT_COLUMNS, append_iteration, query_audit, rebuild_audit

    store = RunStore(tmp_path, "run")
    store.run_dir.mkdir()
    store.write_config("recipe: x\n")
    _fake_iteration(store, 1, [0.0, 1.0, 0.5, 0.25], ["the cat sat", "a dog ran", "cat and dog", "nothing here"])
    _fake_iteration(store, 2, [1.0, 0.0, 0.75, 0.5], ["dog again", "cat again", "bird", "cat cat"])
    assert append_iteration(store, 1, "initial") == 4
    assert append_iteration(store, 2, "checkpoints/000001") == 4
    assert append_iteration(store, 2, "checkpoints/000001") == 4  # a re-run iteration replaces its rows
    t = query_audit(tmp_path, "run", limit=100)
    assert t.column_names == list(AUDIT_COLUMNS) and t.num_rows == 8
    rows = {r["sample_id"]: r for r in t.to_pylist()}
    r = rows["it000002-p0001-s1"]  # 4th row of iteration 2: response of 6 tokens, advantages [3]*5 + [4]
    assert r["response_text"] == "cat cat" and r["score"] == 0.5 and r["response_length"] == 6
    assert r["advantage_mean"] == pytest.approx((3 * 5 + 4) / 6)
    assert r["policy_version"] == 1 and r["checkpoint_id"] == "checkpoints/000001"
    assert r["prompt_text"] == "user: question 1"
    hits = query_audit(tmp_path, "run", where="iteration = 2 AND score >= 0.5", search="cat", limit=10)
    assert sorted(hits.column("sample_id").to_pylist()) == ["it000002-p0001-s1"]
    hits = query_audit(tmp_path, "run", search="dog", limit=10)
    assert sorted(hits.column("sample_id").to_pylist()) == ["it000001-p0000-s1", "it000001-p0001-s0",
                                                            "it000002-p0000-s0"]
    assert query_audit(tmp_path, "run", limit=3).column("sample_id").to_pylist() == [
        "it000001-p0000-s0", "it000001-p0000-s1", "it000001-p0001-s0"]
    with pytest.raises(AuditError, match="not valid SQL"):
        query_audit(tmp_path, "run", where="scor > 1")
    with pytest.raises(AuditError, match=f"no run 'nope' in store root {tmp_path}"):
        query_audit(tmp_path, "nope")
    assert rebuild_audit(store) == 8
    assert query_audit(tmp_path, "run", limit=100).num_rows == 8
