"""Per-iteration views over a run's stored trajectories: score and length distributions, the share
of groups whose scores are all equal, and one prompt's groups across iterations. No Streamlit here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from trajflow.dashboards.data import _iteration_rows, _read_parquet, _stage_file, _store, group_card

#: The dashboard's name for the share of all-equal groups (computed from the stored trajectories).
ALL_EQUAL_METRIC = "groups/all_equal_share"


def _scores_by_group(store, it: int) -> list[tuple[str, float | None, int]] | None:
    """(group_id, score, response length) per row of one iteration; None without a rollout."""
    from trajflow.batch import join_stages, lengths

    ro = _stage_file(store, it, "rollout")
    if ro is None:
        return None
    t = _read_parquet(ro, ["sample_id", "group_id", "response_ids"])
    rw = _stage_file(store, it, "reward")
    if rw is not None:
        t = join_stages([t, _read_parquet(rw, ["sample_id", "score"])])
    scores = t.column("score").to_pylist() if "score" in t.column_names else [None] * t.num_rows
    return list(zip(t.column("group_id").to_pylist(), scores, lengths(t.column("response_ids"))))


def iteration_distributions(store_root: str | Path, run_id: str) -> pa.Table:
    """Every stored response's score and length, for histograms per iteration.

    Returns:
        A table with ``iteration`` (int64), ``score`` (float64, null before the reward stage ran) and
        ``response_length`` (int64, tokens), one row per response, by iteration.

    Raises:
        DashboardError: unknown run; a damaged stage file (named).
    """
    store = _store(store_root, run_id)
    its, scores, lens = [], [], []
    for it in store.iterations():
        rows = _scores_by_group(store, it)
        for _, s, n in rows or ():
            its.append(it)
            scores.append(None if s is None else float(s))
            lens.append(int(n))
    return pa.table({"iteration": pa.array(its, pa.int64()), "score": pa.array(scores, pa.float64()),
                     "response_length": pa.array(lens, pa.int64())})


def all_equal_group_share(store_root: str | Path, run_id: str) -> dict[int, float]:
    """Per iteration, the share of groups (a prompt's ``rollout.n`` responses) whose scores are all equal.

    Such a group gives every outcome estimator (GRPO, RLOO, ...) a zero advantage: its responses teach
    nothing (DAPO's dynamic sampling drops them; Yu et al. 2025, Sec. 3.2). A group of one response
    counts as all equal (it has no spread). Scores compare exactly, as the estimators do (max == min).

    Returns:
        ``{iteration: share in [0, 1]}`` for the iterations with stored scores, ascending.

    Raises:
        DashboardError: unknown run; a damaged stage file (named).
    """
    store = _store(store_root, run_id)
    out = {}
    for it in store.iterations():
        rows = _scores_by_group(store, it)
        if not rows:
            continue
        groups: dict[str, list[float]] = {}
        for gid, s, _ in rows:
            if s is not None and math.isfinite(s):
                groups.setdefault(gid, []).append(float(s))
        if groups:
            out[it] = sum(max(v) == min(v) for v in groups.values()) / len(groups)
    return out


def repeated_prompts(store_root: str | Path, run_id: str) -> list[tuple[str, int]]:
    """Prompts sampled in more than one iteration (a dataset smaller than the run: later epochs).

    Returns:
        ``[(prompt_id, number of iterations)]``, most iterations first, then by prompt id.
    """
    store = _store(store_root, run_id)
    seen: dict[str, set[int]] = {}
    for it in store.iterations():
        ro = _stage_file(store, it, "rollout")
        if ro is None:
            continue
        for pid in set(_read_parquet(ro, ["prompt_id"]).column("prompt_id").to_pylist()):
            seen.setdefault(str(pid), set()).add(it)
    rep = [(p, len(its)) for p, its in seen.items() if len(its) > 1]
    return sorted(rep, key=lambda x: (-x[1], x[0]))


def prompt_history(store_root: str | Path, run_id: str, prompt_id: str) -> list[dict]:
    """One prompt's groups in every iteration that sampled it, oldest first: how the policy's answers
    to the same question changed.

    Returns:
        As :func:`trajflow.dashboards.data.find_groups`: ``{"iteration", "group_id", "prompt_text", "data_source",
        "ground_truth", "score_mean", "score_std", "rows"}`` per iteration (a prompt sampled twice in one
        iteration gives one entry per group).

    Raises:
        DashboardError: unknown run; a damaged stage file (named).
    """
    store = _store(store_root, run_id)
    out = []
    for it in store.iterations():
        t = _iteration_rows(store, it)
        if t is None:
            continue
        t = t.filter(pc.equal(t.column("prompt_id"), str(prompt_id)))
        out.extend(group_card(t, it, gid) for gid in dict.fromkeys(t.column("group_id").to_pylist()))
    return out

