"""The ``train`` flow: rollout -> reward -> gate -> advantage -> update -> checkpoint, per iteration.

Run it with ``trajflow train [--config RECIPE] [key=value ...]`` or call :func:`train` directly;
deployments run :func:`train_recipe` (``infra/prefect/prefect.yaml``). Prefect runs without a server
by default (a temporary local one); set ``PREFECT_API_URL`` to use a real server.
"""

from __future__ import annotations

from trajflow.infra.env import configure_environment

configure_environment()

from typing import Optional, Sequence  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402
from prefect import flow  # noqa: E402

from trajflow.flows import tasks  # noqa: E402
from trajflow.flows.iteration import close_iteration, learn  # noqa: E402
from trajflow.flows.reporting import quiet_expected_errors, rename_flow_run  # noqa: E402
from trajflow import run  # noqa: E402
from trajflow.run.schedule import RolloutSchedule  # noqa: E402
from trajflow.run.start import prepare_resume, prepare_train  # noqa: E402
from trajflow.config import DEFAULT_RECIPE, load_config  # noqa: E402
from trajflow.infra.prefect_server import start_temporary_server  # noqa: E402
from trajflow.store import RunStore, run_lock  # noqa: E402


@flow(name="train", flow_run_name="train-{run_id}", validate_parameters=False)
def train_flow(config_yaml: str, run_id: str, resume: bool = False) -> dict:
    """Train for ``trainer.total_iterations`` iterations; returns a summary (run id, dir, final metrics).

    Args:
        config_yaml: the resolved config (YAML text).
        run_id: the run's id (its folder under ``store.root``).
        resume: continue the run from its newest complete checkpoint.
    """
    quiet_expected_errors()  # a failed gate is one line from the CLI, not Prefect's tracebacks
    cfg = load_config(base=OmegaConf.create(config_yaml))
    stage = tasks.stages_for(cfg)  # the stage tasks with this run's retries and timeouts
    ctx = run.open_run(cfg, run_id, resume=resume)
    status = "FAILED"
    try:
        if run.validation_before_training_due(ctx):
            run.log_validation(ctx, 0, stage.validate(run_id, 0))
        # trainer.max_staleness rollouts ahead of the update (0: synchronous); see trajflow/run/schedule.py
        with RolloutSchedule(ctx, stage.rollout, run_id) as schedule:
            for it, rollout in schedule:  # prompts drawn, gated iterations skipped, the iteration begun
                metrics = learn(stage, run_id, it, rollout)  # reward, gate, advantage, update
                close_iteration(ctx, stage, run_id, it, metrics, schedule)  # books, validation, logs, checkpoint
        summary = run.finish_run(ctx)
        status = "FINISHED"
        return summary
    except KeyboardInterrupt:
        status = "KILLED"  # MLflow's status of a run the user stopped
        raise
    finally:
        run.close_run(ctx, status)


def train(recipe: str | None = None, overrides: Sequence[str] = (), run_id: str | None = None) -> dict:
    """Build the config, check data and model, then run :func:`train_flow` (honours ``trainer.resume=auto``).

    With ``trainer.resume=auto`` and the id of an existing run, the run is resumed with this config
    (differences from its stored config are reported); a run with nothing left to do returns at once.

    Raises:
        ConfigError, DataError, ModelLoadError, RunExistsError: bad input, before anything is written.
    """
    return run_training(*prepare_train(recipe, overrides, run_id))


def run_training(cfg, run_id: str, resume: bool) -> dict:
    """Run :func:`train_flow` for a config :func:`~trajflow.run.start.prepare_train` or
    :func:`~trajflow.run.start.prepare_resume` checked, holding the run's lock
    (:func:`trajflow.store.run_lock`), except for a resumed run with nothing left to do (its summary,
    with ``nothing_to_do=True``, without starting Ray).

    Raises:
        StoreError: another driver holds the run (the message names its pid, host and start).
    """
    store = RunStore(cfg.store.root, run_id)
    # Taken before Prefect starts, held until the flow returns: a second driver of the same run
    # would otherwise train the same iteration and clean up the first one's temp files.
    with run_lock(store):
        if resume:
            done = run.finished_summary(cfg, run_id)
            if done is not None:
                return done
        start_temporary_server()
        return train_flow(config_yaml=OmegaConf.to_yaml(cfg), run_id=run_id, resume=resume)


@flow(name="train-recipe", flow_run_name="train-recipe-{recipe}")
def train_recipe(recipe: str = DEFAULT_RECIPE, overrides: Optional[list[str]] = None,
                 run_id: Optional[str] = None) -> dict:
    """Train a recipe with ``key=value`` overrides: the entry of the ``train`` deployment.

    Builds and checks the config, picks the run id (``trainer.resume=auto`` continues an existing
    run), renames this flow run ``train-recipe-<run id>`` and runs :func:`train_flow` as a subflow.

    Args:
        recipe: a recipe name under ``flows/configs/`` or a YAML path on the worker.
        overrides: config overrides such as ``["trainer.total_iterations=50", "actor.lr=2e-5"]``.
        run_id: the run id (default: generated from the recipe and the time).

    Returns:
        The run summary (``run_id``, ``run_dir``, ``mlflow_run_id``, final ``metrics``, ``policy_version``).

    Raises:
        ConfigError, DataError, ModelLoadError, RunExistsError: bad input, before anything is written.
    """
    cfg, run_id, resume = prepare_train(recipe, list(overrides or []), run_id)
    rename_flow_run(f"train-recipe-{run_id}")
    return run_training(cfg, run_id, resume)


def resume(run_id: str, overrides: Sequence[str] = ()) -> dict:
    """Continue run ``run_id`` from its newest complete checkpoint with its stored config plus ``overrides``.

    A run with nothing left to do (every iteration checkpointed, final model exported) returns its
    summary with ``nothing_to_do=True`` without starting Ray or Prefect; raising
    ``trainer.total_iterations`` makes it train the extra iterations.

    Raises:
        trajflow.store.StoreError: no such run under the store root, or the run is a replay.
        trajflow.config.ConfigError: a bad override.
        trajflow.prompts.DataError, trajflow.models.ModelLoadError: the dataset or model is gone or bad.
    """
    cfg, done = prepare_resume(run_id, overrides)
    return done if done is not None else run_training(cfg, run_id, True)
