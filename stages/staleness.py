"""Staleness of off-policy rows: how many policy versions the trainer moved on since a row was generated.

With ``trainer.max_staleness = N`` the rollout of iteration k may come from an older policy than
the one the update of iteration k starts from; a row's staleness is

    staleness_i = v_trainer - policy_version_i

where ``v_trainer`` is the trainer's policy version when it updates on the row and
``policy_version_i`` the version whose weights generated it (0 in a synchronous run). verl's
one-step-off-policy pipeline and AReaL bound it by N; the update corrects for it with the rollout
importance weights of :mod:`trajflow.stages.rollout_correction`.

Plain numpy; no Ray, no Prefect.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from trajflow.errors import DataError

__all__ = ["check_staleness", "row_staleness", "staleness_metrics"]


def row_staleness(policy_versions: Sequence[int] | np.ndarray, trainer_version: int) -> np.ndarray:
    """Per-row staleness ``trainer_version - policy_version``.

    Args:
        policy_versions: ``(rows,)`` ints, the ``policy_version`` column of the rollout.
        trainer_version: the trainer's policy version at the update that uses the rows.

    Returns:
        ``(rows,)`` int64, each >= 0.

    Raises:
        ValueError: a row claims a policy version newer than the trainer's (names the first).
    """
    v = np.asarray(policy_versions, dtype=np.int64).reshape(-1)
    s = int(trainer_version) - v
    if s.size and s.min() < 0:
        bad = int(np.argmin(s))
        raise ValueError(f"row {bad} has policy_version {int(v[bad])}, newer than the trainer's {int(trainer_version)}")
    return s


def check_staleness(staleness: Sequence[int] | np.ndarray, max_staleness: int, iteration: int) -> None:
    """Refuse rows staler than ``trainer.max_staleness`` where they are used (the update's version),
    not where their rollout was submitted: a stored rollout reused after a resume could otherwise be
    trained up to twice the limit behind.

    Args:
        staleness: ``(rows,)`` from :func:`row_staleness` at the update that uses the rows.
        max_staleness: ``trainer.max_staleness``.
        iteration: the iteration whose rows these are (named in the error).

    Raises:
        DataError: one line naming the iteration, the staleness found, the limit and the remedy.
    """
    s = np.asarray(staleness, dtype=np.int64).reshape(-1)
    if s.size and int(s.max()) > int(max_staleness):
        raise DataError(f"iteration {iteration}: rows generated {int(s.max())} policy versions behind the update "
                        f"that would use them, more than trainer.max_staleness={int(max_staleness)}; they are not "
                        f"trained on (resume regenerates a stored rollout that is too old)")


def staleness_metrics(staleness: Sequence[int] | np.ndarray) -> dict[str, float]:
    """``rollout_corr/staleness_mean`` and ``rollout_corr/staleness_max`` over the rows (0 for none)."""
    s = np.asarray(staleness, dtype=np.float64).reshape(-1)
    if s.size == 0:
        return {"rollout_corr/staleness_mean": 0.0, "rollout_corr/staleness_max": 0.0}
    return {"rollout_corr/staleness_mean": float(s.mean()), "rollout_corr/staleness_max": float(s.max())}
