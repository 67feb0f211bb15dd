"""The names of an iteration's stages: one enumeration for the store, the config and replay."""

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
