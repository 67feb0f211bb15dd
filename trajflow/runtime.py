"""The run's live state, shared by the flow's tasks: config, store, Ray workers, tracker, data cursor.

Prefect tasks receive only a run id and small references; they look the live objects up here
(``get_context(run_id)``) so that no actor handle or tensor is ever hashed, serialised or persisted
by Prefect.

Worker failures: every stage task runs inside :func:`stage_guard`, which bounds its Ray waits by the
stage's timeout and, on a transient failure (a Ray worker died, a wait timed out), drops the workers
that no longer answer. Prefect then retries the task (:func:`retry_on_transient`), whose first step,
:func:`ensure_workers`, recreates what was dropped: the policy worker from the run's newest checkpoint
(or the initial model) with the stored updates since then re-applied, so the retry sees exactly the
policy the failed attempt saw.
"""

from __future__ import annotations

import contextlib
import logging

import time
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from trajflow.infra.ray_cluster import start_ray, stop_ray, watch_new_ray_processes  # noqa: F401 (used by the flows)
from trajflow.run.context import RunContext, unregister

log = logging.getLogger(__name__)

#: Run this class instead of :class:`trajflow.workers.policy.PolicyWorker` (a subclass: extensions,
#: instrumented workers in tests). ``None``: the stock worker.
policy_worker_cls: type | None = None


def placement(ctx: RunContext) -> Any:
    """The run's :class:`trajflow.infra.placement.Placement` (pools -> placement groups -> actor options), made once."""
    from trajflow.infra.placement import Placement

    if ctx.placement is None:
        ctx.placement = Placement(ctx.cfg)
    return ctx.placement


def create_policy_worker(ctx: RunContext, wait_loaded: bool = True) -> None:
    """Start the policy workers (actor + rollout) as a :class:`~trajflow.workers.group.WorkerGroup`
    with the initial model: ``actor.world_size`` ranks on the actor's pool (one rank and today's actor
    options when no pools are declared).

    Args:
        ctx: the run (``ctx.actor`` is set; it is called like one actor handle).
        wait_loaded: wait until the model is loaded (and, for DeepSpeed, the ranks have joined their
            process group, and separate rollout workers are attached), so that errors surface here.

    Raises:
        ray.exceptions.RayActorError: the model could not be loaded (the cause names it).
        trajflow.errors.DeviceError: a pool does not fit the cluster.
    """
    from trajflow.workers.group import WorkerGroup
    from trajflow.workers.policy import PolicyWorker

    cfg = ctx.cfg
    place = placement(ctx)
    ctx.actor = WorkerGroup.spawn(
        policy_worker_cls or PolicyWorker,
        (ctx.model_path, OmegaConf.to_object(cfg.actor), OmegaConf.to_object(cfg.model),
         OmegaConf.to_object(cfg.rollout), int(cfg.trainer.seed), cfg.trainer.device, int(cfg.trainer.num_threads)),
        [place.actor_options("actor", r) for r in range(place.world_size("actor"))], "actor",
        lockstep=cfg.actor.strategy == "deepspeed" and cfg.actor.zero_stage == 3)
    if wait_loaded:
        finish_policy_worker(ctx)


def finish_policy_worker(ctx: RunContext) -> None:
    """Wait for the policy ranks to load; join DeepSpeed ranks into one process group; attach
    separate rollout workers (``rollout.pool``), creating them on first use."""
    import ray

    cfg = ctx.cfg
    if cfg.actor.strategy == "deepspeed":
        ctx.actor.init_distributed()
    if cfg.rollout.pool is not None:
        if ctx.rollout is None:
            from trajflow.workers.group import WorkerGroup
            from trajflow.workers.rollout import RolloutWorker

            place = placement(ctx)
            ctx.rollout = WorkerGroup.spawn(
                RolloutWorker, (ctx.model_path, OmegaConf.to_object(cfg.rollout), OmegaConf.to_object(cfg.model),
                                int(cfg.trainer.seed), cfg.trainer.device, int(cfg.trainer.num_threads)),
                [place.actor_options("rollout", r) for r in range(place.world_size("rollout"))], "rollout")
        ray.get([h.pid.remote() for h in ctx.rollout.handles])
        ctx.actor.execute("attach_rollout", ctx.rollout.handles)
    ray.get(ctx.actor.info.remote())


def create_reference_worker(ctx: RunContext, wait_loaded: bool = True) -> None:
    """Start the frozen reference policy (for KL terms) as a worker group (``ctx.reference``): one
    rank per slot of its pool (one actor with ``num_cpus=0`` when no pools are declared)."""
    import ray

    from trajflow.workers.group import WorkerGroup
    from trajflow.workers.reference import ReferenceWorker

    cfg = ctx.cfg
    ref_path = cfg.reference.path
    if ref_path:
        from trajflow.models import resolve_model_path

        ref_path = str(resolve_model_path(ref_path, cfg.model.cache_dir))
    place = placement(ctx)
    ctx.reference = WorkerGroup.spawn(
        ReferenceWorker, (ref_path or ctx.model_path, OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.rollout),
                          cfg.trainer.device, int(cfg.trainer.num_threads)),
        [place.actor_options("reference", r) for r in range(place.world_size("reference"))], "reference")
    if wait_loaded:
        ray.get([h.pid.remote() for h in ctx.reference.handles])


def create_critic_worker(ctx: RunContext, wait_loaded: bool = True) -> None:
    """Start the critic (value model: ``critic.path`` or the policy's body + a value head) as a Ray
    actor (``ctx.critic``), with fresh weights and optimizer."""
    import ray

    from trajflow.models import resolve_model_path
    from trajflow.workers.critic import CriticWorker

    cfg = ctx.cfg
    path = str(resolve_model_path(cfg.critic.path, cfg.model.cache_dir)) if cfg.critic.path else ctx.model_path
    # One actor on the critic's pool (its slot 0; num_cpus=0 when no pools are declared).
    ctx.critic = ray.remote(max_restarts=0)(CriticWorker).options(**placement(ctx).actor_options("critic", 0)).remote(
        path, OmegaConf.to_object(cfg.critic), OmegaConf.to_object(cfg.model), cfg.trainer.device,
        int(cfg.trainer.num_threads))
    if wait_loaded:
        ray.get(ctx.critic.pid.remote())


def create_reward_model_worker(ctx: RunContext, wait_loaded: bool = True) -> None:
    """Start the reward model (``reward.reward_model.path``) as a Ray actor (``ctx.reward_model``)."""
    import ray

    from trajflow.models import resolve_model_path
    from trajflow.workers.reward_model import RewardModelWorker

    cfg = ctx.cfg
    path = str(resolve_model_path(cfg.reward.reward_model.path, cfg.model.cache_dir))
    ctx.reward_model = ray.remote(RewardModelWorker).options(num_cpus=0).remote(
        path, OmegaConf.to_object(cfg.reward.reward_model), OmegaConf.to_object(cfg.model), cfg.trainer.device,
        int(cfg.trainer.num_threads))
    if wait_loaded:
        ray.get(ctx.reward_model.pid.remote())


def create_workers(ctx: RunContext) -> None:
    """Start the policy workers, plus the reference workers when a KL term is on, the critic when the
    advantage estimator needs values and the reward model when it is enabled; they load in parallel,
    and load errors (bad model directory, ...) surface here rather than at the first stage.

    Where the policy, reference and critic run comes from :class:`trajflow.infra.placement.Placement`
    (``resources.pools``, ``resources.placement``, ``<role>.pool``); the Ray node of every rank is
    recorded in ``run.json`` (``worker_nodes``).
    """
    import ray

    create_policy_worker(ctx, wait_loaded=False)
    if ctx.needs_reference():
        create_reference_worker(ctx, wait_loaded=False)
    if ctx.needs_critic():
        create_critic_worker(ctx, wait_loaded=False)
    if ctx.needs_reward_model():
        create_reward_model_worker(ctx, wait_loaded=False)
    finish_policy_worker(ctx)
    if ctx.reference is not None:
        ray.get([h.pid.remote() for h in ctx.reference.handles])
    for handle in (ctx.critic, ctx.reward_model):
        if handle is not None:
            ray.get(handle.pid.remote())
    groups = {"actor": ctx.actor, "reference": ctx.reference, "rollout": ctx.rollout}
    ctx.store.update_run_meta(worker_nodes={role: g.node_ids() for role, g in groups.items() if g is not None})
    try:
        watch_new_ray_processes()
    except Exception as e:  # pragma: no cover - best effort
        log.warning("could not update the Ray watcher: %s", e)


# ------------------------------------------------------------------------------------------------
# failures: timeouts, dead workers, recreation


def transient_errors() -> tuple[type[BaseException], ...]:
    """Exception types a retry can cure: a worker, node or object died, or a wait timed out.

    ``TimeoutError`` covers Ray's ``GetTimeoutError`` and Prefect's task-run timeout. A
    ``RayTaskError`` (the stage's own code raised) is not transient: retrying repeats it.
    """
    import ray.exceptions as rex

    return (rex.RayActorError, rex.WorkerCrashedError, rex.ObjectLostError, rex.NodeDiedError,
            rex.LocalRayletDiedError, rex.OutOfMemoryError, rex.RaySystemError, TimeoutError)


def is_transient(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a failure a retry can cure (see :func:`transient_errors`)."""
    return isinstance(exc, transient_errors())


def retry_on_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry a stage only after a transient failure.

    Bad input (config, data, a failed quality gate, a bug in a stage) fails at once instead of
    being repeated ``trainer.stage_retries`` times.
    """
    exc = getattr(state, "data", None)
    if not isinstance(exc, BaseException):
        try:
            exc = state.result(raise_on_failure=False)
        except Exception:  # the result cannot be read back: treat it as not retryable
            return False
    return is_transient(exc)


def stage_timeout(cfg: DictConfig, stage: str) -> float | None:
    """The stage's wall-clock limit in seconds (``trainer.stage_timeouts``, else ``stage_timeout_s``); None = none."""
    value = cfg.trainer.stage_timeouts.get(stage, cfg.trainer.stage_timeout_s)
    return float(value) if value and float(value) > 0 else None


@contextlib.contextmanager
def stage_guard(ctx: RunContext, stage: str) -> Iterator[None]:
    """Run one attempt of a stage: bound its Ray waits (:func:`wait`) by the stage's timeout; after a
    transient failure drop the workers that no longer answer, so that the retry recreates them.

    Args:
        ctx: the run.
        stage: the stage name (a key of ``trainer.stage_timeouts``).
    """
    limit = stage_timeout(ctx.cfg, stage)
    ctx.state.deadline = (time.monotonic() + limit) if limit else None
    try:
        yield
    except BaseException as e:
        if is_transient(e):
            dropped = drop_unresponsive_workers(ctx)
            if dropped:
                ctx.state.workers_lost = dropped
            log.warning("run %s: stage %s failed (%s: %s); dropped workers: %s", ctx.run_id, stage,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "", dropped or "none")
        raise
    finally:
        ctx.state.deadline = None


def wait(ctx: RunContext, refs: Any) -> Any:
    """``ray.get(refs)`` bounded by the running stage's deadline.

    Raises:
        ray.exceptions.GetTimeoutError: the stage's time limit passed first.
        ray.exceptions.RayActorError: the worker died while computing.
    """
    import ray

    deadline = ctx.state.deadline
    timeout = None if deadline is None else max(0.01, deadline - time.monotonic())
    return ray.get(refs, timeout=timeout)


def _answers(handle: Any, method: str, timeout_s: float) -> bool:
    """Whether every rank of a worker group (or a plain actor) answers ``method`` within ``timeout_s``."""
    import ray

    handles = getattr(handle, "handles", [handle])
    try:
        ray.get([getattr(h, method).remote() for h in handles], timeout=timeout_s)
        return True
    except Exception:
        return False


#: Seconds a worker has to answer a ping after a failed stage before it is killed and recreated.
PING_TIMEOUT_S = 10.0


def drop_unresponsive_workers(ctx: RunContext, timeout_s: float | None = None) -> list[str]:
    """Kill and forget the run's actors that do not answer a ping within ``timeout_s``.

    A dead actor fails the ping at once; a live one stuck in a timed-out call cannot answer (actor
    calls run one at a time) and is killed too. Returns the dropped roles (``policy``, ``reference``,
    ``critic``, ``reward_model``).
    """
    from trajflow.workers.group import kill_workers

    dropped = []
    for attr, method, role in (("actor", "info", "policy"), ("reference", "pid", "reference"),
                               ("critic", "pid", "critic"), ("reward_model", "pid", "reward_model")):
        handle = getattr(ctx, attr)
        if handle is None or _answers(handle, method, PING_TIMEOUT_S if timeout_s is None else timeout_s):
            continue
        kill_workers(handle)  # every rank: a data-parallel group is recreated whole
        setattr(ctx, attr, None)
        dropped.append(role)
    return dropped


def ensure_workers(ctx: RunContext, through: int) -> list[str]:
    """Recreate the workers a failed stage attempt dropped; a no-op when all are alive.

    The policy worker comes back in the state after iteration ``through``: the run's newest checkpoint
    at or before it (else ``ctx.state.initial_checkpoint``, an actor checkpoint folder a derived run
    starts from, else the initial model), then the stored updates of every later iteration up to
    ``through`` that recorded an update (``update.json``), re-applied in order from the run store. Those
    batches and shuffle seeds are what the original updates used, so the recreated policy equals the
    lost one; the policy version is checked against the run's.

    Args:
        ctx: the run.
        through: the last iteration whose update the caller's stage must see (``iteration - 1``
            before an iteration's rollout or update; ``step`` for validation after step's update).

    Returns:
        The recreated roles (``policy``, ``reference``); empty when nothing was missing.

    Raises:
        trajflow.store.StoreError: an iteration to re-apply lacks verified stage outputs.
        RuntimeError: the recreated policy's version differs from the run's (its stored history is
            incomplete, e.g. a derived run that did not set ``initial_checkpoint``).
    """
    created = []
    if ctx.reference is None and ctx.needs_reference() and not ctx.state.policy_only:
        create_reference_worker(ctx)
        created.append("reference")
    if ctx.reward_model is None and ctx.needs_reward_model() and not ctx.state.policy_only:
        create_reward_model_worker(ctx)
        created.append("reward_model")
    if ctx.critic is None and ctx.needs_critic() and not ctx.state.policy_only:
        create_critic_worker(ctx)
        restore_critic(ctx, through)
        created.append("critic")
    if ctx.actor is None:
        create_policy_worker(ctx)
        restore_policy(ctx, through)
        created.append("policy")
    if created:
        lost, ctx.state.workers_lost = ctx.state.workers_lost, []
        (log.warning if lost else log.info)("run %s: %s %s worker(s) in the state after iteration %d", ctx.run_id,
                                            "recreated" if lost else "started", " and ".join(created), through)
    return created


def restore_policy(ctx: RunContext, through: int) -> int:
    """Bring a freshly created policy worker to the state after iteration ``through`` (see
    :func:`ensure_workers`); returns the number of updates re-applied."""
    from stages.policy_update import update_batch, update_batch_options, with_loss_mask
    from trajflow import checkpoint as ckpt
    from trajflow.batch import join_stages
    from trajflow.store import STAGES

    store, cfg = ctx.store, ctx.cfg
    saved = [c for c in ckpt.list_checkpoints(store) if c <= through]
    base = saved[-1] if saved else None
    if base is not None:
        wait(ctx, ctx.actor.load_checkpoint.remote(str(ckpt.checkpoint_dir(store, base) / "actor")))
    elif ctx.state.initial_checkpoint:
        wait(ctx, ctx.actor.load_checkpoint.remote(str(ctx.state.initial_checkpoint)))
    replayed = 0
    for it in store.iterations():
        # Iterations without update.json changed no weights (a replay that stops before the update).
        if it <= (base or 0) or it > through or store.read_iteration_json(it, "update.json") is None:
            continue
        joined = join_stages([store.read_stage(it, stage) for stage in STAGES])
        joined = with_loss_mask(joined, store.read_iteration_json(it, "gate.json"))
        batch = update_batch(joined, it, **update_batch_options(cfg))
        wait(ctx, ctx.actor.update_actor.remote(batch))
        replayed += 1
    version = int(wait(ctx, ctx.actor.info.remote())["policy_version"])
    if version != ctx.policy_version:
        raise RuntimeError(f"run {ctx.run_id}: the recreated policy worker is at policy version {version} "
                           f"(checkpoint {base}, {replayed} stored updates re-applied) but the run is at "
                           f"{ctx.policy_version}; its stored history is incomplete")
    return replayed


def restore_critic(ctx: RunContext, through: int) -> int:
    """Bring a freshly created critic to the state after iteration ``through``, as
    :func:`restore_policy` does for the policy: the newest checkpoint's ``critic/`` at or before it,
    then the stored critic updates of the later iterations re-applied in order (their values and
    returns are in ``advantage.parquet``). Returns the number of updates re-applied.

    Raises:
        trajflow.store.StoreError: an iteration to re-apply lacks verified stage outputs.
    """
    from stages.policy_update import critic_batch, with_loss_mask
    from trajflow import checkpoint as ckpt
    from trajflow.batch import join_stages
    from trajflow.store import STAGES

    store, cfg = ctx.store, ctx.cfg
    saved = [c for c in ckpt.list_checkpoints(store) if c <= through]
    base = saved[-1] if saved else None
    if base is not None:
        wait(ctx, ctx.critic.load_checkpoint.remote(str(ckpt.checkpoint_dir(store, base) / "critic")))
    replayed = 0
    for state in ctx.iterations.values():
        if state.iteration > through:  # updates of the recreated critic's future: the caller's stage redoes them
            state.critic_update = None
    for it in store.iterations():
        if it <= (base or 0) or it > through or store.read_iteration_json(it, "update.json") is None:
            continue
        joined = join_stages([store.read_stage(it, stage) for stage in STAGES])
        joined = with_loss_mask(joined, store.read_iteration_json(it, "gate.json"))
        if "values" in joined.column_names:
            wait(ctx, ctx.critic.update_critic.remote(critic_batch(joined, it, cfg)))
            replayed += 1
    return replayed


def close(ctx: RunContext) -> None:
    """Stop the run's actors, release its placement groups (and stop Ray, if this run started it)."""
    from trajflow.workers.group import kill_workers

    for handle in (ctx.actor, ctx.reference, ctx.critic, ctx.reward_model, ctx.rollout):
        kill_workers(handle)
    ctx.actor = ctx.reference = ctx.critic = ctx.reward_model = ctx.rollout = None
    place, ctx.placement = ctx.placement, None
    if place is not None:
        place.close()
    unregister(ctx)
    if ctx.started_ray:
        stop_ray()
        ctx.started_ray = False
