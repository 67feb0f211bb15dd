"""trajflow dashboard (Streamlit): runs and their curves, trajectory browser, gate results.

Start it with ``trajflow dashboard [--store ROOT] [--tracking-uri URI]`` (or
``streamlit run dashboards/app.py -- --store ROOT``). Pages: ``/`` runs, ``/trajectories``, ``/gates``.
Query parameters make views linkable: ``/?runs=a,b&metrics=critic/score/mean``,
``/trajectories?run=a&q=word``, ``/gates?run=a``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Streamlit runs this file as a script with only its own folder on sys.path; the pages import
# trajflow.dashboards, so the folder holding the trajflow package must be importable too: the
# checkout's root (dashboards/ is at its top level) or, installed, the one holding trajflow/dashboards/.
_HERE = Path(__file__).resolve().parent
_ROOT = str(_HERE.parents[1] if (_HERE.parent / "__init__.py").is_file() else _HERE.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from trajflow.infra.env import configure_environment  # noqa: E402

configure_environment()

import streamlit as st  # noqa: E402

from trajflow.dashboards.common import settings  # noqa: E402
from trajflow.dashboards.gates_page import gates_page  # noqa: E402
from trajflow.dashboards.runs_page import runs_page  # noqa: E402
from trajflow.dashboards.trajectories_page import trajectories_page  # noqa: E402

st.set_page_config(page_title="trajflow", layout="wide")
cfg = settings()
with st.sidebar:
    st.caption(f"store: `{cfg.store_root}`  \ntracking: `{cfg.tracking_uri}`")
st.navigation([
    st.Page(runs_page, title="Runs", url_path="runs", default=True),
    st.Page(trajectories_page, title="Trajectories", url_path="trajectories"),
    st.Page(gates_page, title="Gates", url_path="gates"),
]).run()
