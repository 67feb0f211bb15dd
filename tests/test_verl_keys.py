"""verl command lines as typed: verl's keys are aliases of trajflow's (docs/config.md's mapping), its
machinery-only keys are dropped with a note, and ``custom_reward_function`` defaults to
``compute_score``. The command lines are verl's own GRPO examples (examples/grpo_trainer/), minus
the data and model paths."""

from __future__ import annotations

import pytest

from trajflow.config import load_config
from trajflow.config.verl_keys import translate_verl_keys
from trajflow.errors import ConfigError

# verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh, the keys trajflow shares or maps
# (the data files, the model and the W&B logger left out: the test has neither).
VERL_GRPO = """
    algorithm.adv_estimator=grpo
    data.train_batch_size=8
    data.max_prompt_length=512
    data.max_response_length=32
    data.filter_overlong_prompts=True
    data.truncation='error'
    data.shuffle=False
    actor_rollout_ref.model.use_shm=True
    actor_rollout_ref.actor.optim.lr=3e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.load_format=safetensors
    actor_rollout_ref.rollout.layered_summon=True
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
""".split()


def test_a_verl_grpo_command_line_loads_with_trajflow_keys(capsys):
    cfg = load_config(None, VERL_GRPO)
    assert cfg.actor.lr == 3e-6
    assert cfg.rollout.n == 5 and cfg.rollout.max_new_tokens == 32
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size) == (4, 2)
    assert (cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type, cfg.actor.entropy_coeff) == (0.001, "low_var_kl", 0)
    assert cfg.model.gradient_checkpointing is True
    assert (cfg.data.train_batch_size, cfg.trainer.save_freq, cfg.trainer.test_freq) == (8, 20, 5)
    out = capsys.readouterr().out
    assert "verl key actor_rollout_ref.actor.optim.lr -> actor.lr" in out
    assert "verl key actor_rollout_ref.rollout.tensor_model_parallel_size: no effect in trajflow" in out
    load_config(None, VERL_GRPO)
    assert "optim.lr" not in capsys.readouterr().out  # each key is said once per process


def test_use_kl_loss_false_turns_the_kl_loss_off():
    cfg = load_config(None, ["actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.use_kl_loss=False"])
    assert cfg.actor.kl_loss_coef == 0


def test_custom_reward_function_defaults_to_compute_score(tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    assert load_config(None, [f"reward.custom_function={reward}"]).reward.custom_function == f"{reward}:compute_score"
    assert translate_verl_keys([f"custom_reward_function.path={reward}"]) == [
        f"reward.custom_function={reward}:compute_score"]
    cfg = load_config(None, [f"custom_reward_function.path={reward}", "custom_reward_function.name=other"])
    assert cfg.reward.custom_function == f"{reward}:other"


@pytest.mark.parametrize("override, message", [
    ("trainer.total_epochs=15", "trajflow counts iterations"),
    ("custom_reward_function.name=f", "needs custom_reward_function.path"),
    ("actor_rollout_ref.actor.optim.lrr=1e-5", "unknown verl key actor_rollout_ref.actor.optim.lrr \\(did you mean "
                                               "actor_rollout_ref.actor.optim.lr, trajflow's actor.lr\\?\\)"),
])
def test_verl_keys_without_a_meaning_here_are_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_batch_larger_than_the_files_names_the_files(tmp_path):
    """With verl's data.train_files, the batch-size error names them, not data.dataset's unused default."""
    from tests.test_verl_data import gsm8k_row, write_verl_parquet
    from trajflow.prompts import data_spec, load_prompt_dataset
    from trajflow.run.preflight import check_batch_size

    train = write_verl_parquet(tmp_path / "train.parquet", [gsm8k_row(i) for i in range(3)])
    cfg = load_config("smoke", [f"data.train_files={train}", "data.train_batch_size=8"])
    with pytest.raises(ConfigError, match=r"larger than the \d+ training prompts of data\.train_files=") as e:
        check_batch_size(cfg, load_prompt_dataset(data_spec(cfg.data)))
    assert str(train) in str(e.value) and "basic_arithmetic" not in str(e.value)
