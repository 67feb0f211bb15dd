"""The ``replay`` flow: run the later stages of stored iterations again, with a (possibly changed) config.

``trajflow replay RUN --iteration N --from-stage reward|advantage|update [key=value ...]`` reads the
stored outputs of iteration N of RUN (the *parent*) and writes a new run:

- the stages before ``--from-stage`` are copied from the parent byte for byte (their sha256 is
  checked on both sides); the stages from it on are computed with the new config (e.g. another
  ``reward.custom_function``, ``algorithm.adv_estimator`` or ``actor.policy_loss``) by the same
  Prefect tasks as training (:mod:`flows.tasks`);
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
request first (:func:`prepare`), so bad input fails before Prefect or Ray start.
"""

from __future__ import annotations

from trajflow.infra.env import configure_environment

configure_environment()

import secrets  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from omegaconf import DictConfig  # noqa: E402
from prefect import flow  # noqa: E402

from flows import tasks  # noqa: E402
from flows.reporting import iteration_artifact, rename_flow_run  # noqa: E402
from stages.names import REPLAY_FROM, STORED_STAGES  # noqa: E402
from trajflow import checkpoint as ckpt  # noqa: E402
from trajflow.batch import join_stages  # noqa: E402
from trajflow.config import load_config  # noqa: E402
from trajflow.errors import ReplayError, RunExistsError  # noqa: E402
from trajflow.infra.prefect_server import start_temporary_server  # noqa: E402
from trajflow.metrics import batch_metrics  # noqa: E402
from trajflow.run import lifecycle as run  # noqa: E402
from trajflow.run.context import RunContext  # noqa: E402
from trajflow.run.workers import close  # noqa: E402
from trajflow.errors import StoreError  # noqa: E402
from trajflow.store import StageRef, RunStore  # noqa: E402

#: ``--from-stage`` choices.
FROM_STAGES = tuple(REPLAY_FROM)
#: The stored stages copied from the parent, per ``--from-stage``: those before it.
_KEPT = {"reward": STORED_STAGES[:1], "advantage": STORED_STAGES[:2], "update": STORED_STAGES}


@dataclass(frozen=True)
class ReplayPlan:
    """What a replay can do with what the parent holds.

    Attributes:
        start_checkpoint: the parent's checkpoint the policy starts from (None = the initial model).
        run_update: whether the policy update runs (its starting checkpoint is stored).
        note: why the update is skipped, or empty.
    """

    start_checkpoint: int | None
    run_update: bool
    note: str


@dataclass(frozen=True)
class ReplayJob:
    """A checked replay request: the new run's config and id, the parent, the iterations, the plan."""

    cfg: DictConfig
    parent: RunStore
    first: int
    last: int
    plan: ReplayPlan
    run_id: str


def parse_iterations(iteration: int | None, iterations: str | None) -> tuple[int, int]:
    """``--iteration N`` or ``--iterations A:B`` as ``(first, last)``.

    Raises:
        ReplayError: neither or both given, not integers, ``A > B`` or ``A < 1``.
    """
    if (iteration is None) == (iterations is None):
        raise ReplayError("give exactly one of --iteration N and --iterations A:B")
    if iteration is not None:
        first = last = int(iteration)
    else:
        a, sep, b = str(iterations).partition(":")
        try:
            first, last = int(a), int(b)
        except ValueError:
            raise ReplayError(f"--iterations {iterations!r}: expected A:B with integers A <= B (e.g. 2:5)") from None
        if not sep:
            raise ReplayError(f"--iterations {iterations!r}: expected A:B (e.g. 2:5)")
    if first < 1 or first > last:
        given = f"--iteration {iteration}" if iterations is None else f"--iterations {iterations}"
        raise ReplayError(f"{given}: iterations {first}..{last} is empty or starts below 1 (need 1 <= A <= B)")
    return first, last


def plan(parent: RunStore, first: int, last: int, from_stage: str) -> ReplayPlan:
    """Check that the parent holds what the replay needs.

    Raises:
        ReplayError: unknown parent run (names the store root) or stage; an iteration of
            ``first..last`` not stored, or a kept stage output that does not verify (names the file);
            the starting checkpoint missing where the update needs it.
    """
    if from_stage not in FROM_STAGES:
        raise ReplayError(f"--from-stage {from_stage!r}: choose one of {', '.join(FROM_STAGES)}")
    if not parent.exists():
        try:
            run.check_resumable(parent)
        except StoreError as e:
            raise ReplayError(str(e)) from None
    stored = parent.iterations()
    shown = f"{stored[0]}..{stored[-1]}" if stored else "none"
    for it in range(first, last + 1):
        if it not in stored:
            raise ReplayError(f"iteration {it} of run {parent.run_id!r} is not stored (stored iterations: {shown})")
        for stage in _KEPT[from_stage]:
            if parent.verified_stage(it, stage) is None:
                raise ReplayError(f"{parent.stage_path(it, stage)} is missing or does not match its manifest: "
                                  f"iteration {it} cannot be replayed from stage {from_stage!r}")
    start = first - 1 if first > 1 else None
    have = start is None or start in ckpt.list_checkpoints(parent)
    note = ""
    if not have:
        kept = ", ".join(f"{i:06d}" for i in ckpt.list_checkpoints(parent)) or "none"
        why = (f"checkpoint {start:06d} of run {parent.run_id!r} is not stored (kept: {kept}), so the policy that "
               f"generated iteration {first} cannot be restored")
        if from_stage == "update" or last > first:
            raise ReplayError(f"{why}; replaying {'the update' if from_stage == 'update' else 'iterations'} needs it")
        note = f"policy update skipped: {why}"
    return ReplayPlan(start_checkpoint=start, run_update=have, note=note)


def _parent_gate(parent: RunStore, iteration: int) -> dict:
    """The parent's gate result (its quarantine shaped the stored advantages); empty when gates were off."""
    g = parent.read_iteration_json(iteration, "gate.json") or {}
    return {"success": g.get("success", True), "quarantined_sample_ids": g.get("quarantined_sample_ids", []),
            "metrics": {}}


def open_replay(job: ReplayJob, from_stage: str, overrides: Sequence[str]) -> RunContext:
    """Create the replay run, start its workers and restore the parent's starting checkpoint.

    Raises:
        RunExistsError: the new run id exists.
    """
    from trajflow.tracking import Tracker, lineage_tags

    cfg, parent, first, last, plan_ = job.cfg, job.parent, job.first, job.last, job.plan
    store = RunStore(cfg.store.root, job.run_id)
    # Without the starting checkpoint the update is skipped (plan's note) and no policy is restored.
    start = plan_.start_checkpoint if plan_.run_update else None
    start_id = (f"{parent.run_id}/{ckpt.checkpoint_id(start)}" if start is not None
                else "initial" if plan_.run_update else "none (update skipped)")
    lineage = {"parent_run_id": parent.run_id, "parent_iteration": first, "parent_iterations": [first, last],
               "from_stage": from_stage}
    run.create_run_folder(store, cfg, recipe=str(cfg.recipe), kind="replay", overrides=list(overrides),
                          custom_function=run.custom_function_record(cfg),
                          start_checkpoint=start_id, note=plan_.note, **lineage)
    print(f"trajflow replay {job.run_id}: {store.run_dir} (run {parent.run_id}, iterations {first}..{last}, "
          f"from stage {from_stage}, policy from {start_id})", flush=True)
    if plan_.note:
        print(f"note: {plan_.note}", flush=True)
    run.preload_audit()
    ctx = run.build_context(cfg, store)
    run.start_workers(ctx)
    try:
        if start is not None:
            run.restore_checkpoint(ctx, start, source=parent)
            # A worker lost mid-replay is rebuilt from here plus this run's stored updates.
            ctx.state.initial_checkpoint = str(ckpt.checkpoint_dir(parent, start) / "actor")
        ctx.state.policy_source, ctx.state.start_iteration, ctx.state.last_iteration = start_id, first, last
        tags = lineage_tags(parent.run_id, first, from_stage)
        tags.update({"trajflow.parent_iterations": f"{first}:{last}", "trajflow.kind": "replay"})
        parent_mlflow = parent.read_run_meta().get("mlflow_run_id")
        if parent_mlflow:
            tags["trajflow.parent_mlflow_run_id"] = parent_mlflow
        ctx.tracker = Tracker(cfg, job.run_id, tags=tags)
        store.update_run_meta(mlflow_run_id=ctx.tracker.run_id, tracking_uri=ctx.tracker.uri)
    except BaseException:
        close(ctx)
        raise
    return ctx


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
        ReplayError: see :func:`parse_iterations` and :func:`plan`.
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
            kept = {s: ctx.store.copy_stage_from(parent, it, s) for s in _KEPT[from_stage]}
            rollout = kept["rollout"]
            if "reward" in kept:
                tasks.restore_reward_metrics(ctx, it)
            reward = kept.get("reward") or stage.reward(new_id, it, rollout)
            gate = _parent_gate(parent, it) if from_stage == "update" else stage.gate(new_id, it, rollout, reward)
            advantage = kept.get("advantage") or stage.advantage(new_id, it, rollout, reward, gate)
            if job.plan.run_update:
                metrics = stage.update(new_id, it, rollout, reward, advantage, gate)
            else:
                metrics = _data_metrics(ctx, it, rollout, reward, advantage)
            metrics = run.record(ctx, it, metrics)
            # Without the update the worker holds the initial model, not the policy after iteration
            # ``it``: validating or checkpointing it under that iteration would misreport the replay.
            if job.plan.run_update and run.validation_due(ctx, it):
                metrics |= stage.validate(new_id, it)
            run.log_iteration(ctx, it, metrics)
            if job.plan.run_update and run.checkpoint_due(ctx, it):
                run.save(ctx, it)
            iteration_artifact(ctx, it, metrics)
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


def _data_metrics(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef, advantage: StageRef) -> dict:
    """verl's data metrics of an iteration whose update is not replayed."""
    joined = join_stages([ctx.store.read_ref(r) for r in (rollout, reward, advantage)])
    metrics = batch_metrics(joined)
    metrics.update(ctx.iteration(iteration).reward_metrics)
    return metrics


def replay_run_id(parent_run_id: str, first: int, last: int, from_stage: str) -> str:
    span = f"it{first}" if first == last else f"it{first}-{last}"
    return f"{parent_run_id}-replay-{from_stage}-{span}-{secrets.token_hex(2)}"


def prepare(parent_run_id: str, from_stage: str, iteration: int | None, iterations: str | None,
            overrides: Sequence[str], run_id: str | None) -> ReplayJob:
    """Check a replay request and build its config; starts nothing.

    Raises:
        ReplayError, trajflow.config.ConfigError, trajflow.errors.RunExistsError,
        trajflow.prompts.DataError, trajflow.models.ModelLoadError.
    """
    first, last = parse_iterations(iteration, iterations)
    parent = RunStore(run.store_root_from(overrides), parent_run_id)
    plan_ = plan(parent, first, last, from_stage)
    cfg = load_config(base=parent.read_config(), overrides=list(overrides))
    run.check_custom_function(cfg, parent.read_run_meta(), f"replay of run {parent_run_id!r}", same_spec_only=True)
    run.preflight(cfg)
    run_id = run_id or replay_run_id(parent_run_id, first, last, from_stage)
    target = RunStore(cfg.store.root, run_id)
    if target.exists():
        raise RunExistsError(f"run {run_id!r} already exists in {target.run_dir}")
    return ReplayJob(cfg=cfg, parent=parent, first=first, last=last, plan=plan_, run_id=run_id)


def replay(parent_run_id: str, from_stage: str, iteration: int | None = None, iterations: str | None = None,
           overrides: Sequence[str] = (), run_id: str | None = None) -> dict:
    """Check the request (before Prefect or Ray start), then run :func:`replay_flow`.

    Returns:
        The summary of :func:`replay_flow`.

    Raises:
        See :func:`prepare`.
    """
    job = prepare(parent_run_id, from_stage, iteration, iterations, overrides, run_id)
    start_temporary_server()
    return replay_flow(run_id=parent_run_id, from_stage=from_stage, iteration=iteration, iterations=iterations,
                       overrides=list(overrides), new_run_id=job.run_id)
