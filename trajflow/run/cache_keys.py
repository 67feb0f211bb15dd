"""What each stored stage output depends on: each stage's settings as one typed object, and the
``inputs`` digests its manifest records.

A stage output is reused (resume, retry, replay) only when its recorded inputs equal
:func:`stage_key` of the stage's settings and upstream inputs. The key digests *every* field of the
settings object (``dataclasses.asdict``), and the stage tasks (:mod:`trajflow.flows.tasks`) read their
settings from the same object, so a setting added to a stage is in its key by construction: it can
never let a stale stored output be reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import OmegaConf

from trajflow.stages.rollout import SamplingParams, sampling_params
from trajflow.stages.seeds import Salt, iteration_seed
from trajflow.run.context import RunContext
from trajflow.store import StageRef


def digest(obj) -> str:
    """Short sha256 of a JSON-serialisable value: how a stage records the settings it was computed with."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_key(settings: Any, **inputs: str) -> dict[str, str]:
    """The ``inputs`` a stage output records: ``settings`` (a settings dataclass: every field, by
    name, so a new field changes the key) plus the upstream digests ``inputs`` (file sha256s, prompt
    digests, the policy version)."""
    return {**inputs, "settings": digest({"stage": type(settings).__name__, **dataclasses.asdict(settings)})}


@dataclass(frozen=True)
class RolloutSettings:
    """What a rollout's samples depend on besides its prompts and the policy version.

    Attributes:
        sampling: the sampling parameters (seeded per iteration).
        filter_groups: ``algorithm.filter_groups`` (DAPO dynamic sampling refills the batch).
        adv_estimator: ``algorithm.adv_estimator`` (ReMax adds a greedy baseline response).
        rollout: the whole ``rollout`` section (engine, sampler dtype, multi-turn, ...).
        model_path: the resolved initial weights.
        model: the ``model`` section (prompt format, LoRA, ...).
    """

    sampling: SamplingParams
    filter_groups: Mapping[str, Any]
    adv_estimator: str
    rollout: Mapping[str, Any]
    model_path: str
    model: Mapping[str, Any]

    @classmethod
    def of(cls, ctx: RunContext, iteration: int) -> "RolloutSettings":
        cfg = ctx.cfg
        return cls(sampling=sampling_params(cfg.rollout, iteration_seed(cfg.trainer.seed, iteration, Salt.ROLLOUT)),
                   filter_groups=OmegaConf.to_container(cfg.algorithm.filter_groups, resolve=True),
                   adv_estimator=str(cfg.algorithm.adv_estimator), rollout=ctx.plain("rollout"),
                   model_path=str(ctx.model_path), model=ctx.plain("model"))


@dataclass(frozen=True)
class RewardSettings:
    """What a reward output depends on besides the rollout file.

    Attributes:
        reward: the ``reward`` section as the scorers receive it (:meth:`RunContext.reward_settings`).
        custom_function_sha256: the code of ``reward.custom_function`` (its file's sha256, not its path).
        max_new_tokens: the length cap (DAPO's overlong penalty).
        temperature: ``rollout.temperature``: the reference log-probs' temperature for a rollout stored
            before schema 3 (a newer rollout carries its own, covered by the file's sha256).
        use_kl_in_reward, kl_penalty: KL shaping of the token rewards (``algorithm``).
        kl_coef: the KL controller's coefficient now (None without one).
        reference: whether reference log-probs are computed, and from which model (``reference.path``).
        teacher_path: on-policy distillation's teacher (``teacher.path``; the stored ``teacher_logprobs``
            come from it), None without a teacher.
    """

    reward: Mapping[str, Any]
    custom_function_sha256: str | None
    max_new_tokens: int
    temperature: float
    use_kl_in_reward: bool
    kl_penalty: str
    kl_coef: float | None
    reference: bool
    reference_path: str | None
    teacher_path: str | None

    @classmethod
    def of(cls, ctx: RunContext) -> "RewardSettings":
        from trajflow.stages.scorers import custom_function_file, file_sha256

        cfg = ctx.cfg
        spec = cfg.reward.custom_function
        return cls(reward=ctx.reward_settings(),
                   custom_function_sha256=file_sha256(custom_function_file(spec)) if spec else None,
                   max_new_tokens=int(cfg.rollout.max_new_tokens), temperature=float(cfg.rollout.temperature),
                   use_kl_in_reward=bool(cfg.algorithm.use_kl_in_reward), kl_penalty=str(cfg.algorithm.kl_penalty),
                   kl_coef=float(ctx.kl_ctrl.value) if ctx.kl_ctrl is not None else None,
                   reference=bool(ctx.needs_reference()), reference_path=cfg.reference.path,
                   teacher_path=cfg.teacher.path if ctx.needs_teacher() else None)

    def algorithm(self) -> dict:
        """The ``algorithm`` keys :func:`trajflow.stages.reward.reward_table` reads."""
        return {"use_kl_in_reward": self.use_kl_in_reward, "kl_penalty": self.kl_penalty}


@dataclass(frozen=True)
class AdvantageSettings:
    """What an advantage output depends on besides the rollout and reward files and the gate.

    Attributes:
        algorithm: the ``algorithm`` section (estimator, gamma, lambda, normalisation, ...).
        trainer_version: with ``trainer.max_staleness`` > 0, the trainer's policy version, from which
            the ``staleness`` column is counted; None otherwise.
    """

    algorithm: Mapping[str, Any]
    trainer_version: int | None

    @classmethod
    def of(cls, ctx: RunContext) -> "AdvantageSettings":
        return cls(algorithm=ctx.plain("algorithm"),
                   trainer_version=int(ctx.policy_version) if ctx.cfg.trainer.max_staleness else None)


def rollout_inputs(ctx: RunContext, iteration: int) -> dict[str, str]:
    """A rollout depends on its settings (:class:`RolloutSettings`), the prompts (ids and their
    rendered messages: an edited template or prompt text is another rollout) and the policy version."""
    state = ctx.iteration(iteration)
    prompts = state.prompts
    # An overlapped rollout is generated by the version fixed when it was submitted, not the trainer's.
    version = ctx.policy_version if state.behaviour_version is None else state.behaviour_version
    extra = {}
    if ctx.cfg.trainer.partial_rollout:  # a segment continues the rows the one before left in flight
        entry = ctx.store.stage_entry(iteration - 1, "inflight") if iteration - 1 in ctx.store.iterations() else None
        extra["partial"] = digest({"pool": (entry or {}).get("sha256"), "use_version": state.use_version,
                                   "max_staleness": int(ctx.cfg.trainer.max_staleness),
                                   "batch_groups": int(ctx.cfg.data.train_batch_size)})
    return stage_key(RolloutSettings.of(ctx, iteration), prompts=digest([str(p.prompt_id) for p in prompts]),
                     prompt_text=digest([p.messages for p in prompts]), policy_version=str(version), **extra)


def reward_inputs(ctx: RunContext, iteration: int, rollout: StageRef) -> dict[str, str]:
    """A reward output depends on the rollout file and :class:`RewardSettings`."""
    return stage_key(RewardSettings.of(ctx), rollout=rollout.sha256)


def advantage_inputs(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef,
                     gate: dict) -> dict[str, str]:
    """An advantage output depends on the rollout and reward files, the gate's quarantine and
    :class:`AdvantageSettings`."""
    return stage_key(AdvantageSettings.of(ctx), rollout=rollout.sha256, reward=reward.sha256,
                     gate=digest(sorted(gate.get("quarantined_sample_ids") or ())))
