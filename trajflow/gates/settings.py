"""Gate settings: the ``gates`` config section plus ``rollout.max_new_tokens``, read and checked."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from trajflow.gates.report import POLICIES

#: Settings exposed to suite files as GX suite parameters (``{"$PARAMETER": name}``).
PARAMETER_NAMES = ("score_min", "score_max", "max_new_tokens", "max_equal_group_frac",
                   "max_truncated_frac", "max_error_rate", "drift_band", "drift_window")


@dataclass
class GateSettings:
    """Resolved gate settings (the ``gates`` config section plus ``rollout.max_new_tokens``).

    Defaults mirror ``trajflow.config.GatesConfig``; a settings object missing an attribute gets
    the default below.
    """

    enabled: bool = True  #: run the gate at all
    suite: Optional[str] = None  #: suite file; None = datasets/expectations/reward_default.json
    score_min: float = -10.0  #: lowest allowed score (inclusive)
    score_max: float = 10.0  #: highest allowed score (inclusive)
    max_new_tokens: Optional[int] = None  #: rollout.max_new_tokens (tokens); required to run
    max_equal_group_frac: float = 1.0  #: max share of groups whose scores are all equal (1.0 = off)
    max_truncated_frac: float = 1.0  #: max share of responses with finish_reason "length" (1.0 = off)
    max_error_rate: float = 0.5  #: max share of responses whose scorer raised
    drift_band: float = 1.0  #: max |mean score - mean of the previous drift_window means|
    drift_window: int = 5  #: previous iterations averaged for the drift check
    policies: dict[str, str] = field(default_factory=dict)  #: name -> fail|warn|quarantine

    def parameters(self) -> dict[str, float]:
        """The suite parameters (``$PARAMETER`` values) these settings provide."""
        return {name: getattr(self, name) for name in PARAMETER_NAMES}


def resolve_settings(settings: Any = None, *, max_new_tokens: int | None = None) -> GateSettings:
    """Read and check gate settings from any object with the ``gates.*`` attributes.

    Args:
        settings: a ``DictConfig`` section ``gates``, a dataclass, a ``SimpleNamespace``, a mapping,
            or None (all defaults). Missing attributes take the :class:`GateSettings` defaults.
        max_new_tokens: ``rollout.max_new_tokens``; overrides ``settings.max_new_tokens``.

    Returns:
        A checked :class:`GateSettings` (``policies`` is a plain dict).

    Raises:
        ValueError: a value out of range, naming the key ``gates.<field>``, the value and what
            is allowed (policy names are checked against the suite later, in :func:`run_gate`).
    """
    if isinstance(settings, GateSettings) and max_new_tokens is None:
        out = dataclasses.replace(settings, policies=dict(settings.policies))
    else:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(GateSettings):
            if settings is None:
                continue
            if isinstance(settings, Mapping):  # a dict or a DictConfig
                if f.name in settings:
                    values[f.name] = settings[f.name]
            else:
                try:
                    value = getattr(settings, f.name)
                except AttributeError:  # includes omegaconf's ConfigAttributeError
                    continue
                values[f.name] = value
        if max_new_tokens is not None:
            values["max_new_tokens"] = max_new_tokens
        policies = values.pop("policies", None)
        out = GateSettings(**values)
        out.policies = {str(k): str(v) for k, v in dict(policies or {}).items()}
    _check_settings(out)
    return out


def _check_settings(s: GateSettings) -> None:
    def bad(key: str, value: Any, allowed: str) -> ValueError:
        return ValueError(f"gates.{key}={value!r} is not allowed: expected {allowed}")

    for key in ("score_min", "score_max", "max_equal_group_frac", "max_truncated_frac",
                "max_error_rate", "drift_band"):
        value = getattr(s, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise bad(key, value, "a number")
        setattr(s, key, float(value))
    for key in ("max_equal_group_frac", "max_truncated_frac", "max_error_rate"):
        if not 0.0 <= getattr(s, key) <= 1.0:
            raise bad(key, getattr(s, key), "a fraction in [0, 1]")
    if s.drift_band < 0:
        raise bad("drift_band", s.drift_band, "a number >= 0")
    if s.score_min > s.score_max:
        raise ValueError(f"gates.score_min={s.score_min} must be <= gates.score_max={s.score_max}")
    if isinstance(s.drift_window, bool) or not isinstance(s.drift_window, int) or s.drift_window < 1:
        raise bad("drift_window", s.drift_window, "an integer >= 1")
    if s.max_new_tokens is not None and (isinstance(s.max_new_tokens, bool)
                                         or not isinstance(s.max_new_tokens, int)
                                         or s.max_new_tokens < 1):
        raise bad("max_new_tokens", s.max_new_tokens,
                  "an integer >= 1 (pass rollout.max_new_tokens)")
    for name, policy in s.policies.items():
        if policy not in POLICIES:
            raise ValueError(f"gates.policies.{name}={policy!r} is not allowed: choose one of "
                             f"{', '.join(POLICIES)}")
    s.enabled = bool(s.enabled)
