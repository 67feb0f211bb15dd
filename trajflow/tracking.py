"""MLflow tracking: one MLflow run per trajflow run, verl metric names, the resolved config as params.

The default tracking store is SQLite under the store root (``sqlite:///<root>/mlflow.db``), with
artifacts beside it in ``<root>/mlartifacts``, so a run directory tree is self-contained.

What a run records (see docs/compare.md):

- experiment ``trajflow/<recipe>`` (or ``trainer.experiment_name``); run name = the trajflow run id;
- tags ``trajflow.run_id``, ``trajflow.recipe``, ``mlflow.source.git.commit`` and, for a replay,
  the lineage tags of :func:`lineage_tags`;
- params: the flattened resolved config (``actor.lr``, ...); artifact ``config.yaml``: the same config;
- metrics: verl's names per iteration (step = iteration, 0 = before training), made valid for MLflow
  by :func:`mlflow_metric_name` (``@`` as ``_at_``, any other character MLflow rejects as ``_``);
  two names that would become the same are kept apart by :meth:`Tracker.metric_name`;
- artifacts ``samples/iteration_NNNNNN.json`` (sample generations, a table as JSON: see
  :meth:`Tracker.log_table`), ``gates/iteration_NNNNNN/``
  (gate reports) and, at the end of a run, ``plots/*.png`` (see :mod:`trajflow.plots`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import posixpath
import re
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


log = logging.getLogger(__name__)

#: MLflow's metric-name length limit (``MAX_ENTITY_KEY_LENGTH``).
MLFLOW_MAX_NAME = 250
# What MLflow accepts in a metric name (mlflow.utils.validation, POSIX): word characters, '/', '.',
# '-', ' ' and ':'.
_BAD_CHARS = re.compile(r"[^/\w.\- :]")
_GLOB_CHARS = "*?[]"


def _hash8(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:8]


def mlflow_metric_name(name: str, *, keep: str = _GLOB_CHARS) -> str:
    """verl metric name -> the readable name MLflow accepts (``val-core/x/acc/mean@1`` -> ``.../mean_at_1``).

    ``@`` becomes ``_at_`` (as verl's MLflow adapter writes it), every other character MLflow rejects
    becomes ``_`` (``timing(s)/gen`` -> ``timing_s_/gen``, ``val-core/a+b/acc`` -> ``val-core/a_b/acc``),
    path segments MLflow would normalise away (empty, ``.``, ``..``) become ``_``/``__``, and a name
    over :data:`MLFLOW_MAX_NAME` characters is cut and ends in 8 hex digits of its sha256. Not
    injective on its own: :meth:`Tracker.metric_name` keeps names that collide apart.

    Args:
        name: the metric name as the code reports it.
        keep: characters left as they are (by default the glob characters, so that
            ``trajflow compare --metric 'val/*@1'`` patterns survive); the tracker passes ``""``.

    Returns:
        The rewritten name (``name`` itself when MLflow accepts it).
    """
    out = _BAD_CHARS.sub(lambda m: m.group(0) if m.group(0) in keep else ("_at_" if m.group(0) == "@" else "_"),
                         str(name))
    if out == "" or posixpath.normpath(out) != out or out.startswith("/"):
        out = "/".join({"": "_", ".": "_", "..": "__"}.get(part, part) for part in out.split("/"))
    if len(out) > MLFLOW_MAX_NAME:
        out = f"{out[:MLFLOW_MAX_NAME - 9]}.{_hash8(str(name))}"
    return out


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
        self._metric_names: dict[str, str] = {}   # reported name -> MLflow name, for the whole run
        self._metric_owners: dict[str, str] = {}  # MLflow name -> reported name
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

    def metric_name(self, name: str) -> str:
        """The MLflow name of a reported metric name, fixed for the rest of the run.

        :func:`mlflow_metric_name` of ``name``, unless another reported name already owns that
        MLflow name (``val/acc@1`` and ``val/acc_at_1``): then ``<that>.<8 hex digits of sha256(name)>``,
        so no two series are merged. A name MLflow accepts as it is claims itself first within a
        :meth:`log_metrics` call, the others follow in sorted order, so the outcome does not depend
        on the order of a dict's keys.
        """
        if name in self._metric_names:
            return self._metric_names[name]
        base = mlflow_metric_name(name, keep="")
        candidate, n = base, 0
        while self._metric_owners.get(candidate, name) != name:
            n += 1
            tag = _hash8(name if n == 1 else f"{name}#{n}")
            candidate = f"{base[:MLFLOW_MAX_NAME - 9]}.{tag}"
        if candidate != name:
            log.debug("metric %r is logged to MLflow as %r", name, candidate)
        self._metric_names[name] = candidate
        self._metric_owners[candidate] = name
        return candidate

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One ``log_batch`` per call (one SQLite transaction instead of one per metric).

        Names go through :meth:`metric_name`. Should MLflow still reject the batch, the metrics are
        logged one by one and only those it rejects are dropped (with a warning naming them), so one
        bad name never costs an iteration's metrics or the run.
        """
        import time

        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        ts = int(time.time() * 1000)
        finite = {str(k): float(v) for k, v in metrics.items()
                  if isinstance(v, (int, float)) and math.isfinite(float(v))}
        # Names MLflow takes verbatim claim themselves before any rewritten name can land on them.
        for k in sorted(finite, key=lambda k: (mlflow_metric_name(k, keep="") != k, k)):
            self.metric_name(k)
        items = [Metric(self.metric_name(k), v, ts, step) for k, v in finite.items()]
        for i in range(0, len(items), 1000):
            chunk = items[i:i + 1000]
            try:
                self.client.log_batch(self.run_id, metrics=chunk)
            except MlflowException as e:
                log.warning("MLflow rejected a batch of %d metrics at step %d (%s); logging them one by one",
                            len(chunk), step, str(e).splitlines()[0])
                for m in chunk:
                    try:
                        self.client.log_batch(self.run_id, metrics=[m])
                    except MlflowException as e1:
                        log.warning("MLflow rejected metric %r at step %d: %s", m.key, step, str(e1).splitlines()[0])

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
