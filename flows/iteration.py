"""One iteration's stages in order, shared by the training loop and replay.

:func:`learn` runs reward -> gate -> advantage -> update on a stored rollout; :func:`close_iteration`
is every iteration's tail: its books closed, validation and checkpoint when due, the logs. Training
(:func:`trajflow.flows.train.train_flow`) and replay (:func:`trajflow.flows.replay.replay_flow`) differ only in where a
rollout comes from (:class:`trajflow.run.schedule.RolloutSchedule`, or a parent run's files) and in
which stages replay keeps.
"""

from __future__ import annotations

from typing import Any

from trajflow.flows.reporting import iteration_artifact
from trajflow import run
from trajflow.run.context import RunContext
from trajflow.run.schedule import RolloutSchedule
from trajflow.store import StageRef


def learn(stage: Any, run_id: str, iteration: int, rollout: StageRef) -> dict:
    """Reward, gate, advantage and the policy (and critic) update of one iteration's stored rollout.

    Args:
        stage: the stage tasks (:func:`trajflow.flows.tasks.stages_for`).
        run_id: the run's id.
        iteration: the iteration.
        rollout: its stored rollout.

    Returns:
        The update's metrics (before :func:`trajflow.run.iteration.record` adds the iteration's books).

    Raises:
        GateFailed, NonFiniteError, StageTimeout: as the stage tasks do.
    """
    reward = stage.reward(run_id, iteration, rollout)
    gate = stage.gate(run_id, iteration, rollout, reward)
    advantage = stage.advantage(run_id, iteration, rollout, reward, gate)
    return stage.update(run_id, iteration, rollout, reward, advantage, gate)


def close_iteration(ctx: RunContext, stage: Any, run_id: str, iteration: int, metrics: dict,
                    schedule: RolloutSchedule | None = None, *, trained: bool = True) -> dict:
    """The end of every iteration: timings, KL controller, score history and the manifest marked
    complete (:func:`~trajflow.run.iteration.record`); validation when due; MLflow, samples, audit
    table and progress; a checkpoint when due; the Prefect artifact.

    Args:
        ctx: the run.
        stage: the stage tasks.
        run_id: the run's id.
        iteration: the iteration.
        metrics: the update's (or, without one, the data's) metrics.
        schedule: the rollout schedule of a training run: its in-flight rollouts are settled (stored,
            the trainer's weights pushed) before validation and checkpoints. None: nothing in flight.
        trained: False when the policy was not updated (a replay that skips the update): the workers
            hold the initial model, not the policy after ``iteration``, so it is neither validated
            nor checkpointed under that iteration.

    Returns:
        The iteration's metrics, validation included.
    """
    metrics = run.record(ctx, iteration, metrics)
    if trained and run.validation_due(ctx, iteration):
        if schedule is not None:
            schedule.settle(iteration)  # validation scores this update's weights, on the rollout workers
        metrics |= stage.validate(run_id, iteration)
    run.log_iteration(ctx, iteration, metrics)
    if trained and run.checkpoint_due(ctx, iteration):
        cursor = None
        if schedule is not None:
            schedule.settle(iteration)  # the in-flight rollouts are stored before the checkpoint exists
            cursor = schedule.cursor_after()
        run.save(ctx, iteration, sampler_state=cursor)
    iteration_artifact(ctx, iteration, metrics)
    return metrics
