"""Validation: the live policy scored on the held-out prompts (shared by the train and evaluate flows)."""

from __future__ import annotations

import json
import time

from trajflow.stages.reward import score_rows
from trajflow.stages.rollout import sampling_params
from trajflow.stages.seeds import Salt, iteration_seed
from trajflow.metrics import validation_metrics
from trajflow.run.context import RunContext
from trajflow.run.recovery import wait


def run_validation(ctx: RunContext, step: int) -> dict[str, float]:
    """Score the policy worker's current policy on the held-out prompts.

    Samples ``rollout.val_n`` responses per prompt (the first ``data.val_max_prompts``, 0 = all) at
    ``rollout.val_temperature`` with a seed derived from ``step``, and scores them with the reward
    scorers (multi-turn: with the episodes' ``env_reward`` for the ``env`` scorer).

    Args:
        ctx: a context with ``cfg``, ``actor`` (a live policy worker) and ``datasets``.
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
    params = sampling_params(cfg.rollout, iteration_seed(cfg.trainer.seed, step, Salt.VALIDATION), n=n,
                             temperature=cfg.rollout.val_temperature, top_p=1.0, top_k=0)
    episodes = cfg.rollout.multi_turn.enable or bool(cfg.rollout.agent)
    if episodes:  # the held-out prompts as episodes, tools (or the agent) and all
        from trajflow.run.roles import generate_episodes

        gen = generate_episodes(ctx, prompts, params)
    else:
        prompt_ids = wait(ctx, ctx.actor.tokenize_prompts.remote([p.messages for p in prompts], cfg.data.max_prompt_length))
        gen = wait(ctx, ctx.actor.generate_sequences.remote(prompt_ids, params, False))
    rows = [p for p in prompts for _ in range(n)]
    env = [e.env_reward for e in gen.episodes] if episodes else None
    # An agent's returned answer is what its episode is scored on.
    texts = [e.agent_answer if e.agent_answer is not None else t for e, t in zip(gen.episodes, gen.response_text)] \
        if episodes else gen.response_text
    result = score_rows([p.data_source for p in rows], texts, [str(p.ground_truth) for p in rows],
                        [json.dumps(p.extra_info, default=str) for p in rows], ctx.reward_settings(),
                        env_rewards=env, row_prompt_ids=[str(p.prompt_id) for p in rows])
    metrics = validation_metrics([p.data_source for p in rows], result.scores, result.extras, gen.response_ids, n)
    metrics["timing_s/testing"] = time.perf_counter() - t0
    _log_generations(ctx, step, rows, gen.response_text, result.scores)
    return metrics


def _log_generations(ctx: RunContext, step: int, rows: list, responses: list[str], scores) -> None:
    """The first ``trainer.log_val_generations`` validation generations, with their prompts, as the
    MLflow table ``validation/iteration_NNNNNN.json`` (verl logs the same to its trackers)."""
    from trajflow.tracking import prompt_text

    k = min(int(ctx.cfg.trainer.log_val_generations), len(rows))
    if not k or ctx.tracker is None:
        return
    ctx.tracker.log_table({"prompt_id": [p.prompt_id for p in rows[:k]],
                           "data_source": [p.data_source for p in rows[:k]],
                           "prompt": [prompt_text(p.messages) for p in rows[:k]],
                           "response_text": list(responses[:k]),
                           "ground_truth": [str(p.ground_truth) for p in rows[:k]],
                           "score": [float(x) for x in list(scores)[:k]]},
                          f"validation/iteration_{step:06d}.json")
