"""Gates page: each iteration's data-quality gate result (``gate.json`` of the run): per expectation
its status, policy, threshold and observed value; failing rows link to the trajectory browser."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from trajflow.dashboards.common import run_picker, settings
from trajflow.dashboards.data import gate_reports


@st.cache_data(ttl=15, show_spinner=False)
def _reports(root: str, run: str) -> list[dict]:
    return gate_reports(root, run)


def _mark(ok) -> str:
    return "—" if ok is None else ("pass" if ok else "FAIL")


#: How a status looks: a blocking failure must not look like a warning.
STATUS_STYLE = {"pass": "color: #1a7f37; font-weight: 600", "FAIL": "color: #cf222e; font-weight: 700",
                "warn": "color: #9a6700; font-weight: 600", "quarantined": "color: #8250df; font-weight: 600",
                "skipped": "color: #57606a"}


def _colour(v) -> str:
    v = str(v)
    return next((style for status, style in STATUS_STYLE.items() if v.startswith(status)), "")


def _styled(df: pd.DataFrame, status_columns):
    return df.style.map(_colour, subset=list(status_columns)).format(precision=4)


def gates_page() -> None:
    cfg = settings()
    st.title("Gates")
    run = run_picker(key="gates_run")
    if run is None:
        return
    reports = _reports(cfg.store_root, run)
    if not reports:
        st.info(f"Run {run} has no gate results (gates.enabled=false, or no iteration reached the gate yet).")
        return
    failed = [r["iteration"] for r in reports if not r["success"]]
    st.markdown(f"**{len(reports)} iterations gated**, " + (f"failed: {failed}" if failed else "all passed"))
    names = sorted({g["gate"] for r in reports for g in r["gates"]})
    overview = pd.DataFrame(
        [{"iteration": r["iteration"], "result": _mark(r["success"]), "quarantined": r["quarantined"],
          **{n: next(((g["status"] or _mark(g["success"])) if not g["skipped"] else "skipped"
                      for g in r["gates"] if g["gate"] == n), "—") for n in names}} for r in reports])
    st.table(_styled(overview, ["result", *names]), hide_index=True)
    for r in reversed(reports):
        warned = [g["gate"] for g in r["gates"] if g["status"] in ("warn", "quarantined")]
        icon = ":material/error:" if not r["success"] else (":material/warning:" if warned else ":material/check_circle:")
        title = f"{icon} iteration {r['iteration']}: {_mark(r['success'])}" + (f" · warnings: {', '.join(warned)}"
                                                                             if warned else "")
        with st.expander(title, expanded=not r["success"] or bool(warned)):
            if r["failures"]:
                st.error(r["failures"])
            if r["gates"]:
                details = pd.DataFrame([{"gate": g["gate"], "status": g["status"] or _mark(g["success"]),
                                         "policy": g["policy"], "expected": g["expected"], "observed": g["observed"],
                                         "rows": g["unexpected_count"]} for g in r["gates"]])
                details["rows"] = details["rows"].astype("Int64")
                st.table(_styled(details, ["status"]), hide_index=True)
            for g in r["gates"]:
                if g["sample_ids"]:
                    links = " ".join(f"[{sid}](/trajectories?run={run}&sample={sid})" for sid in g["sample_ids"][:10])
                    st.markdown(f"`{g['gate']}` rows: {links}")
            if r["data_docs"]:
                st.caption(f"Great Expectations Data Docs: `{r['data_docs']}`")
