"""Read back what trajflow.loggers wrote, with each library's own reader: TensorBoard's
EventAccumulator, W&B's ``wandb leet inspect --json`` (the reader of ``.wandb`` transaction logs
that wandb ships), and MLflow's history for comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def tensorboard_points(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} over every event file in ``log_dir``, in file order (duplicates kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(run_file: Path) -> list[dict]:
    """The records of one ``run-<id>.wandb`` file, as ``wandb leet inspect --json`` prints them."""
    wandb_cli = Path(sys.executable).parent / "wandb"
    out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(run_file)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wandb_points(wandb_dir: Path, run_id: str) -> tuple[dict[str, list[tuple[int, float]]], list[dict]]:
    """({key: [(step, value), ...]}, run records) over every offline session of W&B run ``run_id``
    under ``wandb_dir`` (the ``wandb/`` folder), oldest session first; W&B's own ``_*`` keys left out."""
    points: dict[str, list[tuple[int, float]]] = defaultdict(list)
    runs = []
    for run_file in sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for rec in wandb_records(run_file):
            if rec.get("type") == "run":
                runs.append(rec["run"])
            if rec.get("type") != "history":
                continue
            row = rec["history"]["item"]
            for k, v in row.items():
                if not k.startswith("_"):
                    points[k].append((int(row["_step"]), float(v)))
    return dict(points), runs


def mlflow_points(tracking_uri: str, mlflow_run_id: str) -> dict[str, list[tuple[int, float]]]:
    """{key: sorted [(step, value), ...]} of an MLflow run, MLflow's own ``system/*`` metrics left out."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run_id, k))
            for k in client.get_run(mlflow_run_id).data.metrics if not k.startswith("system/")}
