"""Bad input: one line naming the key/file/row and what was expected, exit code 2, no traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

TRAJFLOW = [str(Path(sys.executable).parent / "trajflow")]


def run_cli(*args, cwd=None):
    p = subprocess.run(TRAJFLOW + list(args), capture_output=True, text=True, timeout=120, cwd=cwd)
    return p.returncode, p.stdout, p.stderr


def assert_one_line_error(rc, err, *needles):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("override, needles", [
    ("actor.lrr=1e-5", ["actor.lrr", "did you mean 'actor.lr'"]),
    ("trainer.total_iteration=3", ["trainer.total_iteration", "trainer.total_iterations"]),
    ("actor.lr=fast", ["actor.lr", "'fast'", "float"]),
    ("rollout.n=0", ["rollout.n=0", ">= 1"]),
    ("rollout.top_p=1.5", ["rollout.top_p=1.5", "<= 1.0"]),
    ("algorithm.adv_estimator=grpoo", ["algorithm.adv_estimator", "grpo", "did you mean 'grpo'"]),
    ("actor", ["expected key=value"]),
])
def test_bad_config(override, needles):
    rc, _, err = run_cli("train", override)
    assert_one_line_error(rc, err, *needles)


def test_missing_recipe():
    rc, _, err = run_cli("train", "--config", "no_such_recipe")
    assert_one_line_error(rc, err, "no_such_recipe", "grpo_default")


def test_bad_model_path(tmp_path):
    rc, _, err = run_cli("train", f"model.path={tmp_path / 'nope'}", f"store.root={tmp_path / 'runs'}")
    assert_one_line_error(rc, err, "model.path", "nope")
    assert not (tmp_path / "runs").exists()


def test_row_without_prompt_names_file_and_row(tmp_path, tiny_model_dir):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
             "reward_model": {"ground_truth": "2"}},
            {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "3"}}]
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = tmp_path / "bad.yaml"
    spec.write_text(f"source: file\npath: {data}\n")
    rc, _, err = run_cli("train", f"data.dataset={spec}", f"model.path={tiny_model_dir}",
                         f"store.root={tmp_path / 'runs'}")
    assert_one_line_error(rc, err, "bad.jsonl", "2")
    assert not (tmp_path / "runs").exists()


def test_row_without_ground_truth(tmp_path, tiny_model_dir):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}]}]
    data = tmp_path / "nogt.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n")
    spec = tmp_path / "nogt.yaml"
    spec.write_text(f"source: file\npath: {data}\n")
    rc, _, err = run_cli("train", f"data.dataset={spec}", f"model.path={tiny_model_dir}",
                         f"store.root={tmp_path / 'runs'}")
    assert_one_line_error(rc, err, "nogt.jsonl", "ground")
