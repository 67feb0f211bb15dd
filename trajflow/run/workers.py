"""Start and stop the run's role workers: the policy (actor + rollout) ranks, the reference policy,
the critic, the reward model, the served LLM judge and separate rollout workers, each placed on its
resource pool.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import OmegaConf

from trajflow.infra.ray_cluster import stop_ray, watch_new_ray_processes
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
        # Sharded parameters (ZeRO-3, FSDP2): every forward is a collective, so ranks get equally many rows.
        lockstep=cfg.actor.strategy == "fsdp2" or (cfg.actor.strategy == "deepspeed" and cfg.actor.zero_stage == 3))
    if wait_loaded:
        finish_policy_worker(ctx)


def finish_policy_worker(ctx: RunContext) -> None:
    """Wait for the policy ranks to load; join DeepSpeed or FSDP2 ranks into one process group; attach
    separate rollout workers (``rollout.pool``), creating them on first use."""
    import ray

    cfg = ctx.cfg
    if cfg.actor.strategy in ("deepspeed", "fsdp2"):
        ctx.actor.init_distributed()
    ctx.actor.execute("set_release_memory", ctx.release_memory())
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
    rank per slot of its pool (one actor with ``num_cpus=0`` when no pools are declared); with
    ``reference.strategy=fsdp2`` the ranks shard the model (FSDP2) and join their own process group."""
    import ray

    from trajflow.workers.group import WorkerGroup
    from trajflow.workers.reference import ReferenceWorker

    cfg = ctx.cfg
    ref_path = cfg.reference.path
    if ref_path:
        from trajflow.models import resolve_model_path

        ref_path = str(resolve_model_path(ref_path, cfg.model.cache_dir))
    place = placement(ctx)
    sharded = cfg.reference.strategy == "fsdp2"
    ctx.reference = WorkerGroup.spawn(
        ReferenceWorker, (ref_path or ctx.model_path, OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.rollout),
                          cfg.trainer.device, int(cfg.trainer.num_threads),
                          OmegaConf.to_object(cfg.reference.mixed_precision), str(cfg.reference.strategy),
                          OmegaConf.to_object(cfg.reference.fsdp)),
        [place.actor_options("reference", r) for r in range(place.world_size("reference"))], "reference",
        # Sharded parameters: every forward is a collective, so ranks get equally many rows.
        lockstep=sharded)
    if sharded:  # the process group forms once every rank has loaded
        ctx.reference.init_distributed()
    elif wait_loaded:
        ray.get([h.pid.remote() for h in ctx.reference.handles])


def create_teacher_worker(ctx: RunContext, wait_loaded: bool = True) -> None:
    """Start on-policy distillation's teacher (``teacher.path``) as a worker group (``ctx.teacher``): a
    frozen model that serves log-probs like the reference, one rank per slot of its pool.

    Raises:
        ConfigError: the teacher's tokenizer is not the policy's (its log-probs would score other tokens).
    """
    import ray

    from trajflow.models import resolve_model_path, same_tokenizer
    from trajflow.workers.group import WorkerGroup
    from trajflow.workers.reference import ReferenceWorker

    cfg = ctx.cfg
    path = str(resolve_model_path(cfg.teacher.path, cfg.model.cache_dir))
    same_tokenizer(ctx.model_path, path, "teacher.path")
    place = placement(ctx)
    ctx.teacher = WorkerGroup.spawn(
        ReferenceWorker, (path, OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.rollout), cfg.trainer.device,
                          int(cfg.trainer.num_threads), OmegaConf.to_object(cfg.teacher.mixed_precision)),
        [place.actor_options("teacher", r) for r in range(place.world_size("teacher"))], "teacher")
    if wait_loaded:
        ray.get([h.pid.remote() for h in ctx.teacher.handles])


def create_critic_worker(ctx: RunContext, wait_loaded: bool = True) -> None:
    """Start the critic (value model: ``critic.path`` or the policy's body + a value head) as a Ray
    actor (``ctx.critic``), with fresh weights and optimizer; with ``critic.strategy=fsdp2`` a worker
    group of one rank per slot of the critic's pool, sharded with FSDP2."""
    import ray

    from trajflow.models import resolve_model_path
    from trajflow.workers.critic import CriticWorker

    cfg = ctx.cfg
    path = str(resolve_model_path(cfg.critic.path, cfg.model.cache_dir)) if cfg.critic.path else ctx.model_path
    args = (path, OmegaConf.to_object(cfg.critic), OmegaConf.to_object(cfg.model), cfg.trainer.device,
            int(cfg.trainer.num_threads))
    if cfg.critic.strategy == "fsdp2":
        from trajflow.workers.group import WorkerGroup

        # One FSDP2 rank per slot of the critic's pool, joined into their own process group now.
        place = placement(ctx)
        ctx.critic = WorkerGroup.spawn(CriticWorker, args, [place.actor_options("critic", r)
                                                            for r in range(place.world_size("critic"))],
                                       "critic", lockstep=True)
        ctx.critic.init_distributed()
        return
    # One actor on the critic's pool (its slot 0; num_cpus=0 when no pools are declared).
    ctx.critic = ray.remote(max_restarts=0)(CriticWorker).options(**placement(ctx).actor_options("critic", 0)).remote(
        *args)
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


def create_judge_worker(ctx: RunContext, wait_loaded: bool = True) -> None:
    """Start the LLM judge of ``reward.judge.model_path`` as a Ray actor serving it on loopback
    (:class:`trajflow.workers.judge.JudgeWorker`, ``ctx.judge``) with a fresh per-run bearer token,
    on the driver's Ray node (the scorer runs in the driver and calls ``127.0.0.1``), reserving
    ``reward.judge.num_cpus``. ``ctx.judge_endpoint`` is set once it serves.

    Raises:
        trajflow.errors.ModelLoadError: the model path is neither a model directory nor a built-in name.
        ray.exceptions.RayActorError: (with ``wait_loaded``) the model did not load; the cause names it.
    """
    import secrets

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from trajflow.models import resolve_model_path
    from trajflow.workers.judge import JudgeWorker

    cfg = ctx.cfg
    judge = cfg.reward.judge
    path = str(resolve_model_path(str(judge.model_path), cfg.model.cache_dir))
    token = secrets.token_urlsafe(32)  # 256 bits, in memory only: the endpoint refuses calls without it
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    ctx.judge = ray.remote(max_restarts=0)(JudgeWorker).options(
        num_cpus=float(judge.num_cpus), scheduling_strategy=here).remote(
        path, token, int(judge.max_tokens), int(judge.num_threads or cfg.trainer.num_threads),
        int(judge.seed or 0))
    ctx.judge_endpoint = (None, token)  # the URL once it serves
    if wait_loaded:
        finish_judge_worker(ctx)


def finish_judge_worker(ctx: RunContext) -> None:
    """Wait until the judge worker serves and record its endpoint (``ctx.judge_endpoint``: base URL, token)."""
    import ray

    ctx.judge_endpoint = (ray.get(ctx.judge.base_url.remote()), ctx.judge_endpoint[1])
    log.info("run %s: the judge model %s serves at %s", ctx.run_id, ctx.cfg.reward.judge.model_path,
             ctx.judge_endpoint[0])


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
    if ctx.needs_reference_worker():
        create_reference_worker(ctx, wait_loaded=False)
    if ctx.needs_critic():
        create_critic_worker(ctx, wait_loaded=False)
    if ctx.needs_teacher():
        create_teacher_worker(ctx, wait_loaded=False)
    if ctx.needs_reward_model():
        create_reward_model_worker(ctx, wait_loaded=False)
    if ctx.needs_judge_worker() and not ctx.state.policy_only:
        create_judge_worker(ctx, wait_loaded=False)
    finish_policy_worker(ctx)
    for group in (ctx.reference, ctx.teacher):
        if group is not None:
            ray.get([h.pid.remote() for h in group.handles])
    for handle in (ctx.critic, ctx.reward_model):
        if handle is not None:
            ray.get(handle.pid.remote())
    if ctx.judge is not None:
        finish_judge_worker(ctx)
    groups = {"actor": ctx.actor, "reference": ctx.reference, "rollout": ctx.rollout, "teacher": ctx.teacher}
    ctx.store.update_run_meta(worker_nodes={role: g.node_ids() for role, g in groups.items() if g is not None})
    if ctx.cfg.rollout.multi_turn.enable and not ctx.cfg.rollout.agent:  # what the tool sandbox isolates here
        from trajflow.envs.sandbox import tool_sandbox_record

        ctx.store.update_run_meta(tool_sandbox=tool_sandbox_record(ctx.cfg.rollout.multi_turn))
    try:
        watch_new_ray_processes()
    except Exception as e:  # pragma: no cover - best effort
        log.warning("could not update the Ray watcher: %s", e)


def release_workers(ctx: RunContext) -> None:
    """Stop the run's actors and release its placement groups (Ray itself keeps running)."""
    from trajflow.workers.group import kill_workers

    for handle in (ctx.actor, ctx.reference, ctx.critic, ctx.reward_model, ctx.rollout, ctx.teacher, ctx.judge):
        kill_workers(handle)
    ctx.actor = ctx.reference = ctx.critic = ctx.reward_model = ctx.rollout = ctx.teacher = ctx.judge = None
    ctx.judge_endpoint = None
    place, ctx.placement = ctx.placement, None
    if place is not None:
        place.close()


def close(ctx: RunContext) -> None:
    """Stop the run's actors, release its placement groups (and stop Ray, if this run started it)."""
    release_workers(ctx)
    unregister(ctx)
    if ctx.started_ray:
        stop_ray()
        ctx.started_ray = False
