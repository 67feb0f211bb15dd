"""Settings and cached data access shared by the dashboard pages."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from trajflow.dashboards.data import has_iterations, store_runs
from trajflow.tracking import store_tracking_uri


@dataclass(frozen=True)
class Settings:
    store_root: str
    tracking_uri: str
    mlflow_ui: str      # base URL of the MLflow UI the run links point at
    prefect_ui: str     # base URL of the Prefect UI (flow-run links)


@st.cache_resource
def settings() -> Settings:
    """``--store`` / ``--tracking-uri`` / ``--mlflow-ui`` / ``--prefect-ui`` after ``--`` on the streamlit
    command line, else ``TRAJFLOW_STORE`` / ``TRAJFLOW_TRACKING_URI`` / ``TRAJFLOW_MLFLOW_UI`` /
    ``PREFECT_UI_URL``, else ``runs`` and its SQLite store, the tracking URI itself when it is an
    MLflow server (else ``mlflow ui``'s default http://127.0.0.1:5000) and ``prefect server start``'s
    default http://127.0.0.1:4200."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--store", default=os.environ.get("TRAJFLOW_STORE", "runs"))
    p.add_argument("--tracking-uri", default=os.environ.get("TRAJFLOW_TRACKING_URI"))
    p.add_argument("--mlflow-ui", default=os.environ.get("TRAJFLOW_MLFLOW_UI"))
    p.add_argument("--prefect-ui", default=os.environ.get("PREFECT_UI_URL") or "http://127.0.0.1:4200")
    args, _ = p.parse_known_args(sys.argv[1:])
    root = str(Path(args.store).expanduser().resolve())
    uri = args.tracking_uri or store_tracking_uri(root)
    mlflow_ui = args.mlflow_ui or (uri if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000")
    return Settings(root, uri, mlflow_ui.rstrip("/"), args.prefect_ui.rstrip("/"))


@st.cache_resource
def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def mlflow_ready(cfg: Settings) -> bool:
    """False (and a message) when the default SQLite store does not exist yet; never creates it."""
    if cfg.tracking_uri.startswith("sqlite:///") and not Path(cfg.tracking_uri[len("sqlite:///"):]).exists():
        st.info(f"No MLflow store at `{cfg.tracking_uri}` yet: train a run with `store.root={cfg.store_root}` "
                f"or start the dashboard with `--tracking-uri`.")
        return False
    return True


def query_list(name: str) -> list[str]:
    """A comma-separated query parameter (``?runs=a,b``) as a list."""
    raw = st.query_params.get(name, "")
    return [x for x in raw.split(",") if x]


def run_picker(key: str, label: str = "Run") -> str | None:
    """A select box over the run folders of the store root, newest first.

    The ``?run=`` query parameter picks the initial run, else the newest run with a stored
    iteration; the choice is written back to the parameter.

    Args:
        key: the widget's Streamlit key (one per page).
        label: the select box's label.

    Returns:
        The chosen run id; None (after a message) when the store has no runs.
    """
    runs = store_runs(settings().store_root)
    if not runs:
        st.info("No runs in this store yet.")
        return None
    wanted = st.query_params.get("run")
    # By default the newest run with a stored iteration: a run still validating at step 0 has nothing to browse.
    index = runs.index(wanted) if wanted in runs else next(
        (i for i, r in enumerate(runs) if has_iterations(settings().store_root, r)), 0)
    choice = st.selectbox(label, runs, index=index, key=key)
    st.query_params["run"] = choice
    return choice
