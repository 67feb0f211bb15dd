"""The CLI answers a bad config, and a finished run, without importing the heavy libraries: which
modules a fresh process has loaded when it exits, not how long it took (benchmarks/startup.py
times it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trajflow.config import load_config, to_yaml
from trajflow.store import RunStore

HEAVY = ("torch", "ray", "prefect", "great_expectations", "transformers", "mlflow", "lancedb")

PROBE = """
import sys
sys.argv = ["trajflow", *sys.argv[1:]]
from trajflow.cli import main
try:
    main()
except SystemExit as e:
    code = e.code
print("exit", code, "loaded", ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


def probe(*args: str, cwd=None) -> tuple[int, list[str], str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], capture_output=True, text=True,
                         timeout=120, cwd=cwd)
    last = out.stderr.strip().splitlines()[-1]
    _, code, _, loaded = (last.split(" ", 3) + [""])[:4]
    return int(code), [m for m in loaded.split(",") if m], out.stdout + out.stderr


@pytest.mark.parametrize("args, needle", [
    (["train", "actor.lrr=1e-5"], "did you mean 'actor.lr'"),
    (["train", "rollout.n=0"], "rollout.n=0 is out of range"),
    (["train", "-c", "grpo_nope"], "no recipe named 'grpo_nope'"),
    (["config", "actor.lrr=1e-5"], "did you mean 'actor.lr'"),
    (["train", "trainer.logger=[console,mlflow,swanlab]"], "'swanlab' is one of verl's loggers"),
    # tensorboard / wandb are looked up (find_spec), not imported, when the config is checked
    (["train", "trainer.logger=[console,mlflow,tensorboard,wandb]", "rollout.n=0"], "rollout.n=0 is out of range"),
])
def test_a_config_error_imports_no_heavy_library(args, needle):
    code, loaded, text = probe(*args)
    assert code == 2 and needle in text, text
    assert loaded == [], f"a config error imported {loaded}"


def test_a_finished_run_says_nothing_to_do_without_heavy_libraries(tmp_path):
    cfg = load_config("smoke", [f"store.root={tmp_path}", "trainer.total_iterations=1"])
    store = RunStore(tmp_path, "done")
    store.run_dir.mkdir(parents=True)
    store.write_config(to_yaml(cfg))
    (store.run_dir / "run.json").write_text(json.dumps({"kind": "train", "recipe": "smoke"}))
    (store.run_dir / "checkpoints" / "000001").mkdir(parents=True)
    (store.run_dir / "checkpoints" / "000001" / "trainer_state.json").write_text("{}")
    store.final_dir.mkdir()
    code, loaded, text = probe("resume", "done", "--store", str(tmp_path))
    assert code == 0 and "run done already finished all its iterations (last checkpoint 000001): nothing to do" \
        in text, text
    assert loaded == [], f"resuming a finished run imported {loaded}"


def test_the_builtin_registry_names_are_the_registries():
    """The names a config is validated against without importing the registries are theirs."""
    import importlib

    from trajflow.config.rules import REGISTRIES
    from trajflow.stages.names import BUILTIN_REGISTRY_NAMES

    for kind, (module, attr) in REGISTRIES.items():
        registry = getattr(importlib.import_module(module), attr)
        assert tuple(sorted(registry.names())) == BUILTIN_REGISTRY_NAMES[kind], kind


def test_config_help_keys_lists_each_key_with_its_help():
    code, loaded, text = probe("config", "--help-keys")
    assert code == 0 and loaded == [], text
    lines = text.splitlines()
    assert "actor.lr (float, default 1e-05): AdamW learning rate [> 0.0]" in lines
    assert "rollout.n (int, default 4): samples per prompt (the GRPO group size) [>= 1]" in lines
