"""Runs page: every MLflow run, and the curves of the selected runs (one chart per metric)."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from trajflow.dashboards.common import client, mlflow_ready, query_list, settings
from trajflow.dashboards.data import has_iterations, list_runs
from trajflow.dashboards.iteration_stats import ALL_EQUAL_METRIC, all_equal_group_share
from trajflow.compare import (DEFAULT_METRICS, Comparison, choose_metrics, compare_runs, fmt_duration,
                              fmt_value, metric_goal)
from trajflow.plots import PALETTE


@st.cache_data(ttl=15, show_spinner=False)
def _runs(uri: str) -> list[dict]:
    return list_runs(client(uri))


@st.cache_data(ttl=15, show_spinner=False)
def _metric_keys(uri: str, ids: tuple[str, ...]) -> list[str]:
    return sorted({k for i in ids for k in client(uri).get_run(i).data.metrics})


@st.cache_data(ttl=15, show_spinner="reading metrics from MLflow ...")
def _compare(uri: str, ids: tuple[str, ...], metrics: tuple[str, ...]) -> Comparison:
    return compare_runs(client(uri), list(ids), list(metrics), uri)


@st.cache_data(ttl=15, show_spinner=False)
def _all_equal(root: str, run: str) -> dict[int, float]:
    return all_equal_group_share(root, run) if has_iterations(root, run) else {}


def _axis_scale(values: list[float], pad: float, zero: bool = False):
    """A scale whose domain has room around its points.

    Vega-Lite gives one distinct value a zero-width domain: the axis then shows that value alone at full
    precision (``0.318750``) and a lone iteration's point sits on the plot edge, half clipped. Pad a
    degenerate domain by ``pad`` (or 10 % of the value) on each side.
    """
    import altair as alt

    if not values:
        return alt.Scale(zero=zero)
    lo, hi = min(values), max(values)
    if lo == hi:
        d = pad if pad else (abs(lo) * 0.1 or 1.0)
        return alt.Scale(domain=[lo - d, hi + d], zero=False, nice=False)
    return alt.Scale(zero=zero, padding=8)


def chart_spec(curves: dict[str, list[tuple[int, float]]], labels: list[str], metric: str):
    """One metric's curves as an Altair line chart, one coloured line (with points) per run.

    Args:
        curves: run label -> ``[(iteration, value)]``.
        labels: the runs in legend order (colours follow :data:`trajflow.plots.PALETTE`).
        metric: the chart's title.
    """
    import altair as alt

    rows = [{"run": label, "iteration": s, "value": v} for label in labels for s, v in curves.get(label, ())]
    data = pd.DataFrame(rows, columns=["run", "iteration", "value"])
    color = alt.Color("run:N", scale=alt.Scale(domain=labels, range=list(PALETTE[:len(labels)])),
                      legend=alt.Legend(orient="top", title=None, labelLimit=400))
    xs, ys = [r["iteration"] for r in rows], [r["value"] for r in rows]
    return (alt.Chart(data, title=metric).mark_line(point=alt.OverlayMarkDef(size=60), strokeWidth=2.5)
            .encode(x=alt.X("iteration:Q", scale=_axis_scale(xs, 0.5), axis=alt.Axis(tickMinStep=1)),
                    y=alt.Y("value:Q", title=None, scale=_axis_scale(ys, 0.0)),
                    color=color, tooltip=["run", "iteration", alt.Tooltip("value:Q", format=".6g")])
            .properties(height=240).interactive())


def _links(rows: list[dict], chosen: list[str], label: dict, cfg) -> None:
    """Per chosen run: its MLflow run and the Prefect flow run that trained it, as links."""
    by_id = {r["mlflow_run_id"]: r for r in rows}
    lines = []
    for i in chosen:
        r = by_id[i]
        parts = [f"[MLflow run]({cfg.mlflow_ui}/#/experiments/{r['experiment_id']}/runs/{i})"]
        if r.get("prefect_flow_run_id"):
            url = (f"{cfg.prefect_ui}/runs/flow-run/{r['prefect_flow_run_id']}" if cfg.prefect_ui
                   else r.get("prefect_flow_run_url"))
            parts.append(f"[Prefect flow run]({url})")
        else:
            parts.append("no Prefect flow run recorded")
        lines.append(f"- **{label[i]}**: " + " · ".join(parts))
    st.markdown("\n".join(lines))
    st.caption(f"MLflow UI: `{cfg.mlflow_ui}` (`mlflow ui --backend-store-uri {cfg.tracking_uri}`), Prefect UI: "
               f"`{cfg.prefect_ui}` (`prefect server start`); other addresses: `--mlflow-ui URL`, `--prefect-ui URL` "
               f"after `--` on the streamlit command line")


def runs_page() -> None:
    cfg = settings()
    st.title("Runs")
    if not mlflow_ready(cfg):
        return
    rows = _runs(cfg.tracking_uri)
    if not rows:
        st.info(f"No runs in `{cfg.tracking_uri}` yet.")
        return
    table = pd.DataFrame(rows)
    table["started"] = pd.to_datetime(table["started"], unit="ms").dt.strftime("%Y-%m-%d %H:%M:%S")
    table["wall"] = table.pop("wall_s").map(lambda s: fmt_duration(s) if pd.notna(s) else "running")
    table = table.drop(columns=["iterations_done", "prefect_flow_run_id", "prefect_flow_run_url", "experiment_id"])
    with st.expander(f"All runs ({len(rows)})", expanded=False):
        st.dataframe(table, hide_index=True, width="stretch")

    by_name = {}
    for r in rows:  # run names may repeat across experiments: label them by id then
        by_name.setdefault(r["run"], []).append(r["mlflow_run_id"])
    options = [r["mlflow_run_id"] for r in rows]
    label = {r["mlflow_run_id"]: (r["run"] if len(by_name[r["run"]]) == 1 else f"{r['run']} ({r['mlflow_run_id'][:8]})")
             for r in rows}
    wanted = query_list("runs")
    # By default the two newest training runs that finished an iteration (a run still at step 0 has no curve).
    trained = [r["mlflow_run_id"] for r in rows if r["kind"] == "train" and r["iterations_done"]]
    newest_training = trained[:2] or [r["mlflow_run_id"] for r in rows if r["kind"] == "train"][:2] or options[:2]
    default = list(dict.fromkeys(i for w in wanted for i in options if w in (i, label[i]))) or newest_training
    chosen = st.multiselect("Runs", options, default=default, format_func=label.get, key="runs")
    if not chosen:
        st.info("Pick runs to compare.")
        return
    available = _metric_keys(cfg.tracking_uri, tuple(chosen))
    # The share of groups with all-equal scores (zero advantage for GRPO-style estimators) is computed from
    # the stored trajectories of the runs with a folder in the store, and is one of the default curves.
    by_id = {r["mlflow_run_id"]: r["run"] for r in rows}
    equal_by_id = {i: sorted(_all_equal(cfg.store_root, by_id[i]).items()) for i in chosen}
    if any(equal_by_id.values()):
        available = available + [ALL_EQUAL_METRIC]
    default_metrics = [m for m in (query_list("metrics") or choose_metrics(None, available) + [ALL_EQUAL_METRIC])
                       if m in available] or \
        [m for m in DEFAULT_METRICS if m in available]
    metrics = st.multiselect("Metrics", available, default=default_metrics, key="metrics")
    st.query_params["runs"] = ",".join(label[i] for i in chosen)
    if metrics:
        st.query_params["metrics"] = ",".join(metrics)
    if not metrics:
        st.info("Pick metrics to plot.")
        return
    logged = [m for m in metrics if m != ALL_EQUAL_METRIC]
    cmp = _compare(cfg.tracking_uri, tuple(chosen), tuple(logged))
    _links(rows, chosen, label, cfg)

    labels = [r.label for r in cmp.runs]
    equal = {r.label: equal_by_id.get(r.mlflow_run_id, []) for r in cmp.runs}
    charts = [(m, equal if m == ALL_EQUAL_METRIC else {lab: cmp.curves[lab].get(m, []) for lab in labels})
              for m in metrics]
    cols = st.columns(2)
    for k, (m, curves) in enumerate(charts):
        with cols[k % 2]:
            st.altair_chart(chart_spec(curves, labels, m), width="stretch", height=320)

    st.subheader("Final and best values")
    summary = []
    for r in cmp.runs:
        row = {"run": r.label, "iterations": cmp.iterations.get(r.label), "wall time": fmt_duration(r.wall_s),
               "status": r.status}
        for m in logged:
            s = cmp.summary[r.label].get(m)
            row[f"{m} final"] = fmt_value(s.final if s else None)
            row[f"{m} best ({metric_goal(m)})"] = f"{fmt_value(s.best)} @ it {s.best_step}" if s else "—"
        summary.append(row)
    st.table(pd.DataFrame(summary).set_index("run"))
    if cmp.config_diff:
        st.subheader("Config differences")
        st.table(pd.DataFrame({"key": [k for k, _ in cmp.config_diff],
                               **{r.label: [str(v[i]) for _, v in cmp.config_diff] for i, r in enumerate(cmp.runs)}})
                 .set_index("key"))
    st.caption(f"read {time.strftime('%H:%M:%S')}; `trajflow compare {' '.join(r.mlflow_run_id for r in cmp.runs)}` "
               f"prints the same table in a terminal")
