"""A run folder is data: no command imports code, or sends data to a tracking URI, that only a
stored file names.

Every command that reads a run folder runs (the real ``trajflow`` command in a subprocess) against
a folder whose stored config was tampered with: a reward function, an environment factory and a
tool config whose code writes a marker file when imported, the consent flag set in the same file,
the run's record of the reward function forged to match, and a tracking URI that would create a
folder if MLflow ever wrote to it. The marker never appears. Then the ways a user consents.
No model, no Ray: every refusal comes before either.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.test_crash_safety import _fake_iteration
from trajflow.config import load_config, to_yaml
from trajflow.errors import ConfigError
from trajflow.store import RunStore

TRAJFLOW = [str(Path(sys.executable).parent / "trajflow")]
PLANT = "import pathlib\npathlib.Path({marker!r}).write_text('{what} ran')\n"


def _plant(tmp_path: Path) -> dict:
    """Files whose import writes ``marker``; the planted module folder goes on PYTHONPATH."""
    marker = tmp_path / "MARKER"
    code = tmp_path / "planted"
    code.mkdir()
    (code / "evil_reward.py").write_text(PLANT.format(marker=str(marker), what="reward") +
                                         "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                         "    return 1.0\n")
    (code / "evil_env.py").write_text(PLANT.format(marker=str(marker), what="environment") +
                                      "def make(ctx):\n    raise SystemExit\n")
    (code / "evil_tool.py").write_text(PLANT.format(marker=str(marker), what="tool") +
                                       "def run(**kw):\n    return ''\n")
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"name": "evil", "function": "evil_tool:run",
                                                "parameters": {"type": "object", "properties": {}}}]}))
    return {"marker": marker, "code": code, "reward": f"{code / 'evil_reward.py'}:score", "tools": tools,
            "uri": (tmp_path / "elsewhere" / "mlruns").as_uri(), "elsewhere": tmp_path / "elsewhere"}


@pytest.fixture
def planted(tmp_path):
    """A run ``r1`` (two stored iterations) whose config.yaml and run.json were tampered with."""
    p = _plant(tmp_path)
    store = RunStore(tmp_path / "runs", "r1")
    store.run_dir.mkdir(parents=True)
    cfg = yaml.safe_load(to_yaml(load_config(None, [f"store.root={store.root}", "rollout.multi_turn.enable=true"])))
    cfg["reward"].update(custom_function=p["reward"], trust_changed_custom_function=True)
    cfg["rollout"]["multi_turn"].update(environment="evil_env:make", tool_config_path=str(p["tools"]))
    cfg["tracking"]["uri"] = p["uri"]
    store.write_config(yaml.safe_dump(cfg))
    reward_file = p["code"] / "evil_reward.py"
    store.update_run_meta(run_id="r1", status="failed", tracking_uri=p["uri"], custom_function={
        "spec": p["reward"], "path": str(reward_file), "sha256": hashlib.sha256(reward_file.read_bytes()).hexdigest()})
    for it in (1, 2):
        _fake_iteration(store, it, [0.0, 1.0, 0.5, 0.5], ["a", "b", "c", "d"])
        store.mark(it, "complete")
    p["store"] = store
    return p


def run_cli(p: dict, *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p["code"]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(TRAJFLOW + list(args), capture_output=True, text=True, timeout=180, env=env,
                       cwd=p["code"])
    return r.returncode, r.stdout, r.stderr


def _untouched(p: dict) -> None:
    assert not p["marker"].exists(), p["marker"].read_text()
    assert not p["elsewhere"].exists()  # the stored tracking URI was never written to


@pytest.mark.parametrize("command", ["resume", "replay", "evaluate"])
def test_commands_that_run_a_stored_config_refuse_its_code_before_importing_anything(planted, command):
    root = str(planted["store"].root)
    args = {"resume": ["resume", "r1", f"store.root={root}", "trainer.total_iterations=3"],
            "replay": ["replay", "r1", "-i", "1", "--from-stage", "reward", f"store.root={root}"],
            "evaluate": ["evaluate", "r1", "--checkpoint", "0", "--store", root]}[command]
    rc, _, err = run_cli(planted, *args)
    assert rc == 2, err
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "reward.custom_function=" in line and "code named by a run folder is not imported" in line, line
    assert "reward.custom_function_sha256=" in line  # the other way to consent, with the file's digest
    _untouched(planted)
    assert json.loads((planted["store"].run_dir / "run.json").read_text())["status"] == "failed"  # nothing written


def test_read_only_commands_never_import_or_contact_what_a_stored_config_names(planted):
    root = str(planted["store"].root)
    rc, out, err = run_cli(planted, "gate", "r1", "--store", root)
    assert rc == 0 and "iteration      1: ok" in out, err
    assert "tracking.uri" not in err  # the gate logs nowhere: no note either
    rc, out, err = run_cli(planted, "audit", "r1", "--rebuild", "--store", root, "--format", "json")
    assert rc == 0 and len(json.loads(out)) == 8, err
    rc, out, err = run_cli(planted, "runs", "--store", root, "--format", "json")
    assert rc == 0 and json.loads(out)[0]["run_id"] == "r1", err
    rc, _, err = run_cli(planted, "compare", "r1", "--store", root)
    assert rc == 2 and "Traceback" not in err, err  # no mlflow.db under the store: one line
    _untouched(planted)


def test_dashboard_data_layer_reads_a_planted_run_without_running_it(planted):
    from trajflow.dashboards import data

    root = planted["store"].root
    assert data.store_runs(root) == ["r1"]
    assert len(data.find_trajectories(root, "r1").to_pylist() if hasattr(data.find_trajectories(root, "r1"), "to_pylist")
               else data.find_trajectories(root, "r1")) == 8
    data.trajectory_facets(root, "r1")
    data.gate_reports(root, "r1")
    _untouched(planted)


def test_stored_consent_flag_and_forged_record_grant_nothing(planted):
    from trajflow.run import resume_config

    root = str(planted["store"].root)
    (planted["store"].run_dir / "run.json").write_text("{}")  # the record deleted
    with pytest.raises(ConfigError, match=r"names reward\.custom_function=.*evil_reward\.py:score"):
        resume_config("r1", [f"store.root={root}"])
    _untouched(planted)


def test_each_code_key_needs_its_own_consent(planted):
    from trajflow.run import resume_config

    root, spec = str(planted["store"].root), planted["reward"]
    digest = hashlib.sha256((planted["code"] / "evil_reward.py").read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match=r"names rollout\.multi_turn\.environment='evil_env:make'"):
        resume_config("r1", [f"store.root={root}", f"reward.custom_function={spec}"])
    with pytest.raises(ConfigError, match=r"names rollout\.multi_turn\.environment="):
        resume_config("r1", [f"store.root={root}", f"reward.custom_function_sha256={digest}"])
    with pytest.raises(ConfigError, match=r"names rollout\.multi_turn\.tool_config_path="):
        resume_config("r1", [f"store.root={root}", f"reward.custom_function_sha256={digest}",
                             "rollout.multi_turn.environment=tool_calculator"])
    with pytest.raises(ConfigError, match=r"names reward\.custom_function="):  # a wrong digest is no consent
        resume_config("r1", [f"store.root={root}", f"reward.custom_function_sha256={'0' * 64}",
                             "rollout.multi_turn.environment=tool_calculator", "rollout.multi_turn.tool_config_path=null"])
    _untouched(planted)
    # Consent: the hash of the reward file, the other two replaced on the command line.
    cfg = resume_config("r1", [f"store.root={root}", f"reward.custom_function_sha256={digest}",
                               "rollout.multi_turn.environment=tool_calculator",
                               "rollout.multi_turn.tool_config_path=null"])
    assert cfg.reward.custom_function == spec
    assert cfg.reward.trust_changed_custom_function is False  # the stored flag was reset
    assert cfg.tracking.uri is None  # the stored URI is not used
    assert not planted["marker"].exists()  # consent given; still nothing imported until start-up checks


def test_a_hash_that_no_longer_matches_refuses_the_import(planted, tmp_path):
    from trajflow.run import check_reward_and_gates

    spec, f = planted["reward"], planted["code"] / "evil_reward.py"
    cfg = load_config(None, [f"reward.custom_function={spec}", f"reward.custom_function_sha256={'ab' * 32}"])
    with pytest.raises(ConfigError, match=r"reward\.custom_function_sha256=abab.* but .*evil_reward\.py has sha256 "
                                          + hashlib.sha256(f.read_bytes()).hexdigest()):
        check_reward_and_gates(cfg)
    assert not planted["marker"].exists()


def test_a_stored_tracking_uri_is_reported_and_replaced_unless_named_again(planted):
    from trajflow.trust import screen_stored_config

    store = planted["store"]
    over = [f"store.root={store.root}", f"reward.custom_function={planted['reward']}",
            "rollout.multi_turn.enable=false"]
    note = io.StringIO()
    base = screen_stored_config(store.read_config(), over, store.config_path, report=note)
    assert base.tracking.uri is None
    assert f"names tracking.uri={planted['uri']!r}; not used" in note.getvalue()
    assert f"pass tracking.uri={planted['uri']} to log there" in note.getvalue()
    note = io.StringIO()
    base = screen_stored_config(store.read_config(), over + [f"tracking.uri={planted['uri']}"], store.config_path,
                                report=note)
    assert base.tracking.uri == planted["uri"] and note.getvalue() == ""
    # a stored URI that is this store's own default is no news
    cfg = store.read_config()
    cfg.tracking.uri = f"sqlite:///{store.root / 'mlflow.db'}"
    note = io.StringIO()
    screen_stored_config(cfg, over, store.config_path, report=note)
    assert note.getvalue() == ""


def test_an_unanswering_tracking_server_is_one_line_within_seconds():
    from trajflow.tracking import check_tracking_server

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers: what hung a resume for minutes
    port = silent.getsockname()[1]
    cfg = load_config(None, [f"tracking.uri=http://127.0.0.1:{port}"])
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"tracking\.uri='http://127\.0\.0\.1:{port}': no answer from the "
                                          r"MLflow server within 1 s") as e:
        check_tracking_server(cfg, timeout_s=1.0)
    assert time.monotonic() - t0 < 10 and "\n" not in str(e.value)
    silent.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens: refused at once
    with pytest.raises(ConfigError, match="no answer"):
        check_tracking_server(load_config(None, [f"tracking.uri=http://127.0.0.1:{port}"]), timeout_s=1.0)
    check_tracking_server(load_config(None, []))  # the SQLite default is not probed


def test_an_answering_tracking_server_passes():
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from trajflow.tracking import check_tracking_server

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404 if self.path != "/health" else 200)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.handle_request, daemon=True).start()
    try:
        check_tracking_server(load_config(None, [f"tracking.uri=http://127.0.0.1:{server.server_port}"]), 5.0)
    finally:
        server.server_close()
