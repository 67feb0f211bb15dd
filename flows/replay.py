"""The ``replay`` flow: run the later stages of stored iterations again, with a (possibly changed) config.

``trajflow replay RUN --iteration N --from-stage reward|advantage|update [key=value ...]`` reads the
stored outputs of iteration N of RUN (the *parent*) and writes a new run:

- the stages before ``--from-stage`` are copied from the parent byte for byte (their sha256 is
  checked on both sides); the stages from it on are computed with the new config (e.g. another
  ``reward.custom_function``, ``algorithm.adv_estimator`` or ``actor.policy_loss``) by the same
  Prefect tasks as training (:mod:`trajflow.flows.tasks`);
- the policy update starts from the policy that generated iteration N's rollouts: the parent's
  checkpoint N-1 (weights, optimizer, RNG, KL controller, score history), or the initial model for
  N = 1. Without that checkpoint (rotated away, or not saved at N-1) a replay from ``reward`` or
  ``advantage`` stops after the advantages (``run.json`` says why); one from ``update`` is refused;
- ``run.json`` and the MLflow tags record ``parent_run_id``, ``parent_iteration`` and ``from_stage``.

With the parent's config unchanged, the replay reproduces the stored ``reward.parquet`` and
``advantage.parquet`` byte for byte (same sha256), and the update reproduces the parent's
``update.json`` metrics (timings aside) and the weights of its checkpoint N.

``--iterations A:B`` replays a whole stretch: the policy starts from the parent's checkpoint A-1
and is trained again on the *stored* rollouts of iterations A..B. From iteration A+1 on those
rollouts were sampled by the parent's policy, not by the re-trained one, so unless the config is
unchanged this is off-policy training by design: the update takes the behaviour log-probs of its
PPO ratio from the policy being trained (``trajflow.workers.policy.PolicyWorker.update_actor``), so
the samples are used as if that policy had drawn them, with no importance correction;
``actor/rollout_logprob_diff`` (stored log-probs of the parent's policy vs the trained policy's)
shows how far apart the two have drifted. It answers "what would these samples have taught another
loss/estimator/reward", not "what would on-policy training with it have done". With an unchanged
config it reproduces the parent's data and final weights exactly.

Deployments run :func:`replay_flow` (``infra/prefect/prefect.yaml``); ``trajflow replay`` checks the
request first (:func:`trajflow.run.replay.prepare`), so bad input fails before Prefect or Ray start.
"""

from __future__ import annotations

from trajflow.infra.env import configure_environment

configure_environment()

import time  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from prefect import flow  # noqa: E402

from trajflow.flows import tasks  # noqa: E402
from trajflow.flows.iteration import close_iteration  # noqa: E402
from trajflow.flows.reporting import rename_flow_run  # noqa: E402
from trajflow import run  # noqa: E402
from trajflow.infra.prefect_server import start_temporary_server  # noqa: E402
from trajflow.run.replay import KEPT_STAGES, data_metrics, open_replay, parent_gate, prepare  # noqa: E402


@flow(name="replay", flow_run_name="replay-{run_id}", validate_parameters=False)
def replay_flow(run_id: str, from_stage: str, iteration: Optional[int] = None, iterations: Optional[str] = None,
                overrides: Optional[list[str]] = None, new_run_id: Optional[str] = None) -> dict:
    """Replay stored iterations of run ``run_id`` from ``from_stage`` into a new run (the ``replay`` deployment).

    Args:
        run_id: the parent run (found under ``store.root`` from ``overrides``, default ``runs``).
        from_stage: ``reward``, ``advantage`` or ``update``: the first stage computed again.
        iteration: replay this iteration (or give ``iterations``).
        iterations: ``"A:B"``: re-train from the parent's checkpoint A-1 on the stored rollouts of A..B.
        overrides: ``key=value`` changes to the parent's config (e.g. ``algorithm.adv_estimator=rloo``).
        new_run_id: the new run's id (default: ``<parent>-replay-<stage>-it<N>-<hex>``).

    Returns:
        The summary: ``run_id``, ``run_dir``, ``mlflow_run_id``, last ``metrics``, ``parent_run_id``,
        ``parent_iterations``, ``from_stage``, ``note`` (why the update was skipped, if it was).

    Raises:
        ReplayError: see :func:`trajflow.run.replay.parse_iterations` and :func:`trajflow.run.replay.plan`.
        trajflow.config.ConfigError: a bad override.
        trajflow.errors.RunExistsError: ``new_run_id`` exists.
    """
    job = prepare(run_id, from_stage, iteration, iterations, overrides or [], new_run_id)
    parent, new_id = job.parent, job.run_id
    rename_flow_run(f"replay-{new_id}")
    stage = tasks.stages_for(job.cfg)  # the stage tasks with this run's retries and timeouts
    ctx = open_replay(job, from_stage, overrides or [])
    status = "FAILED"
    try:
        for it in run.iterations(ctx):
            run.begin_iteration(ctx, it, prompts=[])  # the prompts are in the copied rollout
            kept = {s: ctx.store.copy_stage_from(parent, it, s) for s in KEPT_STAGES[from_stage]}
            rollout = kept["rollout"]
            if "reward" in kept:
                tasks.restore_reward_metrics(ctx, it)
            reward = kept.get("reward") or stage.reward(new_id, it, rollout)
            gate = parent_gate(parent, it) if from_stage == "update" else stage.gate(new_id, it, rollout, reward)
            advantage = kept.get("advantage") or stage.advantage(new_id, it, rollout, reward, gate)
            if job.plan.run_update:
                metrics = stage.update(new_id, it, rollout, reward, advantage, gate)
            else:
                metrics = data_metrics(ctx, it, rollout, reward, advantage)
            close_iteration(ctx, stage, new_id, it, metrics, trained=job.plan.run_update)
        if job.plan.run_update:
            summary = run.finish_run(ctx)
        else:
            ctx.store.update_run_meta(status="finished", finished=time.time())
            summary = {"run_id": new_id, "run_dir": str(ctx.store.run_dir), "mlflow_run_id": ctx.tracker.run_id,
                       "metrics": ctx.state.last_metrics}
        summary.update(parent_run_id=run_id, parent_iterations=[job.first, job.last], from_stage=from_stage,
                       note=job.plan.note)
        status = "FINISHED"
        return summary
    except KeyboardInterrupt:
        status = "KILLED"  # MLflow's status of a run the user stopped
        raise
    finally:
        run.close_run(ctx, status)


def replay(parent_run_id: str, from_stage: str, iteration: int | None = None, iterations: str | None = None,
           overrides: Sequence[str] = (), run_id: str | None = None) -> dict:
    """Check the request (before Prefect or Ray start), then run :func:`replay_flow`.

    Returns:
        The summary of :func:`replay_flow`.

    Raises:
        See :func:`trajflow.run.replay.prepare`.
    """
    job = prepare(parent_run_id, from_stage, iteration, iterations, overrides, run_id)
    start_temporary_server()
    return replay_flow(run_id=parent_run_id, from_stage=from_stage, iteration=iteration, iterations=iterations,
                       overrides=list(overrides), new_run_id=job.run_id)
