"""The names of an iteration's stages: one enumeration for the store, the config and replay; and the
names the built-in registries hold, which a config is validated against without importing them."""

from __future__ import annotations

from enum import Enum


class Stage(str, Enum):
    """One stage of an iteration, in pipeline order. The value is the name used in config keys
    (``trainer.stage_timeouts``), Prefect task names and stored file names."""

    ROLLOUT = "rollout"
    REWARD = "reward"
    GATE = "gate"
    ADVANTAGE = "advantage"
    UPDATE = "update_actor"
    VALIDATE = "validate"

    def __str__(self) -> str:
        return self.value


#: Every stage name, in pipeline order (validation last).
STAGE_NAMES: tuple[str, ...] = tuple(s.value for s in Stage)
#: The stages whose output is a Parquet file (``<stage>.parquet``), in the order they are joined.
STORED_STAGES: tuple[str, ...] = (Stage.ROLLOUT.value, Stage.REWARD.value, Stage.ADVANTAGE.value)
#: ``trajflow replay --from-stage`` choices -> the first stage computed again.
REPLAY_FROM: dict[str, Stage] = {"reward": Stage.REWARD, "advantage": Stage.ADVANTAGE, "update": Stage.UPDATE}
#: The names the built-in registries hold, by the config's ``choices_from`` kind: a config is validated
#: against these without importing the registries' modules (torch); tests check they are the
#: registries' names. A registry that was imported may hold more (one registered by the user's code).
BUILTIN_REGISTRY_NAMES: dict[str, tuple[str, ...]] = {
    "adv_estimator": ("gae", "gpg", "grpo", "grpo_passk", "opd", "opo", "reinforce_plus_plus",
                      "reinforce_plus_plus_baseline", "remax", "rloo"),
    "policy_loss": ("cispo", "gpg", "gspo", "vanilla"),
    "kl": ("abs", "abs+", "k1", "k1+", "k2", "k2+", "k3", "k3+", "kl", "kl+", "low_var_kl", "low_var_kl+", "mse",
           "mse+"),
    "scorer": ("env", "exact_match", "math_verify", "reasoning_gym"),
}
