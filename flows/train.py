"""The ``train`` flow: rollout -> reward -> gate -> advantage -> update -> checkpoint, per iteration.

Run it with ``trajflow train [--config RECIPE] [key=value ...]`` or call :func:`train` directly.
Prefect runs without a server by default (a temporary local one); set ``PREFECT_API_URL`` to use a
real server.
"""

from __future__ import annotations

from trajflow.env import configure_environment

configure_environment()

from typing import Sequence  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402
from prefect import flow  # noqa: E402

from flows.tasks import advantage_stage, gate_stage, reward_stage, rollout_stage, update_stage  # noqa: E402
from trajflow import session  # noqa: E402
from trajflow.config import load_config  # noqa: E402


@flow(name="train", flow_run_name="train-{run_id}", validate_parameters=False)
def train_flow(config_yaml: str, run_id: str, resume: bool = False) -> dict:
    """Train for ``trainer.total_iterations`` iterations; returns a summary (run id, dir, final metrics).

    Args:
        config_yaml: the resolved config (YAML text).
        run_id: the run's id (its folder under ``store.root``).
        resume: continue the run from its newest complete checkpoint.
    """
    cfg = load_config(base=OmegaConf.create(config_yaml))
    ctx = session.open_run(cfg, run_id, resume=resume)
    status = "FAILED"
    try:
        for it in session.pending_iterations(ctx):
            rollout = rollout_stage(run_id, it)
            reward = reward_stage(run_id, it, rollout)
            gate = gate_stage(run_id, it, rollout, reward)
            advantage = advantage_stage(run_id, it, rollout, reward, gate)
            metrics = update_stage(run_id, it, rollout, reward, advantage, gate)
            session.finish_iteration(ctx, it, metrics)
        summary = session.finish_run(ctx)
        status = "FINISHED"
        return summary
    finally:
        session.close_run(ctx, status)


def train(recipe: str | None = None, overrides: Sequence[str] = (), run_id: str | None = None) -> dict:
    """Build the config, check data and model, then run :func:`train_flow` (honours ``trainer.resume=auto``).

    Raises:
        ConfigError, DataError, ModelLoadError, RunExistsError: bad input, before anything is written.
    """
    cfg = load_config(recipe, overrides)
    session.preflight(cfg)
    run_id, resume = session.choose_run_id(cfg, run_id)
    return train_flow(config_yaml=OmegaConf.to_yaml(cfg), run_id=run_id, resume=resume)
