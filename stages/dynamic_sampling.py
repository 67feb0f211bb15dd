"""DAPO's dynamic sampling: keep only groups whose rewards differ, refilling the batch until it is full.

Plain numpy/Arrow functions (no Ray, no Prefect): the group filter, and the refill loop over a
``generate`` callable that the rollout stage supplies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from trajflow.errors import DynamicSamplingError

__all__ = ["DynamicSamplingResult", "GenerationBatch", "dynamic_sampling", "filter_metric", "groups_with_signal",
           "sampling_metrics", "take_first_groups"]


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


def filter_metric(scores: np.ndarray, extras: Sequence[Any], metric: str) -> np.ndarray:
    """Per-row value that dynamic sampling filters on (``algorithm.filter_groups.metric``).

    ``score``: the final score. ``acc``: the scorer's ``acc`` extra where it reports one, else the
    final score of that row.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if metric == "score":
        return scores
    if metric != "acc":
        raise ValueError(f"algorithm.filter_groups.metric must be 'acc' or 'score', got {metric!r}")
    out = scores.copy()
    for i, e in enumerate(extras):
        if isinstance(e, dict) and isinstance(e.get("acc"), (int, float)) and not isinstance(e.get("acc"), bool):
            out[i] = float(e["acc"])
    return out


@dataclass
class GenerationBatch:
    """One generation batch of dynamic sampling, scored.

    Attributes:
        table: its rollout rows (``sample_id``, ``group_id``, ...), ``rows = prompts * n``.
        rule_scores: ``(rows,)`` the scorers' scores.
        extras: ``rows`` scorer extras (dicts).
        rm_scores: ``(rows,)`` reward-model scores, or None without a reward model.
        final_scores: ``(rows,)`` float32, the training score (:func:`trajflow.stages.reward.final_scores`).
    """

    table: pa.Table
    rule_scores: np.ndarray
    extras: list
    rm_scores: np.ndarray | None
    final_scores: np.ndarray


@dataclass
class DynamicSamplingResult:
    """What dynamic sampling kept and dropped, and its counts (``dynamic_sampling.json``).

    Attributes:
        table: the kept rollout rows (``target_groups`` groups, fewer only when the budget ran out).
        dropped: the dropped rows plus ``score`` and ``filter_metric`` columns, or None.
        prescored: ``sample_id -> (rule score, extra, rm score or None)`` of the kept rows, so the
            reward stage need not score them again.
        num_gen_batches, extra_draws, kept_groups, filtered_groups, surplus_groups, target_groups,
        metric: the counts (``filtered``: zero variance; ``surplus``: beyond the target).
    """

    table: pa.Table
    dropped: pa.Table | None
    prescored: dict[str, tuple]
    num_gen_batches: int
    extra_draws: int
    kept_groups: int
    filtered_groups: int
    surplus_groups: int
    target_groups: int
    metric: str

    def record(self, gen_seconds: float) -> dict[str, Any]:
        """The stored record (``dynamic_sampling.json``), with the generation time in seconds."""
        return {"num_gen_batches": self.num_gen_batches, "extra_draws": self.extra_draws,
                "kept_groups": self.kept_groups, "filtered_groups": self.filtered_groups,
                "surplus_groups": self.surplus_groups, "target_groups": self.target_groups,
                "metric": self.metric, "timing_s/gen": gen_seconds}


def sampling_metrics(record: dict) -> dict[str, float]:
    """The rollout stage's ``batch/*`` metrics from a dynamic-sampling record."""
    return {"batch/num_gen_batches": float(record["num_gen_batches"]), "batch/kept_groups": float(record["kept_groups"]),
            "batch/filtered_groups": float(record["filtered_groups"]),
            "batch/surplus_groups": float(record["surplus_groups"])}


def dynamic_sampling(generate: Callable[[list, int], GenerationBatch], first_prompts: list,
                     next_prompts: Callable[[], list], *, target_groups: int, max_gen_batches: int,
                     metric: str, n: int, iteration: int) -> DynamicSamplingResult:
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): generate batches of prompts until
    ``target_groups`` groups have a non-constant ``metric`` or ``max_gen_batches`` batches were generated.

    The first batch is ``first_prompts``; each later one comes from ``next_prompts()`` (the data
    cursor moves on). Groups with signal beyond the target are dropped, as verl does.

    Args:
        generate: ``(prompts, k) -> GenerationBatch`` for generation batch ``k`` (its own seed).
        first_prompts: the iteration's own prompts.
        next_prompts: draws the next batch of prompts.
        target_groups: groups to keep (``data.train_batch_size``).
        max_gen_batches: the budget of generation batches (>= 1).
        metric: ``acc`` or ``score`` (:func:`filter_metric`).
        n: ``rollout.n``, named in the error.
        iteration: the iteration, named in the error.

    Returns:
        The kept and dropped rows with the counts (:class:`DynamicSamplingResult`).

    Raises:
        DynamicSamplingError: no group had signal within the budget.
    """
    kept_parts, dropped_parts, prescored = [], [], {}
    kept = filtered = surplus = batches = extra_draws = 0
    prompts = first_prompts
    while True:
        b = generate(prompts, batches)
        value = filter_metric(b.final_scores, b.extras, metric)
        gids = b.table.column("group_id").to_pylist()
        signal = groups_with_signal(value, gids)
        keep = take_first_groups(gids, signal, target_groups - kept)
        n_signal = len({g for g, s in zip(gids, signal) if s})
        n_keep = len({g for g, k in zip(gids, keep) if k})
        filtered += len(set(gids)) - n_signal
        surplus += n_signal - n_keep
        kept += n_keep
        for i, sid in enumerate(b.table.column("sample_id").to_pylist()):
            if keep[i]:
                prescored[sid] = (float(b.rule_scores[i]), b.extras[i],
                                  None if b.rm_scores is None else float(b.rm_scores[i]))
        kept_parts.append(b.table.filter(pa.array(keep)))
        drop = ~keep
        if drop.any():
            d = b.table.filter(pa.array(drop))
            d = d.append_column("score", pa.array(b.final_scores[drop], pa.float32()))
            dropped_parts.append(d.append_column("filter_metric", pa.array(value[drop].astype(np.float32), pa.float32())))
        batches += 1
        if kept >= target_groups or batches >= max_gen_batches:
            break
        prompts = next_prompts()
        extra_draws += 1
    if kept == 0:
        raise DynamicSamplingError(
            f"iteration {iteration}: dynamic sampling kept no group after {batches} generation batch(es) of {target_groups} prompts x "
            f"rollout.n={n}: every group's '{metric}' was constant. Raise "
            f"algorithm.filter_groups.max_num_gen_batches (0 = up to one epoch of prompts), use data the policy "
            f"sometimes solves, or set algorithm.filter_groups.enable=false")
    return DynamicSamplingResult(table=pa.concat_tables(kept_parts),
                                 dropped=pa.concat_tables(dropped_parts) if dropped_parts else None,
                                 prescored=prescored, num_gen_batches=batches, extra_draws=extra_draws,
                                 kept_groups=kept, filtered_groups=filtered, surplus_groups=surplus,
                                 target_groups=target_groups, metric=metric)
