"""What each stored stage output depends on: the ``inputs`` digests its manifest records.

A stage output is reused (resume, retry, replay) only when its recorded inputs equal these, so
every setting that changes a stage's result must appear in its key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from omegaconf import OmegaConf

from stages.rollout import sampling_params
from stages.seeds import Salt, iteration_seed
from trajflow.run.context import RunContext
from trajflow.store import StageRef


def digest(obj) -> str:
    """Short sha256 of a JSON-serialisable value: how a stage records the settings it was computed with."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rollout_inputs(ctx: RunContext, iteration: int) -> dict[str, str]:
    """A rollout depends on the prompts (ids and their rendered messages: an edited template or
    prompt text is another rollout), the sampling (with dynamic sampling and ReMax's greedy
    baseline), the policy version and the model."""
    cfg = ctx.cfg
    params = sampling_params(cfg.rollout, iteration_seed(cfg.trainer.seed, iteration, Salt.ROLLOUT))
    sampling = [dataclasses.asdict(params), OmegaConf.to_container(cfg.algorithm.filter_groups, resolve=True),
                cfg.algorithm.adv_estimator]
    prompts = ctx.iteration(iteration).prompts
    return {"prompts": digest([str(p.prompt_id) for p in prompts]),
            "prompt_text": digest([p.messages for p in prompts]),
            "sampling": digest(sampling), "policy_version": str(ctx.policy_version),
            "model": digest([ctx.model_path, ctx.plain("model")])}


def reward_inputs(ctx: RunContext, iteration: int, rollout: StageRef) -> dict[str, str]:
    """A reward output depends on the rollout file, every setting that changes scores or KL shaping,
    and the code of a custom reward function (its file's sha256, not just its path)."""
    from stages.scorers import custom_function_file, file_sha256

    cfg = ctx.cfg
    spec = cfg.reward.custom_function
    settings = {"reward": ctx.reward_settings(),
                "custom_function_sha256": file_sha256(custom_function_file(spec)) if spec else None, "max_new_tokens": cfg.rollout.max_new_tokens,
                "temperature": cfg.rollout.temperature,
                "kl": [bool(cfg.algorithm.use_kl_in_reward), cfg.algorithm.kl_penalty,
                       float(ctx.kl_ctrl.value) if ctx.kl_ctrl is not None else None],
                "reference": [ctx.needs_reference(), cfg.reference.path]}
    return {"rollout": rollout.sha256, "settings": digest(settings)}


def advantage_inputs(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef,
                     gate: dict) -> dict[str, str]:
    """An advantage output depends on the rollout and reward files, the gate's quarantine and ``algorithm``."""
    return {"rollout": rollout.sha256, "reward": reward.sha256,
            "gate": digest(sorted(gate.get("quarantined_sample_ids") or ())),
            "settings": digest(ctx.plain("algorithm"))}
