"""MLflow tracking: one MLflow run per trajflow run, verl metric names, the resolved config as params.

The default tracking store is SQLite under the store root (``sqlite:///<root>/mlflow.db``), with
artifacts beside it in ``<root>/mlartifacts``, so a run directory tree is self-contained.

What a run records (see docs/compare.md):

- experiment ``trajflow/<recipe>`` (or ``trainer.experiment_name``); run name = the trajflow run id;
- tags ``trajflow.run_id``, ``trajflow.recipe``, ``mlflow.source.git.commit`` and, for a replay,
  the lineage tags of :func:`lineage_tags`;
- params: the flattened resolved config (``actor.lr``, ...); artifact ``config.yaml``: the same config;
- metrics: verl's names per iteration (step = iteration, 0 = before training), ``@`` as ``_at_``;
- artifacts ``samples/iteration_NNNNNN.json`` (sample generations, a table as JSON: see
  :meth:`Tracker.log_table`), ``gates/iteration_NNNNNN/``
  (gate reports) and, at the end of a run, ``plots/*.png`` (see :mod:`trajflow.plots`).
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig

from trajflow.config import flatten, to_yaml

# Replay lineage (set by the run that replays a stored stage output of another run).
TAG_PARENT_RUN = "trajflow.parent_run_id"          # the parent's trajflow run id (= its MLflow run name)
TAG_PARENT_ITERATION = "trajflow.parent_iteration"  # the parent iteration whose stored output was replayed
TAG_FROM_STAGE = "trajflow.from_stage"              # the first stage recomputed (rollout, reward, advantage, ...)


def lineage_tags(parent_run_id: str, parent_iteration: int, from_stage: str) -> dict[str, str]:
    """The MLflow tags that record where a replay came from (pass them as ``Tracker(tags=...)``).

    Args:
        parent_run_id: the trajflow run id of the run whose stored output is replayed.
        parent_iteration: that run's iteration (>= 0).
        from_stage: the first stage the replay recomputes.

    Returns:
        ``{TAG_PARENT_RUN: ..., TAG_PARENT_ITERATION: ..., TAG_FROM_STAGE: ...}`` (all strings).
    """
    return {TAG_PARENT_RUN: str(parent_run_id), TAG_PARENT_ITERATION: str(int(parent_iteration)),
            TAG_FROM_STAGE: str(from_stage)}


def store_tracking_uri(store_root: str | Path) -> str:
    """The default tracking URI of a store root: ``sqlite:///<root>/mlflow.db`` (absolute path)."""
    return f"sqlite:///{Path(store_root).expanduser().resolve() / 'mlflow.db'}"


def tracking_uri(cfg: DictConfig) -> str:
    """``tracking.uri`` or the SQLite default under ``store.root``."""
    if cfg.tracking.uri:
        return str(cfg.tracking.uri)
    root = Path(cfg.store.root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return store_tracking_uri(root)


def git_commit() -> str | None:
    """The source tree's commit, if it is a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def mlflow_metric_name(name: str) -> str:
    """verl metric name -> a name MLflow accepts (``val-core/x/acc/mean@1`` -> ``.../mean_at_1``)."""
    return name.replace("@", "_at_")


class Tracker:
    """Thin wrapper over an MLflow run (client API, so several runs can coexist in one process).

    Args:
        cfg: the resolved run config.
        run_id: the trajflow run id (MLflow run name).
        tags: extra MLflow tags (e.g. replay lineage).
        mlflow_run_id: reattach to this MLflow run (resume) instead of creating one.
    """

    def __init__(self, cfg: DictConfig, run_id: str, tags: Mapping[str, str] | None = None,
                 mlflow_run_id: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(cfg)
        self.client = MlflowClient(tracking_uri=self.uri)
        name = cfg.trainer.experiment_name or f"trajflow/{cfg.recipe}"
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            artifact_location = None
            if self.uri.startswith("sqlite:///"):
                artifact_location = (Path(self.uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
            exp_id = self.client.create_experiment(name, artifact_location=artifact_location)
        else:
            exp_id = exp.experiment_id
        self.experiment_id = exp_id
        if mlflow_run_id:
            self.run_id = mlflow_run_id
            self.client.update_run(mlflow_run_id, status="RUNNING")
        else:
            all_tags = {"trajflow.run_id": run_id, "trajflow.recipe": str(cfg.recipe)}
            commit = git_commit()
            if commit:
                all_tags["mlflow.source.git.commit"] = commit
            all_tags.update(tags or {})
            run = self.client.create_run(exp_id, run_name=run_id, tags=all_tags)
            self.run_id = run.info.run_id
            self.log_params(flatten(cfg))
            self.log_text(to_yaml(cfg), "config.yaml")

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One ``log_batch`` per call (one SQLite transaction instead of one per metric)."""
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        # MLflow rejects '@' in names; verl's MLflow adapter writes "mean@4" as "mean_at_4" too.
        items = [Metric(mlflow_metric_name(k), float(v), ts, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, data: Mapping[str, list], artifact_file: str) -> None:
        """Write ``{column: values}`` as the JSON artifact ``artifact_file`` (pandas' ``split``
        orientation, what ``MlflowClient.log_table`` writes: ``pd.read_json(path, orient="split")``
        reads it back).

        Not ``MlflowClient.log_table`` itself: that also registers every table in the run's
        ``mlflow.loggedArtifacts`` tag, which holds 8000 characters. One table per iteration fills
        it after ~134 iterations; MLflow then truncates the tag, and the next ``log_table`` fails to
        parse it, which would end the run. (It also lists the artifact directory and re-reads the
        run on every call, ~14 ms against ~1 ms here.)

        Raises:
            ValueError: the columns have different lengths (the column names and lengths are given).
        """
        lengths = {k: len(v) for k, v in data.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"log_table({artifact_file!r}): columns of different lengths {lengths}")
        columns = list(data)
        rows = [list(r) for r in zip(*(data[c] for c in columns))]
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
