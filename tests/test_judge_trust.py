"""A run folder does not choose where responses are sent for judging, nor which secret goes with them:
a stored ``reward.judge.base_url`` / ``api_key_env`` is used by ``resume`` and ``replay`` only when the
caller names it again (the real ``trajflow`` command, against a judge URL that records any
connection; nothing connects). No model, no Ray: the refusals come before either."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.test_crash_safety import _fake_iteration
from trajflow.config import load_config, to_yaml
from trajflow.errors import ConfigError
from trajflow.store import RunStore
from trajflow.trust import screen_stored_config

TRAJFLOW = [str(Path(sys.executable).parent / "trajflow")]


@pytest.fixture
def judged_run(tmp_path):
    """Run ``r1`` (two stored iterations) whose stored config sends responses to a judge URL that
    counts the connections it gets."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    connections, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            connections.append(conn.recv(200))
            conn.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    store = RunStore(tmp_path / "runs", "r1")
    store.run_dir.mkdir(parents=True)
    cfg = yaml.safe_load(to_yaml(load_config(None, [f"store.root={store.root}"])))
    cfg["reward"]["judge"].update(enable=True, base_url=url, api_key_env="HOME")  # HOME: a variable that is set
    store.write_config(yaml.safe_dump(cfg))
    store.update_run_meta(run_id="r1", status="failed")
    for it in (1, 2):
        _fake_iteration(store, it, [0.0, 1.0, 0.5, 0.5], ["a", "b", "c", "d"])
        store.mark(it, "complete")
    yield {"store": store, "url": url, "connections": connections}
    stop.set()
    t.join(2)
    listener.close()


def run_cli(*args: str) -> tuple[int, str, str]:
    r = subprocess.run(TRAJFLOW + list(args), capture_output=True, text=True, timeout=180, env=dict(os.environ))
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("command", ["resume", "replay"])
def test_scoring_commands_refuse_a_stored_judge_url(judged_run, command):
    root = str(judged_run["store"].root)
    args = {"resume": ["resume", "r1", f"store.root={root}", "trainer.total_iterations=3"],
            "replay": ["replay", "r1", "-i", "2", "--from-stage", "reward", f"store.root={root}"]}[command]
    rc, _, err = run_cli(*args)
    assert rc == 2 and "Traceback" not in err, err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert f"names reward.judge.base_url={judged_run['url']!r}" in line, line
    assert f"pass reward.judge.base_url={judged_run['url']} again" in line, line
    assert judged_run["connections"] == []


def test_each_judge_key_needs_its_own_consent(judged_run):
    store, url = judged_run["store"], judged_run["url"]
    over = [f"store.root={store.root}"]
    # The URL named again, the key's variable not: a stored file could name another secret to send.
    with pytest.raises(ConfigError, match="names reward.judge.api_key_env='HOME'"):
        screen_stored_config(store.read_config(), over + [f"reward.judge.base_url={url}"], store.config_path)
    base = screen_stored_config(store.read_config(), over + [f"reward.judge.base_url={url}",
                                                             "reward.judge.api_key_env=HOME"], store.config_path)
    assert base.reward.judge.base_url == url and base.reward.judge.api_key_env == "HOME" and base.reward.judge.enable
    # The judge switched off on the command line: the stored endpoint is dropped, not refused.
    base = screen_stored_config(store.read_config(), over + ["reward.judge.enable=false"], store.config_path)
    assert base.reward.judge.base_url is None and base.reward.judge.api_key_env is None
    # A command that scores nothing (needs_code=False) drops it and turns the judge off.
    base = screen_stored_config(store.read_config(), over, store.config_path, needs_code=False)
    assert base.reward.judge.base_url is None and base.reward.judge.enable is False
    load_config(base=base, overrides=over)  # and the config it leaves is valid
    assert judged_run["connections"] == []


def test_a_stored_judge_model_path_needs_naming_again(tmp_path):
    """``reward.judge.model_path`` is weights, not code, but it decides the scores: like the URL, a
    stored one is refused for a command that scores unless named again, and dropped (judge off) else."""
    store = RunStore(tmp_path / "runs", "r2")
    store.run_dir.mkdir(parents=True)
    cfg = yaml.safe_load(to_yaml(load_config(None, [f"store.root={store.root}"])))
    cfg["reward"]["judge"].update(enable=True, model_path=str(tmp_path / "judge-model"))
    store.write_config(yaml.safe_dump(cfg))
    over = [f"store.root={store.root}"]
    with pytest.raises(ConfigError, match="names reward.judge.model_path=.*which model judges them"):
        screen_stored_config(store.read_config(), over, store.config_path)
    named = over + [f"reward.judge.model_path={tmp_path / 'judge-model'}"]
    base = screen_stored_config(store.read_config(), named, store.config_path)
    assert base.reward.judge.model_path == str(tmp_path / "judge-model") and base.reward.judge.enable
    base = screen_stored_config(store.read_config(), over, store.config_path, needs_code=False)
    assert base.reward.judge.model_path is None and base.reward.judge.enable is False
    load_config(base=base, overrides=over)
