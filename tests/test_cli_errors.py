"""Bad input: one line naming the key/file/row and what was expected, exit code 2, no traceback."""

import json
import os
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
    ("rollout=5", ["override 'rollout=5'", "rollout is a config section, not a value", "rollout."]),
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


def test_config_check_finds_what_train_would(tmp_path):
    missing = str(tmp_path / "no_such_dataset.yaml")
    rc, out, err = run_cli("config", f"data.dataset={missing}")
    assert rc == 0 and f"dataset: {missing}" in out, err  # keys and types only
    rc, out, err = run_cli("config", f"data.dataset={missing}", "--check")
    assert_one_line_error(rc, err, "no_such_dataset.yaml")
    assert out == ""


def test_broken_or_empty_recipe_is_one_line_with_where(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("actor: [1, 2\nrollout: {}\n")  # the flow sequence never closes: caught on line 2
    rc, _, err = run_cli("config", "-c", str(broken))
    assert_one_line_error(rc, err, str(broken), "not valid YAML at line 2, column 8")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    rc, _, err = run_cli("config", "-c", str(empty))
    assert_one_line_error(rc, err, str(empty), "the recipe is empty")


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


def _error_line(rc, err, *needles):
    """Exit 2, no traceback, one ``error:`` line containing ``needles`` (libraries may log INFO lines)."""
    assert rc == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.mark.parametrize("case", ["custom_missing", "custom_syntax", "custom_no_function", "suite_missing",
                                  "suite_malformed", "policy_unknown", "score_min_nan", "betas", "weights"])
def test_preflight_rejects_before_anything_starts(tmp_path, tiny_model_dir, case):
    """Each is found by ``preflight``: one line, and no run folder, Prefect or Ray was started."""
    import shutil

    (tmp_path / "syntax.py").write_text("def score(:\n")
    (tmp_path / "ok.py").write_text("def score(data_source, solution_str, ground_truth, extra_info):\n    return 0.0\n")
    (tmp_path / "bad.json").write_text("{not json")
    model = tiny_model_dir
    if case == "weights":
        model = tmp_path / "model"
        shutil.copytree(tiny_model_dir, model)
        next(model.glob("*.safetensors")).write_bytes(b"\x00garbage" * 8)
    overrides, needles = {
        "custom_missing": (f"reward.custom_function={tmp_path}/nope.py:score", ["nope.py"]),
        "custom_syntax": (f"reward.custom_function={tmp_path}/syntax.py:score", ["syntax.py", "SyntaxError"]),
        "custom_no_function": (f"reward.custom_function={tmp_path}/ok.py:nosuch", ["nosuch"]),
        "suite_missing": (f"gates.suite={tmp_path}/nosuch.json", ["nosuch.json"]),
        "suite_malformed": (f"gates.suite={tmp_path}/bad.json", ["bad.json", "JSON"]),
        "policy_unknown": ("gates.policies={nosuch_gate: fail}", ["nosuch_gate"]),
        "score_min_nan": ("gates.score_min=nan", ["gates.score_min"]),
        "betas": ("actor.betas=[2,3]", ["actor.betas"]),
        "weights": ("trainer.seed=0", ["model.safetensors"]),
    }[case]
    rc, out, err = run_cli("train", f"model.path={model}", f"store.root={tmp_path / 'runs'}", "gates.enabled=true",
                           overrides)
    _error_line(rc, err, *needles)
    assert not (tmp_path / "runs").exists()
    assert "Starting temporary server" not in out + err


@pytest.mark.parametrize("case", [
    pytest.param("readonly", marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only folders")),
    "not_a_dir"])
def test_unusable_store_root_is_one_line(tmp_path, tiny_model_dir, case):
    root = tmp_path / "root"
    if case == "readonly":
        root.mkdir()
        root.chmod(0o555)
    else:
        root.write_text("a file")
    try:
        rc, _, err = run_cli("train", f"model.path={tiny_model_dir}", f"store.root={root / 'runs'}")
        _error_line(rc, err, "store.root", str(root))
    finally:
        if case == "readonly":
            root.chmod(0o755)


def test_non_utf8_dataset_names_file_and_line(tmp_path, tiny_model_dir):
    data = tmp_path / "latin1.jsonl"
    good = json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
                       "reward_model": {"ground_truth": "2"}})
    data.write_bytes(good.encode() + b"\n" + good.replace("1+1", "caf\u00e9").encode("latin-1") + b"\n")
    spec = tmp_path / "latin1.yaml"
    spec.write_text(f"source: file\npath: {data}\n")
    rc, _, err = run_cli("train", f"data.dataset={spec}", f"model.path={tiny_model_dir}",
                         f"store.root={tmp_path / 'runs'}")
    _error_line(rc, err, str(data), "line 2", "UTF-8")


@pytest.mark.parametrize("override", ["model.path=${oc.env:NO_SUCH_TRAJFLOW_VAR}", "trainer.run_id=${oc.env:HOME}"])
def test_interpolation_in_override_is_one_line(tmp_path, override):
    rc, _, err = run_cli("train", override, f"store.root={tmp_path / 'runs'}")
    _error_line(rc, err, override, "interpolations")


def test_overlong_run_id_is_one_line(tmp_path, tiny_model_dir):
    rc, _, err = run_cli("train", f"model.path={tiny_model_dir}", f"store.root={tmp_path / 'runs'}",
                         "--run-id", "r" * 300)
    _error_line(rc, err, "300 bytes", "at most 200")


def test_failed_gate_prints_its_line_once_without_traceback(tmp_path, tiny_model_dir):
    """A real training run whose reward gate fails: exit 3, the failure said once, as one line."""
    from tests.conftest import tiny_overrides

    overrides = tiny_overrides(tiny_model_dir, tmp_path / "runs", **{
        "gates.enabled": True, "gates.score_min": 5.0, "trainer.total_iterations": 1, "trainer.test_freq": 0})
    p = subprocess.run(TRAJFLOW + ["train", "--run-id", "g1"] + overrides, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 3, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr, p.stderr[-3000:]
    assert (p.stdout + p.stderr).count("failed its reward gate") == 1, p.stderr[-3000:]
    # Prefect's task and flow lines (their final states included) are in the run's log file only.
    assert "Finished in state" not in p.stdout + p.stderr, p.stderr[-3000:]
    assert "Finished in state Failed" in (tmp_path / "runs" / "g1" / "logs" / "driver.log").read_text()
    [line] = [ln for ln in p.stderr.splitlines() if "failed its reward gate" in ln]
    assert line.startswith("gate failed: iteration 1 of run g1") and "score_in_range" in line, line


def _jsonl_spec(tmp_path, prompts: list[str], name: str = "prompts") -> Path:
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": p}],
                                        "reward_model": {"ground_truth": "2"}}) + "\n" for p in prompts))
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(f"source: file\npath: {data}\n")
    return spec


def _train_refused(tmp_path, tiny_model_dir, *overrides):
    """``trajflow train`` on the tiny model; returns (rc, stderr) after checking that nothing started."""
    rc, out, err = run_cli("train", f"model.path={tiny_model_dir}", f"store.root={tmp_path / 'runs'}", *overrides)
    assert not (tmp_path / "runs").exists(), "a run folder was created"
    assert "Starting temporary server" not in out + err
    return rc, err


def test_prompt_past_the_models_context_names_file_line_and_keys(tmp_path, tiny_model_dir):
    """The tiny model's context is 1024 positions: a ~1000-token prompt fits data.max_prompt_length=1500
    but not with 32 new tokens after it."""
    spec = _jsonl_spec(tmp_path, ["1+1?", "one " * 1000, "2+2?"], name="long")
    rc, err = _train_refused(tmp_path, tiny_model_dir, f"data.dataset={spec}", "data.max_prompt_length=1500",
                             "rollout.max_new_tokens=32", "data.train_batch_size=2",
                             "trainer.total_iterations=1")
    assert_one_line_error(rc, err, "long.jsonl: line 2 (1-based)", "rollout.max_new_tokens=32",
                          "max_position_embeddings=1024", "model.path")


def test_prompt_over_max_prompt_length_in_a_generated_dataset_names_the_prompt_id(tmp_path, tiny_model_dir):
    """The default recipe's generated prompts are ~85 tokens with SmolLM2's chat template."""
    rc, err = _train_refused(tmp_path, tiny_model_dir, "data.max_prompt_length=20")
    assert_one_line_error(rc, err, "basic_arithmetic.yaml", "generated prompt basic_arithmetic:train:0",
                          "data.max_prompt_length=20")


def test_train_batch_larger_than_the_dataset_names_both_numbers(tmp_path, tiny_model_dir):
    spec = _jsonl_spec(tmp_path, ["1+1?", "2+2?", "3+3?"], name="three")
    rc, err = _train_refused(tmp_path, tiny_model_dir, f"data.dataset={spec}", "data.train_batch_size=4")
    assert_one_line_error(rc, err, "data.train_batch_size=4", "3 training prompts", "three.yaml")


def _copy_with_template(tmp_path, tiny_model_dir, name, template):
    import shutil

    model = tmp_path / name
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def test_prompts_of_a_tokenizer_without_chat_template_are_measured_in_the_plain_format(tmp_path, tiny_model_dir):
    """A base model's tokenizer has no chat template: prompts are rendered "user: ...\nassistant:"
    (docs/models.md), and that is the length preflight checks."""
    from transformers import AutoTokenizer

    from trajflow.config import load_config
    from trajflow.errors import DataError
    from trajflow.prompts import load_prompt_dataset
    from trajflow.run.preflight import check_prompt_lengths

    model = _copy_with_template(tmp_path, tiny_model_dir, "no-template", None)
    spec = _jsonl_spec(tmp_path, ["1+1?"])
    n = len(AutoTokenizer.from_pretrained(model)("user: 1+1?\nassistant:")["input_ids"])
    ok = load_config(None, [f"model.path={model}", f"data.dataset={spec}", "data.train_batch_size=1",
                            f"data.max_prompt_length={n}"])
    check_prompt_lengths(ok, load_prompt_dataset(spec), model)
    short = load_config(None, [f"model.path={model}", f"data.dataset={spec}", "data.train_batch_size=1",
                               f"data.max_prompt_length={n - 1}"])
    with pytest.raises(DataError, match=rf"the prompt is {n} tokens as the policy renders it"):
        check_prompt_lengths(short, load_prompt_dataset(spec), model)


def test_tokenizer_whose_chat_template_fails_is_one_line(tmp_path, tiny_model_dir):
    from trajflow.config import load_config
    from trajflow.errors import ModelLoadError
    from trajflow.prompts import load_prompt_dataset
    from trajflow.run.preflight import check_prompt_lengths

    model = _copy_with_template(tmp_path, tiny_model_dir, "bad-template", "{{ raise_exception('no roles here') }}")
    spec = _jsonl_spec(tmp_path, ["1+1?"])
    cfg = load_config(None, [f"model.path={model}", f"data.dataset={spec}", "data.train_batch_size=1"])
    with pytest.raises(ModelLoadError, match=r"model.path=.*bad-template.*cannot render the prompts") as e:
        check_prompt_lengths(cfg, load_prompt_dataset(spec), model)
    assert "\n" not in str(e.value)
