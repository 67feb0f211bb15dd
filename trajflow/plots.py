"""PNG plots of metric curves (matplotlib, Agg canvas; no display, no pyplot global state).

Used at the end of a run (``plots/reward.png`` and ``plots/response_length.png`` in the run folder
and as MLflow artifacts, see :func:`log_run_plots`) and by ``trajflow compare`` (one subplot per metric, one line
per run, see :func:`plot_curves`).
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

log = logging.getLogger(__name__)

# matplotlib's tab10: the compare plot and the dashboard give the i-th run the same colour.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")

Series = Sequence[tuple[int, float]]


def run_color(i: int) -> str:
    """The colour of the ``i``-th run (0-based) in every trajflow plot."""
    return PALETTE[i % len(PALETTE)]


def metric_series(client, mlflow_run_id: str, name: str) -> list[tuple[int, float]]:
    """A metric's history as ``[(step, value), ...]`` sorted by step (step = iteration).

    A step logged twice (an iteration retried after a resume) keeps its newest value.

    Args:
        client: an ``mlflow.tracking.MlflowClient``.
        mlflow_run_id: the MLflow run id.
        name: the MLflow metric name (``@`` written as ``_at_``).

    Returns:
        ``(step, value)`` pairs; empty if the run never logged the metric.
    """
    newest: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(mlflow_run_id, name):
        if m.step not in newest or m.timestamp >= newest[m.step][0]:
            newest[m.step] = (m.timestamp, float(m.value))
    return [(step, newest[step][1]) for step in sorted(newest)]


def _figure(n_panels: int, width: float = 6.0, height: float = 3.2):
    from matplotlib.figure import Figure

    cols = 1 if n_panels == 1 else 2
    rows = math.ceil(n_panels / cols)
    fig = Figure(figsize=(width * cols, height * rows), dpi=100, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def plot_curves(curves: Mapping[str, Mapping[str, Series]], metrics: Sequence[str], path: str | Path,
                title: str | None = None) -> Path:
    """One subplot per metric, one line per run; x = iteration, y = the metric's value.

    Args:
        curves: run label -> metric name -> ``[(step, value), ...]``; run order sets the colours
            (:func:`run_color`).
        metrics: the metrics to draw, one subplot each, in this order.
        path: the PNG to write (its folder is created).
        title: an optional figure title.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``metrics`` is empty.
    """
    if not metrics:
        raise ValueError("plot_curves: no metrics to plot")
    fig, axes = _figure(len(metrics))
    for ax, metric in zip(axes, metrics):
        for i, (label, by_metric) in enumerate(curves.items()):
            pts = list(by_metric.get(metric, ()))
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.6, color=run_color(i), label=label)
        ax.set_title(metric, fontsize=10)
        ax.set_xlabel("iteration")
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _band_plot(path: Path, title: str, mean: Series, lo: Series, hi: Series, extra: Mapping[str, Series],
               ylabel: str) -> Path:
    fig, (ax,) = _figure(1, width=7.0, height=3.6)
    if lo and hi:
        lo_d, hi_d = dict(lo), dict(hi)
        steps = [s for s in sorted(lo_d) if s in hi_d]
        ax.fill_between(steps, [lo_d[s] for s in steps], [hi_d[s] for s in steps], color=run_color(0), alpha=0.15,
                        label="min-max")
    if mean:
        xs, ys = zip(*mean)
        ax.plot(xs, ys, marker="o", markersize=3, color=run_color(0), label="mean")
    for i, (label, series) in enumerate(extra.items(), start=1):
        if series:
            xs, ys = zip(*series)
            ax.plot(xs, ys, marker="s", markersize=3, linestyle="--", color=run_color(i), label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if ax.lines or ax.collections:
        ax.legend(fontsize=8)
    fig.savefig(path)
    return path


def run_plots(client, mlflow_run_id: str, out_dir: str | Path, run_name: str | None = None) -> list[Path]:
    """Write ``reward.png`` and ``response_length.png`` for one run.

    ``reward.png``: ``critic/score/mean`` with its min-max band per iteration, plus every
    ``val-core/*`` curve. ``response_length.png``: ``response_length/mean`` with its min-max band.

    Args:
        client: an ``mlflow.tracking.MlflowClient``.
        mlflow_run_id: the MLflow run id.
        out_dir: folder for the PNGs (created).
        run_name: shown in the titles (default: the MLflow run id).

    Returns:
        The written paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = run_name or mlflow_run_id
    keys = client.get_run(mlflow_run_id).data.metrics.keys()
    val = {k: metric_series(client, mlflow_run_id, k) for k in sorted(keys) if k.startswith("val-core/")}

    def s(k: str) -> list[tuple[int, float]]:
        return metric_series(client, mlflow_run_id, k) if k in keys else []

    return [
        _band_plot(out / "reward.png", f"{name}: reward (critic/score)", s("critic/score/mean"),
                   s("critic/score/min"), s("critic/score/max"), val, "score"),
        _band_plot(out / "response_length.png", f"{name}: response length", s("response_length/mean"),
                   s("response_length/min"), s("response_length/max"), {}, "tokens"),
    ]


def log_run_plots(tracker, run_name: str | None = None, out_dir: str | Path | None = None) -> list[str]:
    """Write the end-of-run plots (the learning curve ``reward.png``: training score and held-out
    accuracy per iteration; ``response_length.png``) and log them as MLflow artifacts under ``plots/``.

    Args:
        tracker: the run's :class:`trajflow.tracking.Tracker`.
        run_name: shown in the titles.
        out_dir: where the PNGs stay (the run folder's ``plots/``); ``None``: only in MLflow.

    Returns:
        The artifact paths (``plots/reward.png``, ``plots/response_length.png``).
    """
    with tempfile.TemporaryDirectory(prefix="trajflow-plots-") as tmp:
        paths = run_plots(tracker.client, tracker.run_id, out_dir if out_dir is not None else tmp, run_name)
        for p in paths:
            tracker.log_artifact(p, "plots")
        return [f"plots/{p.name}" for p in paths]
