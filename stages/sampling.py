"""Sampling controls over groups of responses: DAPO's dynamic sampling (group filtering).

Plain numpy functions (no Ray, no Prefect) used by the rollout stage to decide which groups of a
generation batch are kept for training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["groups_with_signal", "take_first_groups"]


def groups_with_signal(metric: Sequence[float] | np.ndarray, group_ids: Sequence[Any]) -> np.ndarray:
    """Rows whose group's metric is not constant: DAPO's dynamic-sampling filter.

    DAPO (Yu et al. 2025, arXiv:2503.14476, eq. 11) over-samples and keeps only prompts whose
    groups satisfy ``0 < |{o_i : is_equivalent(a, o_i)}| < G``: not all correct and not all
    wrong. For a general metric this is "the group's values are not all equal" (non-zero variance):
    a group with equal values has zero advantage under every group-baseline estimator and only
    dilutes the batch. A group of one row has no variance and is dropped.

    Args:
        metric: ``(rows,)`` float, the per-response filter metric (``acc`` or ``score``).
        group_ids: ``(rows,)`` hashable group ids (rows with the same id answer the same prompt).

    Returns:
        ``(rows,)`` bool: True on every row of a group with at least two distinct metric values.

    Raises:
        ValueError: lengths differ, or a metric value is NaN/inf (names the row).
    """
    values = np.asarray(metric, dtype=np.float64)
    if values.ndim != 1 or len(values) != len(group_ids):
        raise ValueError(f"groups_with_signal: metric must be 1-D with one value per row ({len(group_ids)} rows), "
                         f"got shape {values.shape}")
    bad = ~np.isfinite(values)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(f"groups_with_signal: metric of row {row} is not finite ({values[row]})")
    lo: dict[Any, float] = {}
    hi: dict[Any, float] = {}
    for g, v in zip(group_ids, values):
        lo[g] = min(lo.get(g, v), v)
        hi[g] = max(hi.get(g, v), v)
    return np.array([hi[g] > lo[g] for g in group_ids], dtype=bool)


def take_first_groups(group_ids: Sequence[Any], keep: Sequence[bool] | np.ndarray, max_groups: int) -> np.ndarray:
    """Restrict ``keep`` to the first ``max_groups`` kept groups, in order of first appearance.

    Used to cut the kept groups of the last generation batch so that exactly
    ``data.train_batch_size`` groups are trained on (the surplus is dropped, as verl does).

    Args:
        group_ids: ``(rows,)`` group ids.
        keep: ``(rows,)`` bool, rows eligible for training.
        max_groups: how many groups to keep, >= 0.

    Returns:
        ``(rows,)`` bool, a subset of ``keep``.

    Raises:
        ValueError: lengths differ or ``max_groups < 0``.
    """
    keep = np.asarray(keep, dtype=bool)
    if len(keep) != len(group_ids):
        raise ValueError(f"take_first_groups: keep has {len(keep)} entries for {len(group_ids)} rows")
    if max_groups < 0:
        raise ValueError(f"take_first_groups: max_groups must be >= 0, got {max_groups}")
    chosen: set[Any] = set()
    out = np.zeros(len(keep), dtype=bool)
    for i, (g, k) in enumerate(zip(group_ids, keep)):
        if not k:
            continue
        if g not in chosen:
            if len(chosen) >= max_groups:
                continue
            chosen.add(g)
        out[i] = True
    return out
