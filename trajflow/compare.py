"""``trajflow compare``: runs side by side from MLflow (terminal table + PNG of the metric curves).

A run is named by its MLflow run id (or a unique prefix of at least 6 characters), its MLflow run
name, or its ``trajflow.run_id`` tag (trajflow sets run name = tag = the trajflow run id; of a
resumed run's sessions, the newest segment is meant, see :mod:`trajflow.tracking`), in any
experiment of the tracking store: the SQLite store under ``--store`` (default ``runs``) or any
``--tracking-uri`` (e.g. ``http://mlflow.internal:5000``).

For each run the table shows iterations (completed/configured), wall time (MLflow start to end),
git commit, parent run (replays), the final and best value of each chosen metric, and the config
keys (MLflow params) whose values differ between the runs. The PNG has one subplot per metric and
one line per run (:func:`trajflow.plots.plot_curves`).
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from trajflow.errors import CompareError
from trajflow.metric_names import GLOB_CHARS, metric_name
from trajflow.plots import metric_series, plot_curves, run_color
from trajflow.tracking import (TAG_FROM_STAGE, TAG_PARENT_ITERATION, TAG_PARENT_RUN, TAG_SUPERSEDED_BY,
                               store_tracking_uri)

DEFAULT_METRICS = ("critic/score/mean", "response_length/mean")
DEFAULT_METRIC_PATTERNS = ("val-core/*",)
ITERATION_METRIC = "timing_s/step"  # logged once per finished iteration
MISSING = "—"

# Lower is better for these (substring match on the metric name); everything else: higher is better.
_LOWER_IS_BETTER = ("loss", "timing_s/", "timing_per_token_ms/", "ppo_kl", "clipfrac", "clip_ratio", "scorer_errors", "memory",
                    "_gb", "gate/failed", "gate/warnings", "gate/quarantined", "/unexpected_count",
                    "grad_norm")


def metric_goal(name: str) -> str:
    """``"min"`` when a lower value is better (losses, timings, KL, clip fractions, ...), else ``"max"``."""
    return "min" if any(p in name for p in _LOWER_IS_BETTER) else "max"


@dataclass(frozen=True)
class MetricSummary:
    """Final and best value of one metric of one run.

    Attributes:
        final: the value at the last logged step; final_step: that step (iteration).
        best: max or min over all steps (per ``goal``); best_step: the first step reaching it.
        goal: ``"max"`` or ``"min"``.
    """

    final: float
    final_step: int
    best: float
    best_step: int
    goal: str


def summarize(series: Sequence[tuple[int, float]], goal: str) -> MetricSummary | None:
    """Final and best of a ``[(step, value), ...]`` series sorted by step; NaNs are skipped.

    Returns:
        ``None`` when the series has no finite value.
    """
    pts = [(s, v) for s, v in series if math.isfinite(v)]
    if not pts:
        return None
    final_step, final = pts[-1]
    pick = max if goal == "max" else min
    best = pick(v for _, v in pts)
    best_step = next(s for s, v in pts if v == best)
    return MetricSummary(final, final_step, best, best_step, goal)


@dataclass
class RunInfo:
    """What the table needs about one MLflow run."""

    mlflow_run_id: str
    name: str
    experiment: str
    status: str
    start_ms: int | None
    end_ms: int | None
    tags: dict
    params: dict
    metric_keys: list
    label: str = ""

    @property
    def wall_s(self) -> float | None:
        """Seconds from MLflow run start to end (to now while it runs); None without a start time."""
        if not self.start_ms:
            return None
        end = self.end_ms if self.end_ms else time.time() * 1000
        return (end - self.start_ms) / 1000.0


@dataclass
class Comparison:
    """The result of :func:`compare_runs` (what the table and the plot show)."""

    tracking_uri: str
    runs: list[RunInfo]
    metrics: list[str]
    curves: dict = field(default_factory=dict)       # label -> metric -> [(step, value)]
    summary: dict = field(default_factory=dict)      # label -> metric -> MetricSummary | None
    iterations: dict = field(default_factory=dict)   # label -> completed iterations
    config_diff: list = field(default_factory=list)  # [(key, [value per run])]

    def to_json(self) -> dict:
        """Plain data: per run its ids, iterations, wall time, and final/best of each metric."""
        out = {"tracking_uri": self.tracking_uri, "metrics": self.metrics, "runs": [],
               "config_diff": {k: v for k, v in self.config_diff}}
        for r in self.runs:
            out["runs"].append({
                "label": r.label, "name": r.name, "mlflow_run_id": r.mlflow_run_id, "experiment": r.experiment,
                "status": r.status, "iterations": self.iterations.get(r.label), "wall_s": r.wall_s,
                "metrics": {m: (vars(s) if s else None) for m, s in self.summary.get(r.label, {}).items()}})
        return out


# ----------------------------------------------------------------------------------------- store access

def open_client(store_root: str | Path = "runs", tracking_uri: str | None = None):
    """An ``MlflowClient`` for ``tracking_uri`` or the SQLite store under ``store_root``.

    Returns:
        ``(client, uri)``.

    Raises:
        CompareError: no ``mlflow.db`` under ``store_root`` (and no ``tracking_uri``); the SQLite
            store is never created by a reader.
    """
    from mlflow.tracking import MlflowClient

    if not tracking_uri:
        db = Path(store_root).expanduser().resolve() / "mlflow.db"
        if not db.exists():
            raise CompareError(f"no MLflow store at {db} (--store {store_root}); pass the store root of your "
                               f"runs with --store or an MLflow server with --tracking-uri")
        tracking_uri = store_tracking_uri(store_root)
    return MlflowClient(tracking_uri=tracking_uri), tracking_uri


def experiments(client) -> dict[str, str]:
    """Every active experiment of the tracking store.

    Args:
        client: an ``MlflowClient``.

    Returns:
        Experiment id -> experiment name (all result pages read).
    """
    out, token = {}, None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        out.update({e.experiment_id: e.name for e in page})
        token = getattr(page, "token", None)
        if not token:
            return out


def search(client, exps: dict[str, str], filter_string: str = "", max_results: int = 1000) -> list:
    """The runs of the given experiments that match an MLflow filter, newest first.

    Args:
        client: an ``MlflowClient``.
        exps: experiment id -> name (see :func:`experiments`); the runs of these experiments are searched.
        filter_string: an MLflow search filter (``attributes.run_name = 'a'``); empty: every run.
        max_results: at most this many runs.

    Returns:
        ``mlflow.entities.Run`` objects by start time, newest first; ``[]`` when ``exps`` is empty.
    """
    if not exps:
        return []
    return list(client.search_runs(list(exps), filter_string=filter_string, max_results=max_results,
                                   order_by=["attributes.start_time DESC"]))


def _describe(run, exps: dict[str, str]) -> str:
    return f"{run.info.run_name} ({run.info.run_id}, experiment {exps.get(run.info.experiment_id, '?')!r})"


def resolve_run(client, token: str, exps: dict[str, str] | None = None):
    """The MLflow run a user-given name refers to.

    Args:
        client: an ``MlflowClient``.
        token: an MLflow run id, a unique prefix of one (>= 6 characters), an MLflow run name or a
            ``trajflow.run_id`` tag value.
        exps: experiment id -> name (looked up when omitted).

    Returns:
        An ``mlflow.entities.Run``.

    Raises:
        CompareError: no run matches (the message lists close matches) or several runs share the
            name (the message lists their MLflow ids).
    """
    from mlflow.exceptions import MlflowException

    exps = experiments(client) if exps is None else exps
    if re.fullmatch(r"[0-9a-f]{32}", token):
        try:
            return client.get_run(token)
        except MlflowException:
            pass
    matches: dict[str, object] = {}
    if "'" not in token and "\\" not in token:
        for flt in (f"attributes.run_name = '{token}'", f"tags.\"trajflow.run_id\" = '{token}'"):
            for r in search(client, exps, flt):
                matches[r.info.run_id] = r
    if not matches:
        everything = search(client, exps, max_results=5000)
        if len(token) >= 6:
            for r in everything:
                if r.info.run_id.startswith(token):
                    matches[r.info.run_id] = r
        if not matches:
            names = sorted({r.info.run_name for r in everything if r.info.run_name})
            close = difflib.get_close_matches(token, names + [r.info.run_id for r in everything], n=5, cutoff=0.5)
            if close:
                hint = "close matches: " + ", ".join(close)
            elif names:
                hint = f"{len(names)} runs there, e.g. " + ", ".join(names[:5])
            else:
                hint = "it holds no runs"
            raise CompareError(f"unknown run {token!r} in {client.tracking_uri}; {hint}")
    if len(matches) > 1:
        # A resumed run's earlier sessions share its name; the newest segment holds its whole history.
        current = {k: r for k, r in matches.items() if TAG_SUPERSEDED_BY not in r.data.tags}
        if len(current) == 1:
            matches = current
    if len(matches) > 1:
        listed = "; ".join(_describe(r, exps) for r in matches.values())
        raise CompareError(f"run name {token!r} is ambiguous in {client.tracking_uri}: {listed}; "
                           f"name the run by its MLflow run id")
    return next(iter(matches.values()))


def _run_info(run, exps: dict[str, str]) -> RunInfo:
    return RunInfo(mlflow_run_id=run.info.run_id, name=run.info.run_name or run.info.run_id,
                   experiment=exps.get(run.info.experiment_id, run.info.experiment_id), status=run.info.status,
                   start_ms=run.info.start_time, end_ms=run.info.end_time, tags=dict(run.data.tags),
                   params=dict(run.data.params), metric_keys=sorted(run.data.metrics))


def choose_metrics(requested: Sequence[str] | None, available: Sequence[str]) -> list[str]:
    """The metrics to show: requested names/globs (verl ``@`` names accepted) or the defaults.

    Defaults: ``critic/score/mean``, ``response_length/mean`` and every ``val-core/*`` metric logged
    by any of the runs.

    Raises:
        CompareError: a requested name or pattern matches no metric of any run (close matches listed).
    """
    avail = sorted(set(available))
    if not requested:
        out = list(DEFAULT_METRICS)
        for pat in DEFAULT_METRIC_PATTERNS:
            out += [m for m in avail if fnmatch.fnmatchcase(m, pat) and m not in out]
        return out
    out: list[str] = []
    for raw in requested:
        name = metric_name(raw.strip(), keep=GLOB_CHARS)
        hits = [m for m in avail if fnmatch.fnmatchcase(m, name)] if any(c in name for c in "*?[") else (
            [name] if name in avail else [])
        if not hits:
            close = difflib.get_close_matches(name, avail, n=4, cutoff=0.5)
            hint = ("did you mean " + ", ".join(repr(c) for c in close)) if close else \
                f"logged metrics include {', '.join(avail[:6])}, ..."
            raise CompareError(f"--metric {raw!r}: no run logged it; {hint}")
        out += [h for h in hits if h not in out]
    return out


def compare_runs(client, tokens: Sequence[str], metrics: Sequence[str] | None = None,
                 tracking_uri: str = "") -> Comparison:
    """Resolve the runs and collect everything the table and plot show.

    Args:
        client: an ``MlflowClient``.
        tokens: the runs, as accepted by :func:`resolve_run` (at least one).
        metrics: metric names or glob patterns (default: see :func:`choose_metrics`).
        tracking_uri: shown in the table title.

    Raises:
        CompareError: no runs given, a run is unknown/ambiguous or given twice, or a metric is unknown.
    """
    if not tokens:
        raise CompareError("name at least one run to compare")
    exps = experiments(client)
    infos: list[RunInfo] = []
    for tok in tokens:
        info = _run_info(resolve_run(client, tok, exps), exps)
        if any(i.mlflow_run_id == info.mlflow_run_id for i in infos):
            raise CompareError(f"run {tok!r} is named twice ({info.name}, {info.mlflow_run_id})")
        infos.append(info)
    names = [i.name for i in infos]
    for i in infos:
        i.label = i.name if names.count(i.name) == 1 else f"{i.name} ({i.mlflow_run_id[:8]})"
    chosen = choose_metrics(metrics, [k for i in infos for k in i.metric_keys])
    cmp = Comparison(tracking_uri=tracking_uri or client.tracking_uri, runs=infos, metrics=chosen)
    for i in infos:
        cmp.curves[i.label] = {m: metric_series(client, i.mlflow_run_id, m) for m in chosen if m in i.metric_keys}
        cmp.summary[i.label] = {m: summarize(cmp.curves[i.label].get(m, ()), metric_goal(m)) for m in chosen}
        steps = ({s for s, _ in metric_series(client, i.mlflow_run_id, ITERATION_METRIC)}
                 if ITERATION_METRIC in i.metric_keys else {s for c in cmp.curves[i.label].values() for s, _ in c})
        cmp.iterations[i.label] = len({s for s in steps if s >= 1})
    keys = sorted({k for i in infos for k in i.params})
    for k in keys:
        vals = [i.params.get(k, MISSING) for i in infos]
        if len(set(vals)) > 1:
            cmp.config_diff.append((k, vals))
    return cmp


# ----------------------------------------------------------------------------------------- output

def fmt_value(v: float | None) -> str:
    """A metric value as printed in the table: 6 significant digits (``8``, ``0.123457``, ``1.5e-05``)."""
    if v is None:
        return MISSING
    return f"{v:.6g}"


def fmt_duration(s: float | None) -> str:
    """Seconds as ``42.1s``, ``3m 07s`` or ``2h 05m``."""
    if s is None:
        return MISSING
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m {int(s % 60):02d}s"
    return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"


def table(cmp: Comparison):
    """The comparison as a ``rich.table.Table``: one column per run, best run per metric in bold."""
    from rich.table import Table

    t = Table(title=f"trajflow compare: {len(cmp.runs)} runs from {cmp.tracking_uri}", title_justify="left",
              show_lines=False)
    t.add_column("", style="bold", no_wrap=True)
    for i, r in enumerate(cmp.runs):
        t.add_column(r.label, style=None, header_style=f"bold {run_color(i)}", no_wrap=True)

    def row(label: str, values: list[str], styles: list[str] | None = None) -> None:
        cells = [v if not styles or not styles[j] else f"[{styles[j]}]{v}[/]" for j, v in enumerate(values)]
        t.add_row(label, *cells)

    runs = cmp.runs
    row("mlflow run id", [r.mlflow_run_id for r in runs])
    row("experiment", [r.experiment for r in runs])
    row("status", [r.status for r in runs])
    total = [r.params.get("trainer.total_iterations") for r in runs]
    row("iterations", [f"{cmp.iterations.get(r.label, 0)}/{tot}" if tot else str(cmp.iterations.get(r.label, 0))
                       for r, tot in zip(runs, total)])
    row("wall time", [fmt_duration(r.wall_s) + (" (running)" if r.status == "RUNNING" else "") for r in runs])
    row("git commit", [(r.tags.get("mlflow.source.git.commit") or MISSING)[:10] for r in runs])
    if any(TAG_PARENT_RUN in r.tags for r in runs):
        row("parent run", [f"{r.tags[TAG_PARENT_RUN]} it {r.tags.get(TAG_PARENT_ITERATION, '?')} "
                           f"from {r.tags.get(TAG_FROM_STAGE, '?')}" if TAG_PARENT_RUN in r.tags else MISSING
                           for r in runs])
    t.add_section()
    for m in cmp.metrics:
        goal = metric_goal(m)
        sums = [cmp.summary[r.label].get(m) for r in runs]
        bests = [s.best for s in sums if s]
        winner = (max(bests) if goal == "max" else min(bests)) if bests else None
        row(f"{m} final", [fmt_value(s.final if s else None) for s in sums])
        row(f"{m} best ({goal})", [f"{fmt_value(s.best)} @ it {s.best_step}" if s else MISSING for s in sums],
            ["bold green" if s and len(bests) > 1 and s.best == winner else "" for s in sums])
    if cmp.config_diff:
        t.add_section()
        for k, vals in cmp.config_diff:
            row(k, [str(v) for v in vals])
    else:
        t.add_section()
        row("config", ["identical" for _ in runs])
    return t


def console_for_output():
    """A rich Console: terminal width on a terminal, 240 columns when piped (no wrapped cells)."""
    from rich.console import Console

    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=240)


def write_outputs(cmp: Comparison, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``compare.png`` (one subplot per metric, one line per run) and ``compare.json``.

    Returns:
        ``(png_path, json_path)``.
    """
    out = Path(out_dir)
    png = plot_curves(cmp.curves, cmp.metrics, out / "compare.png",
                      title="trajflow compare: " + " vs ".join(r.label for r in cmp.runs))
    js = out / "compare.json"
    js.write_text(json.dumps(cmp.to_json(), indent=2, default=str))
    return png, js


def run_compare(tokens: Sequence[str], metrics: Sequence[str] | None = None, out_dir: str | Path = ".",
                store_root: str | Path = "runs", tracking_uri: str | None = None, console=None) -> Comparison:
    """What ``trajflow compare`` does: resolve, print the table, write the PNG (and JSON).

    Raises:
        CompareError: see :func:`open_client`, :func:`compare_runs`.
    """
    client, uri = open_client(store_root, tracking_uri)
    cmp = compare_runs(client, tokens, metrics, uri)
    console = console or console_for_output()
    console.print(table(cmp))
    png, js = write_outputs(cmp, out_dir)
    console.print(f"plot: {png}\ntable data: {js}", soft_wrap=True)
    return cmp
