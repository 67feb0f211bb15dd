"""Prefect artifacts for runs: one markdown table of metrics per iteration (and per evaluation),
with a link to the MLflow run that holds the full history.

The table shows the metrics a person checks first (scores, validation accuracy, losses, lengths,
speed); everything else is in MLflow. Artifact keys group one run's tables: the UI shows the newest
under the key and the earlier ones as its history.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Mapping
from uuid import UUID

from trajflow.metric_names import metric_name

log = logging.getLogger(__name__)

#: Metrics shown in an iteration's table: exact names, or prefixes ending in ``/``.
SHOWN_METRICS = ("critic/score/mean", "critic/score/max", "critic/score/min", "val-core/", "actor/pg_loss",
                 "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss", "actor/grad_norm",
                 "response_length/mean", "response_length/clip_ratio", "gate/", "timing_s/step",
                 "perf/throughput")


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key from ``parts``: lowercase letters, digits and single dashes only.

    >>> artifact_key("grpo_default-20261129-151146-e145", "metrics")
    'grpo-default-20261129-151146-e145-metrics'
    """
    key = re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")
    return key or "trajflow"


def mlflow_run_url(ui_url: str | None, experiment_id: str | None, mlflow_run_id: str | None) -> str | None:
    """The MLflow UI page of a run (``<ui_url>/#/experiments/<id>/runs/<run id>``); None without a UI URL."""
    if not ui_url or not experiment_id or not mlflow_run_id:
        return None
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{mlflow_run_id}"


def _shown(name: str) -> bool:
    return any(name.startswith(p) if p.endswith("/") else name == p for p in SHOWN_METRICS)


def _fmt(value: float) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def metrics_markdown(title: str, metrics: Mapping[str, float], *, mlflow_url: str | None = None,
                     mlflow_run_id: str | None = None, tracking_uri: str | None = None,
                     details: Mapping[str, str] | None = None, all_metrics: bool = False) -> str:
    """A markdown report: title, details lines, a ``| metric | value |`` table and the MLflow link.

    Args:
        title: the heading (e.g. ``run X, iteration 3``).
        metrics: metric name -> value (verl names).
        mlflow_url: the MLflow UI page of the run (a link), if known.
        mlflow_run_id: the MLflow run id (shown when there is no UI URL).
        tracking_uri: the MLflow tracking URI (shown when there is no UI URL).
        details: extra ``key: value`` lines shown above the table.
        all_metrics: show every metric instead of :data:`SHOWN_METRICS`.

    Returns:
        Markdown text.
    """
    lines = [f"### {title}", ""]
    for k, v in (details or {}).items():
        lines.append(f"- **{k}**: {v}")
    if mlflow_url:
        lines.append(f"- **MLflow**: [run {mlflow_run_id or ''}]({mlflow_url})")
    elif mlflow_run_id:
        where = f" at `{tracking_uri}`" if tracking_uri else ""
        lines.append(f"- **MLflow**: run `{mlflow_run_id}`{where} (set `tracking.ui_url` for a link)")
    lines += ["", "| metric | value |", "|---|---|"]
    for name in sorted(metrics):
        if all_metrics or _shown(name):
            lines.append(f"| `{metric_name(name)}` | {_fmt(metrics[name])} |")  # MLflow's spelling, as everywhere
    return "\n".join(lines) + "\n"


def iteration_artifact(ctx, iteration: int, metrics: Mapping[str, float]) -> UUID | None:
    """Publish the iteration's metrics table as a Prefect markdown artifact of the current flow run.

    Args:
        ctx: the run (:class:`trajflow.run.context.RunContext` with a tracker).
        iteration: the finished iteration.
        metrics: its metrics (as logged to MLflow).

    Returns:
        The artifact id; None outside a Prefect flow run.
    """
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return None
    tracker = ctx.tracker
    mlflow_id = getattr(tracker, "run_id", None)
    url = mlflow_run_url(ctx.cfg.tracking.ui_url, getattr(tracker, "experiment_id", None), mlflow_id)
    total = ctx.cfg.trainer.total_iterations
    md = metrics_markdown(f"{ctx.run_id}: iteration {iteration}/{total}", metrics, mlflow_url=url,
                          mlflow_run_id=mlflow_id, tracking_uri=getattr(tracker, "uri", None),
                          details={"run": f"`{ctx.run_id}`", "run folder": f"`{ctx.store.run_dir}`",
                                   "policy version": str(ctx.policy_version)})
    return publish(md, artifact_key(ctx.run_id, "metrics"), f"trajflow run {ctx.run_id}, iteration {iteration}")


def publish(markdown: str, key: str, description: str) -> UUID | None:
    """Create a markdown artifact; a failure is logged, never raised (a report must not stop a run)."""
    from prefect.artifacts import create_markdown_artifact

    try:
        return create_markdown_artifact(markdown, key=key, description=description)
    except Exception as e:  # the API is unreachable, ...: the metrics are in MLflow anyway
        log.warning("could not create the Prefect artifact %s: %s", key, e)
        return None


def rename_flow_run(name: str) -> None:
    """Rename the current flow run (a name can include the run id only once the id is chosen).

    A no-op outside a flow run; a failure is logged, never raised.
    """
    from prefect import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(UUID(flow_run.id), name=name)
    except Exception as e:
        log.warning("could not rename flow run %s to %s: %s", flow_run.id, name, e)


class _ExpectedErrorFilter(logging.Filter):
    """Drop Prefect's console records of a :class:`~trajflow.errors.TrajflowError` (a failed gate, bad
    input): the CLI prints its message once, as one line; Prefect would print its traceback for the
    task and the flow, then the message again in each run's final state."""

    def filter(self, record: logging.LogRecord) -> bool:
        from trajflow.errors import TrajflowError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, TrajflowError):
            return False
        if record.levelno >= logging.INFO and record.name.startswith("prefect"):
            msg = record.getMessage()
            return not ("Failed(" in msg and any(f"{name}:" in msg for name in _error_names()))
        return True


def _error_names() -> set[str]:
    from trajflow.errors import TrajflowError

    names, todo = set(), [TrajflowError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def quiet_expected_errors() -> None:
    """Install :class:`_ExpectedErrorFilter` on the handlers of Prefect's loggers (once). Prefect
    configures them when the first flow starts, so a flow calls this first."""
    seen: set[int] = set()
    for name in ("prefect", "prefect.flow_runs", "prefect.task_runs", ""):
        for handler in logging.getLogger(name).handlers:
            if id(handler) in seen or any(isinstance(f, _ExpectedErrorFilter) for f in handler.filters):
                continue
            if getattr(handler, "keeps_everything", False):  # the run's log file keeps the tracebacks
                continue
            seen.add(id(handler))
            handler.addFilter(_ExpectedErrorFilter())
