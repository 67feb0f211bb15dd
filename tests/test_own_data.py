"""Own data gets a recipe that fits it: verl's GSM8K and MATH layouts pick grpo_gsm8k / grpo_math
(response caps and rewards for worked solutions), the console names the cap and the reward shaping,
the shaping is in reward_extra, and a batch stuck at the overlong floor, or with no group whose scores
differ, is a warning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajflow.stages.reward import no_signal_warning, overlong_floor_warning, reward_table, shaping_penalties
from tests.test_verl_data import gsm8k_row, math_row, write_verl_parquet
from trajflow.config import load_config
from trajflow.prompts.shape import describe_recipe, detect_shape

TRAJFLOW = [str(Path(sys.executable).parent / "trajflow")]


def boxed_row(i: int, source: str = "my_olympiad") -> dict:
    """A MATH-style row whose data source is no known set: only its \\boxed{} prompt shows the shape."""
    return {"data_source": source,
            "prompt": [{"role": "user", "content": f"What is {i} + {i}? Put the final answer within \\boxed{{}}."}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i}}


def plain_row(i: int) -> dict:
    return {"data_source": "acme/riddles", "prompt": [{"role": "user", "content": f"Riddle {i}?"}],
            "ability": "riddle", "reward_model": {"style": "rule", "ground_truth": "egg"},
            "extra_info": {"split": "train", "index": i}}


@pytest.fixture
def gsm8k_files(tmp_path):
    # unknown data source on purpose for one row: the '####' solution still shows the shape
    rows = [gsm8k_row(i) for i in range(6)] + [{**gsm8k_row(7), "data_source": "my_gsm8k_copy"}]
    return (write_verl_parquet(tmp_path / "train.parquet", rows),
            write_verl_parquet(tmp_path / "test.parquet", [gsm8k_row(20, "test"), gsm8k_row(21, "test")]))


def test_own_data_picks_the_recipe_of_its_shape(tmp_path, gsm8k_files):
    train, test = gsm8k_files
    cfg = load_config(None, [f"data.train_files={train}", f"data.val_files={test}"])
    assert cfg.recipe == "grpo_gsm8k"
    assert cfg.rollout.max_new_tokens == 256 and not cfg.reward.overlong_buffer.enable
    assert cfg.reward.default_scorer == "math_verify"
    assert cfg.data.train_files == str(train)  # the user's overrides still win over the recipe
    shape = detect_shape(cfg.data)
    assert shape.name == "gsm8k" and shape.why == "data_source 'openai/gsm8k' in 6 of the first 7 rows"

    math = write_verl_parquet(tmp_path / "math.parquet", [math_row(i, "lighteval/MATH") for i in range(3)])
    assert load_config(None, [f"data.dataset={math}"]).recipe == "grpo_math"
    boxed = write_verl_parquet(tmp_path / "boxed.parquet", [boxed_row(i) for i in range(3)])
    cfg = load_config(None, [f"data.train_files={boxed}"])
    assert cfg.recipe == "grpo_math" and cfg.rollout.max_new_tokens == 512
    assert "'\\boxed{}' answers in 3 of the first 3 rows" in detect_shape(cfg.data).why
    jsonl = tmp_path / "boxed.jsonl"
    jsonl.write_text("".join(json.dumps(boxed_row(i)) + "\n" for i in range(2)))
    assert load_config(None, [f"data.train_files={jsonl}"]).recipe == "grpo_math"

    # a shape it does not know, an explicit recipe and a missing file keep the recipe they name
    plain = write_verl_parquet(tmp_path / "plain.parquet", [plain_row(i) for i in range(3)])
    assert load_config(None, [f"data.train_files={plain}"]).recipe == "grpo_default"
    assert load_config("grpo", [f"data.train_files={train}"]).recipe == "grpo"
    assert load_config(None, [f"data.train_files={tmp_path / 'nope.parquet'}"]).recipe == "grpo_default"
    assert load_config(None, []).recipe == "grpo_default"


def test_the_start_line_names_cap_shaping_and_shape(tmp_path, gsm8k_files):
    train, _ = gsm8k_files
    line = describe_recipe(load_config(None, [f"data.train_files={train}"]))
    assert line.startswith("recipe grpo_gsm8k (data.train_files: GSM8K shape, data_source 'openai/gsm8k' in 6 of "
                           "the first 7 rows): responses up to 256 tokens (rollout.max_new_tokens)")
    assert line.endswith("reward: scorer by data_source (else math_verify), no length shaping")
    plain = write_verl_parquet(tmp_path / "plain.parquet", [plain_row(i) for i in range(3)])
    line = describe_recipe(load_config(None, [f"data.train_files={plain}", "reward.scorer=exact_match"]))
    assert "recipe grpo_default (data.train_files: no GSM8K '####' or MATH '\\boxed{}' shape recognised" in line
    assert line.endswith("responses up to 64 tokens (rollout.max_new_tokens); reward: scorer exact_match for every "
                         "row, plus DAPO's overlong penalty over the last 16 tokens (0 down to -1 at the cap; "
                         "reward.overlong_buffer)")
    assert describe_recipe(load_config("smoke", [])).startswith("recipe smoke: responses up to 16 tokens")


def _rollout(lengths: list[int]) -> pa.Table:
    n = len(lengths)
    return pa.table({"sample_id": [f"s{i}" for i in range(n)],
                     "response_ids": pa.array([[5] * k for k in lengths], pa.list_(pa.int32())),
                     "rollout_logprobs": pa.array([[-1.0] * k for k in lengths], pa.list_(pa.float32()))})


def test_shaping_is_recorded_per_row_and_the_floor_is_a_warning():
    reward_cfg = {"overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 0.5}}
    # L_max 8, L_cache 4: |y| <= 4 -> 0; 6 -> (4 - 6) / 4 * 0.5 = -0.25; 8 -> -0.5 (DAPO eq. 13)
    table, _ = reward_table(_rollout([3, 6, 8]), np.array([1.0, 0.0, 1.0]), [{"acc": 1.0}, {}, {"acc": 1.0}],
                            ref_logprobs=None, reward_cfg=reward_cfg, algorithm_cfg={}, max_new_tokens=8,
                            kl_coef=0.0)
    extras = [json.loads(x) for x in table.column("reward_extra").to_pylist()]
    assert extras == [{"acc": 1.0, "overlong_penalty": 0.0}, {"overlong_penalty": -0.25},
                      {"acc": 1.0, "overlong_penalty": -0.5}]
    assert table.column("score").to_pylist() == [1.0, -0.25, 0.5]
    off, _ = reward_table(_rollout([8]), np.array([0.0]), [{}], ref_logprobs=None,
                          reward_cfg={"overlong_buffer": {"enable": False}}, algorithm_cfg={}, max_new_tokens=8,
                          kl_coef=0.0)
    assert json.loads(off.column("reward_extra")[0].as_py()) == {}

    pen = shaping_penalties(np.array([8, 9, 8]), reward_cfg, 8)
    assert pen.tolist() == [-0.5, -0.5, -0.5]
    msg = overlong_floor_warning(np.full(3, -0.5), pen, reward_cfg, 8)
    assert msg.startswith("all 3 scores are -0.500, the overlong floor: every response reached "
                          "rollout.max_new_tokens=8 and got the full overlong penalty -0.5")
    assert overlong_floor_warning(np.array([-0.5, 0.5, -0.5]), pen, reward_cfg, 8) is None  # a right answer
    assert overlong_floor_warning(np.full(3, -0.25), np.full(3, -0.25), reward_cfg, 8) is None  # not at the cap
    assert overlong_floor_warning(np.zeros(3), None, reward_cfg, 8) is None  # no shaping


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk")


def _advantages(name: str, scores: list[float], groups: list[str]):
    """The registered estimator's advantages for one-token responses carrying ``scores``."""
    import torch

    from trajflow.stages.advantage import ADV_ESTIMATORS, AdvantageConfig

    rewards = torch.tensor(scores, dtype=torch.float32).unsqueeze(-1)
    return ADV_ESTIMATORS.get(name)(rewards, torch.ones_like(rewards), groups, AdvantageConfig())[0]


def test_a_batch_without_learning_signal_is_a_warning():
    groups = ["a", "a", "b", "b", "c", "c"]
    msg = no_signal_warning(np.zeros(6), groups, "grpo", run_id="grpo_gsm8k-1", iteration=2)
    assert msg == ("all 6 scores are 0.000, so with grpo's group baseline every advantage is 0 and nothing is "
                   "learnt from this batch. Likely: the reward never matches the model's answers (compare "
                   "response_text with ground_truth and reward_extra: `trajflow audit grpo_gsm8k-1 --where "
                   "\"iteration = 2\" -f json`, or the dashboard's trajectories; the math scorers read '#### 42', "
                   "'Answer: 42' or \\boxed{42}), or the task is too hard (or too easy) for the model: easier data, "
                   "more samples per prompt (rollout.n), a higher rollout.temperature")
    equal_per_group = [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    msg = no_signal_warning(np.array(equal_per_group), groups, "rloo", run_id="r", iteration=1, store="/data/runs")
    assert msg.startswith("each of the 3 groups has equal scores (0.000 in 2, 1.000 in 1), so with rloo's group "
                          "baseline every advantage is 0")
    assert "`trajflow audit r --where \"iteration = 1\" -f json --store /data/runs`" in msg
    one_differs = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert no_signal_warning(np.array(one_differs), groups, "grpo", run_id="r", iteration=1) is None
    # exact equality, as the estimators' all_equal: a difference of 1e-7 is still a signal
    assert no_signal_warning(np.array([0.0, 1e-7, 0, 0, 0, 0]), groups, "grpo", run_id="r", iteration=1) is None
    # the line's claim, checked against every group-baseline estimator: all advantages 0 exactly when it warns
    for name in GROUP_ESTIMATORS:
        assert not _advantages(name, equal_per_group, groups).any(), name
        assert _advantages(name, one_differs, groups).any(), name
        assert no_signal_warning(np.zeros(6), groups, name, run_id="r", iteration=1) is not None, name
    # a critic, a batch-wide whitening, a greedy baseline or a teacher still give a signal: no line
    for name in ("gae", "reinforce_plus_plus", "remax", "opd"):
        assert no_signal_warning(np.zeros(6), groups, name, run_id="r", iteration=1) is None, name
    assert _advantages("reinforce_plus_plus", equal_per_group, groups).any()  # groups differ from each other
    # with the KL penalty in the reward the advantages are not 0, but the reward teaches nothing
    kl = no_signal_warning(np.zeros(6), groups, "grpo", run_id="r", iteration=1, kl_in_reward=True)
    assert "the advantages carry only the KL penalty (algorithm.use_kl_in_reward) and nothing is learnt from the " \
           "reward" in kl
    # a NaN is the gate's to report; an empty batch has nothing to say
    assert no_signal_warning(np.array([0.0, np.nan]), ["a", "a"], "grpo", run_id="r", iteration=1) is None
    assert no_signal_warning(np.zeros(0), [], "grpo", run_id="r", iteration=1) is None
    with pytest.raises(ValueError, match="group_ids has 2 entries for 3 scores"):
        no_signal_warning(np.zeros(3), ["a", "a"], "grpo", run_id="r", iteration=1)
    with pytest.raises(ValueError, match="grpoo"):
        no_signal_warning(np.zeros(2), ["a", "a"], "grpoo", run_id="r", iteration=1)
    # the overlong floor is all-equal too: the flow prints the floor's own, more specific line instead
    pen = np.full(4, -1.0)
    floor_cfg = {"overlong_buffer": {"enable": True, "len": 6, "penalty_factor": 1.0}}
    assert overlong_floor_warning(np.full(4, -1.0), pen, floor_cfg, 6) is not None
    assert no_signal_warning(np.full(4, -1.0), ["a", "a", "b", "b"], "grpo", run_id="r", iteration=1) is not None


def test_own_gsm8k_parquet_trains_end_to_end(tmp_path, tiny_model_dir, gsm8k_files):
    """The README's "train on your own verl parquet": no recipe named, the GSM8K recipe chosen and said;
    with the default's shaping forced back on, a random model's cut responses hit the floor and say so."""
    train, test = gsm8k_files
    root = tmp_path / "runs"
    p = subprocess.run(TRAJFLOW + ["train", f"data.train_files={train}", f"data.val_files={test}",
                                   f"model.path={tiny_model_dir}", f"store.root={root}", "rollout.max_new_tokens=6",
                                   "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=6",
                                   "data.train_batch_size=2", "rollout.n=2", "trainer.total_iterations=1",
                                   "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.progress=false",
                                   "gates.enabled=false", "actor.mixed_precision.param_dtype=float32",
                                   "rollout.dtype=float32", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert ("recipe grpo_gsm8k (data.train_files: GSM8K shape, data_source 'openai/gsm8k' in 6 of the first 7 rows): "
            "responses up to 6 tokens (rollout.max_new_tokens); reward: scorer by data_source (else math_verify), "
            "plus DAPO's overlong penalty over the last 6 tokens") in p.stdout
    (run_dir,) = [d for d in root.iterdir() if d.is_dir()]
    assert run_dir.name.startswith("grpo_gsm8k-")
    reward = pq.read_table(run_dir / "iterations" / "000001" / "reward.parquet")
    rollout = pq.read_table(run_dir / "iterations" / "000001" / "rollout.parquet")
    lengths = [len(r) for r in rollout.column("response_ids").to_pylist()]
    extras = [json.loads(x) for x in reward.column("reward_extra").to_pylist()]
    # (L_max - L_cache - |y|) / L_cache with L_max = L_cache = 6: -|y| / 6
    assert [e["overlong_penalty"] for e in extras] == pytest.approx([-n / 6 for n in lengths], abs=1e-6)
    assert lengths == [6] * 4 and reward.column("score").to_pylist() == [-1.0] * 4  # a random model: cut, wrong
    assert "warning: iteration 1: all 4 scores are -1.000, the overlong floor" in p.stderr
    assert "group baseline" not in p.stderr  # the floor's line only, not also the general no-signal line
    # Disk: the recipe's trainer.save_freq=0 writes no checkpoint; the final model is in MLflow by
    # reference (a LoggedModel pointing at final/), not copied into the artifact store.
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    assert (run_dir / "final" / "model.safetensors").exists()
    assert not list((tmp_path / "mlartifacts").rglob("*.safetensors"))
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow_run = client.get_run(json.loads((run_dir / "run.json").read_text())["mlflow_run_id"])
    model = client.get_logged_model(mlflow_run.data.tags["trajflow.model_id"])
    assert str(model.status) == "READY" and model.tags["trajflow.model_path"] == str((run_dir / "final").resolve())
    assert {m.key for m in model.metrics} >= {"critic/score/mean", "actor/pg_loss"}
    # ... so there is nothing to continue from: asking for more iterations is one line, not a restart
    more = subprocess.run(TRAJFLOW + ["resume", run_dir.name, "trainer.total_iterations=2", "--store", str(root),
                                      f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert more.returncode == 2 and more.stderr.strip() == (
        f"error: run {run_dir.name!r} finished 1 iterations with trainer.save_freq=0: it has no checkpoint to "
        f"continue from; train a new run from its final model (model.path={run_dir / 'final'})"), more.stderr
