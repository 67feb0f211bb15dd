"""MLflow tracking: one MLflow run per trajflow run (across resumes), verl metric names, the
resolved config as params, the policy as an MLflow 3 LoggedModel.

The default tracking store is SQLite under the store root (``sqlite:///<root>/mlflow.db``), with
artifacts beside it in ``<root>/mlartifacts``, so a run directory tree is self-contained.

What a run records (see docs/compare.md):

- experiment ``trajflow/<recipe>`` (or ``trainer.project_name``, verl's name for it), tagged as a
  model-training experiment (``mlflow.experimentKind=custom_model_development``, MLflow 3's "Machine
  learning"); run name = ``trainer.experiment_name`` (verl's name for it), else the trajflow run id;
- tags ``trajflow.run_id``, ``trajflow.recipe``, ``trajflow.sessions``, MLflow's source tags
  (``mlflow.user``, ``mlflow.source.name``, ``mlflow.source.type``, ``mlflow.source.git.commit``),
  the Prefect flow run's (:func:`prefect_tags`) and, for a replay, the lineage tags of
  :func:`lineage_tags`;
- params: the flattened resolved config (``actor.lr``, ...); artifact ``config.yaml``: the same config;
- inputs: the training and validation prompt sets as MLflow datasets (:meth:`Tracker.log_datasets`);
- metrics: verl's names per iteration (step = iteration, 0 = before training), made valid for MLflow
  :func:`trajflow.metric_names.metric_name`'s (``@`` as ``_at_``, any other character MLflow rejects as
  ``_``), the names the console and every other surface show too;
  two names that would become the same are kept apart by :meth:`Tracker.metric_name`; each is
  logged with the run's LoggedModel id, so the model lists them; MLflow's ``system/*`` metrics
  (``tracking.system_metrics``);
- artifacts ``samples/iteration_NNNNNN.json`` (sample generations with their prompts, a table as
  JSON: see :meth:`Tracker.log_table`), ``validation/iteration_NNNNNN.json`` (validation
  generations), ``gates/iteration_NNNNNN/`` (gate reports), at the end of a run ``plots/*.png``
  (see :mod:`trajflow.plots`);
- output: the LoggedModel ``policy`` (:mod:`trajflow.mlflow_model`), READY at the end of the run,
  pointing at the run's ``final/`` (or holding a copy with ``tracking.model_copy``).

TensorBoard and W&B (``trainer.logger``): :mod:`trajflow.loggers` mirrors, given every point this
module logs, after MLflow took it (:meth:`Tracker.log_metrics`).

Resume: a resumed session reopens the run's MLflow run (``run.json``'s ``mlflow_run_id``) and
continues it, so a trajflow run is one MLflow run, with one value per metric and step: points the
earlier session logged stay, and are not logged again when their iteration is re-run
(:meth:`Tracker._continue`).
"""

from __future__ import annotations

import logging
import math
import subprocess
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from omegaconf import DictConfig

from trajflow.config import flatten, to_yaml
from trajflow.metric_names import MLFLOW_MAX_NAME, metric_name, name_hash

# Replay lineage (set by the run that replays a stored stage output of another run).
TAG_PARENT_RUN = "trajflow.parent_run_id"          # the parent's trajflow run id (= its MLflow run name)
TAG_PARENT_ITERATION = "trajflow.parent_iteration"  # the parent iteration whose stored output was replayed
TAG_FROM_STAGE = "trajflow.from_stage"              # the first stage recomputed (rollout, reward, advantage, ...)

# Sessions: a resumed run continues its MLflow run (one MLflow run per trajflow run).
TAG_SESSIONS = "trajflow.sessions"                    # 1 for a run's first session, 2 after its first resume, ...
#: Re-run steps (past the resumed checkpoint) whose metrics keep the earlier session's values.
TAG_KEPT_RERUN_STEPS = "trajflow.kept_rerun_steps"
#: Set on the MLflow runs of sessions before this version (one MLflow run per session then); read
#: by compare and the dashboard to pick a resumed run's newest record.
TAG_SUPERSEDED_BY = "trajflow.superseded_by"
#: The experiment tag MLflow 3's UI files experiments by; ``custom_model_development`` is its
#: "Machine learning" (model training) kind, not GenAI's evaluation views.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


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


#: Seconds an http(s) tracking server gets to answer before a run starts.
TRACKING_PROBE_TIMEOUT_S = 5.0


def check_tracking_server(cfg: DictConfig, timeout_s: float = TRACKING_PROBE_TIMEOUT_S) -> None:
    """An http(s) ``tracking.uri`` answers within ``timeout_s``: MLflow's client retries an
    unreachable server with back-off for minutes, silently, after Ray and the workers started.

    Any HTTP answer counts (an auth error is the server's to explain); SQLite and file stores are
    not probed.

    Raises:
        trajflow.errors.ConfigError: no answer (names the URI, the reason and the fix).
    """
    import urllib.error
    import urllib.request

    from trajflow.errors import ConfigError

    uri = str(cfg.tracking.uri or "")
    if not uri.lower().startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        raise ConfigError(f"tracking.uri={uri!r}: no answer from the MLflow server within {timeout_s:g} s "
                          f"({why}); start it, or leave tracking.uri unset to log to the SQLite store under "
                          f"store.root") from None


def git_commit() -> str | None:
    """The source tree's commit, if it is a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


log = logging.getLogger(__name__)

def session_tags(cfg: DictConfig) -> dict[str, str]:
    """The tags that say who ran a session, from what code and under which Prefect flow run.

    MLflow's own context tags (``mlflow.user``, ``mlflow.source.name``, ``mlflow.source.type``, as
    its fluent ``start_run`` sets them), ``mlflow.source.git.commit`` of trajflow's source tree, and
    inside a Prefect flow run ``prefect.flow_run_id``, ``prefect.flow_run_name``,
    ``prefect.deployment_id`` (when started from a deployment) and ``prefect.flow_run_url`` (when
    Prefect has a UI URL; the temporary local server has none).
    """
    tags: dict[str, str] = {}
    try:
        from mlflow.tracking.context.registry import resolve_tags

        tags.update({k: str(v) for k, v in resolve_tags({}).items()})
    except Exception as e:  # a context provider failing must not cost the run its record
        log.debug("MLflow context tags unavailable: %s", e)
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    tags.update(prefect_tags())
    return tags


def prefect_tags() -> dict[str, str]:
    """``prefect.flow_run_id`` / ``_name`` / ``_url`` and ``prefect.deployment_id`` of the flow run
    this process is in ({} outside one)."""
    try:
        from prefect.runtime import deployment, flow_run
        from prefect.settings import PREFECT_UI_URL
    except Exception:
        return {}
    fid = flow_run.get_id()
    if not fid:
        return {}
    tags = {"prefect.flow_run_id": str(fid), "prefect.flow_run_name": str(flow_run.get_name() or "")}
    if deployment.get_id():
        tags["prefect.deployment_id"] = str(deployment.get_id())
    ui = PREFECT_UI_URL.value()
    if ui:
        tags["prefect.flow_run_url"] = f"{str(ui).rstrip('/')}/flow-runs/flow-run/{fid}"
    return tags


class Tracker:
    """Thin wrapper over an MLflow run (client API, so several runs can coexist in one process).

    Args:
        cfg: the resolved run config.
        run_id: the trajflow run id (MLflow run name).
        tags: extra MLflow tags (e.g. replay lineage).
        continue_from: the MLflow run id of the run's earlier session (resume): that run is reopened
            and continued instead of creating one.
        keep_step: on resume, whether the earlier session's values at a step are the ones kept
            (the iterations up to the checkpoint resumed from); used only to record, in the tag
            :data:`TAG_KEPT_RERUN_STEPS`, which re-run steps keep the earlier session's values.
        run_name: the MLflow run's name (default: ``trainer.experiment_name``, else ``run_id``).
        logged_model: create the run's LoggedModel (:mod:`trajflow.mlflow_model`) and log every
            metric with its id (train and replay; an evaluation has no model of its own).
    """

    def __init__(self, cfg: DictConfig, run_id: str, tags: Mapping[str, str] | None = None,
                 continue_from: str | None = None, keep_step: Callable[[int], bool] | None = None,
                 logged_model: bool = True, run_name: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        from trajflow.mlflow_model import TAG_MODEL_ID, TAG_SUPERSEDED_BY, create_policy_model, model_is_final

        self.uri = tracking_uri(cfg)
        self.client = MlflowClient(tracking_uri=self.uri)
        # verl's names: trainer.project_name is the experiment, trainer.experiment_name the run's name.
        name = cfg.trainer.get("project_name") or f"trajflow/{cfg.recipe}"
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            artifact_location = None
            if self.uri.startswith("sqlite:///"):
                artifact_location = (Path(self.uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
            exp_id = self.client.create_experiment(name, artifact_location=artifact_location,
                                                   tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        else:
            exp_id = exp.experiment_id
            if EXPERIMENT_KIND_TAG not in exp.tags:  # made by an older trajflow: filed as GenAI otherwise
                self.client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        self.experiment_id = exp_id
        self._metric_names: dict[str, str] = {}   # reported name -> MLflow name, for the whole run
        self._metric_owners: dict[str, str] = {}  # MLflow name -> reported name
        self._logged: set[tuple[str, int]] = set()  # (MLflow name, step) already in the run (resume)
        self.mirrors: list = []  # trajflow.loggers' TensorBoard / W&B copies of every point logged
        self._system_monitor = None
        self.model_id: str | None = None
        superseded: str | None = None
        previous = self._previous_session(continue_from)
        all_tags = session_tags(cfg)
        all_tags.update({"trajflow.run_id": run_id, "trajflow.recipe": str(cfg.recipe)})
        all_tags.update(tags or {})
        if previous is None:
            all_tags[TAG_SESSIONS] = "1"
            run = self.client.create_run(exp_id, run_name=run_name or cfg.trainer.get("experiment_name") or run_id,
                                         tags=all_tags)
            self.run_id = run.info.run_id
            self.log_params(flatten(cfg))
        else:
            self.run_id = previous.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            all_tags[TAG_SESSIONS] = str(int(previous.data.tags.get(TAG_SESSIONS, "1")) + 1)
            self.set_tags(all_tags)
            self._continue(previous, cfg, keep_step or (lambda step: True))
            self.model_id = previous.data.tags.get(TAG_MODEL_ID)
            if logged_model and self.model_id and model_is_final(self.client, self.model_id):
                # A finished run trained further: its earlier final model stays as it was logged
                # (MLflow links a model to a run as output once), the policy trained on is a new one.
                superseded, self.model_id = self.model_id, None
        if logged_model and self.model_id is None:
            self.model_id = create_policy_model(self.client, exp_id, self.run_id, run_id, cfg)
            self.client.set_tag(self.run_id, TAG_MODEL_ID, self.model_id)
            if superseded:
                self.client.set_logged_model_tags(superseded, {TAG_SUPERSEDED_BY: self.model_id})
        self.log_text(to_yaml(cfg), "config.yaml")
        if cfg.tracking.system_metrics:
            self._start_system_metrics(float(cfg.tracking.system_metrics_interval_s), resume=previous is not None)

    def _previous_session(self, mlflow_run_id: str | None):
        """The MLflow run of the session a resume continues, or None (none recorded, or deleted)."""
        if not mlflow_run_id:
            return None
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(mlflow_run_id)
        except MlflowException as e:
            log.warning("the previous session's MLflow run %s is gone (%s); this session starts a new record",
                        mlflow_run_id, str(e).splitlines()[0])
            return None

    def _continue(self, previous, cfg: DictConfig, keep_step: Callable[[int], bool]) -> None:
        """Take up the run of the earlier session: every (metric, step) it logged stays and is not
        logged again (MLflow cannot delete a point, and a second value at a step would make the
        history ambiguous); params it logged stay (MLflow's params are immutable), and a param the
        resume changed is recorded as the tag ``trajflow.param_changed.<key>`` (``old -> new``),
        new params are logged.

        Steps past the checkpoint the resume restarts from, which the earlier session had logged
        before it stopped, are re-run; their metrics keep the earlier values (the same for an exact
        resume, except ``timing_s/*``), listed in the tag :data:`TAG_KEPT_RERUN_STEPS`.
        """
        from mlflow.entities import Param

        rerun: set[int] = set()
        for key in sorted(previous.data.metrics):
            for m in self.client.get_metric_history(self.run_id, key):
                self._logged.add((key, int(m.step)))
                if not key.startswith("system/") and not keep_step(int(m.step)):
                    rerun.add(int(m.step))
        if rerun:
            self.client.set_tag(self.run_id, TAG_KEPT_RERUN_STEPS, ",".join(str(s) for s in sorted(rerun)))
        old = previous.data.params
        new = {k: str(v)[:6000] for k, v in flatten(cfg).items()}
        fresh = [Param(k, v) for k, v in new.items() if k not in old]
        for i in range(0, len(fresh), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=fresh[i:i + 100])
        for k, v in new.items():
            if k in old and old[k] != v:
                self.client.set_tag(self.run_id, f"trajflow.param_changed.{k}"[:250], f"{old[k]} -> {v}"[:5000])

    def _start_system_metrics(self, interval_s: float, resume: bool = False) -> None:
        """MLflow's system-metrics monitor (CPU, memory, disk, network, GPU where present) on this run;
        a resumed session's samples continue after the earlier session's steps."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s,
                                                        tracking_uri=self.uri, resume_logging=resume)
            self._system_monitor.start()
        except Exception as e:  # psutil missing or similar: the run's own metrics matter more
            log.warning("MLflow system metrics are off: %s", e)
            self._system_monitor = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def metric_name(self, name: str) -> str:
        """The MLflow name of a reported metric name, fixed for the rest of the run.

        :func:`trajflow.metric_names.metric_name` of ``name``, unless another reported name already owns that
        MLflow name (``val/acc@1`` and ``val/acc_at_1``): then ``<that>.<8 hex digits of sha256(name)>``,
        so no two series are merged. A name MLflow accepts as it is claims itself first within a
        :meth:`log_metrics` call, the others follow in sorted order, so the outcome does not depend
        on the order of a dict's keys.
        """
        if name in self._metric_names:
            return self._metric_names[name]
        base = metric_name(name)
        candidate, n = base, 0
        while self._metric_owners.get(candidate, name) != name:
            n += 1
            tag = name_hash(name if n == 1 else f"{name}#{n}")
            candidate = f"{base[:MLFLOW_MAX_NAME - 9]}.{tag}"
        if candidate != name:
            log.debug("metric %r is logged to MLflow as %r", name, candidate)
        self._metric_names[name] = candidate
        self._metric_owners[candidate] = name
        return candidate

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One ``log_batch`` per call (one SQLite transaction instead of one per metric).

        Names go through :meth:`metric_name`; each point carries the run's LoggedModel id; a (name,
        step) that an earlier session of a resumed run logged is not logged again. Should MLflow
        still reject the batch, the metrics are
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
        for k in sorted(finite, key=lambda k: (metric_name(k) != k, k)):
            self.metric_name(k)
        items = [Metric(self.metric_name(k), v, ts, step, model_id=self.model_id) for k, v in finite.items()
                 if (self.metric_name(k), int(step)) not in self._logged]
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
        if items and self.mirrors:
            self._mirror({m.key: m.value for m in items}, int(step))

    def _mirror(self, points: Mapping[str, float], step: int) -> None:
        """The points MLflow just got, to each mirror (:mod:`trajflow.loggers`); a mirror that fails
        is named once and dropped: MLflow is the run's record, a copy must not end the run."""
        for m in list(self.mirrors):
            try:
                m.log(points, step)
            except Exception as e:
                log.warning("trainer.logger %r failed at step %d and is off for the rest of this session: %s",
                            m.name, step, str(e).splitlines()[0] if str(e) else type(e).__name__)
                self.mirrors.remove(m)

    def mirror_generations(self, table: Mapping[str, list], step: int) -> None:
        """Validation generations (``{column: values}``) to the mirrors as verl's ``val/generations``
        (TensorBoard text, a W&B table); not at a step whose validation metrics an earlier session
        logged (a re-run step keeps the earlier record, as for metrics). A failure is one warning and
        leaves the mirror's metrics on."""
        if not self.mirrors or any(s == int(step) and k.startswith("val-") for k, s in self._logged):
            return
        for m in self.mirrors:
            try:
                m.log_generations(table, int(step))
            except Exception as e:
                log.warning("trainer.logger %r could not log the validation generations of step %d: %s",
                            m.name, step, str(e).splitlines()[0] if str(e) else type(e).__name__)

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

    def log_datasets(self, train: Sequence[Any], validation: Sequence[Any], name: str, source: str) -> None:
        """Log the prompt sets as MLflow dataset inputs (contexts ``training`` and ``validation``).

        Each is a table of ``prompt_id``, ``data_source``, ``prompt`` (the last message's text) and
        ``ground_truth`` (the target column); MLflow records its digest, schema and row count.

        Args:
            train, validation: :class:`trajflow.prompts.PromptRecord` lists (an empty one is skipped).
            name: the dataset's name (the spec's ``name``).
            source: where it came from (the data file or spec path, or ``reasoning_gym:<task>``).
        """
        import warnings

        import mlflow.data
        import pandas as pd
        from mlflow.entities import DatasetInput, InputTag

        inputs = []
        for context, records in (("training", train), ("validation", validation)):
            if not records:
                continue
            df = pd.DataFrame({"prompt_id": [r.prompt_id for r in records],
                               "data_source": [r.data_source for r in records],
                               "prompt": [prompt_text(r.messages) for r in records],
                               "ground_truth": [str(r.ground_truth) for r in records]})
            with warnings.catch_warnings():  # "source can be interpreted in multiple ways": both are local
                warnings.simplefilter("ignore")
                ds = mlflow.data.from_pandas(df, source=source, name=f"{name}/{context}", targets="ground_truth")
            inputs.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
        if inputs:
            self.client.log_inputs(self.run_id, datasets=inputs)

    def log_model(self, model_dir: str | Path, step: int, registered_name: str | None = None,
                  description: str = "", copy: bool = False) -> str:
        """Finalise the run's LoggedModel as the policy in ``model_dir`` after iteration ``step``:
        by reference (its tag ``trajflow.model_path`` names the folder; no second copy of the
        weights) or, with ``copy``, as an MLflow transformers-flavour model in its artifacts
        (``mlflow.transformers.load_model("models:/<model_id>")``), optionally registered.

        Args:
            model_dir: a ``from_pretrained``-loadable directory (the run's ``final/``).
            step: the iteration the model is the policy after.
            registered_name: register the copied model under this name (a new version each call).
            description: the model card's text.
            copy: copy the weights into MLflow's artifact store.

        Returns:
            ``models:/<model_id>``, or ``models:/<name>/<version>`` when registered.

        Raises:
            ValueError: ``registered_name`` without ``copy``, or a tracker made without a LoggedModel.
        """
        from trajflow.mlflow_model import finalize_policy_model, register_policy_model

        if self.model_id is None:
            raise ValueError("log_model: this MLflow run has no LoggedModel (Tracker(logged_model=False))")
        if registered_name and not copy:
            raise ValueError("log_model: the registry serves copied models; pass copy=True to register")
        uri = finalize_policy_model(self.client, self.run_id, self.model_id, model_dir, step, copy=copy,
                                    description=description)
        if registered_name:
            return register_policy_model(self.client, self.run_id, self.model_id, registered_name, description)
        return uri

    def close_mirrors(self, status: str) -> None:
        """Close the TensorBoard / W&B mirrors with ``status``; one that fails to close is a warning."""
        for m in self.mirrors:
            try:
                m.close(status)
            except Exception as e:  # never lose the MLflow run's status to a copy's error
                log.warning("could not close trainer.logger %r: %s", m.name, e)
        self.mirrors = []

    def finish(self, status: str = "FINISHED") -> None:
        """Stop the system-metrics monitor (flushing its last samples), close the mirrors and the MLflow run."""
        self.close_mirrors(status)
        if self._system_monitor is not None:
            self._system_monitor.finish()
            self._system_monitor = None
        self.client.set_terminated(self.run_id, status=status)


def prompt_text(messages: Any) -> str:
    """The text of a prompt's last message (a chat list, its JSON string, or plain text)."""
    import json

    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except ValueError:
            return messages
    if isinstance(messages, (list, tuple)) and messages:
        last = messages[-1]
        return str(last.get("content", "")) if isinstance(last, Mapping) else str(last)
    return "" if messages is None else str(messages)
