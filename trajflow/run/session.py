"""A run's session: pick its id, open it (new or resumed), finish it, close it.

``open_run`` (train), :func:`trajflow.run.replay.open_replay` (replay) and :func:`open_evaluation`
(evaluate) share its parts: the run folder, the context without workers, Ray and the workers;
``close_run`` ends every session the same way (workers released, MLflow run closed, the session's
end recorded in ``run.json``, Ray stopped last).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
import uuid

from omegaconf import DictConfig

from trajflow import checkpoint as ckpt
from trajflow.config import to_yaml
from trajflow.errors import NonFiniteError, RunExistsError
from trajflow.infra import logs
from trajflow.infra.ray_cluster import start_ray
from trajflow.run.context import RunContext, register
from trajflow.run.preflight import custom_function_record
from trajflow.run.resume import _report_resume, check_resumable, config_changes, restore_checkpoint
from trajflow.run.workers import close, create_workers, release_workers
from trajflow.store import RunStore, follow_umask

log = logging.getLogger(__name__)


def new_run_id(cfg: DictConfig) -> str:
    """``<recipe>-<UTC time>-<4 hex>``: sortable and unique across parallel launches."""
    return f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def choose_run_id(cfg: DictConfig, run_id: str | None = None) -> tuple[str, bool]:
    """The run id to use and whether it resumes an existing run (``trainer.resume=auto``).

    Raises:
        RunExistsError: the id names an existing run and ``trainer.resume`` is ``disable``.
    """
    run_id = run_id or cfg.trainer.run_id
    if run_id is None:
        return new_run_id(cfg), False
    store = RunStore(cfg.store.root, run_id)
    if store.exists():
        if cfg.trainer.resume == "auto":
            return run_id, True
        raise RunExistsError(f"run {run_id!r} already exists in {store.run_dir}; use trainer.resume=auto "
                             f"or 'trajflow resume {run_id}' to continue it")
    return run_id, False


def open_run(cfg: DictConfig, run_id: str, resume: bool = False) -> RunContext:
    """Create (or reopen) the run folder, start Ray and the workers, restore a checkpoint on resume.

    On resume: leftovers of killed writers are deleted, the newest complete checkpoint is restored
    (weights, optimizer, RNG, data cursor, KL controller, score history) and training continues at
    the iteration after it; stored stage outputs of the iterations to come are checked now (a file
    that does not verify is named on stderr and recomputed by its task), config changes against the
    stored config are reported and recorded in ``run.json``'s ``sessions``.

    Raises:
        RunExistsError: a new run's folder exists already.
        StoreError: resuming a run that does not exist or is a replay.
        trajflow.prompts.DataError, trajflow.models.ModelLoadError: bad dataset or model.
    """
    from trajflow.loggers import open_mirrors
    from trajflow.tracking import Tracker

    store = RunStore(cfg.store.root, run_id)
    changes: dict = {}
    # Load inputs first: a bad dataset or model must not leave a half-created run behind.
    ctx = build_context(cfg, store)
    if not resume:
        create_run_folder(store, cfg, recipe=str(cfg.recipe), custom_function=custom_function_record(cfg))
    else:
        check_resumable(store)
        from trajflow.loggers import stored_wandb_id

        stored_wandb_id(store.read_run_meta(), store.run_dir / "run.json")  # a bad id is one line, before Ray
        logs.attach_run_dir(store.run_dir)
        removed = store.cleanup_temp() + ckpt.cleanup(store)
        for p in removed:
            log.info("removed %s, left behind by a killed writer", p)
        changes = config_changes(store, cfg)
        if changes:
            print(f"run {run_id}: config changed since the last session: "
                  + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()), flush=True)
            store.write_config(to_yaml(cfg))
        store.update_run_meta(status="running")
    print(f"trajflow run {run_id}: {store.run_dir}", flush=True)
    from trajflow.modeling.precision import describe, run_precision

    print(describe(run_precision(cfg)), flush=True)  # decided at config load ('auto'), before any worker starts
    from trajflow.prompts.shape import describe_recipe

    print(describe_recipe(cfg), flush=True)  # the response cap and shaping the data gets, before it is spent

    preload_audit()
    try:
        start_workers(ctx)
        start = 1
        previous_mlflow_run = store.read_run_meta().get("mlflow_run_id") if resume else None
        latest = None
        if resume:
            latest, skipped = ckpt.newest_verified_checkpoint(store)
            for it, why in skipped:
                print(f"warning: checkpoint {it:06d} skipped: {why}", file=sys.stderr, flush=True)
        if latest is not None:
            restore_checkpoint(ctx, latest)
            start = latest + 1
        ctx.state.policy_source = ckpt.checkpoint_id(latest)
        ctx.state.start_iteration = start
        ctx.state.last_iteration = int(cfg.trainer.total_iterations)
        if resume:
            _report_resume(ctx, latest, start)
        # A session with nothing to train neither starts nor supersedes the run's LoggedModel.
        ctx.tracker = Tracker(cfg, run_id, continue_from=previous_mlflow_run, keep_step=_kept_steps(store, latest),
                              logged_model=bool(cfg.tracking.log_model) and start <= ctx.state.last_iteration)
        ctx.tracker.mirrors = open_mirrors(cfg, store, run_id)  # trainer.logger's tensorboard / wandb
        _log_datasets(ctx)
        sessions = store.read_run_meta().get("sessions", [])
        sessions.append({"started": time.time(), "resumed_from_checkpoint": latest if resume else None,
                         "first_iteration": start, "config_changes": {k: list(v) for k, v in changes.items()}})
        store.update_run_meta(mlflow_run_id=ctx.tracker.run_id, tracking_uri=ctx.tracker.uri, sessions=sessions)
    except BaseException:
        close_mirrors(ctx)
        close(ctx)
        raise
    if start > ctx.state.last_iteration:
        print(f"run {run_id} already finished all {ctx.state.last_iteration} iterations; nothing to do", flush=True)
        ctx.state.nothing_to_do = True
    return ctx


def _kept_steps(store: RunStore, latest: int | None):
    """The MLflow steps a resumed session keeps from the previous one: those up to its checkpoint
    (0 = validation before training included) and iterations a gate stopped (never re-run)."""
    gated = {it for it in store.iterations() if store.read_manifest(it).get("status") == "gated"}
    return lambda step: (latest is not None and step <= latest) or step in gated


def _log_datasets(ctx: RunContext) -> None:
    """The prompt sets as MLflow dataset inputs; a failure only warns (the record, not the run)."""
    spec = ctx.datasets.spec
    source = spec.get("path") or spec.get("spec_path") or spec.get("name") or "prompts"
    if not isinstance(source, str):
        source = ", ".join(str(p) for p in source)  # data.train_files: several files
    try:
        ctx.tracker.log_datasets(ctx.datasets.train, ctx.datasets.validation, str(spec.get("name") or "prompts"),
                                 str(source))
    except Exception as e:
        log.warning("could not log the datasets to MLflow: %s", e)


def create_run_folder(store: RunStore, cfg: DictConfig, **meta) -> None:
    """Create a new run's folder with its resolved ``config.yaml`` and ``run.json`` (``status: running``).

    Args:
        store: the new run's store.
        cfg: its resolved config.
        meta: more ``run.json`` fields (``recipe``, a replay's lineage, ...).

    Raises:
        RunExistsError: the folder holds a run already.
    """
    if store.exists():
        raise RunExistsError(f"run {store.run_id!r} already exists in {store.run_dir}")
    store.run_dir.mkdir(parents=True, exist_ok=True)
    logs.attach_run_dir(store.run_dir)
    store.write_config(to_yaml(cfg))
    from trajflow.modeling.precision import run_precision

    store.update_run_meta(run_id=store.run_id, status="running", created=time.time(), precision=run_precision(cfg),
                          **meta)


def preload_audit() -> None:
    """Import LanceDB in the background: it takes seconds (its generated REST client), and the driver
    is only waiting for Ray and the workers meanwhile; the audit table is written after iteration 1."""
    import threading

    def load() -> None:
        try:
            import lancedb  # noqa: F401
        except Exception:  # reported when the audit table is written
            pass

    threading.Thread(target=load, name="preload-lancedb", daemon=True).start()


def build_context(cfg: DictConfig, store: RunStore) -> RunContext:
    """The run's context without workers: datasets, model path, data cursor, KL controller."""
    from trajflow.prompts import PromptSampler, data_spec, load_prompt_dataset
    from trajflow.models import resolve_model_path

    datasets = load_prompt_dataset(data_spec(cfg.data))
    model_path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    ctx = RunContext(cfg=cfg, store=store, model_path=model_path, datasets=datasets)
    ctx.sampler = PromptSampler(datasets.train, cfg.data.train_batch_size, cfg.trainer.seed)
    if cfg.algorithm.use_kl_in_reward:
        from trajflow.stages.kl import make_kl_controller

        k = cfg.algorithm.kl_ctrl
        ctx.kl_ctrl = make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
    return ctx


def start_workers(ctx: RunContext) -> None:
    """Start (or join) Ray, register the context for the tasks and start the workers.

    On failure the context is closed (workers, and Ray if this call started it) before re-raising.
    """
    ctx.started_ray = start_ray(ctx.cfg)
    register(ctx)
    try:
        create_workers(ctx)
    except BaseException:
        close(ctx)
        raise


def open_evaluation(cfg: DictConfig, store: RunStore, step: int) -> RunContext:
    """The context of an evaluation of ``store``'s checkpoint ``step`` (0 = the initial model):
    policy workers only, registered under a key of its own (an evaluation must not disturb a
    training run of the same id in this process), with Ray started (or joined). The workers start
    in the evaluation's first task (:func:`trajflow.run.recovery.ensure_workers`).
    """
    from trajflow.prompts import data_spec, load_prompt_dataset
    from trajflow.models import resolve_model_path

    ctx = RunContext(cfg=cfg, store=store, model_path=str(resolve_model_path(cfg.model.path, cfg.model.cache_dir)),
                     datasets=load_prompt_dataset(data_spec(cfg.data)), context_id=f"eval-{uuid.uuid4().hex}")
    ctx.state.policy_only = True
    ctx.policy_version = int(ckpt.read_trainer_state(store, step)["policy_version"]) if step else 0
    register(ctx)
    ctx.started_ray = start_ray(cfg)
    return ctx


def finish_run(ctx: RunContext) -> dict:
    """Export the final policy to ``<run>/final`` and return the run summary."""
    import ray  # here, not at the top: choosing a run id must not import it

    store = ctx.store
    if not ctx.state.nothing_to_do or not store.final_dir.exists():
        if not ray.get(ctx.actor.weights_finite.remote()):
            raise NonFiniteError(f"run {ctx.run_id}: the policy's weights are not finite; the final model is not "
                                 f"exported (the checkpoints under {store.checkpoints_dir()} hold earlier states)")
        tmp = store.run_dir / ".final-tmp"
        ray.get(ctx.actor.export_hf.remote(str(tmp)))
        follow_umask(tmp)
        if store.final_dir.exists():
            import shutil

            shutil.rmtree(store.final_dir)
        os.replace(tmp, store.final_dir)
    _log_end_of_run_plots(ctx)
    meta = store.update_run_meta(status="finished", finished=time.time(), policy_version=ctx.policy_version)
    if ctx.state.progress is not None:  # end the bar's line first, or this one is appended to it
        ctx.state.progress.close()
    print(f"trajflow run {ctx.run_id} finished: {store.run_dir}", flush=True)
    return {"run_id": ctx.run_id, "run_dir": str(store.run_dir), "mlflow_run_id": meta.get("mlflow_run_id"),
            "metrics": ctx.state.last_metrics, "policy_version": ctx.policy_version,
            "trained_iterations": list(ctx.state.trained_iterations), "nothing_to_do": ctx.state.nothing_to_do}


def _log_end_of_run_plots(ctx: RunContext) -> None:
    """Reward and response-length PNGs in ``<run>/plots/`` and as MLflow artifacts; a plotting error only warns."""
    if ctx.tracker is None:
        return
    try:
        from trajflow.plots import log_run_plots

        log_run_plots(ctx.tracker, ctx.run_id, ctx.store.run_dir / "plots")
    except Exception as e:  # a missing plot must never fail a finished run
        log.warning("could not log the end-of-run plots: %s", e)


def close_run(ctx: RunContext, status: str) -> None:
    """Close progress, workers and the MLflow run (a finished run's model is logged to it first);
    a failed run says where its files are."""
    if ctx.state.progress is not None:
        ctx.state.progress.close()
    try:
        # The final model is loaded for MLflow once the workers' memory is free; Ray (and with it
        # the watcher that reaps Prefect's temporary server) stops last, after the flow's bookkeeping.
        release_workers(ctx)
        _close_tracker(ctx, status)
        _record_session_end(ctx, status)
    finally:
        close(ctx)


def close_mirrors(ctx: RunContext) -> None:
    """Close the TensorBoard / W&B mirrors of a session that failed to start (the MLflow run is
    left as it is, as before)."""
    if ctx.tracker is not None:
        ctx.tracker.close_mirrors("FAILED")


def _close_tracker(ctx: RunContext, status: str) -> None:
    if ctx.tracker is None:
        return
    if status == "FINISHED" and not ctx.state.nothing_to_do and ctx.cfg.tracking.log_model \
            and ctx.store.final_dir.exists():
        _log_final_model(ctx)
    try:
        ctx.tracker.finish(status)
    except Exception as e:  # never hide the original error behind a tracking one
        log.warning("could not close the MLflow run: %s", e)


def _log_final_model(ctx: RunContext) -> None:
    """``final/`` as the run's LoggedModel (``tracking.log_model``): by reference, or copied with
    ``tracking.model_copy`` and then registered under ``tracking.register_model``; a failure is one
    warning line (the model is in ``final/`` anyway)."""
    cfg = ctx.cfg
    try:
        uri = ctx.tracker.log_model(ctx.store.final_dir, int(ctx.state.last_iteration),
                                    registered_name=cfg.tracking.register_model or None, copy=cfg.tracking.model_copy,
                                    description=f"trajflow run {ctx.run_id} (recipe {cfg.recipe}), policy version "
                                                f"{ctx.policy_version}, trained from {cfg.model.path}")
        print(f"final model logged to MLflow: {uri}", flush=True)
    except Exception as e:
        log.warning("could not log the final model to MLflow", exc_info=True)
        print(f"warning: the final model was not logged to MLflow ({type(e).__name__}: {str(e).splitlines()[0]}); "
              f"it is in {ctx.store.final_dir}", file=sys.stderr, flush=True)


def _record_session_end(ctx: RunContext, status: str) -> None:
    meta = ctx.store.read_run_meta()
    sessions = meta.get("sessions") or []
    if sessions:
        sessions[-1].update(ended=time.time(), status=status,
                            trained_iterations=list(ctx.state.trained_iterations),
                            skipped_iterations=list(ctx.state.skipped_iterations))
        ctx.store.update_run_meta(sessions=sessions)
    if status == "KILLED":
        ctx.store.update_run_meta(status="interrupted")
        print(f"trajflow run {ctx.run_id} interrupted: {ctx.store.run_dir} (trajflow resume {ctx.run_id} goes on from "
              f"its newest checkpoint)", flush=True)
    elif status != "FINISHED":
        ctx.store.update_run_meta(status="failed")
        print(f"trajflow run {ctx.run_id} stopped ({status.lower()}): {ctx.store.run_dir}", flush=True)
