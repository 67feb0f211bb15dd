"""Resuming a run: its stored config, whether it can be resumed, what changed since, where it
continues, and restoring a checkpoint into the workers (also a replay's starting checkpoint).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

from trajflow import checkpoint as ckpt
from trajflow.errors import StoreError
from trajflow.run.context import RunContext
from trajflow.store import STAGES, RunStore, run_folders

log = logging.getLogger(__name__)


def store_root_from(overrides: Sequence[str]) -> str:
    """The ``store.root=...`` among ``overrides``, else the config default."""
    from trajflow.config import StoreConfig

    for o in overrides:
        if o.startswith("store.root="):
            return o.split("=", 1)[1]
    return StoreConfig().root


def resume_config(run_id: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The stored config of run ``run_id`` (under ``store.root`` from ``overrides``) plus ``overrides``.

    Raises:
        StoreError: no such run, a replay run (see :func:`check_resumable`), or a damaged stored
            config (see :meth:`RunStore.read_config`).
        trajflow.config.ConfigError: a bad override; code named by the stored config that the
            overrides do not name again (:func:`trajflow.trust.screen_stored_config`).
    """
    from trajflow.config import load_config
    from trajflow.trust import screen_stored_config

    store = RunStore(store_root_from(overrides), run_id)
    check_resumable(store)
    # Before load_config: validating a config imports its environment factory and tool functions.
    base = screen_stored_config(store.read_config(), overrides, store.config_path)
    return load_config(base=base, overrides=list(overrides))


def check_resumable(store: RunStore) -> None:
    """Raise :class:`StoreError` unless ``store`` holds a run that ``resume`` can continue.

    Raises:
        StoreError: no such run under the store root (names the root and the runs there), or the
            run is a replay (replays are re-run, not resumed).
    """
    if not store.exists():
        runs = [p.name for p in run_folders(store.root)]
        shown = ", ".join(runs[-10:]) if runs else "none"
        raise StoreError(f"no run {store.run_id!r} in store root {store.root} (runs there: {shown}); "
                         f"pass --store DIR (or store.root=DIR) to look elsewhere")
    meta = store.read_run_meta()
    if meta.get("kind") == "replay":
        raise StoreError(f"run {store.run_id!r} is a replay of run {meta.get('parent_run_id')!r}; replays are "
                         f"not resumed: run 'trajflow replay' again")


def config_changes(store: RunStore, cfg: DictConfig) -> dict[str, tuple]:
    """``{key: (stored, new)}`` for config keys whose value differs from the run's stored config.

    ``trainer.resume``, ``trainer.run_id`` and ``trainer.progress`` are not reported (they say how
    to start, not what to train).
    """
    from trajflow.config import flatten

    old = flatten(store.read_config())
    new = flatten(cfg)
    ignore = {"trainer.resume", "trainer.run_id", "trainer.progress"}
    if old.get("store.root") and new.get("store.root") and \
            Path(old["store.root"]).expanduser().resolve() == Path(new["store.root"]).expanduser().resolve():
        ignore.add("store.root")  # the same folder, spelled differently
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if k not in ignore and old.get(k) != new.get(k)}


def _report_resume(ctx: RunContext, latest: int | None, start: int) -> None:
    """Say where the run continues and name every stored file of the iterations to come that fails to verify."""
    store, total = ctx.store, ctx.cfg.trainer.total_iterations
    where = f"checkpoint {latest:06d}" if latest is not None else "the start (no complete checkpoint)"
    todo = f"iterations {start}..{total}" if start <= total else "no iterations left"
    print(f"resuming run {ctx.run_id} from {where}: {todo}", flush=True)
    for it in (i for i in store.iterations() if i >= start):
        status = store.read_manifest(it).get("status")
        for stage in STAGES:
            path = store.stage_path(it, stage)
            if store.stage_entry(it, stage) is None and path.exists():
                print(f"warning: {path} is not recorded in its manifest (a write was interrupted): "
                      f"it will be recomputed", file=sys.stderr, flush=True)
            elif store.stage_entry(it, stage) is not None and store.verified_stage(it, stage, warn=False) is None:
                print(f"warning: stored {path} is truncated or does not match its manifest's sha256: "
                      f"it will be recomputed", file=sys.stderr, flush=True)
        if status == "gated":
            print(f"iteration {it} was stopped by its gate: it will be skipped", flush=True)


def restore_checkpoint(ctx: RunContext, iteration: int, source: RunStore | None = None) -> None:
    """Load the policy (and critic), optimizers, RNG, data cursor and controller state saved after ``iteration``.

    Args:
        ctx: the run's context (workers started).
        iteration: the checkpoint's iteration.
        source: restore from this run's checkpoint instead of the context's own (a replay starts
            from its parent's); the data cursor is then left alone.

    Raises:
        StoreError: a checkpoint file is missing or does not match the checkpoint's manifest (named).
    """
    import ray  # here, not at the top: the resume checks before Ray starts must not import it

    store = source or ctx.store
    why = ckpt.verify_checkpoint(store, iteration)
    if why is not None:
        raise StoreError(f"checkpoint {iteration:06d} of run {store.run_id!r} cannot be loaded: {why}")
    d = ckpt.checkpoint_dir(store, iteration)
    state = ckpt.read_trainer_state(store, iteration)
    ray.get(ctx.actor.load_checkpoint.remote(str(d / "actor")))
    if ctx.critic is not None:
        if not (d / "critic").exists():
            raise RuntimeError(f"checkpoint {d} has no critic/ folder, but this run trains a critic "
                               f"(algorithm.adv_estimator={ctx.cfg.algorithm.adv_estimator!r})")
        ray.get(ctx.critic.load_checkpoint.remote(str(d / "critic")))
    if source is None and ctx.sampler is not None and state.get("sampler"):
        ctx.sampler.load_state_dict(state["sampler"])
    if ctx.kl_ctrl is not None and state.get("kl_ctrl"):
        ctx.kl_ctrl.load_state_dict(state["kl_ctrl"])
    ctx.score_history = list(state.get("score_history", []))
    ctx.policy_version = int(state["policy_version"])
    log.info("%s: restored checkpoint %06d of %s", ctx.run_id, iteration, store.run_id)


def finished_summary(cfg: DictConfig, run_id: str) -> dict | None:
    """The summary of a run with nothing left to do (all iterations checkpointed, final model
    exported, or finished without checkpoints and asked for no more iterations), or ``None`` when
    there is something to train. Starts nothing.

    Raises:
        StoreError: the run finished without a checkpoint (``trainer.save_freq=0``) and
            ``trainer.total_iterations`` asks for more iterations than it trained.
    """
    store = RunStore(cfg.store.root, run_id)
    latest = ckpt.latest_checkpoint(store)
    if latest is None and store.final_dir.exists() and store.read_run_meta().get("status") == "finished":
        # trainer.save_freq=0: the run finished without a checkpoint, so there is nothing to continue from
        trained = int(store.read_config().trainer.total_iterations)
        if cfg.trainer.total_iterations > trained:
            raise StoreError(f"run {run_id!r} finished {trained} iterations with trainer.save_freq=0: it has no "
                             f"checkpoint to continue from; train a new run from its final model "
                             f"(model.path={store.final_dir})")
    elif latest is None or latest < cfg.trainer.total_iterations or not store.final_dir.exists():
        return None
    meta = store.read_run_meta()
    return {"run_id": run_id, "run_dir": str(store.run_dir), "mlflow_run_id": meta.get("mlflow_run_id"),
            "metrics": {}, "policy_version": meta.get("policy_version"), "trained_iterations": [],
            "nothing_to_do": True, "last_checkpoint": latest}
