"""The one-row ``summary`` table and the quarantine row sets (registries: open to new entries)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from trajflow.stages.registry import Registry
from trajflow.config import GatesConfig


SUMMARY_METRICS = Registry("gate summary metric")
#: Row sets a failed summary expectation can quarantine (``meta.quarantine`` in the suite):
#: ``fn(view) -> pa.BooleanArray`` (True = the row belongs to the set), length ``view.num_rows``.
QUARANTINE_ROWS = Registry("gate quarantine row set")


def _finite_scores(view: pa.Table) -> pa.Array:
    """``score`` as float64 with NaN/inf turned into nulls."""
    score = pc.cast(view["score"], pa.float64())
    return pc.if_else(pc.is_finite(score), score, pa.scalar(None, pa.float64()))


def _equal_group_ids(view: pa.Table) -> tuple[pa.Array, int]:
    """Groups with >= 2 finite scores whose scores are all equal, and the count of such groups
    with >= 2 finite scores (the denominator)."""
    t = pa.table({"group_id": view["group_id"], "s": _finite_scores(view)})
    g = t.group_by("group_id").aggregate([("s", "min"), ("s", "max"), ("s", "count")])
    judged = pc.greater_equal(g["s_count"], 2)
    equal = pc.and_(judged, pc.equal(g["s_min"], g["s_max"]))
    return pc.filter(g["group_id"], equal), pc.sum(pc.cast(judged, pa.int64())).as_py() or 0


@SUMMARY_METRICS.register("rows")
def _rows(view: pa.Table, history: Sequence[float], settings: GatesConfig) -> float:
    """Number of rows (responses) in the view."""
    return float(view.num_rows)


@SUMMARY_METRICS.register("groups")
def _groups(view: pa.Table, history: Sequence[float], settings: GatesConfig) -> float:
    """Number of distinct ``group_id`` (prompts)."""
    return float(pc.count_distinct(view["group_id"]).as_py())


@SUMMARY_METRICS.register("equal_reward_group_frac")
def _equal_reward_group_frac(view, history, settings) -> float | None:
    """Share of groups whose finite scores are all equal (GRPO gives them zero advantage).

    Only groups with >= 2 finite scores are judged; None when there is none.
    """
    equal_ids, judged = _equal_group_ids(view)
    return len(equal_ids) / judged if judged else None


@SUMMARY_METRICS.register("truncated_frac")
def _truncated_frac(view, history, settings) -> float | None:
    """Share of responses with ``finish_reason == "length"``."""
    if view.num_rows == 0:
        return None
    return pc.sum(pc.cast(_truncated_rows(view), pa.int64())).as_py() / view.num_rows


@SUMMARY_METRICS.register("scorer_error_rate")
def _scorer_error_rate(view, history, settings) -> float | None:
    """Share of responses whose scorer raised (``reward_error`` not null)."""
    if view.num_rows == 0:
        return None
    return pc.sum(pc.cast(_scorer_error_rows(view), pa.int64())).as_py() / view.num_rows


def _score_mean(view: pa.Table) -> float | None:
    ok = pc.is_null(view["reward_error"])
    mean = pc.mean(pc.filter(_finite_scores(view), ok)).as_py()
    return None if mean is None else float(mean)


def _history_mean(history: Sequence[float], window: int) -> float | None:
    recent = [float(h) for h in list(history)[-window:] if h is not None and math.isfinite(h)]
    return sum(recent) / len(recent) if recent else None


@SUMMARY_METRICS.register("score_mean")
def _score_mean_metric(view, history, settings) -> float | None:
    """Mean of the finite scores of rows whose scorer did not raise; None if there is none."""
    return _score_mean(view)


@SUMMARY_METRICS.register("history_mean")
def _history_mean_metric(view, history, settings) -> float | None:
    """Mean of the last ``drift_window`` finite entries of ``history``; None without history."""
    return _history_mean(history, settings.drift_window)


@SUMMARY_METRICS.register("score_mean_drift")
def _score_mean_drift(view, history, settings) -> float | None:
    """``|score_mean - history_mean|``; None without history or without a finite score."""
    mean, ref = _score_mean(view), _history_mean(history, settings.drift_window)
    return None if mean is None or ref is None else abs(mean - ref)


@QUARANTINE_ROWS.register("truncated_rows")
def _truncated_rows(view: pa.Table) -> pa.Array:
    """Rows cut at ``max_new_tokens`` (``finish_reason == "length"``)."""
    return pc.fill_null(pc.equal(view["finish_reason"], "length"), False)


@QUARANTINE_ROWS.register("scorer_error_rows")
def _scorer_error_rows(view: pa.Table) -> pa.Array:
    """Rows whose scorer raised (``reward_error`` not null)."""
    return pc.is_valid(view["reward_error"])


@QUARANTINE_ROWS.register("equal_reward_groups")
def _equal_reward_groups(view: pa.Table) -> pa.Array:
    """Every row of a group whose finite scores are all equal (>= 2 of them)."""
    equal_ids, _ = _equal_group_ids(view)
    return pc.fill_null(pc.is_in(view["group_id"], value_set=pc.cast(equal_ids, pa.string())),
                        False)


def summarize(view: pa.Table, history: Sequence[float] = (),
              settings: GatesConfig | None = None) -> dict[str, float | None]:
    """Compute the one-row ``summary`` table the summary expectations run on.

    Args:
        view: the gate view (see :func:`run_gate`).
        history: mean scores of previous iterations, oldest first.
        settings: resolved settings (``drift_window`` is used); None = defaults.

    Returns:
        ``{column: value}`` for every registered summary metric; None where undefined.
    """
    settings = settings or GatesConfig()
    return {name: SUMMARY_METRICS.get(name)(view, history, settings)
            for name in SUMMARY_METRICS.names()}
