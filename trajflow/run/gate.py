"""The gate step of an iteration: build the reward view, validate it, record and enforce the result.

The expectations themselves are run by :mod:`trajflow.gates.validate` (Great Expectations); this module
is the glue between them and a run: it stores ``gate.json`` beside the iteration, logs ``gate/*`` metrics
and the validation result to MLflow, marks a failed iteration as ``gated`` in its manifest and stops
the run with :class:`GateFailed` before the policy update may use the data. It lives with the run, not
in :mod:`trajflow.gates`, so that the gates never import the driver.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from trajflow.errors import GateFailed
from trajflow.gates.docs import json_safe, write_data_docs
from trajflow.gates.iteration import check_finite_scores, gate_view, scorer_errors
from trajflow.gates.validate import run_gate
from trajflow.run.context import RunContext
from trajflow.store import StageRef

log = logging.getLogger(__name__)


#: Run tags: ``trajflow.gate`` (the run's worst gate outcome so far) and ``trajflow.gate.<name>``
#: (each expectation's): ``passed``, ``warned``, ``quarantined`` or ``failed``.
TAG_GATE = "trajflow.gate"
#: Run tags ``trajflow.gate_rule.<name>``: each expectation's policy and threshold (``warn: <= 0.9 ...``).
TAG_GATE_RULE = "trajflow.gate_rule"
_OUTCOME = {"pass": "passed", "skipped": "passed", "warn": "warned", "quarantined": "quarantined", "FAIL": "failed"}
_RANK = {"passed": 0, "warned": 1, "quarantined": 2, "failed": 3}


def _tag_outcomes(ctx: RunContext, report) -> None:
    """Each expectation's worst outcome over the run's iterations as the tag ``trajflow.gate.<name>``
    and the worst of all as ``trajflow.gate`` (what a person filters runs by in MLflow); a resumed
    run starts from the tags its earlier sessions left."""
    if ctx.state.gate_outcomes is None:
        tags = ctx.tracker.client.get_run(ctx.tracker.run_id).data.tags
        ctx.state.gate_outcomes = {k[len(TAG_GATE) + 1:]: v for k, v in tags.items()
                                   if k.startswith(TAG_GATE + ".") and v in _RANK}
    worst, changed = ctx.state.gate_outcomes, {}
    for o in report.results:
        now = _OUTCOME.get(o.status, "failed")
        if _RANK[now] > _RANK.get(worst.get(o.name, "passed"), 0) or o.name not in worst:
            worst[o.name] = now
            changed[f"{TAG_GATE}.{o.name}"] = now
    if changed:
        changed[TAG_GATE] = max(worst.values(), key=_RANK.__getitem__, default="passed")
        ctx.tracker.set_tags(changed)


def _want_data_docs(when: str, report) -> bool:
    """``gates.data_docs``: ``on_failure`` (the default: ~4 MB of HTML per iteration is too much to
    write for every warning), ``on_warning`` (any expectation not passed) or ``never``."""
    if when == "never":
        return False
    if when == "on_failure":
        return not report.success
    return not all(o.status in ("pass", "skipped") for o in report.results)


def run_iteration_gate(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef) -> dict:
    """Validate one iteration's rewards and store the result as the iteration's ``gate.json``.

    Returns:
        ``{"success", "quarantined_sample_ids", "metrics", "score_mean"}``; ``score_mean`` is the
        iteration's mean finite score (:attr:`GateReport.score_mean`, None when undefined or the
        gate is disabled), the entry to append to the drift check's score history.

    Raises:
        GateFailed: a ``fail`` expectation failed (the iteration is marked ``gated``; nothing written
            so far is removed); the message ends with what the scorer raised, if it raised.
        DataError: with the gate off, a score is NaN or infinite
            (:func:`trajflow.gates.iteration.check_finite_scores`).
    """
    cfg = ctx.cfg
    if not cfg.gates.enabled:
        check_finite_scores(ctx.store.read_ref(reward), iteration, ctx.run_id)
        return {"success": True, "quarantined_sample_ids": [], "metrics": {}, "score_mean": None}

    t0 = time.perf_counter()
    view = gate_view(ctx.store.read_ref(rollout), ctx.store.read_ref(reward))
    report = run_gate(view, cfg.gates, cfg.rollout.max_new_tokens,
                      history=ctx.score_history[-cfg.gates.drift_window:])
    metrics = dict(report.metrics())
    metrics["timing_s/gate"] = time.perf_counter() - t0
    docs = None
    if _want_data_docs(cfg.gates.data_docs, report):  # a person will want GX's own page
        try:
            docs = write_data_docs(report, ctx.store.iteration_dir(iteration) / "data_docs")
        except Exception as e:  # data docs are a convenience; the JSON result is stored regardless
            log.warning("run %s: no gate data docs for iteration %d: %s", ctx.run_id, iteration, e)
    result = {"success": bool(report.success), "quarantined_sample_ids": sorted(report.quarantined_sample_ids),
              "quarantined_reason": {k: sorted(v) for k, v in report.quarantined_reason.items()},
              "metrics": metrics, "failures": report.failure_message() if not report.success else "",
              "expectations": [json_safe(o.to_json()) for o in report.results],
              "data_docs": None if docs is None else str(Path(docs).relative_to(ctx.store.iteration_dir(iteration))),
              "validation": report.gx_result_json}
    path = ctx.store.write_iteration_json(iteration, "gate.json", result)
    if ctx.tracker is not None:
        ctx.tracker.log_metrics(metrics, step=iteration)
        if not ctx.state.gate_thresholds_logged:
            # What each expectation accepts, as tags (mutable: a resumed run may change gates.* settings),
            # once per session: the suite and settings do not change within one.
            ctx.state.gate_thresholds_logged = True
            ctx.tracker.set_tags({f"{TAG_GATE_RULE}.{o.name}": f"{o.policy}: {o.details.get('threshold') or o.details.get('type')}"
                                 for o in report.results})
        _tag_outcomes(ctx, report)
        ctx.tracker.log_artifact(path, f"gates/iteration_{iteration:06d}")
        if docs is not None:
            ctx.tracker.log_artifact(Path(docs).parent, f"gates/iteration_{iteration:06d}/data_docs")
    if not report.success:
        ctx.store.mark(iteration, "gated", gate=result["failures"])
        # One line (the CLI's): each failed expectation, joined.
        failures = "; ".join(line for line in report.failure_message().splitlines() if line.strip())
        raise GateFailed(f"iteration {iteration} of run {ctx.run_id} failed its reward gate: {failures}"
                         f"{scorer_errors(view)}")
    # The drift check's history: mean over finite scores of rows whose scorer did not raise.
    score_mean = None if report.score_mean is None else float(report.score_mean)
    return {**{k: result[k] for k in ("success", "quarantined_sample_ids", "metrics")}, "score_mean": score_mean}
