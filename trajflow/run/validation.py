"""Validation: the live policy scored on the held-out prompts (shared by the train and evaluate flows)."""

from __future__ import annotations

import json
import sys
import time
from typing import Callable

from trajflow.stages.reward import score_rows
from trajflow.stages.rollout import sampling_params
from trajflow.stages.seeds import Salt, iteration_seed
from trajflow.metrics import validation_metrics
from trajflow.run.context import RunContext
from trajflow.run.recovery import wait


def run_validation(ctx: RunContext, step: int) -> dict[str, float]:
    """Score the policy worker's current policy on the held-out prompts.

    Samples ``rollout.val_n`` responses per prompt (the first ``data.val_max_prompts``, 0 = all) at
    ``rollout.val_temperature`` and scores them with the reward scorers (multi-turn: with the
    episodes' ``env_reward`` for the ``env`` scorer). The prompts are generated ``data.val_batch_size``
    at a time (:func:`generate_in_chunks`), and the console's live line (``trainer.progress``) counts
    them, so a long validation is never silent.

    Args:
        ctx: a context with ``cfg``, ``actor`` (a live policy worker) and ``datasets``.
        step: the iteration the policy comes from (0 = before training); seeds the sampling.

    Returns:
        ``val-core/<data_source>/acc/mean_at_<n>`` (accuracy in [0, 1]), ``val-aux/<data_source>/reward/mean_at_<n>``,
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
    episodes = cfg.rollout.multi_turn.enable or bool(cfg.rollout.agent)

    def generate(part: list, seed: int) -> tuple[list, list, list | None]:
        params = sampling_params(cfg.rollout, seed, n=n, temperature=cfg.rollout.val_temperature, top_p=1.0, top_k=0)
        if episodes:  # the held-out prompts as episodes, tools (or the agent) and all
            from trajflow.run.roles import generate_episodes

            gen = generate_episodes(ctx, part, params)
            return gen.response_ids, gen.response_text, list(gen.episodes)
        prompt_ids = wait(ctx, ctx.actor.tokenize_prompts.remote([p.messages for p in part], cfg.data.max_prompt_length))
        gen = wait(ctx, ctx.actor.generate_sequences.remote(prompt_ids, params, False))
        return gen.response_ids, gen.response_text, None

    with ValidationProgress(step, len(prompts), bool(cfg.trainer.progress)) as bar:
        response_ids, response_text, eps = generate_in_chunks(
            prompts, int(cfg.data.get("val_batch_size") or 0), cfg.trainer.seed, step, generate, bar.update)
    rows = [p for p in prompts for _ in range(n)]
    env = [e.env_reward for e in eps] if episodes else None
    # An agent's returned answer is what its episode is scored on.
    texts = [e.agent_answer if e.agent_answer is not None else t for e, t in zip(eps, response_text)] \
        if episodes else response_text
    result = score_rows([p.data_source for p in rows], texts, [str(p.ground_truth) for p in rows],
                        [json.dumps(p.extra_info, default=str) for p in rows], ctx.reward_settings(),
                        env_rewards=env, row_prompt_ids=[str(p.prompt_id) for p in rows])
    metrics = validation_metrics([p.data_source for p in rows], result.scores, result.extras, response_ids, n)
    metrics["timing_s/testing"] = time.perf_counter() - t0
    _log_generations(ctx, step, rows, response_text, result.scores)
    return metrics


def generate_in_chunks(prompts: list, chunk: int, seed: int, step: int,
                       generate: Callable[[list, int], tuple[list, list, list | None]],
                       advance: Callable[[int], None]) -> tuple[list, list, list | None]:
    """Generate the held-out ``prompts`` ``chunk`` at a time (0 = all at once), in order.

    Chunk ``c`` is sampled with seed ``iteration_seed(seed, step, Salt.validation_chunk(c))``; chunk 0's
    is the one a single call had (``Salt.VALIDATION``), so a validation of at most ``chunk`` prompts
    samples exactly what it did before chunking existed.

    Args:
        prompts: the held-out prompts.
        chunk: prompts per call (``data.val_batch_size``).
        seed: ``trainer.seed``.
        step: the validation step.
        generate: ``(prompts, seed) -> (response_ids, response_text, episodes or None)``, rows prompt-major.
        advance: called with the number of prompts done after each chunk (the live line).

    Returns:
        The chunks' ``response_ids``, ``response_text`` and episodes (None without), concatenated.
    """
    size = chunk if chunk > 0 else len(prompts)
    ids: list = []
    texts: list = []
    episodes: list | None = None
    for c, start in enumerate(range(0, len(prompts), size)):
        part = prompts[start:start + size]
        r_ids, r_text, eps = generate(part, iteration_seed(seed, step, Salt.validation_chunk(c)))
        ids += list(r_ids)
        texts += list(r_text)
        if eps is not None:
            episodes = (episodes or []) + list(eps)
        advance(len(part))
    return ids, texts, episodes


class ValidationProgress:
    """The console's live line while validation generates (tqdm on stderr, as the train line; below it
    while a run trains, cleared when done): ``validate step N: k/M prompts``.

    Args:
        step: the validation step.
        total: held-out prompts.
        enabled: ``trainer.progress``.
    """

    def __init__(self, step: int, total: int, enabled: bool) -> None:
        self.step, self.total, self.enabled = step, total, enabled
        self.bar = None

    def __enter__(self) -> "ValidationProgress":
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.total, desc=f"validate step {self.step}", unit="prompt", disable=not self.enabled,
                        dynamic_ncols=True, file=sys.stderr, leave=False, mininterval=0)  # few, slow updates
        return self

    def update(self, done: int) -> None:
        self.bar.update(done)

    def __exit__(self, *exc) -> None:
        self.bar.close()


def _log_generations(ctx: RunContext, step: int, rows: list, responses: list[str], scores) -> None:
    """The first ``trainer.log_val_generations`` validation generations, with their prompts, as the
    MLflow table ``validation/iteration_NNNNNN.json`` and, with ``trainer.logger``'s tensorboard /
    wandb, as their ``val/generations`` (verl logs the same to its trackers)."""
    from trajflow.tracking import prompt_text

    k = min(int(ctx.cfg.trainer.log_val_generations), len(rows))
    if not k or ctx.tracker is None:
        return
    table = {"prompt_id": [p.prompt_id for p in rows[:k]],
             "data_source": [p.data_source for p in rows[:k]],
             "prompt": [prompt_text(p.messages) for p in rows[:k]],
             "response_text": list(responses[:k]),
             "ground_truth": [str(p.ground_truth) for p in rows[:k]],
             "score": [float(x) for x in list(scores)[:k]]}
    ctx.tracker.log_table(table, f"validation/iteration_{step:06d}.json")
    ctx.tracker.mirror_generations(table, step)  # trainer.logger's tensorboard / wandb: val/generations
