"""The gate over stored iterations: the reward view the gate validates (:func:`gate_view`, also used
by the training run's gate step, :mod:`trajflow.run.gate`) and ``trajflow gate``'s re-check of a
stored run (:func:`recheck_run`), which writes nothing.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from trajflow.batch import join_stages, trainable_lengths
from trajflow.gates.validate import run_gate


def gate_view(rollout: pa.Table, reward: pa.Table) -> pa.Table:
    """The columns the gate validates, one row per response (see ``trajflow.gates``).

    ``response_length`` is the number of tokens the policy generated (:func:`trajflow.batch.trainable_lengths`):
    the whole response of a single-turn row; for a multi-turn row without the tool and environment
    tokens, which do not count against ``rollout.max_new_tokens``.
    """
    cols = ["sample_id", "group_id", "iteration", "response_ids", "finish_reason"]
    cols += ["loss_mask"] if "loss_mask" in rollout.column_names else []
    joined = join_stages([rollout.select(cols), reward.select(["sample_id", "score", "reward_error"])])
    return pa.table({
        "sample_id": joined.column("sample_id"),
        "group_id": joined.column("group_id"),
        "iteration": joined.column("iteration"),
        "score": joined.column("score"),
        "response_length": pa.array(trainable_lengths(joined), pa.int32()),
        "finish_reason": joined.column("finish_reason"),
        "reward_error": joined.column("reward_error"),
    })


def check_finite_scores(reward: pa.Table, iteration: int, run_id: str) -> None:
    """The one check that runs with ``gates.enabled=false``: every score is finite. A NaN or
    infinite reward would otherwise flow into the advantages and the policy update.

    Raises:
        DataError: names the rows and the fix; nothing stored is changed.
    """
    import numpy as np

    from trajflow.errors import DataError

    scores = reward.column("score").to_numpy(zero_copy_only=False).astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(scores))
    if bad.size:
        sids = reward.column("sample_id").to_pylist()
        shown = ", ".join(f"{sids[i]} ({scores[i]})" for i in bad[:3])
        raise DataError(f"iteration {iteration} of run {run_id}: the reward is NaN or infinite on {bad.size} of "
                        f"{len(scores)} rows (e.g. {shown}); with gates.enabled=false nothing else stops it "
                        f"reaching the policy update: make the scorer return finite numbers, or enable the gates")


def scorer_errors(view: pa.Table) -> str:
    """``"; the scorer raised on N of M rows, e.g. ValueError: ..."``: what the scorer said, for a
    failed gate's message (the expectations count the rows, the user needs the exception), or ``""``."""
    errors = [e for e in view.column("reward_error").to_pylist() if e]
    if not errors:
        return ""
    first = str(errors[0]).splitlines()[0] if str(errors[0]).strip() else repr(errors[0])
    distinct = len(set(errors))
    more = f" ({distinct} different errors; all in reward.parquet's reward_error)" if distinct > 1 else ""
    return f"; the scorer raised on {len(errors)} of {view.num_rows} rows, e.g. {first[:300]}{more}"


def recheck_run(store_root: str, run_id: str, iteration: int | None = None,
                suite: str | None = None) -> tuple[list, list[tuple[int, str]]]:
    """Re-run the gate over stored reward outputs (``trajflow gate``); nothing is written.

    An iteration whose rollout or reward output cannot be read back (manifest missing, file
    truncated or altered, never written) is not checked; it is returned with the reason, never
    left out silently.

    Returns:
        ``([(iteration, GateReport), ...], [(iteration, why it was not checked), ...])`` in
        iteration order.

    Raises:
        StoreError: unknown run, a damaged stored config, or no such iteration.
    """
    from omegaconf import OmegaConf

    from trajflow.config import load_config
    from trajflow.errors import StoreError
    from trajflow.store import RunStore

    store = RunStore(store_root, run_id)
    if not store.exists():
        raise StoreError(f"no run {run_id!r} under {store.root}")
    overrides = [f"gates.suite={suite}"] if suite else []
    import io

    from trajflow.trust import screen_stored_config

    # The gate runs no stored code: whatever the stored config names is dropped before validation
    # (which would import an environment factory), never imported.
    base = screen_stored_config(store.read_config(), overrides, store.config_path, needs_code=False,
                                report=io.StringIO())
    cfg = load_config(base=base, overrides=overrides)
    if iteration is not None and iteration not in store.iterations():
        raise StoreError(f"run {run_id!r} has no iteration {iteration} (has {store.iterations()})")
    its, skipped = [], []
    for it in [iteration] if iteration is not None else store.iterations():
        problem = store.stage_problem(it, "rollout") or store.stage_problem(it, "reward")
        if problem is None:
            its.append(it)
        else:
            skipped.append((it, problem))
    from trajflow.gates.suite import check_suite

    check_suite(cfg.gates.suite, cfg.gates.policies)  # the suite (maybe a new one from --suite), parsed once here
    settings = dataclasses.replace(OmegaConf.to_object(cfg.gates), enabled=True)  # cfg stays read-only
    out, history = [], []
    for it in its:
        view = gate_view(store.read_stage(it, "rollout"), store.read_stage(it, "reward"))
        report = run_gate(view, settings, cfg.rollout.max_new_tokens, history=history[-cfg.gates.drift_window:])
        if report.score_mean is not None:
            history.append(float(report.score_mean))
        out.append((it, report))
    return out, skipped
