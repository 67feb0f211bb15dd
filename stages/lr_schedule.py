"""Learning-rate warmup and decay per iteration, as verl schedules its actor's optimizer
(``actor_rollout_ref.actor.optim.lr_warmup_steps_ratio`` / ``lr_warmup_steps`` / ``warmup_style`` /
``min_lr_ratio``): one scheduler step per training iteration, so iteration ``k`` (1-based) trains at
the factor of step ``k - 1``.

A plain function of the iteration, not a stateful scheduler: a resumed run, a retried update and a
replay of stored updates get the same rate without any scheduler state in the checkpoint.
"""

from __future__ import annotations

import math

__all__ = ["WARMUP_STYLES", "lr_factor", "warmup_steps"]

#: ``actor.warmup_style`` choices (verl's).
WARMUP_STYLES = ("constant", "cosine")


def warmup_steps(total_steps: int, lr_warmup_steps: int, lr_warmup_steps_ratio: float) -> int:
    """verl's warmup length: ``lr_warmup_steps`` when > 0, else ``int(ratio * total_steps)``."""
    return int(lr_warmup_steps) if lr_warmup_steps > 0 else int(float(lr_warmup_steps_ratio) * int(total_steps))


def lr_factor(step: int, total_steps: int, num_warmup: int, style: str = "constant", min_lr_ratio: float = 0.0) -> float:
    """The multiplier of the base learning rate after ``step`` scheduler steps.

    ``constant`` (transformers' ``get_constant_schedule_with_warmup``): ``step / num_warmup`` while
    ``step < num_warmup``, then 1. ``cosine`` (``get_cosine_schedule_with_warmup`` with verl's
    ``min_lr_ratio``, half a cycle; Loshchilov & Hutter 2017, "SGDR", eq. 5): the same linear warmup,
    then with ``p = (step - num_warmup) / max(1, total_steps - num_warmup)``::

        factor = min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2

    Args:
        step: scheduler steps taken (iteration - 1), >= 0.
        total_steps: ``trainer.total_iterations``.
        num_warmup: warmup steps (:func:`warmup_steps`), >= 0.
        style: ``constant`` or ``cosine``.
        min_lr_ratio: cosine's floor as a fraction of the base rate, in [0, 1].

    Returns:
        The factor, in [0, 1].

    Raises:
        ValueError: an unknown ``style`` or a negative ``step``.
    """
    if style not in WARMUP_STYLES:
        raise ValueError(f"warmup_style must be one of {WARMUP_STYLES}, got {style!r}")
    if step < 0:
        raise ValueError(f"lr_factor: step must be >= 0, got {step}")
    if step < num_warmup:
        return float(step) / float(max(1, num_warmup))
    if style == "constant":
        return 1.0
    progress = min(1.0, float(step - num_warmup) / float(max(1, total_steps - num_warmup)))
    return max(0.0, min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
