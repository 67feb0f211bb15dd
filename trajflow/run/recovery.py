"""Stage attempts that survive dead or stuck workers.

Every stage task runs inside :func:`stage_guard`, which bounds its Ray waits by the stage's
timeout and, after a transient failure (a worker died, a wait timed out), drops the workers that no
longer answer. Prefect then retries the task (:func:`retry_on_transient`), whose first step,
:func:`ensure_workers`, recreates what was dropped in the exact state the failed attempt saw: the
newest checkpoint, then the run's stored updates since then re-applied.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

import pyarrow as pa
from omegaconf import DictConfig

from trajflow.run.context import RunContext
from trajflow.run.workers import create_critic_worker, create_policy_worker, create_reference_worker, \
    create_judge_worker, create_reward_model_worker, create_teacher_worker

log = logging.getLogger(__name__)



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


def timed_out(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a stage's timeout: a ``TimeoutError`` (Ray's ``GetTimeoutError`` is one),
    or the ``SystemError`` CPython raises when an asynchronous timeout lands inside a C call."""
    if isinstance(exc, TimeoutError):
        return True
    return isinstance(exc, SystemError) and isinstance(exc.__cause__ or exc.__context__, TimeoutError)


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
        if timed_out(e):
            # Ray's GetTimeoutError, or Prefect's timeout landing inside a Ray call (then a SystemError
            # around it): the same event, said once, with the key that sets the limit.
            from trajflow.errors import StageTimeoutError

            key = f"trainer.stage_timeouts.{stage}"
            shown = f"{limit:g} s" if limit else "its time limit"
            drop = drop_unresponsive_workers(ctx)
            if drop:
                ctx.state.workers_lost = drop
            raise StageTimeoutError(f"run {ctx.run_id}: stage {stage} did not finish within {shown} ({key}, else "
                                    f"trainer.stage_timeout_s); a worker or the scorer is stuck or slower than "
                                    f"that: raise it ({key}=SECONDS, 0 = no limit) or see the run's "
                                    f"logs/driver.log") from None
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
    ``critic``, ``reward_model``, ``judge``).
    """
    from trajflow.workers.group import kill_workers

    dropped = []
    for attr, method, role in (("actor", "info", "policy"), ("reference", "pid", "reference"),
                               ("critic", "pid", "critic"), ("reward_model", "pid", "reward_model"),
                               ("judge", "pid", "judge")):
        handle = getattr(ctx, attr)
        if handle is None or _answers(handle, method, PING_TIMEOUT_S if timeout_s is None else timeout_s):
            continue
        kill_workers(handle)  # every rank: a data-parallel group is recreated whole
        setattr(ctx, attr, None)
        if attr == "judge":
            ctx.judge_endpoint = None
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
    if ctx.reference is None and ctx.needs_reference_worker() and not ctx.state.policy_only:
        create_reference_worker(ctx)
        created.append("reference")
    if ctx.teacher is None and ctx.needs_teacher() and not ctx.state.policy_only:
        create_teacher_worker(ctx)
        created.append("teacher")
    if ctx.reward_model is None and ctx.needs_reward_model() and not ctx.state.policy_only:
        create_reward_model_worker(ctx)
        created.append("reward_model")
    if ctx.judge is None and ctx.needs_judge_worker() and not ctx.state.policy_only:
        create_judge_worker(ctx)
        created.append("judge")
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


def _stored_updates(ctx: RunContext, base: int | None, through: int) -> Iterator[tuple[int, pa.Table]]:
    """The iterations after checkpoint ``base`` up to ``through`` that recorded an update (iterations
    without ``update.json`` changed no weights, e.g. a replay that stops before the update), in
    order, each with its stored stages joined and the gate's loss mask applied."""
    from trajflow.stages.policy_update import with_loss_mask
    from trajflow.batch import join_stages
    from trajflow.store import STAGES

    store = ctx.store
    for it in store.iterations():
        if it <= (base or 0) or it > through or store.read_iteration_json(it, "update.json") is None:
            continue
        joined = join_stages([store.read_stage(it, stage) for stage in STAGES])
        yield it, with_loss_mask(joined, store.read_iteration_json(it, "gate.json"))


def _newest_checkpoint(ctx: RunContext, through: int) -> int | None:
    from trajflow import checkpoint as ckpt

    saved = [c for c in ckpt.list_checkpoints(ctx.store) if c <= through]
    return saved[-1] if saved else None


def restore_policy(ctx: RunContext, through: int) -> int:
    """Bring a freshly created policy worker to the state after iteration ``through`` (see
    :func:`ensure_workers`); returns the number of updates re-applied.

    Raises:
        RuntimeError: the restored policy version differs from the run's.
    """
    from trajflow.stages.policy_update import update_batch, update_batch_options
    from trajflow import checkpoint as ckpt

    base = _newest_checkpoint(ctx, through)
    if base is not None:
        wait(ctx, ctx.actor.load_checkpoint.remote(str(ckpt.checkpoint_dir(ctx.store, base) / "actor")))
    elif ctx.state.initial_checkpoint:
        wait(ctx, ctx.actor.load_checkpoint.remote(str(ctx.state.initial_checkpoint)))
    replayed = 0
    for it, joined in _stored_updates(ctx, base, through):
        wait(ctx, ctx.actor.update_actor.remote(update_batch(joined, it, **update_batch_options(ctx.cfg))))
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
        trajflow.errors.StoreError: an iteration to re-apply lacks verified stage outputs.
    """
    from trajflow.stages.critic_update import critic_batch
    from trajflow import checkpoint as ckpt

    base = _newest_checkpoint(ctx, through)
    if base is not None:
        wait(ctx, ctx.critic.load_checkpoint.remote(str(ckpt.checkpoint_dir(ctx.store, base) / "critic")))
    for state in ctx.iterations.values():
        if state.iteration > through:  # updates of the recreated critic's future: the caller's stage redoes them
            state.critic_update = None
    replayed = 0
    for it, joined in _stored_updates(ctx, base, through):
        if "values" in joined.column_names:
            wait(ctx, ctx.critic.update_critic.remote(critic_batch(joined, it, ctx.cfg)))
            replayed += 1
    return replayed
