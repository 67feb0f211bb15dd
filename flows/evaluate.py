"""The ``evaluate`` flow: validation of a run's newest (or a given) checkpoint, logged to MLflow.

The checkpoint's policy is loaded into a policy worker on Ray and scored on the held-out prompts
exactly as the train flow validates (:func:`trajflow.flows.tasks.run_validation`). Results go to a new MLflow
run in the training run's experiment (a child of the training run's MLflow run), tagged with the
evaluated run id and checkpoint, to ``<run>/evaluations/`` and to a Prefect markdown artifact. The
evaluated run may still be training: nothing of it is changed.

Deployed as ``evaluate`` (nightly, ``infra/prefect/prefect.yaml``); callable directly too.
"""

from __future__ import annotations

from trajflow.infra.env import configure_environment

configure_environment()

import io  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

from prefect import flow, task  # noqa: E402

from trajflow.flows.reporting import artifact_key, metrics_markdown, mlflow_run_url, publish, rename_flow_run  # noqa: E402
from trajflow.flows.tasks import TASK_OPTS  # noqa: E402
from trajflow import checkpoint as ckpt  # noqa: E402
from trajflow.config import load_config  # noqa: E402
from trajflow.errors import StoreError  # noqa: E402
from trajflow import run  # noqa: E402
from trajflow.run.context import get_context  # noqa: E402
from trajflow.run.validation import run_validation  # noqa: E402
from trajflow.run.recovery import ensure_workers, stage_guard  # noqa: E402
from trajflow.run.workers import close  # noqa: E402
from trajflow.store import RunStore, atomic_write_json, run_folders  # noqa: E402


def find_run(store_root: str | Path, run_id: str | None = None, recipe: str | None = None) -> RunStore:
    """The run to evaluate: ``run_id``, else the newest run under ``store_root`` with a checkpoint.

    Args:
        store_root: the store root (``store.root`` of the training runs).
        run_id: a run id; None picks the most recently created run that has a checkpoint.
        recipe: with ``run_id=None``, only runs of this recipe.

    Raises:
        StoreError: the run does not exist, or no run qualifies.
    """
    root = Path(store_root).expanduser().resolve()
    if run_id is not None:
        store = RunStore(root, run_id)
        if not store.exists():
            raise StoreError(f"no run {run_id!r} under {root} (no {store.config_path.name})")
        return store
    candidates = []
    for d in run_folders(root):
        store = RunStore(root, d.name)
        meta = store.read_run_meta()
        if recipe is not None and meta.get("recipe") != recipe:
            continue
        if ckpt.latest_checkpoint(store) is None:
            continue
        candidates.append((float(meta.get("created") or d.stat().st_mtime), d.name, store))
    if not candidates:
        which = f" of recipe {recipe!r}" if recipe else ""
        raise StoreError(f"no run{which} with a checkpoint under {root}")
    return max(candidates, key=lambda c: (c[0], c[1]))[2]


def pick_checkpoint(store: RunStore, checkpoint: int | None) -> int:
    """The checkpoint to evaluate: ``checkpoint`` (0 = the initial model), else the newest.

    Raises:
        StoreError: the run has no such checkpoint (the message lists the ones it has).
    """
    done = ckpt.list_checkpoints(store)
    if checkpoint is None:
        if not done:
            raise StoreError(f"run {store.run_id!r} has no checkpoint yet; pass checkpoint=0 to evaluate "
                             "the initial model")
        return done[-1]
    if checkpoint == 0 or checkpoint in done:
        return int(checkpoint)
    raise StoreError(f"run {store.run_id!r} has no checkpoint {checkpoint}; it has: "
                     f"{', '.join(map(str, done)) or 'none'} (0 = the initial model)")


def prepare_evaluation(store_root: str | Path, run_id: str | None = None, checkpoint: int | None = None,
                       recipe: str | None = None, overrides: Optional[list[str]] = None,
                       quiet: bool = False) -> tuple[RunStore, int, "DictConfig"]:
    """Check an evaluation request and build its config; starts nothing (the CLI calls it before
    Prefect, the flow again inside).

    The run folder names neither the code imported nor where results go: its stored reward function
    and environment need the caller's consent (:func:`trajflow.trust.screen_stored_config`), its
    tracking URI is not used unless the caller names it again (a one-line note says so, unless
    ``quiet``).

    Returns:
        ``(store, checkpoint, cfg)``.

    Raises:
        StoreError: no such run or checkpoint, or the checkpoint does not verify against its manifest
            (a truncated, missing or changed file, named). ConfigError: a bad override, stored code not
            consented to, a reward function that does not import, an unreachable tracking server.
    """
    from trajflow.run.preflight import check_reward_and_gates
    from trajflow.tracking import check_tracking_server
    from trajflow.trust import screen_stored_config

    store = find_run(store_root, run_id, recipe)
    step = pick_checkpoint(store, checkpoint)
    if step:
        why = ckpt.verify_checkpoint(store, step)
        if why is not None:
            raise StoreError(f"run {store.run_id!r} checkpoint {step}: {why}; evaluate another checkpoint "
                             f"(--checkpoint)")
        check_safetensors(ckpt.checkpoint_dir(store, step))
    layers = [f"store.root={store.root}"] + list(overrides or [])
    base = screen_stored_config(store.read_config(), layers, store.config_path,
                                report=io.StringIO() if quiet else None)
    cfg = load_config(base=base, overrides=layers)
    check_reward_and_gates(cfg)  # imports the (consented) reward function: a bad one is one line, before Ray
    check_tracking_server(cfg)
    return store, step, cfg


def check_safetensors(folder: Path) -> None:
    """Every safetensors file under a checkpoint opens (its header parses): a manifest is an integrity
    check that someone who can write the folder can recompute, so the files are read as well.

    Raises:
        StoreError: names the file and what the reader said.
    """
    from safetensors import safe_open

    for f in sorted(Path(folder).rglob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        except Exception as e:  # safetensors' own SafetensorError, or OSError
            raise StoreError(f"{f} is not a readable safetensors file ({str(e).splitlines()[0] if str(e) else e}); "
                             f"evaluate another checkpoint (--checkpoint)") from None


@task(name="validate-checkpoint", task_run_name="validate-{run_id}-ckpt{checkpoint}", **TASK_OPTS)
def validate_checkpoint(eval_id: str, run_id: str, checkpoint: int) -> dict:
    """Load the checkpoint into a policy worker (recreated if one died) and score the held-out prompts."""
    ctx = get_context(eval_id)
    with stage_guard(ctx, "validate"):
        ensure_workers(ctx, through=checkpoint)
        return run_validation(ctx, checkpoint)


def _eval_run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    ck = p.get("checkpoint")
    return f"evaluate-{p.get('run_id') or 'newest'}-{'ckpt' + str(ck) if ck is not None else 'latest'}"


@flow(name="evaluate", flow_run_name=_eval_run_name)
def evaluate_flow(run_id: Optional[str] = None, checkpoint: Optional[int] = None, store_root: str = "runs",
                  recipe: Optional[str] = None, overrides: Optional[list[str]] = None) -> dict:
    """Validate a run's checkpoint and log the result to MLflow.

    Args:
        run_id: the run (default: the newest run under ``store_root`` with a checkpoint).
        checkpoint: the checkpoint iteration (default: the newest; 0 = the initial model).
        store_root: where runs live (``store.root`` of the training runs), on the worker.
        recipe: with ``run_id`` unset, only consider runs of this recipe.
        overrides: config overrides for the evaluation, e.g. ``["data.val_max_prompts=0", "rollout.val_n=4"]``.

    Returns:
        ``run_id``, ``checkpoint``, ``metrics`` (``val-core/<source>/acc/mean@<n>``, ...), ``mlflow_run_id``
        and ``path`` (the stored JSON result).

    Raises:
        See :func:`prepare_evaluation`.
    """
    from trajflow.tracking import Tracker, tracking_uri

    store, step, cfg = prepare_evaluation(store_root, run_id, checkpoint, recipe, overrides)
    meta = store.read_run_meta()
    rename_flow_run(f"evaluate-{store.run_id}-ckpt{step}")
    ctx = run.open_evaluation(cfg, store, step)
    eval_id = ctx.key
    tracker = None
    status = "FAILED"
    try:
        metrics = validate_checkpoint(eval_id, store.run_id, step)
        tags = {"trajflow.kind": "evaluation", "trajflow.evaluated_run_id": store.run_id,
                "trajflow.checkpoint": str(step), "trajflow.policy_version": str(ctx.policy_version)}
        if meta.get("mlflow_run_id") and meta.get("tracking_uri") == tracking_uri(cfg):
            tags["mlflow.parentRunId"] = str(meta["mlflow_run_id"])  # the training run is in this store
        name = f"eval-{store.run_id}-ckpt{step:06d}"
        tracker = Tracker(cfg, name, tags=tags, logged_model=False, run_name=name)  # not the trained run's name
        tracker.log_metrics(metrics, step=step)
        result = {"run_id": store.run_id, "checkpoint": step, "policy_version": ctx.policy_version,
                  "metrics": metrics, "mlflow_run_id": tracker.run_id, "evaluated_at": time.time()}
        path = store.run_dir / "evaluations" / f"ckpt-{step:06d}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
        atomic_write_json(path, result)
        tracker.log_artifact(path, "evaluation")
        url = mlflow_run_url(cfg.tracking.ui_url, tracker.experiment_id, tracker.run_id)
        md = metrics_markdown(f"{store.run_id}: evaluation of checkpoint {step}", metrics, mlflow_url=url,
                              mlflow_run_id=tracker.run_id, tracking_uri=tracker.uri, all_metrics=True,
                              details={"run": f"`{store.run_id}`", "checkpoint": str(step),
                                       "policy version": str(ctx.policy_version), "result": f"`{path}`"})
        publish(md, artifact_key(store.run_id, "evaluation"), f"evaluation of {store.run_id} checkpoint {step}")
        status = "FINISHED"
        return {**result, "path": str(path)}
    finally:
        if tracker is not None:
            tracker.finish(status)
        close(ctx)  # every rank, the placement groups, and Ray if this flow started it
