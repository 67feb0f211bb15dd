"""The field helpers of the config schema: a dataclass field with its one-line help and the range or
choices :func:`trajflow.config.rules.validate` checks, and a section field."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Sequence


def _f(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
       le: float | None = None, lt: float | None = None, choices: Sequence[Any] | None = None,
       choices_from: str | None = None) -> Any:
    """A dataclass field with a one-line doc and constraints checked by :func:`validate`.

    ``choices_from`` names a registry (``"adv_estimator"``, ``"policy_loss"``, ``"kl"``) whose
    registered names are the allowed values; it is resolved lazily so config stays importable
    without torch.
    """
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices,
            "choices_from": choices_from}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _section(cls: type) -> Any:
    return field(default_factory=cls, metadata={"help": cls.__doc__ or ""})
