"""Prefect tasks of the training pipeline: thin wrappers that move references between Ray and the store.

Every task takes the run id, the iteration and :class:`~trajflow.store.StageRef` references, and
returns a reference or a small dict: no tensors or actor handles cross a Prefect boundary. A stage
whose verified output already exists (resume, retry) is not recomputed.

Robustness: each task body runs in :func:`trajflow.runtime.stage_guard` (Ray waits bounded by the
stage's timeout; dead or stuck workers dropped on a transient failure) and starts with
:func:`trajflow.runtime.ensure_workers` (dropped workers recreated in the state the stage needs), and
Prefect retries a task only after a transient failure (:func:`trajflow.runtime.retry_on_transient`).
:func:`stages_for` applies a run's ``trainer.stage_retries``, ``stage_retry_delay_s`` and stage
timeouts to the tasks.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import ray
from omegaconf import DictConfig
from prefect import task
from prefect.cache_policies import NONE

from stages.rollout import SamplingParams
from trajflow import pipeline
from trajflow.batch import join_stages
from trajflow.config import TrainerConfig
from trajflow.pipeline import iteration_seed
from trajflow.runtime import (RunContext, ensure_workers, get_context, retry_on_transient, stage_guard, stage_timeout,
                              wait)
from trajflow.store import StageRef

__all__ = ["iteration_seed", "stages_for", "run_validation", "rollout_stage", "reward_stage", "gate_stage",
           "advantage_stage", "update_stage", "validate_stage"]

_DEFAULTS = TrainerConfig()
#: Options of every stage task; retries and delay default to ``TrainerConfig``'s (see :func:`stages_for`).
TASK_OPTS = dict(cache_policy=NONE, persist_result=False, retries=_DEFAULTS.stage_retries,
                 retry_delay_seconds=_DEFAULTS.stage_retry_delay_s, retry_condition_fn=retry_on_transient)


@task(name="rollout", task_run_name="rollout-{run_id}-it{iteration}", **TASK_OPTS)
def rollout_stage(run_id: str, iteration: int) -> StageRef:
    """Sample ``rollout.n`` responses for the iteration's prompts and store them with old log-probs."""
    ctx = get_context(run_id)
    prompts = ctx.extra["batches"][iteration]
    ref = ctx.store.verified_stage(iteration, "rollout")
    if ref is not None:
        return ref
    with stage_guard(ctx, "rollout"):
        ensure_workers(ctx, through=iteration - 1)
        return _rollout(ctx, iteration, prompts)


def _rollout(ctx: RunContext, iteration: int, prompts: list) -> StageRef:
    cfg = ctx.cfg
    params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                            seed=iteration_seed(cfg.trainer.seed, iteration))
    prompt_ids = wait(ctx, ctx.actor.tokenize_prompts.remote([p.messages for p in prompts], cfg.data.max_prompt_length))
    gen = wait(ctx, ctx.actor.generate_sequences.remote(prompt_ids, params))
    table = pipeline.rollout_table(iteration, prompts, prompt_ids, gen, cfg.rollout.n)
    ctx.extra.setdefault("timing", {})[iteration] = {
        "timing_s/gen": gen["timing_s/gen"], "timing_s/old_log_prob": gen.get("timing_s/old_log_prob", 0.0)}
    return ctx.store.write_stage(iteration, "rollout", table, int(gen["policy_version"]))


@task(name="reward", task_run_name="reward-{run_id}-it{iteration}", **TASK_OPTS)
def reward_stage(run_id: str, iteration: int, rollout: StageRef) -> StageRef:
    """Score responses on Ray workers; add reference log-probs and KL shaping when configured."""
    ctx = get_context(run_id)
    ref = ctx.store.verified_stage(iteration, "reward")
    if ref is not None:
        return ref
    with stage_guard(ctx, "reward"):
        ensure_workers(ctx, through=iteration - 1)
        return _reward(ctx, iteration, rollout)


def _reward(ctx: RunContext, iteration: int, rollout: StageRef) -> StageRef:
    t0 = time.perf_counter()
    cfg = ctx.cfg
    table = ctx.store.read_ref(rollout)
    reward_cfg = ctx.plain("reward")
    cols = [table.column(c).to_pylist() for c in ("data_source", "response_text", "ground_truth", "extra_info")]
    k = max(1, min(cfg.reward.num_workers, table.num_rows))
    bounds = np.linspace(0, table.num_rows, k + 1).astype(int)
    remote_score = ray.remote(num_cpus=0)(pipeline.score_rows)
    futures = [remote_score.remote(*[c[a:b] for c in cols], reward_cfg) for a, b in zip(bounds[:-1], bounds[1:])]
    ref_lp = None
    if ctx.reference is not None:
        ref_lp = wait(ctx, ctx.reference.compute_ref_log_prob.remote(
            table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist(), cfg.rollout.temperature))
    results = wait(ctx, futures)
    scores = np.concatenate([r.scores for r in results]).astype(np.float32)
    extras = [e for r in results for e in r.extras]
    kl_coef = float(ctx.kl_ctrl.value) if ctx.kl_ctrl is not None else 0.0
    out, metrics = pipeline.reward_table(table, scores, extras, ref_logprobs=ref_lp, reward_cfg=reward_cfg,
                                         algorithm_cfg=ctx.plain("algorithm"),
                                         max_new_tokens=cfg.rollout.max_new_tokens, kl_coef=kl_coef)
    metrics["reward/scorer_errors"] = float(sum(r.num_errors for r in results))
    ctx.extra.setdefault("reward_metrics", {})[iteration] = metrics
    ctx.extra.setdefault("timing", {}).setdefault(iteration, {})["timing_s/reward"] = time.perf_counter() - t0
    return ctx.store.write_stage(iteration, "reward", out, ctx.policy_version)


@task(name="gate", task_run_name="gate-{run_id}-it{iteration}", **TASK_OPTS)
def gate_stage(run_id: str, iteration: int, rollout: StageRef, reward: StageRef) -> dict:
    """Validate the reward output (Great Expectations); returns ``{"success", "quarantined", ...}``."""
    from trajflow.gating import run_iteration_gate

    ctx = get_context(run_id)
    with stage_guard(ctx, "gate"):
        return run_iteration_gate(ctx, iteration, rollout, reward)


@task(name="advantage", task_run_name="advantage-{run_id}-it{iteration}", **TASK_OPTS)
def advantage_stage(run_id: str, iteration: int, rollout: StageRef, reward: StageRef, gate: dict) -> StageRef:
    """Compute advantages and returns on a Ray worker and store them.

    Rows quarantined by the gate take no part: the estimator sees only the kept rows (so they
    cannot shift a group's baseline), and their advantages are stored as zeros.
    """
    ctx = get_context(run_id)
    ref = ctx.store.verified_stage(iteration, "advantage")
    if ref is not None:
        return ref
    with stage_guard(ctx, "advantage"):
        return _advantage(ctx, iteration, rollout, reward, gate)


def _advantage(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef, gate: dict) -> StageRef:
    t0 = time.perf_counter()
    joined = join_stages([ctx.store.read_ref(rollout), ctx.store.read_ref(reward)])
    dropped = set(gate.get("quarantined_sample_ids") or ())
    keep = np.array([sid not in dropped for sid in joined.column("sample_id").to_pylist()])
    compute = ray.remote(num_cpus=0)(pipeline.advantage_table)
    out = wait(ctx, compute.remote(joined.filter(pa.array(keep)), ctx.plain("algorithm"))) if keep.any() else None
    out = pipeline.fill_dropped_rows(joined, out)
    ctx.extra.setdefault("timing", {}).setdefault(iteration, {})["timing_s/adv"] = time.perf_counter() - t0
    return ctx.store.write_stage(iteration, "advantage", out, ctx.policy_version)


@task(name="update_actor", task_run_name="update-{run_id}-it{iteration}", **TASK_OPTS)
def update_stage(run_id: str, iteration: int, rollout: StageRef, reward: StageRef, advantage: StageRef,
                 gate: dict) -> dict:
    """One policy update on the policy worker; stores ``update.json`` and returns its metrics."""
    ctx = get_context(run_id)
    with stage_guard(ctx, "update_actor"):
        ensure_workers(ctx, through=iteration - 1)
        return _update(ctx, iteration, rollout, reward, advantage, gate)


def _update(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef, advantage: StageRef,
            gate: dict) -> dict:
    cfg = ctx.cfg
    joined = join_stages([ctx.store.read_ref(r) for r in (rollout, reward, advantage)])
    joined = pipeline.with_loss_mask(joined, gate)
    batch = pipeline.update_batch(joined, iteration, seed=int(cfg.trainer.seed), n=int(cfg.rollout.n),
                                  ppo_mini_batch_size=int(cfg.actor.ppo_mini_batch_size),
                                  use_ref_logprobs=cfg.actor.kl_loss_coef > 0)
    metrics = wait(ctx, ctx.actor.update_actor.remote(batch, cfg.rollout.temperature))
    ctx.policy_version = int(metrics["policy_version"])
    metrics.update(pipeline.batch_metrics(joined))
    metrics.update(ctx.extra.get("reward_metrics", {}).get(iteration, {}))
    ctx.store.write_iteration_json(iteration, "update.json", metrics)
    return metrics


@task(name="validate", task_run_name="validate-{run_id}-step{step}", **TASK_OPTS)
def validate_stage(run_id: str, step: int) -> dict:
    """Score the current policy on the held-out prompts (see :func:`run_validation`); stored in ``run.json``."""
    ctx = get_context(run_id)
    with stage_guard(ctx, "validate"):
        ensure_workers(ctx, through=step)
        metrics = run_validation(ctx, step)
    if metrics:
        ctx.store.update_run_meta(**{f"validation_{step:06d}": metrics})
    return metrics


def run_validation(ctx: RunContext, step: int) -> dict[str, float]:
    """Score the policy worker's current policy on the held-out prompts (shared by train and evaluate).

    Samples ``rollout.val_n`` responses per prompt (the first ``data.val_max_prompts``, 0 = all) at
    ``rollout.val_temperature`` with a seed derived from ``step``, and scores them with the reward
    scorers.

    Args:
        ctx: a context with ``cfg``, ``actor`` (a live policy worker), ``datasets`` and the reward config.
        step: the iteration the policy comes from (0 = before training); seeds the sampling.

    Returns:
        ``val-core/<data_source>/acc/mean@<n>`` (accuracy in [0, 1]), ``val-aux/<data_source>/reward/mean@<n>``,
        ``val-aux/response_length/mean`` (tokens) and ``timing_s/testing`` (seconds); empty without prompts.
    """
    cfg = ctx.cfg
    prompts = ctx.datasets.validation
    if cfg.data.val_max_prompts:
        prompts = prompts[:cfg.data.val_max_prompts]
    if not prompts:
        return {}
    t0 = time.perf_counter()
    n = cfg.rollout.val_n
    params = SamplingParams(n=n, temperature=cfg.rollout.val_temperature, top_p=1.0, top_k=0,
                            max_new_tokens=cfg.rollout.max_new_tokens, seed=iteration_seed(cfg.trainer.seed, step, 2))
    prompt_ids = wait(ctx, ctx.actor.tokenize_prompts.remote([p.messages for p in prompts], cfg.data.max_prompt_length))
    gen = wait(ctx, ctx.actor.generate_sequences.remote(prompt_ids, params, False))
    rows = [p for p in prompts for _ in range(n)]
    result = pipeline.score_rows([p.data_source for p in rows], gen["response_text"], [str(p.ground_truth) for p in rows],
                                 [json.dumps(p.extra_info, default=str) for p in rows], ctx.plain("reward"))
    metrics: dict[str, float] = {}
    sources = np.array([p.data_source for p in rows])
    acc = np.array([float(e.get("acc", s)) if isinstance(e, dict) else float(s)
                    for e, s in zip(result.extras, result.scores)])
    for src in sorted(set(sources)):
        sel = sources == src
        metrics[f"val-core/{src}/acc/mean@{n}"] = float(np.nanmean(acc[sel]))
        metrics[f"val-aux/{src}/reward/mean@{n}"] = float(np.nanmean(result.scores[sel]))
    metrics["val-aux/response_length/mean"] = float(np.mean([len(r) for r in gen["response_ids"]]))
    metrics["timing_s/testing"] = time.perf_counter() - t0
    return metrics


def stages_for(cfg: DictConfig) -> SimpleNamespace:
    """The stage tasks with a run's retry and timeout settings.

    Args:
        cfg: the run config (``trainer.stage_retries``, ``stage_retry_delay_s``, ``stage_timeout_s``,
            ``stage_timeouts``).

    Returns:
        A namespace with ``rollout``, ``reward``, ``gate``, ``advantage``, ``update`` and ``validate`` tasks.
    """
    t = cfg.trainer

    def configured(fn, stage: str):
        return fn.with_options(retries=int(t.stage_retries), retry_delay_seconds=float(t.stage_retry_delay_s),
                               timeout_seconds=stage_timeout(cfg, stage))

    return SimpleNamespace(rollout=configured(rollout_stage, "rollout"), reward=configured(reward_stage, "reward"),
                           gate=configured(gate_stage, "gate"), advantage=configured(advantage_stage, "advantage"),
                           update=configured(update_stage, "update_actor"),
                           validate=configured(validate_stage, "validate"))
