"""Replay planning: check what a replay asks of its parent run, build its config and id, and open
it (the new run's folder, workers, the parent's starting checkpoint). :mod:`trajflow.flows.replay` is the flow
that runs the stages; this module starts nothing until :func:`open_replay`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

from omegaconf import DictConfig

from trajflow.stages.names import REPLAY_FROM, STORED_STAGES
from trajflow import checkpoint as ckpt
from trajflow.batch import join_stages
from trajflow.config import load_config
from trajflow.errors import ReplayError, RunExistsError, StoreError
from trajflow.metrics import batch_metrics
from trajflow.run.context import RunContext
from trajflow.run.preflight import check_custom_function, custom_function_record, preflight
from trajflow.run.resume import check_resumable, restore_checkpoint, store_root_from
from trajflow.run.session import build_context, close_mirrors, create_run_folder, preload_audit, start_workers
from trajflow.run.workers import close
from trajflow.store import RunStore, StageRef


#: ``--from-stage`` choices.
FROM_STAGES = tuple(REPLAY_FROM)
#: The stored stages copied from the parent, per ``--from-stage``: those before it.
KEPT_STAGES = {"reward": STORED_STAGES[:1], "advantage": STORED_STAGES[:2], "update": STORED_STAGES}


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
            check_resumable(parent)
        except StoreError as e:
            raise ReplayError(str(e)) from None
    stored = parent.iterations()
    shown = f"{stored[0]}..{stored[-1]}" if stored else "none"
    for it in range(first, last + 1):
        if it not in stored:
            raise ReplayError(f"iteration {it} of run {parent.run_id!r} is not stored (stored iterations: {shown})")
        for stage in KEPT_STAGES[from_stage]:
            if parent.verified_stage(it, stage) is None:
                raise ReplayError(f"{parent.stage_path(it, stage)} is missing or does not match its manifest: "
                                  f"iteration {it} cannot be replayed from stage {from_stage!r}")
    start = first - 1 if first > 1 else None
    have = start is None or start in ckpt.list_checkpoints(parent)
    if have and start is not None:
        why = ckpt.verify_checkpoint(parent, start)  # before Ray: the update would start from it
        if why is not None:
            raise ReplayError(f"checkpoint {start:06d} of run {parent.run_id!r} cannot be loaded: {why}")
    note = ""
    if not have:
        kept = ", ".join(f"{i:06d}" for i in ckpt.list_checkpoints(parent)) or "none"
        why = (f"checkpoint {start:06d} of run {parent.run_id!r} is not stored (kept: {kept}), so the policy that "
               f"generated iteration {first} cannot be restored")
        if from_stage == "update" or last > first:
            raise ReplayError(f"{why}; replaying {'the update' if from_stage == 'update' else 'iterations'} needs it")
        note = f"policy update skipped: {why}"
    return ReplayPlan(start_checkpoint=start, run_update=have, note=note)


def parent_gate(parent: RunStore, iteration: int) -> dict:
    """The parent's gate result (its quarantine shaped the stored advantages); empty when gates were off."""
    g = parent.read_iteration_json(iteration, "gate.json") or {}
    return {"success": g.get("success", True), "quarantined_sample_ids": g.get("quarantined_sample_ids", []),
            "metrics": {}}


def open_replay(job: ReplayJob, from_stage: str, overrides: Sequence[str]) -> RunContext:
    """Create the replay run, start its workers and restore the parent's starting checkpoint.

    Raises:
        RunExistsError: the new run id exists.
    """
    from trajflow.loggers import open_mirrors
    from trajflow.tracking import Tracker, lineage_tags

    cfg, parent, first, last, plan_ = job.cfg, job.parent, job.first, job.last, job.plan
    store = RunStore(cfg.store.root, job.run_id)
    # Without the starting checkpoint the update is skipped (plan's note) and no policy is restored.
    start = plan_.start_checkpoint if plan_.run_update else None
    start_id = (f"{parent.run_id}/{ckpt.checkpoint_id(start)}" if start is not None
                else "initial" if plan_.run_update else "none (update skipped)")
    lineage = {"parent_run_id": parent.run_id, "parent_iteration": first, "parent_iterations": [first, last],
               "from_stage": from_stage}
    create_run_folder(store, cfg, recipe=str(cfg.recipe), kind="replay", overrides=list(overrides),
                          custom_function=custom_function_record(cfg),
                          start_checkpoint=start_id, note=plan_.note, **lineage)
    print(f"trajflow replay {job.run_id}: {store.run_dir} (run {parent.run_id}, iterations {first}..{last}, "
          f"from stage {from_stage}, policy from {start_id})", flush=True)
    if plan_.note:
        print(f"note: {plan_.note}", flush=True)
    preload_audit()
    ctx = build_context(cfg, store)
    start_workers(ctx)
    try:
        if start is not None:
            restore_checkpoint(ctx, start, source=parent)
            # A worker lost mid-replay is rebuilt from here plus this run's stored updates.
            ctx.state.initial_checkpoint = str(ckpt.checkpoint_dir(parent, start) / "actor")
        ctx.state.policy_source, ctx.state.start_iteration, ctx.state.last_iteration = start_id, first, last
        tags = lineage_tags(parent.run_id, first, from_stage)
        tags.update({"trajflow.parent_iterations": f"{first}:{last}", "trajflow.kind": "replay"})
        parent_mlflow = parent.read_run_meta().get("mlflow_run_id")
        if parent_mlflow:
            tags["trajflow.parent_mlflow_run_id"] = parent_mlflow
        ctx.tracker = Tracker(cfg, job.run_id, tags=tags, logged_model=bool(cfg.tracking.log_model))
        ctx.tracker.mirrors = open_mirrors(cfg, store, job.run_id)  # trainer.logger's tensorboard / wandb
        store.update_run_meta(mlflow_run_id=ctx.tracker.run_id, tracking_uri=ctx.tracker.uri)
    except BaseException:
        close_mirrors(ctx)
        close(ctx)
        raise
    return ctx


def data_metrics(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef, advantage: StageRef) -> dict:
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
        ReplayError, trajflow.config.ConfigError (also: code the parent's stored config names that
        the overrides do not name again), trajflow.errors.RunExistsError,
        trajflow.prompts.DataError, trajflow.models.ModelLoadError.
    """
    first, last = parse_iterations(iteration, iterations)
    parent = RunStore(store_root_from(overrides), parent_run_id)
    plan_ = plan(parent, first, last, from_stage)
    from trajflow.trust import screen_stored_config

    # Before load_config: validating a config imports its environment factory and tool functions.
    base = screen_stored_config(parent.read_config(), overrides, parent.config_path)
    cfg = load_config(base=base, overrides=list(overrides))
    check_custom_function(cfg, parent.read_run_meta(), f"replay of run {parent_run_id!r}", same_spec_only=True)
    preflight(cfg)
    run_id = run_id or replay_run_id(parent_run_id, first, last, from_stage)
    target = RunStore(cfg.store.root, run_id)
    if target.exists():
        raise RunExistsError(f"run {run_id!r} already exists in {target.run_dir}")
    return ReplayJob(cfg=cfg, parent=parent, first=first, last=last, plan=plan_, run_id=run_id)


