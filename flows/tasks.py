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

import dataclasses
import hashlib
import json
import time
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import ray
from omegaconf import DictConfig, OmegaConf
from prefect import task
from prefect.cache_policies import NONE

from trajflow.errors import DynamicSamplingError
from stages.rollout import SamplingParams
from trajflow import pipeline
from trajflow.batch import join_stages
from trajflow.config import TrainerConfig
from trajflow.errors import DataError
from trajflow.faults import fault_point
from trajflow.pipeline import iteration_seed
from trajflow.runtime import (RunContext, ensure_workers, get_context, retry_on_transient, stage_guard, stage_timeout,
                              wait)
from trajflow.store import StageRef

__all__ = ["iteration_seed", "stages_for", "run_validation", "rollout_stage", "reward_stage", "gate_stage",
           "advantage_stage", "update_stage", "validate_stage", "DynamicSamplingError"]

_DEFAULTS = TrainerConfig()
#: Options of every stage task; retries and delay default to ``TrainerConfig``'s (see :func:`stages_for`).
TASK_OPTS = dict(cache_policy=NONE, persist_result=False, retries=_DEFAULTS.stage_retries,
                 retry_delay_seconds=_DEFAULTS.stage_retry_delay_s, retry_condition_fn=retry_on_transient)


def _sampling_params(cfg, iteration: int, gen_batch: int = 0) -> SamplingParams:
    """Sampling parameters of generation batch ``gen_batch`` of ``iteration`` (its own seed)."""
    salt = 0 if gen_batch == 0 else 100 + gen_batch
    return SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                          top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                          seed=iteration_seed(cfg.trainer.seed, iteration, salt))


def _score_rows(ctx, data_sources: list, texts: list, ground_truths: list, extra_infos: list,
                prompts: list | None) -> tuple[np.ndarray, list, int, np.ndarray | None]:
    """Rule scores on ``reward.num_workers`` Ray tasks and, in parallel, reward-model scores.

    Returns:
        ``(rule_scores (rows,) float32, extras, num_errors, rm_scores (rows,) float32 or None)``.
    """
    cfg = ctx.cfg
    reward_cfg = ctx.plain("reward")
    rows = len(texts)
    k = max(1, min(cfg.reward.num_workers, rows))
    bounds = np.linspace(0, rows, k + 1).astype(int)
    remote_score = ray.remote(num_cpus=0)(pipeline.score_rows)
    cols = (data_sources, texts, ground_truths, extra_infos)
    futures = [remote_score.remote(*[c[a:b] for c in cols], reward_cfg) for a, b in zip(bounds[:-1], bounds[1:])]
    rm_future = None
    if ctx.reward_model is not None:
        messages = [json.loads(p) if isinstance(p, str) else p for p in prompts]
        rm_future = ctx.reward_model.compute_rm_score.remote(messages, texts)
    results = wait(ctx, futures)
    rule = np.concatenate([r.scores for r in results]).astype(np.float32) if results else np.zeros(0, np.float32)
    extras = [e for r in results for e in r.extras]
    rm = np.asarray(wait(ctx, rm_future), dtype=np.float32) if rm_future is not None else None
    return rule, extras, int(sum(r.num_errors for r in results)), rm


def _score_table(ctx, table: pa.Table, text_column: str = "response_text"):
    """:func:`_score_rows` over a rollout table's rows (``text_column`` holds the responses)."""
    cols = [table.column(c).to_pylist() for c in ("data_source", text_column, "ground_truth", "extra_info")]
    return _score_rows(ctx, *cols, table.column("prompt").to_pylist())


def _generate(ctx, prompts, params: SamplingParams, iteration: int | None = None) -> tuple[list, dict]:
    """Tokenize the prompts and sample responses with the engine's log-probs (``old_logprobs``)."""
    cfg = ctx.cfg
    prompt_ids = wait(ctx, ctx.actor.tokenize_prompts.remote([p.messages for p in prompts], cfg.data.max_prompt_length))
    pending = ctx.actor.generate_sequences.remote(prompt_ids, params)
    fault_point("rollout", iteration)
    return prompt_ids, wait(ctx, pending)


def digest(obj) -> str:
    """Short sha256 of a JSON-serialisable value: how a stage records the settings it was computed with."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rollout_inputs(ctx: RunContext, iteration: int, prompts: list) -> dict[str, str]:
    """What a rollout depends on besides the weights: prompts, sampling (incl. dynamic sampling and
    ReMax's greedy baseline), policy version, model."""
    cfg = ctx.cfg
    sampling = [dataclasses.asdict(_sampling_params(cfg, iteration)),
                OmegaConf.to_container(cfg.algorithm.filter_groups, resolve=True), cfg.algorithm.adv_estimator]
    return {"prompts": digest([str(p.prompt_id) for p in prompts]), "sampling": digest(sampling),
            "policy_version": str(ctx.policy_version), "model": digest([ctx.model_path, ctx.plain("model")])}


def reward_inputs(ctx: RunContext, rollout: StageRef) -> dict[str, str]:
    """What a reward output depends on: the rollout file and every setting that changes scores or KL shaping."""
    cfg = ctx.cfg
    settings = {"reward": ctx.plain("reward"), "max_new_tokens": cfg.rollout.max_new_tokens,
                "temperature": cfg.rollout.temperature,
                "kl": [bool(cfg.algorithm.use_kl_in_reward), cfg.algorithm.kl_penalty,
                       float(ctx.kl_ctrl.value) if ctx.kl_ctrl is not None else None],
                "reference": [ctx.needs_reference(), cfg.reference.path]}
    return {"rollout": rollout.sha256, "settings": digest(settings)}


def restore_reward_metrics(ctx: RunContext, iteration: int) -> None:
    """Put the metrics stored with a reused reward output (KL for the controller, ...) back in the context."""
    stored = (ctx.store.stage_entry(iteration, "reward") or {}).get("meta", {}).get("metrics", {})
    ctx.extra.setdefault("reward_metrics", {})[iteration] = dict(stored)


def advantage_inputs(ctx: RunContext, rollout: StageRef, reward: StageRef, gate: dict) -> dict[str, str]:
    """What an advantage output depends on: rollout and reward files, the gate's quarantine, ``algorithm``."""
    return {"rollout": rollout.sha256, "reward": reward.sha256,
            "gate": digest(sorted(gate.get("quarantined_sample_ids") or ())),
            "settings": digest(ctx.plain("algorithm"))}


def _dynamic_sampling(ctx, iteration: int, first_prompts: list) -> tuple[pa.Table, dict]:
    """DAPO dynamic sampling: generate batches of prompts until ``data.train_batch_size`` groups have
    reward variance (``stages.sampling.groups_with_signal``) or ``filter_groups.max_num_gen_batches``
    batches were generated.

    Every generation batch draws ``data.train_batch_size`` prompts (the first batch is the
    iteration's own; later ones come from the sampler, so the data cursor moves on). Kept groups
    beyond the target are dropped (as verl). The scores computed here are cached for the reward
    stage.

    Returns:
        ``(kept rollout rows, record)`` where ``record`` is what ``dynamic_sampling.json`` stores:
        ``num_gen_batches``, ``extra_draws``, ``kept_groups``, ``filtered_groups`` (zero variance)
        and ``surplus_groups``; the dropped rows (rollout columns plus ``score`` and
        ``filter_metric``) are ``record["dropped"]``.

    Raises:
        DynamicSamplingError: no group with variance within the budget.
    """
    from stages.sampling import groups_with_signal, take_first_groups

    cfg = ctx.cfg
    fg = cfg.algorithm.filter_groups
    target = cfg.data.train_batch_size
    reward_cfg = ctx.plain("reward")
    kept_parts, dropped_parts = [], []
    kept_groups = filtered = surplus = gen_batches = extra_draws = 0
    gen_s = 0.0
    cache = ctx.extra.setdefault("prescored", {}).setdefault(iteration, {})
    # 0 = no limit, but never more than one epoch of prompts: data without any signal must not loop forever
    budget = fg.max_num_gen_batches or max(1, ctx.sampler.iterations_per_epoch)
    prompts = first_prompts
    while True:
        prompt_ids, gen = _generate(ctx, prompts, _sampling_params(cfg, iteration, gen_batches), iteration)
        gen_s += gen.timing["timing_s/gen"]
        t = pipeline.rollout_table(iteration, prompts, prompt_ids, gen, cfg.rollout.n, offset=gen_batches * target)
        rule, extras, _, rm = _score_table(ctx, t)
        final, _ = pipeline.final_scores(rule, rm, pipeline.lengths(t.column("response_ids")), reward_cfg,
                                         cfg.rollout.max_new_tokens)
        metric = pipeline.filter_metric(final, extras, fg.metric)
        gids = t.column("group_id").to_pylist()
        signal = groups_with_signal(metric, gids)
        keep = take_first_groups(gids, signal, target - kept_groups)
        n_signal = len({g for g, s_ in zip(gids, signal) if s_})
        n_keep = len({g for g, k_ in zip(gids, keep) if k_})
        filtered += len(set(gids)) - n_signal
        surplus += n_signal - n_keep
        kept_groups += n_keep
        for i, sid in enumerate(t.column("sample_id").to_pylist()):
            if keep[i]:
                cache[sid] = (float(rule[i]), extras[i], None if rm is None else float(rm[i]))
        kept_parts.append(t.filter(pa.array(keep)))
        drop = ~keep
        if drop.any():
            d = t.filter(pa.array(drop))
            d = d.append_column("score", pa.array(final[drop], pa.float32()))
            dropped_parts.append(d.append_column("filter_metric", pa.array(metric[drop].astype(np.float32), pa.float32())))
        gen_batches += 1
        if kept_groups >= target or gen_batches >= budget:
            break
        prompts = ctx.sampler.next_batch()
        extra_draws += 1
    if kept_groups == 0:
        raise DynamicSamplingError(
            f"iteration {iteration}: dynamic sampling kept no group after {gen_batches} generation batch(es) of "
            f"{target} prompts x rollout.n={cfg.rollout.n}: every group's '{fg.metric}' was constant. Raise "
            f"algorithm.filter_groups.max_num_gen_batches (0 = up to one epoch of prompts), use data the policy "
            f"sometimes solves, or set algorithm.filter_groups.enable=false")
    table = pa.concat_tables(kept_parts)
    record = {"num_gen_batches": gen_batches, "extra_draws": extra_draws, "kept_groups": kept_groups,
              "filtered_groups": filtered, "surplus_groups": surplus, "target_groups": target,
              "metric": fg.metric, "timing_s/gen": gen_s,
              "dropped": pa.concat_tables(dropped_parts) if dropped_parts else None}
    return table, record


def _sampling_metrics(record: dict) -> dict[str, float]:
    return {"batch/num_gen_batches": float(record["num_gen_batches"]), "batch/kept_groups": float(record["kept_groups"]),
            "batch/filtered_groups": float(record["filtered_groups"]),
            "batch/surplus_groups": float(record["surplus_groups"])}


def _replay_stored_rollout(ctx, iteration: int) -> None:
    """The rollout of ``iteration`` is already stored (resume): move the data cursor past the extra
    prompt batches its dynamic sampling drew, exactly as generating it did."""
    record = ctx.store.read_iteration_json(iteration, "dynamic_sampling.json")
    if record:
        for _ in range(int(record["extra_draws"])):
            ctx.sampler.next_batch()
        ctx.extra.setdefault("rollout_metrics", {})[iteration] = _sampling_metrics(record)


@task(name="rollout", task_run_name="rollout-{run_id}-it{iteration}", **TASK_OPTS)
def rollout_stage(run_id: str, iteration: int) -> StageRef:
    """Sample ``rollout.n`` responses for the iteration's prompts and store them with the engine's log-probs.

    With ``algorithm.filter_groups.enable`` the batch is refilled until it holds
    ``data.train_batch_size`` groups with reward variance (DAPO dynamic sampling): ``rollout.parquet``
    then holds only the kept rows, ``dropped.parquet`` the dropped ones (with their score) and
    ``dynamic_sampling.json`` the counts. For ReMax, one greedy response per prompt is generated as
    the baseline (``baseline_response_ids``/``baseline_response_text`` columns).
    """
    ctx = get_context(run_id)
    prompts = ctx.extra["batches"][iteration]
    # Every attempt (first, retry, resume) starts from the data cursor as it was before this stage, so
    # the prompt batches dynamic sampling draws are the same whichever attempt produced the stored rollout.
    cursor = ctx.extra.setdefault("sampler_before_rollout", {}).setdefault(iteration, ctx.sampler.state_dict())
    ctx.sampler.load_state_dict(cursor)
    inputs = rollout_inputs(ctx, iteration, prompts)
    ref = ctx.store.verified_stage(iteration, "rollout", inputs=inputs)
    if ref is not None:
        _replay_stored_rollout(ctx, iteration)
        return ref
    with stage_guard(ctx, "rollout"):
        ensure_workers(ctx, through=iteration - 1)
        return _rollout(ctx, iteration, prompts, inputs)


def _rollout(ctx: RunContext, iteration: int, prompts: list, inputs: dict[str, str]) -> StageRef:
    from trajflow.runtime import BASELINE_ESTIMATORS

    cfg = ctx.cfg
    timing = ctx.extra.setdefault("timing", {}).setdefault(iteration, {})
    if cfg.algorithm.filter_groups.enable:
        t0 = time.perf_counter()
        table, record = _dynamic_sampling(ctx, iteration, prompts)
        timing["timing_s/gen"] = time.perf_counter() - t0
        policy_version = int(table.column("policy_version")[0].as_py())
        dropped = record.pop("dropped")
        if dropped is not None:
            ctx.store.write_stage(iteration, "dropped", dropped, policy_version)
        ctx.store.write_iteration_json(iteration, "dynamic_sampling.json", record)
        ctx.extra.setdefault("rollout_metrics", {})[iteration] = _sampling_metrics(record)
    else:
        prompt_ids, gen = _generate(ctx, prompts, _sampling_params(cfg, iteration), iteration)
        table = pipeline.rollout_table(iteration, prompts, prompt_ids, gen, cfg.rollout.n)
        timing["timing_s/gen"] = gen.timing["timing_s/gen"]
        timing["timing_s/old_log_prob"] = gen.timing.get("timing_s/old_log_prob", 0.0)
        policy_version = int(gen.policy_version)
    if cfg.algorithm.adv_estimator in BASELINE_ESTIMATORS:
        t0 = time.perf_counter()
        gids = table.column("group_id").to_pylist()
        first = {g: i for i, g in reversed(list(enumerate(gids)))}
        order = list(dict.fromkeys(gids))
        prompt_ids = table.column("prompt_ids").to_pylist()
        greedy_params = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens,
                                       seed=iteration_seed(cfg.trainer.seed, iteration, 3))
        greedy = wait(ctx, ctx.actor.generate_sequences.remote([prompt_ids[first[g]] for g in order], greedy_params))
        index = {g: k for k, g in enumerate(order)}
        for name, col in pipeline.baseline_columns([index[g] for g in gids], greedy).items():
            table = table.append_column(name, col)
        timing["timing_s/gen_baseline"] = time.perf_counter() - t0
    return ctx.store.write_stage(iteration, "rollout", table, policy_version, inputs=inputs,
                                 meta={"checkpoint_id": ctx.extra.get("policy_source", "initial")})


@task(name="reward", task_run_name="reward-{run_id}-it{iteration}", **TASK_OPTS)
def reward_stage(run_id: str, iteration: int, rollout: StageRef) -> StageRef:
    """Score responses on Ray workers (rules, plus the reward model when enabled); add reference
    log-probs and KL shaping when configured, and ReMax's baseline score."""
    ctx = get_context(run_id)
    inputs = reward_inputs(ctx, rollout)
    ref = ctx.store.verified_stage(iteration, "reward", inputs=inputs)
    if ref is not None:
        restore_reward_metrics(ctx, iteration)
        return ref
    with stage_guard(ctx, "reward"):
        ensure_workers(ctx, through=iteration - 1)
        return _reward(ctx, iteration, rollout, inputs)


def _reward(ctx: RunContext, iteration: int, rollout: StageRef, inputs: dict[str, str]) -> StageRef:
    t0 = time.perf_counter()
    cfg = ctx.cfg
    table = ctx.store.read_ref(rollout)
    reward_cfg = ctx.plain("reward")
    ref_future = None
    if ctx.reference is not None:
        ref_future = ctx.reference.compute_ref_log_prob.remote(
            table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist())
    sids = table.column("sample_id").to_pylist()
    cache = ctx.extra.get("prescored", {}).get(iteration, {})
    if sids and all(sid in cache for sid in sids):  # scored by dynamic sampling in this process
        scores = np.array([cache[sid][0] for sid in sids], np.float32)
        extras = [cache[sid][1] for sid in sids]
        num_errors = sum(1 for e in extras if isinstance(e, dict) and e.get("error"))
        rm = None if ctx.reward_model is None else np.array([cache[sid][2] for sid in sids], np.float32)
    else:
        scores, extras, num_errors, rm = _score_table(ctx, table)
    baselines = None
    if "baseline_response_text" in table.column_names:  # ReMax: the greedy response's final score
        b_rule, _, _, b_rm = _score_table(ctx, table, "baseline_response_text")
        baselines, _ = pipeline.final_scores(b_rule, b_rm, pipeline.lengths(table.column("baseline_response_ids")),
                                             reward_cfg, cfg.rollout.max_new_tokens)
    ref_lp = wait(ctx, ref_future) if ref_future is not None else None
    kl_coef = float(ctx.kl_ctrl.value) if ctx.kl_ctrl is not None else 0.0
    out, metrics = pipeline.reward_table(table, scores, extras, ref_logprobs=ref_lp, reward_cfg=reward_cfg,
                                         algorithm_cfg=ctx.plain("algorithm"),
                                         max_new_tokens=cfg.rollout.max_new_tokens, kl_coef=kl_coef,
                                         rm_scores=rm, reward_baselines=baselines)
    metrics["reward/scorer_errors"] = float(num_errors)
    ctx.extra.setdefault("reward_metrics", {})[iteration] = metrics
    ctx.extra.setdefault("timing", {}).setdefault(iteration, {})["timing_s/reward"] = time.perf_counter() - t0
    ref = ctx.store.write_stage(iteration, "reward", out, ctx.policy_version, inputs=inputs, meta={"metrics": metrics})
    ctx.extra.get("prescored", {}).pop(iteration, None)
    return ref


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
    fault_point("after_reward", iteration)
    ctx = get_context(run_id)
    inputs = advantage_inputs(ctx, rollout, reward, gate)
    ref = ctx.store.verified_stage(iteration, "advantage", inputs=inputs)
    if ref is not None:
        return ref
    with stage_guard(ctx, "advantage"):
        ensure_workers(ctx, through=iteration - 1)  # the critic, for estimators that need values
        return _advantage(ctx, iteration, rollout, reward, gate, inputs)


def _advantage(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef, gate: dict,
               inputs: dict[str, str]) -> StageRef:
    t0 = time.perf_counter()
    joined = join_stages([ctx.store.read_ref(rollout), ctx.store.read_ref(reward)])
    dropped = set(gate.get("quarantined_sample_ids") or ())
    keep = np.array([sid not in dropped for sid in joined.column("sample_id").to_pylist()])
    compute = ray.remote(num_cpus=0)(pipeline.advantage_table)
    out = None
    if keep.any():
        kept = joined.filter(pa.array(keep))
        values = None
        if ctx.critic is not None:  # V(s_t) of the critic before this iteration's update
            values = wait(ctx, ctx.critic.compute_values.remote(kept.column("prompt_ids").to_pylist(),
                                                               kept.column("response_ids").to_pylist()))
            ctx.extra.setdefault("timing", {}).setdefault(iteration, {})["timing_s/values"] = time.perf_counter() - t0
        baselines = None
        if "reward_baseline" in kept.column_names:  # ReMax: the greedy response's score
            baselines = kept.column("reward_baseline").to_numpy(zero_copy_only=False)
        out = wait(ctx, compute.remote(kept, ctx.plain("algorithm"), values, baselines))
    out = pipeline.fill_dropped_rows(joined, out)
    ctx.extra.setdefault("timing", {}).setdefault(iteration, {})["timing_s/adv"] = time.perf_counter() - t0
    return ctx.store.write_stage(iteration, "advantage", out, ctx.policy_version, inputs=inputs)


@task(name="update_actor", task_run_name="update-{run_id}-it{iteration}", **TASK_OPTS)
def update_stage(run_id: str, iteration: int, rollout: StageRef, reward: StageRef, advantage: StageRef,
                 gate: dict) -> dict:
    """The critic update (when there is a critic, first, as verl) and the policy update; stores
    ``update.json`` and returns its metrics."""
    ctx = get_context(run_id)
    with stage_guard(ctx, "update_actor"):
        ensure_workers(ctx, through=iteration - 1)
        return _update(ctx, iteration, rollout, reward, advantage, gate)


def _update(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef, advantage: StageRef,
            gate: dict) -> dict:
    cfg = ctx.cfg
    joined = join_stages([ctx.store.read_ref(r) for r in (rollout, reward, advantage)])
    joined = pipeline.with_loss_mask(joined, gate)
    metrics: dict = {}
    if ctx.critic is not None and "values" in joined.column_names:  # no values: every row was quarantined
        done = ctx.extra.setdefault("critic_updates", {})
        if iteration not in done:  # a retry after the actor failed must not update the critic twice
            done[iteration] = wait(ctx, ctx.critic.update_critic.remote(pipeline.critic_batch(joined, iteration, cfg)))
        metrics.update(done[iteration])
    batch = pipeline.update_batch(joined, iteration, **pipeline.update_batch_options(cfg))
    pending = ctx.actor.update_actor.remote(batch)
    fault_point("update", iteration)
    metrics.update(wait(ctx, pending))
    ctx.policy_version = int(metrics["policy_version"])
    metrics.update(pipeline.batch_metrics(joined))
    if cfg.algorithm.mask_truncated_samples:
        metrics["batch/masked_truncated"] = float(sum(f == "length" for f in joined.column("finish_reason").to_pylist()))
    metrics.update(ctx.extra.get("rollout_metrics", {}).get(iteration, {}))
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
    result = pipeline.score_rows([p.data_source for p in rows], gen.response_text, [str(p.ground_truth) for p in rows],
                                 [json.dumps(p.extra_info, default=str) for p in rows], ctx.plain("reward"))
    metrics: dict[str, float] = {}
    sources = np.array([p.data_source for p in rows])
    acc = np.array([float(e.get("acc", s)) if isinstance(e, dict) else float(s)
                    for e, s in zip(result.extras, result.scores)])
    for src in sorted(set(sources)):
        sel = sources == src
        metrics[f"val-core/{src}/acc/mean@{n}"] = float(np.nanmean(acc[sel]))
        metrics[f"val-aux/{src}/reward/mean@{n}"] = float(np.nanmean(result.scores[sel]))
    metrics["val-aux/response_length/mean"] = float(np.mean([len(r) for r in gen.response_ids]))
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
