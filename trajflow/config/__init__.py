"""Structured configuration for trajflow runs.

The config is a tree of dataclasses (sections ``model``, ``data``, ``rollout``, ``reward``,
``algorithm``, ``actor``, ``critic``, ``reference``, ``trainer``, ``resources``, ``store``,
``tracking``, ``gates``) turned into an OmegaConf object in struct mode. A run's config is built as

    defaults (these dataclasses) <- recipe YAML (``flows/configs/*.yaml``) <- ``key=value`` overrides

and then validated. Every problem is raised as :class:`ConfigError`, whose message is one line
naming the full key path, the bad value and what is allowed (with the closest valid key for typos),
so the CLI can print it and exit 2 without a traceback.

The package is cut in three:

- :mod:`trajflow.config.schema`: the sections, each field with a one-line ``help`` and optional
  range/choice constraints in its dataclass metadata;
- :mod:`trajflow.config.rules`: :func:`validate`, which checks those constraints and every
  cross-field rule (each rule defined once);
- :mod:`trajflow.config.load`: recipes, overrides, ``auto`` precision, :func:`load_config`,
  :func:`to_yaml`, :func:`flatten`.
"""

# _explain and _check_fields are re-exported for the tests that check single rules.
from trajflow.config.load import (AUTO_PRECISION_ENV, RECIPES_DIR, _explain, flatten, load_config,
                                  resolve_auto_precision, resolve_recipe, to_yaml)
from trajflow.config.rules import _check_fields, validate
from trajflow.config.schema import (DEFAULT_RECIPE, PRECISION_DTYPES, PRECISION_SECTIONS, MixedPrecisionConfig,
                                    ModelConfig, DataConfig, MultiTurnConfig, RolloutConfig, OverlongBufferConfig,
                                    RewardModelConfig, RewardConfig, KLControlConfig, FilterGroupsConfig,
                                    AlgorithmConfig, ActorConfig, CriticConfig, ReferenceConfig, TeacherConfig,
                                    TrainerConfig, ResourcesConfig, StoreConfig, TrackingConfig, GatesConfig, TrajflowConfig)
from trajflow.errors import ConfigError

__all__ = [
    "AUTO_PRECISION_ENV", "ConfigError", "DEFAULT_RECIPE", "PRECISION_DTYPES", "PRECISION_SECTIONS", "RECIPES_DIR",
    "MixedPrecisionConfig", "ModelConfig", "DataConfig", "MultiTurnConfig", "RolloutConfig", "OverlongBufferConfig",
    "RewardModelConfig", "RewardConfig", "KLControlConfig", "FilterGroupsConfig", "AlgorithmConfig", "ActorConfig",
    "CriticConfig", "ReferenceConfig", "TeacherConfig", "TrainerConfig", "ResourcesConfig", "StoreConfig", "TrackingConfig",
    "GatesConfig", "TrajflowConfig",
    "flatten", "load_config", "resolve_auto_precision", "resolve_recipe", "to_yaml", "validate",
]
