"""Gates page: each iteration's data-quality gate result (``gate.json`` of the run)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards.common import run_picker, settings
from dashboards.data import gate_reports


@st.cache_data(ttl=15, show_spinner=False)
def _reports(root: str, run: str) -> list[dict]:
    return gate_reports(root, run)


def _mark(ok) -> str:
    return "—" if ok is None else ("pass" if ok else "FAIL")


def _colour(v) -> str:
    v = str(v)
    return "color: #1a7f37; font-weight: 600" if v.startswith("pass") else (
        "color: #cf222e; font-weight: 700" if v.startswith("FAIL") else "")


def _styled(df: pd.DataFrame):
    return df.style.map(_colour).format(precision=4)


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
          **{n: next((_mark(g["success"]) + (" (skipped)" if g["skipped"] else "")
                      for g in r["gates"] if g["gate"] == n), "—") for n in names}} for r in reports])
    st.table(_styled(overview), hide_index=True)
    for r in reversed(reports):
        icon = ":material/check_circle:" if r["success"] else ":material/error:"
        with st.expander(f"{icon} iteration {r['iteration']}: {_mark(r['success'])}", expanded=not r["success"]):
            if r["failures"]:
                st.error(r["failures"])
            if r["gates"]:
                details = pd.DataFrame(r["gates"])
                details["success"] = details["success"].map(_mark)
                st.table(_styled(details), hide_index=True)
