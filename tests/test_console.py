"""The console of a real training run (real Prefect, real local Ray, MLflow on SQLite) and the CLI's
options: one ``step:N`` line per step on the console, library logs in ``<run_dir>/logs/driver.log``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import typer

import trajflow.cli as cli_module

from tests.conftest import tiny_overrides

TRAJFLOW = [str(Path(sys.executable).parent / "trajflow")]
#: Keys every training step's line has (the KL key depends on the recipe, see KL_KEYS).
STEP_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "response_length/mean",
             "actor/pg_clipfrac", "timing_s/step")
KL_KEYS = ("actor/kl_loss", "critic/kl", "actor/ppo_kl")
#: A Prefect console record: "HH:MM:SS.mmm | INFO    | ..."
PREFECT_LINE = re.compile(r"\d\d:\d\d:\d\d\.\d{3} \| (INFO|WARNING|DEBUG)")


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(TRAJFLOW + list(args), capture_output=True, text=True, timeout=timeout)


def console_lines(p: subprocess.CompletedProcess) -> list[str]:
    """stdout and stderr as lines (tqdm redraws its bar with carriage returns)."""
    return [ln for ln in re.split(r"[\r\n]", p.stdout + "\n" + p.stderr) if ln.strip()]


def parse_step(line: str) -> tuple[int, dict[str, float]]:
    """``step:N - key:value - ...`` -> (N, {key: float}); every value must parse as a float."""
    head, *parts = line.split(" - ")
    step = int(head.removeprefix("step:"))
    values = {}
    for part in parts:
        key, _, value = part.rpartition(":")
        values[key] = float(value)
    return step, values


def run_dir_of(p: subprocess.CompletedProcess, run_id: str) -> Path:
    [line] = [ln for ln in p.stdout.splitlines() if ln.startswith(f"trajflow run {run_id}: ")]
    return Path(line.split(": ", 1)[1])


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("console")
    overrides = tiny_overrides(tiny_model_dir, root / "runs", **{
        "trainer.progress": True, "trainer.test_freq": 2, "tracking.uri": f"sqlite:///{root / 'mlflow.db'}"})
    p = cli("train", "--run-id", "c1", *overrides)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_console_shows_one_step_line_per_step(quiet_run):
    lines = console_lines(quiet_run)
    steps = [ln for ln in lines if ln.startswith("step:")]
    assert [ln.split(" - ")[0] for ln in steps] == ["step:0", "step:1", "step:2"], steps
    parsed = dict(parse_step(ln) for ln in steps)
    for step in (1, 2):
        keys = parsed[step]
        assert all(k in keys for k in STEP_KEYS), (step, keys)
        assert sum(k in keys for k in KL_KEYS) == 1, keys
    # Validation runs before training and after the last step (test_freq=2): its scores are shown.
    assert any(k.startswith("val-core/") for k in parsed[0]) and any(k.startswith("val-core/") for k in parsed[2])
    assert not any(k.startswith("val-") for k in parsed[1]), parsed[1]
    # verl's console format: 3 decimals.
    assert re.search(r" - critic/score/mean:-?\d+\.\d{3} - ", steps[1]), steps[1]


def test_library_logs_go_to_the_run_log_file(quiet_run):
    text = quiet_run.stdout + quiet_run.stderr
    assert "Finished in state" not in text and "Beginning flow run" not in text, text[-3000:]
    assert not [ln for ln in console_lines(quiet_run) if PREFECT_LINE.search(ln)], text[-3000:]
    assert "lancedb fork support" not in text and "Token authentication" not in text, text[-3000:]
    assert "PolicyWorker pid=" not in text, text[-3000:]  # Ray worker output stays in Ray's session logs
    log = (run_dir_of(quiet_run, "c1") / "logs" / "driver.log").read_text()
    # Logged before the run folder existed (Prefect's temporary server), then the flow and its tasks.
    assert "Starting temporary server" in log
    assert "Beginning flow run 'train-c1'" in log
    assert "Task run 'update-c1-it1' - Finished in state Completed()" in log
    assert "Ray session" in log and "worker output is in" in log


def test_verbose_shows_library_logs_on_the_console(tmp_path, tiny_model_dir):
    overrides = tiny_overrides(tiny_model_dir, tmp_path / "runs", **{
        "trainer.total_iterations": 1, "trainer.test_freq": 0, "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    p = cli("-v", "train", "--run-id", "v1", *overrides)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Beginning flow run 'train-v1'" in p.stderr, p.stderr[-3000:]
    assert "Task run 'update-v1-it1' - Finished in state Completed()" in p.stderr
    assert len([ln for ln in console_lines(p) if ln.startswith("step:1 - ")]) == 1
    # The file gets them too.
    assert "Beginning flow run 'train-v1'" in (run_dir_of(p, "v1") / "logs" / "driver.log").read_text()


def test_version():
    p = cli("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"trajflow {version('trajflow')}"


def test_from_stage_choices_are_validated():
    p = cli("replay", "r1", "--iteration", "1", "--from-stage", "bogus")
    assert p.returncode == 2, p.stderr
    assert "--from-stage" in p.stderr and all(f"'{s}'" in p.stderr for s in ("reward", "advantage", "update"))
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and p.stderr.startswith("error: trajflow replay: ")


def test_a_missing_choice_option_is_one_line_without_tabs():
    p = cli("replay", "r1", "--iteration", "1")
    assert p.returncode == 2, p.stderr
    assert "--from-stage" in p.stderr and "\t" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Choose from: reward, advantage, update" in p.stderr, p.stderr


@pytest.mark.parametrize("raised, code", [(typer.Abort(), 130), (KeyboardInterrupt(), 130)])
def test_main_maps_an_abort_to_exit_130(monkeypatch, raised, code):
    def app(**_):
        raise raised
    monkeypatch.setattr(cli_module, "app", app)
    with pytest.raises(SystemExit) as e:
        cli_module.main()
    assert e.value.code == code


def test_main_lets_an_unexpected_error_through_as_itself(monkeypatch):
    # A bug or an environment failure (a full disk) must surface as itself, not be masked by an
    # error of the handler (an attribute the vendored Click lacks).
    def app(**_):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cli_module, "app", app)
    with pytest.raises(OSError, match="No space left"):
        cli_module.main()


def test_audit_format_choices_are_validated():
    p = cli("audit", "r1", "--format", "csv")
    assert p.returncode == 2, p.stderr
    assert "--format" in p.stderr and all(f"'{s}'" in p.stderr for s in ("table", "json", "parquet"))
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, needle", [(["train", "--bogus"], "No such option: --bogus"),
                                          (["audit"], "Missing argument"),
                                          (["train", "--config"], "Option '--config' requires an argument"),
                                          (["replay", "r", "--iteration", "x", "--from-stage", "reward"], "'--iteration'")])
def test_usage_errors_are_one_line(args, needle):
    p = cli(*args)
    assert p.returncode == 2 and p.stderr.startswith(f"error: trajflow {args[0]}: "), p.stderr
    assert needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


# deploy registers Prefect deployments: it reads no run store, so it has no --store.
@pytest.mark.parametrize("command", ["train", "resume", "replay", "audit", "gate", "config", "compare", "dashboard",
                                     "runs"])
def test_every_store_command_takes_store(command):
    p = cli(command, "--help")
    assert p.returncode == 0, p.stderr
    assert re.search(r"^\s+--store\b", p.stdout, re.M), p.stdout
    assert "--store-root" not in p.stdout  # the old spelling of audit's option is a hidden alias
    assert "<bool>" not in p.stdout  # flags take no value, and their help does not say otherwise


def test_every_command_has_help():
    p = cli("--help")
    commands = re.search(r"Commands:\n(.*)", p.stdout, re.S).group(1)
    rows = [ln.split(None, 1) for ln in commands.splitlines() if ln.startswith("  ") and ln.strip()]
    assert len(rows) >= 9 and all(len(r) == 2 and r[1].strip() for r in rows), commands
    for name, _ in rows:
        sub = cli(name, "--help").stdout
        for option in re.findall(r"^\s+(?:-\w, )?(--[\w-]+)(.*)$", sub, re.M):
            assert option[1].strip(), f"{name} {option[0]} has no help text:\n{sub}"


def test_store_option_and_old_audit_spelling(tmp_path):
    p = cli("config", "--store", str(tmp_path / "elsewhere"))
    assert p.returncode == 0, p.stderr
    assert f"root: {tmp_path / 'elsewhere'}" in p.stdout
    for opt in ("--store", "--store-root"):
        p = cli("audit", "nope", opt, str(tmp_path))
        assert p.returncode == 2 and "nope" in p.stderr and str(tmp_path) in p.stderr, p.stderr


def test_ctrl_c_in_a_terminal_stops_the_run_cleanly_and_it_resumes(tmp_path, tiny_model_dir):
    """Ctrl-C sends SIGINT to the terminal's whole foreground process group: the driver and every
    child that shares its group. The run must end with exit code 130, without a traceback, leave no
    process behind, and resume from its last checkpoint."""
    import os
    import signal
    import time

    import psutil

    overrides = tiny_overrides(tiny_model_dir, tmp_path / "runs", **{
        "trainer.total_iterations": 200, "trainer.test_freq": 0, "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:
        # Its own session and group stand in for the terminal's foreground group, and SIGINT is
        # delivered as in a terminal: a test runner started in the background (`cmd &` in a script)
        # hands its children SIGINT ignored, and the driver would rightly keep ignoring it.
        p = subprocess.Popen(TRAJFLOW + ["train", "--run-id", "int1", *overrides], stdout=o, stderr=e,
                             start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while "step:2 - " not in out.read_text():
            assert p.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.5)
        started = {c.pid: c for c in psutil.Process(p.pid).children(recursive=True)}
        os.killpg(p.pid, signal.SIGINT)
        code = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    stderr = err.read_text()
    assert code == 130, stderr[-3000:]
    for bad in ("Traceback", "AttributeError", "ConnectError"):
        assert bad not in stderr, stderr[-3000:]
    assert "trajflow run int1 interrupted: " in out.read_text(), out.read_text()[-2000:]
    time.sleep(5)  # Ray's own processes exit on their watchdogs
    left = [c for c in started.values() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, [" ".join(c.cmdline())[:120] for c in left]
    r = cli("resume", "int1", "--store", str(tmp_path / "runs"), "trainer.total_iterations=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step:4 - " in r.stdout + r.stderr


def test_runs_lists_a_store(quiet_run, tmp_path):
    import shutil

    run_dir = run_dir_of(quiet_run, "c1")
    p = cli("runs", "--store", str(run_dir.parent), "--format", "json")
    assert p.returncode == 0, p.stderr
    [row] = [r for r in json.loads(p.stdout) if r["run_id"] == "c1"]
    # tiny_overrides: 2 iterations, a checkpoint after each, validation every 2 (and before training).
    assert (row["kind"], row["status"], row["iterations"], row["checkpoints"]) == ("train", "finished", 2, [1, 2])
    assert row["val_iteration"] == 2 and row["val_metric"].startswith("val-core/")
    stored = json.loads((run_dir / "run.json").read_text())["validation_000002"][row["val_metric"]]
    assert row["val_value"] == stored
    # A damaged run.json is one row saying so, not a failed listing.
    store = tmp_path / "store"
    shutil.copytree(run_dir, store / "c1")
    shutil.copytree(run_dir, store / "broken")
    (store / "broken" / "run.json").write_text("{not json")
    p = cli("runs", "--store", str(store))
    assert p.returncode == 0, p.stderr
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines()[1:] if ln.strip()}
    assert "unreadable" in lines["broken"] and "finished" in lines["c1"], p.stdout
    p = cli("runs", "--store", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "is not a folder" in p.stderr and len(p.stderr.strip().splitlines()) == 1
