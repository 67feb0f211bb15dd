"""verl's config keys, accepted as aliases of trajflow's so that a verl command line works as typed.

The table is docs/config.md's "Mapping to verl and TRL": each verl key that has a trajflow key is
rewritten to it before the config is built, and the console says so once per key
(``verl key actor_rollout_ref.actor.optim.lr -> actor.lr``). verl keys that only tune verl's own
machinery (GPU memory share, tensor parallelism, offload, padding removal) have no effect here: they
are dropped with a note naming them. A verl key whose meaning differs (``trainer.total_epochs``, the
nearest trajflow key of ``rollout.max_num_seqs``, verl's agent loop and interaction configs, its
fully async trainer) is refused with what to write instead. Anything else is left to the config's own checks.
"""

from __future__ import annotations

import difflib
from typing import Sequence

from trajflow.errors import ConfigError

ARR = "actor_rollout_ref."

#: verl key -> trajflow key (docs/config.md, "Mapping to verl and TRL").
ALIASES: dict[str, str] = {
    "data.max_response_length": "rollout.max_new_tokens",
    ARR + "model.path": "model.path",
    ARR + "model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    ARR + "model.lora_rank": "model.lora_rank",
    ARR + "model.lora_alpha": "model.lora_alpha",
    ARR + "model.target_modules": "model.target_modules",
    ARR + "rollout.n": "rollout.n",
    ARR + "rollout.temperature": "rollout.temperature",
    ARR + "rollout.top_p": "rollout.top_p",
    ARR + "rollout.top_k": "rollout.top_k",
    ARR + "rollout.name": "rollout.engine",
    ARR + "rollout.dtype": "rollout.dtype",
    ARR + "rollout.val_kwargs.n": "rollout.val_n",
    ARR + "rollout.val_kwargs.temperature": "rollout.val_temperature",
    ARR + "rollout.multi_turn.enable": "rollout.multi_turn.enable",
    ARR + "rollout.multi_turn.max_assistant_turns": "rollout.multi_turn.max_assistant_turns",
    ARR + "rollout.multi_turn.max_user_turns": "rollout.multi_turn.max_user_turns",
    ARR + "rollout.multi_turn.max_tool_response_length": "rollout.multi_turn.max_tool_response_length",
    ARR + "rollout.multi_turn.tool_config_path": "rollout.multi_turn.tool_config_path",
    ARR + "rollout.multi_turn.format": "rollout.multi_turn.format",
    ARR + "actor.optim.lr": "actor.lr",
    ARR + "actor.strategy": "actor.strategy",
    ARR + "actor.policy_loss.loss_mode": "actor.policy_loss",
    ARR + "actor.clip_ratio_low": "actor.clip_ratio_low",
    ARR + "actor.clip_ratio_high": "actor.clip_ratio_high",
    ARR + "actor.clip_ratio_c": "actor.clip_ratio_c",
    ARR + "actor.loss_agg_mode": "actor.loss_agg_mode",
    ARR + "actor.kl_loss_coef": "actor.kl_loss_coef",
    ARR + "actor.kl_loss_type": "actor.kl_loss_type",
    ARR + "actor.entropy_coeff": "actor.entropy_coeff",
    ARR + "actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    ARR + "actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    ARR + "actor.ppo_micro_batch_size": "actor.ppo_micro_batch_size",  # verl's older, global spelling
    ARR + "actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    ARR + "actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    ARR + "actor.ppo_epochs": "actor.ppo_epochs",
    ARR + "actor.grad_clip": "actor.grad_clip",
    ARR + "actor.fsdp_config.reshard_after_forward": "actor.fsdp.reshard_after_forward",
    ARR + "actor.fsdp_config.fsdp_size": "actor.fsdp.fsdp_size",
    ARR + "actor.fsdp_config.mixed_precision.param_dtype": "actor.mixed_precision.param_dtype",
    ARR + "actor.fsdp_config.mixed_precision.reduce_dtype": "actor.mixed_precision.reduce_dtype",
    ARR + "actor.fsdp_config.mixed_precision.buffer_dtype": "actor.mixed_precision.buffer_dtype",
    ARR + "actor.fsdp_config.offload_policy": "actor.fsdp.offload_params",  # FSDP2's CPUOffloadPolicy, both
    ARR + "actor.optim.lr_warmup_steps_ratio": "actor.lr_warmup_steps_ratio",
    ARR + "actor.optim.lr_warmup_steps": "actor.lr_warmup_steps",
    ARR + "actor.optim.warmup_style": "actor.warmup_style",
    ARR + "actor.optim.min_lr_ratio": "actor.min_lr_ratio",
    ARR + "ref.strategy": "reference.strategy",
    ARR + "ref.fsdp_config.reshard_after_forward": "reference.fsdp.reshard_after_forward",
    ARR + "ref.fsdp_config.fsdp_size": "reference.fsdp.fsdp_size",
    ARR + "ref.fsdp_config.offload_policy": "reference.fsdp.offload_params",
    ARR + "ref.fsdp_config.mixed_precision.param_dtype": "reference.mixed_precision.param_dtype",
    ARR + "ref.fsdp_config.mixed_precision.reduce_dtype": "reference.mixed_precision.reduce_dtype",
    ARR + "ref.fsdp_config.mixed_precision.buffer_dtype": "reference.mixed_precision.buffer_dtype",
    "critic.model.fsdp_config.mixed_precision.param_dtype": "critic.mixed_precision.param_dtype",
    "critic.model.fsdp_config.mixed_precision.reduce_dtype": "critic.mixed_precision.reduce_dtype",
    "critic.model.fsdp_config.mixed_precision.buffer_dtype": "critic.mixed_precision.buffer_dtype",
    "critic.model.path": "critic.path",
    "critic.optim.lr": "critic.lr",
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size",
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.model.path": "reward.reward_model.path",
    "reward_model.micro_batch_size_per_gpu": "reward.reward_model.micro_batch_size",
    "reward_model.max_length": "reward.reward_model.max_length",
    "reward_model.overlong_buffer.enable": "reward.overlong_buffer.enable",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_buffer.penalty_factor",
    "algorithm.rollout_correction.rollout_is": "algorithm.rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_is_threshold",
    "algorithm.rollout_correction.rollout_rs": "algorithm.rollout_rs",
    "algorithm.rollout_correction.rollout_rs_threshold": "algorithm.rollout_rs_threshold",
    "algorithm.rollout_correction.rollout_rs_threshold_lower": "algorithm.rollout_rs_threshold_lower",
    "trainer.total_training_steps": "trainer.total_iterations",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints",
    "trainer.max_critic_ckpt_to_keep": "trainer.max_checkpoints",  # one checkpoint holds both roles here
}

#: verl keys that tune only verl's own machinery (devices, memory, offload, padding removal): no
#: effect in trajflow, dropped with a note. Matched as prefixes of the key.
NO_EFFECT: tuple[str, ...] = (
    ARR + "rollout.tensor_model_parallel_size", ARR + "rollout.gpu_memory_utilization",
    ARR + "rollout.log_prob_micro_batch_size", ARR + "ref.log_prob_micro_batch_size",
    ARR + "rollout.load_format", ARR + "rollout.layered_summon", ARR + "rollout.enforce_eager",
    ARR + "rollout.free_cache_engine", ARR + "model.use_remove_padding", ARR + "model.use_shm",
    ARR + "actor.fsdp_config.param_offload", ARR + "actor.fsdp_config.optimizer_offload",
    ARR + "actor.fsdp_config.grad_offload", ARR + "ref.fsdp_config.param_offload",
    ARR + "actor.ulysses_sequence_parallel_size",
    "critic.model.fsdp_config.param_offload", "critic.model.fsdp_config.optimizer_offload",
    "critic.model.use_remove_padding", "data.filter_overlong_prompts", "data.truncation", "data.shuffle",
    "trainer.n_gpus_per_node", "trainer.nnodes", "trainer.critic_warmup",
    "trainer.default_local_dir",
)

#: verl keys whose meaning differs from any trajflow key: refused with what to write instead.
REFUSED: dict[str, str] = {
    "trainer.total_epochs": "trajflow counts iterations (one batch of data.train_batch_size prompts each): set "
                            "trainer.total_iterations (epochs x training prompts / data.train_batch_size)",
    # The nearest trajflow key means something else (docs/config.md's table says how): named, not rewritten.
    ARR + "rollout.max_num_seqs": "vLLM's scheduler limit is not set by trajflow; the hf engine's decode slots are "
                                  "rollout.micro_batch_size",
    ARR + "rollout.multi_turn.interaction_config_path": "trajflow's environments are named by "
                                                        "rollout.multi_turn.environment (a registered name or "
                                                        "module:factory; docs/multi-turn.md)",
    ARR + "rollout.multi_turn.max_parallel_calls": "trajflow bounds tool calls across the whole batch: "
                                                   "rollout.multi_turn.tool_workers",
    ARR + "rollout.agent.agent_loop_config_path": "your own agent is rollout.agent=module:function, run against "
                                                  "the endpoint the rollout serves (docs/agents.md)",
}
#: verl keys (and sections) that trajflow has no counterpart for, refused like REFUSED (matched as prefixes).
REFUSED_SECTIONS: dict[str, str] = {
    ARR + "model.override_config": "trajflow does not override the model's config.json (edit the file); the weights "
                                   "are float32 master weights, the compute dtype is actor.mixed_precision.param_dtype "
                                   "and the sampler's rollout.dtype",
    "async_training.": "trajflow's asynchronous training is trainer.max_staleness and trainer.partial_rollout "
                       "(docs/overlap.md, docs/partial_rollout.md)",
}

#: Top-level sections only verl has: a key under them that is in none of the tables above is named
#: with the closest verl key we know (the config's own check would name only the section).
VERL_SECTIONS = (ARR, "reward_model.", "custom_reward_function.")

_SAID: set[str] = set()


def _say(line: str) -> None:
    if line not in _SAID:  # once per process: a resume, a replay and the flow load the config again
        _SAID.add(line)
        print(line, flush=True)


def translate_verl_keys(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with verl's keys rewritten to trajflow's (see the module docstring).

    ``actor_rollout_ref.actor.use_kl_loss=False`` becomes ``actor.kl_loss_coef=0`` (trajflow's KL loss
    is on when its coefficient is > 0); ``custom_reward_function.path`` and ``.name`` become
    ``reward.custom_function=<path>:<name>`` (``name`` defaults to ``compute_score``, as in verl).

    Raises:
        ConfigError: a verl key with another meaning (``trainer.total_epochs``), named with what to use.
    """
    out: list[str] = []
    reward_path = reward_name = None
    kl_off = False
    for o in overrides:
        if "=" not in o:
            out.append(o)  # load_config names it
            continue
        key, value = o.split("=", 1)
        key = key.strip().lstrip("+")  # Hydra's "+key=value" (add a key) is plain assignment here
        if key in ALIASES:
            _say(f"verl key {key} -> {ALIASES[key]}")
            out.append(f"{ALIASES[key]}={value}")
        elif key == ARR + "actor.use_kl_loss":
            _say(f"verl key {key}: the KL loss is on when actor.kl_loss_coef > 0")
            kl_off = value.strip().lower() in ("false", "0", "no")
        elif key == "custom_reward_function.path":
            reward_path = value
        elif key == "custom_reward_function.name":
            reward_name = value
        elif key in REFUSED:
            raise ConfigError(f"override {o!r}: {REFUSED[key]}")
        elif key.startswith(tuple(REFUSED_SECTIONS)):
            why = next(v for k, v in REFUSED_SECTIONS.items() if key.startswith(k))
            raise ConfigError(f"override {o!r}: verl key {key}: {why}")
        elif key.startswith(NO_EFFECT):
            _say(f"verl key {key}: no effect in trajflow (verl's own devices, memory or offload setting), ignored")
        elif key.startswith(VERL_SECTIONS):
            known = [*ALIASES, ARR + "actor.use_kl_loss", "custom_reward_function.path", "custom_reward_function.name"]
            close = difflib.get_close_matches(key, known, n=1)
            hint = (f" (did you mean {close[0]}, trajflow's {ALIASES.get(close[0], close[0])}?)" if close else
                    " (docs/config.md maps verl's keys to trajflow's)")
            raise ConfigError(f"override {o!r}: unknown verl key {key}{hint}")
        else:
            out.append(o)
    if kl_off:
        out.append("actor.kl_loss_coef=0")
    if reward_path is not None or reward_name is not None:
        if reward_path is None:
            raise ConfigError("override custom_reward_function.name needs custom_reward_function.path (the file)")
        spec = f"{reward_path}:{reward_name or 'compute_score'}"
        _say(f"verl keys custom_reward_function.path/name -> reward.custom_function={spec}")
        out.append(f"reward.custom_function={spec}")
    return out
