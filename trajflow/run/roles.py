"""The driver's calls into the role workers that the stage tasks share: tokenize and generate on the
policy (or rollout) workers, move the policy's weights to the rollout workers (``trainer.max_staleness`` > 0),
and score responses on Ray tasks (rules) plus the reward-model worker.

Every wait is bounded by the running stage's deadline (:func:`trajflow.run.recovery.wait`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from trajflow.stages.reward import check_env_rewards, rollout_env_rewards, score_rows
from trajflow.stages.rollout import Generation, SamplingParams, baseline_columns
from trajflow.batch import decode_nested
from trajflow.faults import fault_point
from trajflow.run.context import RunContext
from trajflow.run.recovery import wait


def generate(ctx: RunContext, prompts: list, params: SamplingParams, iteration: int | None = None) -> tuple[list, Generation]:
    """Tokenize the prompts' messages and sample ``params.n`` responses per prompt with the engine's log-probs.

    Returns:
        ``(prompt_ids, generation)``: token ids per prompt, and the policy worker's generation result.
    """
    cfg = ctx.cfg
    prompt_ids = wait(ctx, ctx.actor.tokenize_prompts.remote([p.messages for p in prompts], cfg.data.max_prompt_length))
    pending = ctx.actor.generate_sequences.remote(prompt_ids, params)
    fault_point("rollout", iteration)
    return prompt_ids, wait(ctx, pending)


def generate_on_rollout_workers(ctx: RunContext, prompts: list, params: SamplingParams,
                                iteration: int | None = None) -> tuple[list, Generation]:
    """:func:`generate`, on the separate rollout workers directly (``trainer.max_staleness`` > 0): the
    policy workers are updating meanwhile, and a call to them would wait for the update.

    The log-probs are the engines' own (the behaviour policy's, under ``rollout.temperature``) and
    ``policy_version`` the version of the weights the engines hold.

    Raises:
        RuntimeError: the engines returned no log-probs for sampled responses.
    """
    cfg = ctx.cfg
    prompt_ids = wait(ctx, ctx.rollout.tokenize_prompts.remote([p.messages for p in prompts],
                                                               cfg.data.max_prompt_length))
    pending = ctx.rollout.generate.remote(prompt_ids, params)
    fault_point("rollout", iteration)
    gen = wait(ctx, pending)
    if not params.greedy and gen.rollout_logprobs is None:
        raise RuntimeError(f"rollout.engine={cfg.rollout.engine!r} returned no log-probs: trainer.max_staleness > 0 "
                           f"needs the behaviour policy's log-probs from the engine")
    return prompt_ids, gen


def sync_rollout_weights(ctx: RunContext, iteration: int) -> int:
    """Push the policy's current weights to the rollout workers (``trainer.max_staleness`` > 0; no
    rollout may be in flight on them); the copy's seconds go to ``iteration``'s
    ``timing_s/weight_sync`` when it is live. Returns the version pushed."""
    out = ray.get(ctx.actor.push_weights.remote())
    if iteration in ctx.iterations:
        ctx.iterations[iteration].timing["timing_s/weight_sync"] = float(out["timing_s/weight_sync"])
    return int(out["policy_version"])


def snapshot_rollout_weights(ctx: RunContext, iteration: int) -> tuple[int, Any]:
    """Copy the policy's current weights into the Ray object store for a rollout submitted now but
    started later, once the rollouts ahead of it on the rollout workers are done
    (``trainer.max_staleness`` > 0; :func:`trajflow.run.roles.load_rollout_weights` loads it). The copy's seconds (what
    the trainer waits) go to ``iteration``'s ``timing_s/weight_sync``.

    Returns:
        ``(policy_version, ref)``: the version copied and the ``ObjectRef`` of its weights (None when
        no rank returned any).
    """
    out = ray.get(ctx.actor.snapshot_weights.remote())
    if iteration in ctx.iterations:
        ctx.iterations[iteration].timing["timing_s/weight_sync"] = float(out["timing_s/weight_sync"])
    refs = out["weights"]
    return int(out["policy_version"]), (refs[0] if refs else None)



def load_rollout_weights(ctx: RunContext, weights, version: int, iteration: int | None = None) -> float:
    """Load a weight snapshot (:func:`snapshot_rollout_weights`) into every
    rollout worker, tagged with its policy ``version``; no other rollout may be in flight on them.
    ``iteration``: the rollout's, for the ``weight_sync`` fault point (crash tests).

    Returns:
        The seconds it took.
    """
    t0 = time.perf_counter()
    pending = ctx.rollout.update_weights.remote(weights, int(version))
    fault_point("weight_sync", iteration)
    wait(ctx, pending)
    return time.perf_counter() - t0


def generate_episodes(ctx: RunContext, prompts: list, params: SamplingParams, iteration: int | None = None):
    """Run ``params.n`` multi-turn episodes per prompt on the policy (or rollout) workers: the
    environment's (``rollout.multi_turn``), or ``rollout.agent``'s through the served endpoint.

    Returns:
        :class:`trajflow.stages.multi_turn.EpisodeGeneration`, ``len(prompts) * n`` episodes, prompt-major.
    """
    rows = [{"messages": p.messages, "ground_truth": str(p.ground_truth), "data_source": p.data_source,
             "extra_info": p.extra_info, "prompt_id": str(p.prompt_id)} for p in prompts for _ in range(params.n)]
    run = ctx.actor.generate_agent_episodes if ctx.cfg.rollout.agent else ctx.actor.generate_episodes
    pending = run.remote(rows, params, int(ctx.cfg.data.max_prompt_length))
    fault_point("rollout", iteration)
    return wait(ctx, pending)


def score(ctx: RunContext, table: pa.Table, text_column: str = "response_text"
          ) -> tuple[np.ndarray, list, int, np.ndarray | None]:
    """Score a rollout table's responses: rule scorers on ``reward.num_workers`` Ray tasks and, in
    parallel, the reward model and the LLM judge (``reward.judge``, :mod:`trajflow.stages.judge`) when
    enabled; the judge's score is combined with the rules' (``rule_weight * rule + weight * judge``).

    Args:
        ctx: the run.
        table: rollout rows (``data_source``, ``ground_truth``, ``extra_info``, ``prompt`` and ``text_column``).
        text_column: the column holding the responses (``baseline_response_text`` for ReMax's baseline).

    Returns:
        ``(rule_scores (rows,) float32, extras, num_errors, rm_scores (rows,) float32 or None)``; with
        the judge, ``rule_scores`` are the combined scores and the extras carry ``judge_score``/``judge_error``.

    Raises:
        DataError: a row scored by the ``env`` scorer has no ``env_reward`` (checked here, before any
            task starts, so the error stays one line).
    """
    cols = [table.column(c).to_pylist() for c in ("data_source", text_column, "ground_truth", "extra_info")]
    if text_column == "response_text" and "agent_answer" in table.column_names:
        # An agent's returned answer is what its episode is scored on.
        cols[1] = [a if a is not None else t for a, t in zip(table.column("agent_answer").to_pylist(), cols[1])]
    rows = len(cols[1])
    reward_cfg = ctx.reward_settings()
    # The environment rewarded the episode's own response, not ReMax's greedy one.
    env = rollout_env_rewards(table) if text_column == "response_text" else None
    pids = [str(p) for p in table.column("prompt_id").to_pylist()]
    check_env_rewards(cols[0], env, pids, reward_cfg)
    judge = dict(reward_cfg.get("judge") or {})
    rules = not (judge.get("enable") and float(judge.get("rule_weight", 0.0)) == 0.0)  # the judge alone: no rules
    k = max(1, min(ctx.cfg.reward.num_workers, rows))
    bounds = np.linspace(0, rows, k + 1).astype(int)
    remote_score = ray.remote(num_cpus=0)(score_rows)
    futures = [remote_score.remote(*[c[a:b] for c in cols], reward_cfg, None if env is None else env[a:b], pids[a:b])
               for a, b in zip(bounds[:-1], bounds[1:])] if rules else []
    rm_future = None
    messages = [decode_nested(p) for p in table.column("prompt").to_pylist()] \
        if ctx.reward_model is not None or judge.get("enable") else None
    if ctx.reward_model is not None:
        rm_future = ctx.reward_model.compute_rm_score.remote(messages, cols[1])
    verdicts = None
    if judge.get("enable"):  # HTTP calls from the driver, while the Ray tasks score the rules
        from trajflow.stages.judge import judge_scores

        verdicts = judge_scores(judge, messages, cols[1], cols[2], client=served_judge_client(ctx, judge))
    results = wait(ctx, futures)
    rule = np.concatenate([r.scores for r in results]).astype(np.float32) if results else np.zeros(rows, np.float32)
    extras = [e for r in results for e in r.extras] if results else [{} for _ in range(rows)]
    errors = int(sum(r.num_errors for r in results))
    if verdicts is not None:
        from trajflow.stages.judge import combine

        rule, extras = combine(rule, extras, verdicts, judge)
        errors += sum(e is not None for e in verdicts.errors)
    rm = np.asarray(wait(ctx, rm_future), dtype=np.float32) if rm_future is not None else None
    return rule, extras, errors, rm


def served_judge_client(ctx: RunContext, judge: dict) -> Any:
    """The ``openai`` client for the judge model trajflow serves (``reward.judge.model_path``), its
    worker started first if it is not running (a recreated context, a replay); None for a
    ``base_url`` judge (:func:`trajflow.stages.judge.judge_scores` makes that client)."""
    if not judge.get("model_path"):
        return None
    from trajflow.run.workers import create_judge_worker, finish_judge_worker
    from trajflow.stages.judge import judge_client

    if ctx.judge is None:
        create_judge_worker(ctx)
    elif ctx.judge_endpoint[0] is None:
        finish_judge_worker(ctx)
    url, token = ctx.judge_endpoint
    return judge_client(judge, url, token)


def greedy_baseline(ctx: RunContext, table: pa.Table, params: SamplingParams) -> pa.Table:
    """ReMax's baseline: one greedy response per prompt, added to every row of its group as
    ``baseline_response_ids`` / ``baseline_response_text``."""
    gids = table.column("group_id").to_pylist()
    first = {g: i for i, g in reversed(list(enumerate(gids)))}
    order = list(dict.fromkeys(gids))
    prompt_ids = table.column("prompt_ids").to_pylist()
    greedy = wait(ctx, ctx.actor.generate_sequences.remote([prompt_ids[first[g]] for g in order], params))
    index = {g: k for k, g in enumerate(order)}
    for name, col in baseline_columns([index[g] for g in gids], greedy).items():
        table = table.append_column(name, col)
    return table
