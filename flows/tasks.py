"""Prefect tasks of the pipeline: one thin task per stage.

Each task takes the run id, the iteration and :class:`~trajflow.store.StageRef` references and returns
a reference or a small dict: no tensors or actor handles cross a Prefect boundary. :func:`stage_task`
gives every task the same skeleton (context lookup, verified reuse, the failure guard, workers
recreated after a loss, timing); the bodies only call workers and the pure functions of ``stages/``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pyarrow as pa
import ray
from omegaconf import DictConfig
from prefect import task
from prefect.cache_policies import NONE

from trajflow.stages.advantage import advantage_table, fill_dropped_rows
from trajflow.stages.dynamic_sampling import GenerationBatch, dynamic_sampling, sampling_metrics
from trajflow.stages.multi_turn import multi_turn_table
from trajflow.stages.names import Stage
from trajflow.stages.critic_update import critic_batch
from trajflow.stages.policy_update import update_batch, update_batch_options, with_loss_mask
from trajflow.stages.judge import judge_metrics
from trajflow.stages.reward import (final_scores, no_signal_warning, overlong_floor_warning, reward_table,
                                   shaping_penalties)
from trajflow.stages.rollout import rollout_table, rollout_temperature, sampling_params, with_sampling_columns
from trajflow.stages.staleness import check_staleness, row_staleness, staleness_metrics
from trajflow.stages.partial_rollout import TOKEN_VERSIONS, provenance_metrics
from trajflow.stages.seeds import Salt, iteration_seed
from trajflow.batch import join_stages, lengths, trainable_lengths
from trajflow.errors import NonFiniteError
from trajflow.faults import fault_point
from trajflow.metrics import batch_metrics, timing_per_token_metrics
from trajflow.run import roles
from trajflow.run.gate import run_iteration_gate
from trajflow.run.cache_keys import (AdvantageSettings, RewardSettings, RolloutSettings, advantage_inputs,
                                     reward_inputs, rollout_inputs)
from trajflow.run.context import RunContext, get_context
from trajflow.run.partial import restore_segment_metrics, run_segment
from trajflow.run.validation import run_validation
from trajflow.run.recovery import ensure_workers, retry_on_transient, stage_guard, stage_timeout, wait
from trajflow.store import StageRef

__all__ = ["stage_task", "stages_for", "rollout_stage", "reward_stage", "gate_stage", "advantage_stage",
           "update_stage", "validate_stage", "restore_reward_metrics"]

#: Options of every stage task; :func:`stages_for` sets a run's retries, delay and timeouts.
TASK_OPTS = dict(cache_policy=NONE, persist_result=False, retry_condition_fn=retry_on_transient)


def stage_task(stage: Stage, *, inputs: Callable | None = None, on_reuse: Callable | None = None,
               timer: str | None = None) -> Callable:
    """Make ``body(ctx, iteration, *refs[, inputs=...])`` the Prefect task of ``stage``.

    The task (called as ``task(run_id, iteration, *refs)``) looks up the run's context; when
    ``inputs`` is given it computes the stage's input digests and returns the stored output instead
    of recomputing it if one verifies against them (calling ``on_reuse(ctx, iteration)``); otherwise
    it runs the body inside :func:`~trajflow.run.recovery.stage_guard`, after recreating lost workers in
    the state after iteration ``iteration - 1``, and records the body's seconds as ``timer`` in the
    iteration's timings.

    Args:
        stage: the stage (its value names the task and the ``trainer.stage_timeouts`` key).
        inputs: ``(ctx, iteration, *refs) -> dict`` of input digests, for stages with a stored output.
        on_reuse: what a reused output must still do in this process (restore metrics, move the cursor).
        timer: the ``timing_s/*`` key of the body's wall time, or None.
    """
    def deco(body: Callable) -> Callable:
        @functools.wraps(body)
        def run(run_id: str, iteration: int, *refs):
            ctx = get_context(run_id)
            kwargs = {}
            if inputs is not None:
                kwargs["inputs"] = inputs(ctx, iteration, *refs)
                ref = ctx.store.verified_stage(iteration, stage.value, inputs=kwargs["inputs"])
                if ref is not None:
                    if on_reuse is not None:
                        on_reuse(ctx, iteration)
                    return ref
            with stage_guard(ctx, stage.value):
                ensure_workers(ctx, through=iteration - 1)
                t0 = time.perf_counter()
                out = body(ctx, iteration, *refs, **kwargs)
                if timer is not None:
                    ctx.iteration(iteration).timing[timer] = time.perf_counter() - t0
                return out

        # Prefect reads the parameters from the signature: the body's, with the run id for the context.
        params = list(inspect.signature(body).parameters.values())
        params = [inspect.Parameter("run_id", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)] + \
            [p for p in params[1:] if p.name != "inputs"]
        run.__signature__ = inspect.Signature(params)
        del run.__wrapped__
        short = "update" if stage is Stage.UPDATE else stage.value
        return task(name=stage.value, task_run_name=f"{short}-{{run_id}}-it{{iteration}}", **TASK_OPTS)(run)
    return deco


# ------------------------------------------------------------------------------------------------ rollout

def _rewind_data_cursor(ctx: RunContext, iteration: int) -> None:
    """Every attempt of a rollout (first, retry, reuse) starts from the data cursor as it was when the
    iteration began, so dynamic sampling draws the same extra prompt batches whichever attempt ran.
    Not an overlapped rollout (no dynamic sampling there): it runs in a thread while the driver
    draws the prompts of later iterations, whose draws a rewind would undo."""
    state = ctx.iteration(iteration)
    if state.behaviour_version is None:
        ctx.sampler.load_state_dict(state.sampler_before_rollout)


def _reuse_rollout(ctx: RunContext, iteration: int) -> None:
    """A stored rollout is reused: move the data cursor past the extra batches its dynamic sampling drew.
    An overlapped one still loads the weights it was given, which the rollouts after it expect."""
    state = ctx.iteration(iteration)
    if state.behaviour_weights is not None:
        roles.load_rollout_weights(ctx, state.behaviour_weights, state.behaviour_version)
        state.behaviour_weights = None
    _rewind_data_cursor(ctx, iteration)
    if ctx.cfg.trainer.partial_rollout:
        restore_segment_metrics(ctx, iteration)
    record = ctx.store.read_iteration_json(iteration, "dynamic_sampling.json")
    if record:
        for _ in range(int(record["extra_draws"])):
            ctx.sampler.next_batch()
        ctx.iteration(iteration).rollout_metrics = sampling_metrics(record)


@stage_task(Stage.ROLLOUT, inputs=rollout_inputs, on_reuse=_reuse_rollout)
def rollout_stage(ctx: RunContext, iteration: int, *, inputs: dict) -> StageRef:
    """Sample ``rollout.n`` responses per prompt of the iteration and store them with the engine's log-probs.

    With ``algorithm.filter_groups.enable`` the batch is refilled until it holds
    ``data.train_batch_size`` groups with reward variance (DAPO dynamic sampling): ``rollout.parquet``
    holds the kept rows, ``dropped.parquet`` the dropped ones and ``dynamic_sampling.json`` the
    counts. For ReMax, one greedy response per prompt is added as the baseline.
    """
    cfg, state = ctx.cfg, ctx.iteration(iteration)
    _rewind_data_cursor(ctx, iteration)
    params = RolloutSettings.of(ctx, iteration).sampling
    if cfg.algorithm.filter_groups.enable:
        table, policy_version = _dynamic_sampling(ctx, iteration)
    elif cfg.rollout.multi_turn.enable or cfg.rollout.agent:
        gen = roles.generate_episodes(ctx, state.prompts, params, iteration)
        table = multi_turn_table(iteration, state.prompts, gen.episodes, gen.response_text, cfg.rollout.n,
                                 gen.policy_version, extra_info_type=ctx.datasets.extra_info_type,
                                 agent=bool(cfg.rollout.agent))
        state.timing["timing_s/gen"] = gen.timing["timing_s/gen"]
        policy_version = gen.policy_version
    elif cfg.trainer.partial_rollout:  # a segment of the pool in flight across updates (trajflow/run/partial.py)
        table, policy_version = run_segment(ctx, iteration, params)
    elif state.behaviour_version is not None:  # overlapped (trainer.max_staleness > 0): beside the update
        if state.behaviour_weights is not None:  # the rollouts ahead of this one are done: its weights now
            state.timing["timing_s/weight_load"] = roles.load_rollout_weights(ctx, state.behaviour_weights,
                                                                              state.behaviour_version)
        prompt_ids, gen = roles.generate_on_rollout_workers(ctx, state.prompts, params, iteration)
        state.behaviour_weights = None  # generated: the snapshot may go (a retry before this reloads it)
        table = rollout_table(iteration, state.prompts, prompt_ids, gen, cfg.rollout.n,
                              extra_info_type=ctx.datasets.extra_info_type)
        state.timing["timing_s/gen"] = gen.timing["timing_s/gen"]
        policy_version = int(gen.policy_version)
        if policy_version != state.behaviour_version:
            # Only a resume whose stored in-flight rollout did not verify gets here: the version that
            # generated it is no longer loaded. Record what generated the rows (the run continues,
            # but no longer as the interrupted one would have).
            print(f"warning: iteration {iteration}'s rollout was to be generated by policy version "
                  f"{state.behaviour_version}, but the rollout workers hold version {policy_version}; "
                  f"it is recorded as generated by {policy_version}", file=sys.stderr, flush=True)
            inputs = dict(inputs, policy_version=str(policy_version))
            state.behaviour_version = policy_version
    else:
        prompt_ids, gen = roles.generate(ctx, state.prompts, params, iteration)
        table = rollout_table(iteration, state.prompts, prompt_ids, gen, cfg.rollout.n,
                              extra_info_type=ctx.datasets.extra_info_type)
        state.timing["timing_s/gen"] = gen.timing["timing_s/gen"]
        state.timing["timing_s/old_log_prob"] = gen.timing.get("timing_s/old_log_prob", 0.0)
        policy_version = gen.policy_version
    if "temperature" not in table.column_names:  # dynamic sampling's batches carry them already
        table = with_sampling_columns(table, params)
    if ctx.needs_greedy_baseline():
        t0 = time.perf_counter()
        greedy = sampling_params(cfg.rollout, iteration_seed(cfg.trainer.seed, iteration, Salt.REMAX_GREEDY), n=1,
                                 temperature=0.0, top_p=1.0, top_k=0)
        table = roles.greedy_baseline(ctx, table, greedy)
        state.timing["timing_s/gen_baseline"] = time.perf_counter() - t0
    return ctx.store.write_stage(iteration, Stage.ROLLOUT.value, table, policy_version, inputs=inputs,
                                 meta={"checkpoint_id": ctx.state.policy_source})


def _dynamic_sampling(ctx: RunContext, iteration: int) -> tuple[pa.Table, int]:
    """Generate and score batches until enough groups have signal (:func:`trajflow.stages.dynamic_sampling.dynamic_sampling`);
    stores the dropped rows and the record; returns the kept rows and their policy version."""
    cfg, state = ctx.cfg, ctx.iteration(iteration)
    fg, target = cfg.algorithm.filter_groups, cfg.data.train_batch_size
    reward_cfg, gen_s = ctx.reward_settings(), [0.0]

    def generate(prompts: list, k: int) -> GenerationBatch:
        seed = iteration_seed(cfg.trainer.seed, iteration, Salt.dynamic(k))
        params = sampling_params(cfg.rollout, seed)
        prompt_ids, gen = roles.generate(ctx, prompts, params, iteration)
        gen_s[0] += gen.timing["timing_s/gen"]
        t = with_sampling_columns(rollout_table(iteration, prompts, prompt_ids, gen, cfg.rollout.n, offset=k * target,
                                                extra_info_type=ctx.datasets.extra_info_type), params)
        rule, extras, _, rm = roles.score(ctx, t)
        final, _ = final_scores(rule, rm, trainable_lengths(t), reward_cfg, cfg.rollout.max_new_tokens)
        return GenerationBatch(t, rule, extras, rm, final)

    t0 = time.perf_counter()
    # 0 = no limit, but never more than one epoch of prompts: data without any signal must not loop forever
    budget = fg.max_num_gen_batches or max(1, ctx.sampler.iterations_per_epoch)
    result = dynamic_sampling(generate, state.prompts, ctx.sampler.next_batch, target_groups=target,
                              max_gen_batches=budget, metric=fg.metric, n=cfg.rollout.n, iteration=iteration)
    state.timing["timing_s/gen"] = time.perf_counter() - t0
    state.prescored = result.prescored
    policy_version = int(result.table.column("policy_version")[0].as_py())
    if result.dropped is not None:
        ctx.store.write_stage(iteration, "dropped", result.dropped, policy_version)
    record = result.record(gen_s[0])
    ctx.store.write_iteration_json(iteration, "dynamic_sampling.json", record)
    state.rollout_metrics = sampling_metrics(record)
    return result.table, policy_version


# ------------------------------------------------------------------------------------------------ reward

def restore_reward_metrics(ctx: RunContext, iteration: int) -> None:
    """Put the metrics stored with a reused reward output (KL for the controller, ...) back in the iteration."""
    stored = (ctx.store.stage_entry(iteration, "reward") or {}).get("meta", {}).get("metrics", {})
    ctx.iteration(iteration).reward_metrics = dict(stored)


@stage_task(Stage.REWARD, inputs=reward_inputs, on_reuse=restore_reward_metrics, timer="timing_s/reward")
def reward_stage(ctx: RunContext, iteration: int, rollout: StageRef, *, inputs: dict) -> StageRef:
    """Score the responses (rules on Ray tasks, plus the reward model when enabled); add reference
    log-probs and KL shaping when configured, and ReMax's baseline score."""
    cfg, state, s = ctx.cfg, ctx.iteration(iteration), RewardSettings.of(ctx)
    table = ctx.store.read_ref(rollout)
    reward_cfg = s.reward
    ref_future = None
    ref_role = ctx.actor if ctx.reference_in_actor() else ctx.reference
    temperature = rollout_temperature(table, s.temperature)  # the rows' own, whatever the config says now
    if ref_role is not None:
        ref_future = ref_role.compute_ref_log_prob.remote(
            table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist(), temperature)
    teacher_future = None
    if ctx.teacher is not None:  # on-policy distillation: the teacher scores every sampled token
        teacher_future = ctx.teacher.compute_ref_log_prob.remote(
            table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist(), temperature)
    sids, cache = table.column("sample_id").to_pylist(), state.prescored
    if sids and all(sid in cache for sid in sids):  # scored by dynamic sampling in this process
        scores = np.array([cache[sid][0] for sid in sids], np.float32)
        extras = [cache[sid][1] for sid in sids]
        rm = None if ctx.reward_model is None else np.array([cache[sid][2] for sid in sids], np.float32)
    else:
        scores, extras, _, rm = roles.score(ctx, table)
    baselines = None
    if "baseline_response_text" in table.column_names:  # ReMax: the greedy response's final score
        b_rule, _, _, b_rm = roles.score(ctx, table, "baseline_response_text")
        baselines, _ = final_scores(b_rule, b_rm, lengths(table.column("baseline_response_ids")), reward_cfg,
                                    s.max_new_tokens)
    ref_lp = wait(ctx, ref_future) if ref_future is not None else None
    teacher_lp = wait(ctx, teacher_future) if teacher_future is not None else None
    out, metrics = reward_table(table, scores, extras, ref_logprobs=ref_lp, reward_cfg=reward_cfg,
                                algorithm_cfg=s.algorithm(), max_new_tokens=s.max_new_tokens,
                                kl_coef=s.kl_coef or 0.0, rm_scores=rm, reward_baselines=baselines,
                                teacher_logprobs=teacher_lp)
    metrics.update(judge_metrics(extras))  # reward/judge_error_frac, reward/judge_score/mean (reward.judge)
    state.reward_metrics = metrics
    state.prescored = {}
    floor = overlong_floor_warning(out.column("score").to_numpy(),
                                   shaping_penalties(trainable_lengths(table), reward_cfg, s.max_new_tokens),
                                   reward_cfg, s.max_new_tokens)
    # the floor's line is the more specific one: the no-signal line only when the floor's is not printed
    warning = floor or no_signal_warning(out.column("score").to_numpy(), table.column("group_id").to_pylist(),
                                         cfg.algorithm.adv_estimator, run_id=ctx.run_id, iteration=iteration,
                                         store=None if cfg.store.root == "runs" else cfg.store.root,
                                         kl_in_reward=s.use_kl_in_reward)
    if warning is not None:
        print(f"warning: iteration {iteration}: {warning}", file=sys.stderr, flush=True)
    return ctx.store.write_stage(iteration, Stage.REWARD.value, out, ctx.policy_version, inputs=inputs,
                                 meta={"metrics": metrics})


# ------------------------------------------------------------------------------------------------ gate

@task(name="gate", task_run_name="gate-{run_id}-it{iteration}", **TASK_OPTS)
def gate_stage(run_id: str, iteration: int, rollout: StageRef, reward: StageRef) -> dict:
    """Validate the reward output (Great Expectations); returns ``{"success", "quarantined_sample_ids", ...}``.

    Raises:
        GateFailed: a ``fail`` expectation failed (the iteration is marked ``gated``).
    """
    ctx = get_context(run_id)
    with stage_guard(ctx, Stage.GATE.value):
        result = run_iteration_gate(ctx, iteration, rollout, reward)
    ctx.iteration(iteration).gate_score_mean = result.get("score_mean")
    return result


# ------------------------------------------------------------------------------------------------ advantage

@stage_task(Stage.ADVANTAGE, inputs=advantage_inputs, timer="timing_s/adv")
def advantage_stage(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef, gate: dict, *,
                    inputs: dict) -> StageRef:
    """Compute advantages and returns and store them.

    Rows quarantined by the gate take no part: the estimator sees only the kept rows (so they cannot
    shift a group's baseline), and their advantages are stored as zeros.

    The estimators run here, in the driver: milliseconds of math over the batch, in the torch the
    driver already holds for the worker classes it creates. A Ray task for them held a second torch
    (~240 MB) in the worker that scores rewards, idle the rest of the iteration.
    """
    fault_point("after_reward", iteration)
    s = AdvantageSettings.of(ctx)
    joined = join_stages([ctx.store.read_ref(rollout), ctx.store.read_ref(reward)])
    dropped = set(gate.get("quarantined_sample_ids") or ())
    keep = np.array([sid not in dropped for sid in joined.column("sample_id").to_pylist()])
    out = None
    if keep.any():
        kept = joined.filter(pa.array(keep))
        values = None
        if ctx.critic is not None:  # V(s_t) of the critic before this iteration's update
            t0 = time.perf_counter()
            values = wait(ctx, ctx.critic.compute_values.remote(kept.column("prompt_ids").to_pylist(),
                                                               kept.column("response_ids").to_pylist()))
            ctx.iteration(iteration).timing["timing_s/values"] = time.perf_counter() - t0
        baselines = None
        if "reward_baseline" in kept.column_names:  # ReMax: the greedy response's score
            baselines = kept.column("reward_baseline").to_numpy(zero_copy_only=False)
        out = advantage_table(kept, dict(s.algorithm), values, baselines)
    out = fill_dropped_rows(joined, out)
    if s.trainer_version is not None:  # off-policy rows: how far behind the trainer each one is
        versions = dict(zip(joined.column("sample_id").to_pylist(), joined.column("policy_version").to_pylist()))
        stale = row_staleness([versions[sid] for sid in out.column("sample_id").to_pylist()], s.trainer_version)
        check_staleness(stale, ctx.cfg.trainer.max_staleness, iteration)  # at use, whatever the submission assumed
        out = out.append_column("staleness", pa.array(stale, pa.int64()))
    return ctx.store.write_stage(iteration, Stage.ADVANTAGE.value, out, ctx.policy_version, inputs=inputs)


# ------------------------------------------------------------------------------------------------ update

@stage_task(Stage.UPDATE)
def update_stage(ctx: RunContext, iteration: int, rollout: StageRef, reward: StageRef, advantage: StageRef,
                 gate: dict) -> dict:
    """The critic update (first, as verl, when there is a critic) and the policy update; stores
    ``update.json`` and returns its metrics."""
    cfg, state = ctx.cfg, ctx.iteration(iteration)
    stored = join_stages([ctx.store.read_ref(r) for r in (rollout, reward, advantage)])
    joined = with_loss_mask(stored, gate)
    metrics: dict = {}
    if ctx.critic is not None and "values" in joined.column_names:  # no values: every row was quarantined
        if state.critic_update is None:  # a retry after the actor failed must not update the critic twice
            state.critic_update = wait(ctx, ctx.critic.update_critic.remote(critic_batch(joined, iteration, cfg)))
        metrics.update(state.critic_update)
    batch = update_batch(joined, iteration, **update_batch_options(cfg))
    pending = ctx.actor.update_actor.remote(batch)
    fault_point("update", iteration)
    metrics.update(wait(ctx, pending))
    ctx.policy_version = int(metrics["policy_version"])
    if metrics.get("actor/nonfinite_steps_in_a_row", 0) >= cfg.trainer.max_nonfinite_steps:
        ctx.store.write_iteration_json(iteration, "update.json", metrics)
        raise NonFiniteError(
            f"iteration {iteration}: {int(metrics['actor/nonfinite_steps_in_a_row'])} optimizer steps in a row had a "
            f"non-finite gradient norm and were skipped (trainer.max_nonfinite_steps={cfg.trainer.max_nonfinite_steps}); "
            f"the weights are unchanged since the last finite step. Lower actor.lr, check the rewards and advantages "
            f"of {ctx.store.iteration_dir(iteration)}, or resume from the last checkpoint")
    metrics.update(batch_metrics(stored))  # data metrics over every row, quarantined ones too
    if "staleness" in stored.column_names:  # trainer.max_staleness > 0
        metrics.update(staleness_metrics(stored.column("staleness").to_numpy()))
    if TOKEN_VERSIONS in stored.column_names:  # trainer.partial_rollout: staleness per token and per row
        # the trainer's version at this update, as the advantage stage counted it (staleness + policy_version)
        trainer_version = int(stored.column("staleness")[0].as_py()) + int(stored.column("policy_version")[0].as_py())
        metrics.update(provenance_metrics(stored.column(TOKEN_VERSIONS).to_pylist(), trainer_version))
    if cfg.algorithm.mask_truncated_samples:
        metrics["batch/masked_truncated"] = float(sum(f == "length" for f in joined.column("finish_reason").to_pylist()))
    metrics.update(state.rollout_metrics)
    metrics.update(state.reward_metrics)
    metrics.update(timing_per_token_metrics({**state.timing, **metrics}, stored))
    # verl's step counters: the iteration, and the pass over the prompts its batch was drawn from (0-based)
    metrics["training/global_step"] = float(iteration)
    cursor = state.sampler_before_rollout or ctx.sampler.state_dict()  # taken after the batch was drawn
    metrics["training/epoch"] = float(cursor["epoch"])
    ctx.store.write_iteration_json(iteration, "update.json", metrics)
    return metrics


# ------------------------------------------------------------------------------------------------ validate

@task(name="validate", task_run_name="validate-{run_id}-step{step}", **TASK_OPTS)
def validate_stage(run_id: str, step: int) -> dict:
    """Score the current policy on the held-out prompts (:func:`trajflow.run.validation.run_validation`);
    stored in ``run.json`` as ``validation_<step>``."""
    ctx = get_context(run_id)
    with stage_guard(ctx, Stage.VALIDATE.value):
        ensure_workers(ctx, through=step)
        metrics = run_validation(ctx, step)
    if metrics:
        ctx.store.update_run_meta(**{f"validation_{step:06d}": metrics})
    return metrics


def stages_for(cfg: DictConfig) -> SimpleNamespace:
    """The stage tasks with a run's retry and timeout settings.

    Args:
        cfg: the run config (``trainer.stage_retries``, ``stage_retry_delay_s``, ``stage_timeout_s``,
            ``stage_timeouts``).

    Returns:
        A namespace with ``rollout``, ``reward``, ``gate``, ``advantage``, ``update`` and ``validate`` tasks,
        each a :class:`~trajflow.flows.graph.LinkedTask` (called like the task; the Prefect graph's edges
        are the stages it really waits for). Call it once per flow run.
    """
    t = cfg.trainer

    def configured(fn, stage: Stage):
        return fn.with_options(retries=int(t.stage_retries), retry_delay_seconds=float(t.stage_retry_delay_s),
                               timeout_seconds=stage_timeout(cfg, stage.value))

    from trajflow.flows.graph import LinkedTask, StageGraph

    graph = StageGraph()  # one per flow run: the Prefect graph's edges (flows/graph.py)
    stages = {"rollout": (rollout_stage, Stage.ROLLOUT), "reward": (reward_stage, Stage.REWARD),
              "gate": (gate_stage, Stage.GATE), "advantage": (advantage_stage, Stage.ADVANTAGE),
              "update": (update_stage, Stage.UPDATE), "validate": (validate_stage, Stage.VALIDATE)}
    return SimpleNamespace(**{name: LinkedTask(configured(fn, st), name, graph) for name, (fn, st) in stages.items()})
