"""Prefect tasks of the training pipeline: thin wrappers that move references between Ray and the store.

Every task takes the run id, the iteration and :class:`~trajflow.store.StageRef` references, and
returns a reference or a small dict: no tensors or actor handles cross a Prefect boundary. A stage
whose verified output already exists (resume, retry) is not recomputed.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import ray
from prefect import task
from prefect.cache_policies import NONE

from stages.rollout import SamplingParams
from trajflow import pipeline
from trajflow.batch import join_stages
from trajflow.runtime import get_context
from trajflow.store import StageRef

TASK_OPTS = dict(cache_policy=NONE, persist_result=False)


def iteration_seed(seed: int, iteration: int, salt: int = 0) -> int:
    """Seed for iteration-local randomness (sampling, shuffling): equal across resumes."""
    return (seed * 1_000_003 + iteration * 7919 + salt) % (2**31 - 1)


@task(name="rollout", task_run_name="rollout-{run_id}-it{iteration}", **TASK_OPTS)
def rollout_stage(run_id: str, iteration: int) -> StageRef:
    """Sample ``rollout.n`` responses for the iteration's prompts and store them with old log-probs."""
    ctx = get_context(run_id)
    prompts = ctx.extra["batches"][iteration]
    ref = ctx.store.verified_stage(iteration, "rollout")
    if ref is not None:
        return ref
    cfg = ctx.cfg
    params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                            seed=iteration_seed(cfg.trainer.seed, iteration))
    prompt_ids = ray.get(ctx.actor.tokenize_prompts.remote([p.messages for p in prompts], cfg.data.max_prompt_length))
    gen = ray.get(ctx.actor.generate_sequences.remote(prompt_ids, params))
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
        ref_lp = ray.get(ctx.reference.compute_ref_log_prob.remote(
            table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist(), cfg.rollout.temperature))
    results = ray.get(futures)
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

    return run_iteration_gate(get_context(run_id), iteration, rollout, reward)


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
    t0 = time.perf_counter()
    joined = join_stages([ctx.store.read_ref(rollout), ctx.store.read_ref(reward)])
    dropped = set(gate.get("quarantined_sample_ids") or ())
    keep = np.array([sid not in dropped for sid in joined.column("sample_id").to_pylist()])
    compute = ray.remote(num_cpus=0)(pipeline.advantage_table)
    out = ray.get(compute.remote(joined.filter(pa.array(keep)), ctx.plain("algorithm"))) if keep.any() else None
    out = pipeline.fill_dropped_rows(joined, out)
    ctx.extra.setdefault("timing", {}).setdefault(iteration, {})["timing_s/adv"] = time.perf_counter() - t0
    return ctx.store.write_stage(iteration, "advantage", out, ctx.policy_version)


def _with_loss_mask(joined: pa.Table, gate: dict) -> pa.Table:
    """Add a ragged 0/1 ``loss_mask`` that drops quarantined rows (all ones when none)."""
    dropped = set(gate.get("quarantined_sample_ids") or ())
    if not dropped:
        return joined
    lens = pipeline.lengths(joined.column("response_ids"))
    keep = [sid not in dropped for sid in joined.column("sample_id").to_pylist()]
    mask = [[1.0 if k else 0.0] * int(n) for k, n in zip(keep, lens)]
    return joined.append_column("loss_mask", pa.array(mask, pa.list_(pa.float32())))


@task(name="update_actor", task_run_name="update-{run_id}-it{iteration}", **TASK_OPTS)
def update_stage(run_id: str, iteration: int, rollout: StageRef, reward: StageRef, advantage: StageRef,
                 gate: dict) -> dict:
    """One policy update on the policy worker; stores ``update.json`` and returns its metrics."""
    ctx = get_context(run_id)
    cfg = ctx.cfg
    joined = join_stages([ctx.store.read_ref(r) for r in (rollout, reward, advantage)])
    joined = _with_loss_mask(joined, gate)
    batch = {c: joined.column(c).to_pylist() for c in ("prompt_ids", "response_ids", "old_logprobs", "advantages")}
    if "loss_mask" in joined.column_names:
        batch["loss_mask"] = joined.column("loss_mask").to_pylist()
    if cfg.actor.kl_loss_coef > 0 and "ref_logprobs" in joined.column_names:
        batch["ref_logprobs"] = joined.column("ref_logprobs").to_pylist()
    batch["mini_batch_rows"] = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    batch["shuffle_seed"] = iteration_seed(cfg.trainer.seed, iteration, salt=1)
    metrics = ray.get(ctx.actor.update_actor.remote(batch, cfg.rollout.temperature))
    ctx.policy_version = int(metrics["policy_version"])
    metrics.update(pipeline.batch_metrics(joined))
    metrics.update(ctx.extra.get("reward_metrics", {}).get(iteration, {}))
    ctx.store.write_iteration_json(iteration, "update.json", metrics)
    return metrics


@task(name="validate", task_run_name="validate-{run_id}-step{step}", **TASK_OPTS)
def validate_stage(run_id: str, step: int) -> dict:
    """Score the current policy on the held-out prompts: ``val-core/<data_source>/acc/mean@<n>``."""
    ctx = get_context(run_id)
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
    prompt_ids = ray.get(ctx.actor.tokenize_prompts.remote([p.messages for p in prompts], cfg.data.max_prompt_length))
    gen = ray.get(ctx.actor.generate_sequences.remote(prompt_ids, params, False))
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
    ctx.store.update_run_meta(**{f"validation_{step:06d}": metrics})
    return metrics
