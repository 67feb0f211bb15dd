"""A damaged stored run (config, manifests, stage files) is reported, never skipped or guessed at.

Real run folders written by :class:`trajflow.store.RunStore`, the real ``trajflow`` command in a
subprocess: what the user reads (one ``error:`` line naming the file, the exit code) is the point.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_crash_safety import _fake_iteration
from trajflow.config import load_config, to_yaml
from trajflow.store import RunStore

TRAJFLOW = [str(Path(sys.executable).parent / "trajflow")]


def run_cli(*args: str) -> tuple[int, str, str]:
    p = subprocess.run(TRAJFLOW + list(args), capture_output=True, text=True, timeout=180)
    return p.returncode, p.stdout, p.stderr


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def make_stored_run(tmp_path: Path) -> RunStore:
    """A run with a resolved config and two complete iterations (rollout, reward, advantage)."""
    store = RunStore(tmp_path / "runs", "r1")
    store.run_dir.mkdir(parents=True)
    store.write_config(to_yaml(load_config(None, [f"store.root={store.root}"])))
    store.update_run_meta(run_id="r1", status="failed")
    for it in (1, 2):
        _fake_iteration(store, it, [0.0, 1.0, 0.5, 0.5], ["a", "b", "c", "d"])
        store.mark(it, "complete")
    return store


@pytest.fixture
def stored_run(tmp_path) -> RunStore:
    return make_stored_run(tmp_path)


DAMAGED = {"garbage": b"\x00\xff\xfe\x89PNG\r\n\x1a\n", "yaml_error": b"model: {path: [unclosed\n",
           "list": b"- 1\n- 2\n", "empty": b""}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
@pytest.mark.parametrize("command", ["gate", "resume", "replay"])
def test_damaged_stored_config_is_one_line_naming_the_file(stored_run, damage, command):
    stored_run.config_path.write_bytes(DAMAGED[damage])
    root = str(stored_run.root)
    args = {"gate": ["gate", "r1", "--store", root],
            "resume": ["resume", "r1", f"store.root={root}", "trainer.total_iterations=3"],
            "replay": ["replay", "r1", "-i", "1", "--from-stage", "advantage", f"store.root={root}"]}[command]
    rc, _, err = run_cli(*args)
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(error_lines(err)) == 1 and str(stored_run.config_path) in error_lines(err)[0], err
    assert stored_run.config_path.read_bytes() == DAMAGED[damage]  # never rewritten with the defaults
    assert not (stored_run.root / "mlflow.db").exists()


def test_gate_names_every_iteration_it_could_not_check(stored_run):
    """A corrupt reward file and a missing manifest are not passes: each is named, exit 2."""
    rc, out, err = run_cli("gate", "r1", "--store", str(stored_run.root))
    assert rc == 0 and "iteration      1" in out and "iteration      2" in out, err
    reward = stored_run.stage_path(1, "reward")
    reward.write_bytes(reward.read_bytes()[:40])
    stored_run.manifest_path(2).unlink()
    rc, out, err = run_cli("gate", "r1", "--store", str(stored_run.root))
    assert rc == 2, err
    assert "Traceback" not in err
    [line] = error_lines(err)
    assert "2 iteration(s) not checked" in line and f"iteration 1: {reward}" in line, line
    assert f"iteration 2: {stored_run.manifest_path(2)} is missing" in line, line


def test_audit_rebuild_names_the_iterations_it_left_out(stored_run):
    rollout = stored_run.stage_path(2, "rollout")
    rollout.write_bytes(rollout.read_bytes()[:40])
    rc, _, err = run_cli("audit", "r1", "--store", str(stored_run.root), "--rebuild")
    assert rc == 2, err
    assert "Traceback" not in err and "will be recomputed" not in err
    [line] = error_lines(err)
    assert "rebuilt without 1 iteration(s)" in line and f"iteration 2: {rollout}" in line, line


_HOLDER = """
import sys, time
from trajflow.store import RunStore, run_lock
with run_lock(RunStore(sys.argv[1], "r1")):
    print("HOLDING", flush=True)
    time.sleep(300)
"""


def test_second_driver_of_a_run_is_refused_until_the_holder_dies(stored_run, tiny_model_dir):
    """A concurrent ``resume`` refuses with one line naming the holder; a SIGKILLed holder's lock
    does not outlive it."""
    import os
    import signal
    import socket

    from omegaconf import OmegaConf

    from trajflow.store import run_lock

    cfg = stored_run.read_config()
    cfg.model.path = str(tiny_model_dir)
    stored_run.write_config(OmegaConf.to_yaml(cfg))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(stored_run.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HOLDING"
        rc, out, err = run_cli("resume", "r1", f"store.root={stored_run.root}", "trainer.total_iterations=3")
        assert rc == 2, err
        [line] = error_lines(err)
        assert f"pid {holder.pid} on {socket.gethostname()} since " in line and ".lock" in line, line
        assert "trajflow run r1" not in out  # nothing started
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        with run_lock(stored_run):  # the dead holder's lock is gone with it
            pass
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_gate_with_malformed_suite_is_one_line(stored_run, tmp_path):
    suite = tmp_path / "bad.json"
    suite.write_text("{not json")
    rc, _, err = run_cli("gate", "r1", "--store", str(stored_run.root), "--suite", str(suite))
    assert rc == 2 and "Traceback" not in err, err
    [line] = error_lines(err)
    assert str(suite) in line and "JSON" in line, line
