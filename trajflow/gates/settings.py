"""Gate settings: the config's ``gates`` section (:class:`trajflow.config.GatesConfig`), read and checked."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trajflow.config import GatesConfig, _check_fields, _explain
from trajflow.errors import ConfigError
from trajflow.gates.report import POLICIES

#: Settings exposed to suite files as GX suite parameters (``{"$PARAMETER": name}``).
PARAMETER_NAMES = ("score_min", "score_max", "max_new_tokens", "max_equal_group_frac",
                   "max_truncated_frac", "max_error_rate", "drift_band", "drift_window")
_SOURCE = "gate settings"


def resolve_settings(settings: Any = None) -> GatesConfig:
    """Read and check gate settings from the ``gates`` config section or any object like it.

    Args:
        settings: the ``DictConfig`` section ``gates``, a :class:`~trajflow.config.GatesConfig`,
            any object with its attributes, a mapping, or None (all defaults). Missing attributes
            take the ``GatesConfig`` defaults; other attributes are ignored.

    Returns:
        A checked ``GatesConfig`` of its own (``policies`` is a plain dict); ``settings`` is not
        changed.

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the key ``gates.<field>``,
            the value and what is allowed (policy names are checked against the suite later, in
            :func:`~trajflow.gates.run_gate`).
    """
    values: dict[str, Any] = {}
    for f in dataclasses.fields(GatesConfig):
        if settings is None:
            break
        if isinstance(settings, Mapping):  # a dict or a DictConfig
            if f.name in settings:
                values[f.name] = settings[f.name]
        else:
            try:
                values[f.name] = getattr(settings, f.name)
            except AttributeError:  # includes omegaconf's ConfigAttributeError
                continue
    # types and ranges are GatesConfig's (field types and metadata), checked the way load_config does
    node = OmegaConf.create({"gates": OmegaConf.structured(GatesConfig)})
    try:
        node = OmegaConf.merge(node, {"gates": values})
    except OmegaConfBaseException as e:
        raise _explain(e, _SOURCE) from None
    _check_fields(node.gates, GatesConfig, "gates.", _SOURCE)
    out = OmegaConf.to_object(node.gates)
    if out.score_min > out.score_max:
        raise ConfigError(f"{_SOURCE}: gates.score_min={out.score_min} must be <= "
                          f"gates.score_max={out.score_max}")
    for name, policy in out.policies.items():
        if policy not in POLICIES:
            raise ConfigError(f"{_SOURCE}: gates.policies.{name}={policy!r} is not allowed: "
                              f"choose one of {', '.join(POLICIES)}")
    return out


def check_max_new_tokens(max_new_tokens: Any) -> None:
    """Raise ``ValueError`` unless ``max_new_tokens`` is None or an integer >= 1."""
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool)
                                       or not isinstance(max_new_tokens, int) or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is not allowed: expected an integer >= 1 "
                         "(pass rollout.max_new_tokens)")


def suite_parameters(settings: GatesConfig, max_new_tokens: int) -> dict[str, float]:
    """The suite parameters (``$PARAMETER`` values) the settings and ``max_new_tokens`` provide."""
    values = {**dataclasses.asdict(settings), "max_new_tokens": max_new_tokens}
    return {name: values[name] for name in PARAMETER_NAMES}
