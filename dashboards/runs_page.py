"""Runs page: every MLflow run, and the curves of the selected runs (one chart per metric)."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from dashboards.common import client, mlflow_ready, query_list, settings
from dashboards.data import list_runs
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


def _chart(cmp: Comparison, metric: str):
    import altair as alt

    rows = [{"run": r.label, "iteration": s, "value": v} for r in cmp.runs for s, v in cmp.curves[r.label].get(metric, ())]
    labels = [r.label for r in cmp.runs]
    data = pd.DataFrame(rows, columns=["run", "iteration", "value"])
    color = alt.Color("run:N", scale=alt.Scale(domain=labels, range=list(PALETTE[:len(labels)])),
                      legend=alt.Legend(orient="top", title=None, labelLimit=400))
    return (alt.Chart(data, title=metric).mark_line(point=True, strokeWidth=2.5)
            .encode(x=alt.X("iteration:Q", axis=alt.Axis(tickMinStep=1)),
                    y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False)),
                    color=color, tooltip=["run", "iteration", alt.Tooltip("value:Q", format=".6g")])
            .properties(height=240).interactive())


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
    with st.expander(f"All runs ({len(rows)})", expanded=False):
        st.dataframe(table, hide_index=True, width="stretch")

    by_name = {}
    for r in rows:  # run names may repeat across experiments: label them by id then
        by_name.setdefault(r["run"], []).append(r["mlflow_run_id"])
    options = [r["mlflow_run_id"] for r in rows]
    label = {r["mlflow_run_id"]: (r["run"] if len(by_name[r["run"]]) == 1 else f"{r['run']} ({r['mlflow_run_id'][:8]})")
             for r in rows}
    wanted = query_list("runs")
    newest_training = [r["mlflow_run_id"] for r in rows if r["kind"] == "train"][:2] or options[:2]
    default = list(dict.fromkeys(i for w in wanted for i in options if w in (i, label[i]))) or newest_training
    chosen = st.multiselect("Runs", options, default=default, format_func=label.get, key="runs")
    if not chosen:
        st.info("Pick runs to compare.")
        return
    available = _metric_keys(cfg.tracking_uri, tuple(chosen))
    default_metrics = [m for m in (query_list("metrics") or choose_metrics(None, available)) if m in available] or \
        [m for m in DEFAULT_METRICS if m in available]
    metrics = st.multiselect("Metrics", available, default=default_metrics, key="metrics")
    st.query_params["runs"] = ",".join(label[i] for i in chosen)
    if metrics:
        st.query_params["metrics"] = ",".join(metrics)
    if not metrics:
        st.info("Pick metrics to plot.")
        return
    cmp = _compare(cfg.tracking_uri, tuple(chosen), tuple(metrics))

    cols = st.columns(2)
    for k, m in enumerate(metrics):
        with cols[k % 2]:
            st.altair_chart(_chart(cmp, m), width="stretch", height=320)

    st.subheader("Final and best values")
    summary = []
    for r in cmp.runs:
        row = {"run": r.label, "iterations": cmp.iterations.get(r.label), "wall time": fmt_duration(r.wall_s),
               "status": r.status}
        for m in metrics:
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
