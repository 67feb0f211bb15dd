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
            media = {k[:-len("._type")] for k in row if k.endswith("._type")}  # tables: val/generations.nrows, ...
            for k, v in row.items():
                if not k.startswith("_") and k.rpartition(".")[0] not in media:
                    points[k].append((int(row["_step"]), float(v)))
    return dict(points), runs


def mlflow_points(tracking_uri: str, mlflow_run_id: str) -> dict[str, list[tuple[int, float]]]:
    """{key: sorted [(step, value), ...]} of an MLflow run, MLflow's own ``system/*`` metrics left out."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run_id, k))
            for k in client.get_run(mlflow_run_id).data.metrics if not k.startswith("system/")}


def tensorboard_texts(log_dir: Path, tag: str) -> list[tuple[int, str]]:
    """[(step, text), ...] of the text summaries ``tag`` (``add_text``'s tag) in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).reshape(-1)[0].decode())
            for e in acc.Tensors(f"{tag}/text_summary")]


def wandb_tables(wandb_dir: Path, run_id: str, key: str) -> list[tuple[int, dict]]:
    """[(step, {"columns": [...], "data": [[...], ...]}), ...] of the tables logged as ``key``, over every
    offline session of ``run_id``: the history row's ``<key>.path`` names the table file W&B wrote in
    the session's ``files/``."""
    out = []
    for run_file in sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for rec in wandb_records(run_file):
            row = rec.get("history", {}).get("item", {}) if rec.get("type") == "history" else {}
            if f"{key}.path" in row:
                table = json.loads((run_file.parent / "files" / row[f"{key}.path"]).read_text())
                out.append((int(row["_step"]), {"columns": table["columns"], "data": table["data"]}))
    return out
