"""Batch-level stage functions: Arrow table in, Arrow table out.

Each wraps the tensor math of ``stages/`` for one stage and produces exactly the columns that stage
owns (design.md's schema), keyed by ``sample_id``. They import neither Ray nor Prefect: the flow's
tasks run them on Ray workers and persist what they return.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import torch

from stages.policy_update import actor_loss_mask, critic_batch, update_batch, update_batch_options, with_loss_mask  # noqa: F401
from trajflow.batch import json_column, lengths, list_column, pad_ragged, to_ragged


def sample_ids(iteration: int, num_prompts: int, n: int, offset: int = 0) -> tuple[list[str], list[str]]:
    """``sample_id`` and ``group_id`` per row, prompt-major: ``it000003-p0005-s2`` / ``it000003-p0005``.

    ``offset`` numbers the prompts from ``offset`` on (the later generation batches of dynamic
    sampling continue the numbering, so ids stay unique within an iteration).
    """
    groups = [f"it{iteration:06d}-p{j:04d}" for j in range(offset, offset + num_prompts) for _ in range(n)]
    samples = [f"{g}-s{k}" for g, k in zip(groups, [k for _ in range(num_prompts) for k in range(n)])]
    return samples, groups


def rollout_table(iteration: int, prompts: Sequence[Any], prompt_ids: Sequence[Sequence[int]], gen: dict,
                  n: int, offset: int = 0) -> pa.Table:
    """The rollout stage's output.

    Args:
        iteration: iteration number.
        prompts: ``PromptRecord`` per prompt (``prompt_id``, ``data_source``, ``messages``,
            ``ground_truth``, ``extra_info``).
        prompt_ids: token ids per prompt.
        gen: the policy worker's ``generate_sequences`` result (``n`` rows per prompt, prompt-major).
        n: samples per prompt.
        offset: number of the first prompt (see :func:`sample_ids`).
    """
    sids, gids = sample_ids(iteration, len(prompts), n, offset)
    rep = [p for p in prompts for _ in range(n)]
    rep_ids = [ids for ids in prompt_ids for _ in range(n)]
    cols = {
        "sample_id": pa.array(sids, pa.string()),
        "prompt_id": pa.array([str(p.prompt_id) for p in rep], pa.string()),
        "group_id": pa.array(gids, pa.string()),
        "iteration": pa.array([iteration] * len(sids), pa.int64()),
        "policy_version": pa.array([int(gen.policy_version)] * len(sids), pa.int64()),
        "prompt": json_column([p.messages for p in rep]),
        "prompt_ids": list_column(rep_ids, pa.int32()),
        "response_ids": list_column(gen.response_ids, pa.int32()),
        "response_text": pa.array(gen.response_text, pa.string()),
        "old_logprobs": list_column(gen.old_logprobs or [[] for _ in sids], pa.float32()),
        "finish_reason": pa.array(gen.finish_reason, pa.string()),
        "ground_truth": pa.array([str(p.ground_truth) for p in rep], pa.string()),
        "data_source": pa.array([p.data_source for p in rep], pa.string()),
        "extra_info": json_column([p.extra_info for p in rep]),
    }
    return pa.table(cols)


def baseline_columns(prompt_rows: Sequence[int], greedy: dict) -> dict[str, pa.Array]:
    """ReMax's greedy baseline responses as rollout columns (one greedy response per prompt, repeated on
    every row of the prompt's group).

    Args:
        prompt_rows: for each row, the index of its prompt in ``greedy``'s order.
        greedy: ``generate_sequences`` output with one greedy response per prompt.
    """
    ids = [greedy.response_ids[k] for k in prompt_rows]
    return {"baseline_response_ids": list_column(ids, pa.int32()),
            "baseline_response_text": pa.array([greedy.response_text[k] for k in prompt_rows], pa.string())}


def final_scores(rule_scores: np.ndarray, rm_scores: np.ndarray | None, response_lengths: np.ndarray,
                 reward_cfg: dict, max_new_tokens: int) -> tuple[np.ndarray, dict[str, float]]:
    """The sequence score that training uses: rule/RM combination plus DAPO's overlong penalty.

    ``score = rule_weight * rule + rm_weight * rm`` when ``reward.reward_model.enable`` (else
    ``score = rule``), then ``+ overlong_penalty(len)`` when ``reward.overlong_buffer.enable`` (Yu et
    al. 2025, eq. 13).

    Args:
        rule_scores: ``(rows,)`` float, the scorers' scores.
        rm_scores: ``(rows,)`` float reward-model scores, or ``None`` without a reward model.
        response_lengths: ``(rows,)`` int response lengths in tokens.
        reward_cfg: the ``reward`` config section as a dict.
        max_new_tokens: ``rollout.max_new_tokens``.

    Returns:
        ``(scores (rows,) float32, metrics)`` with ``reward/overlong_penalty/mean`` when shaping is on
        and ``reward/rule_score/mean``, ``reward/rm_score/mean`` with a reward model.

    Raises:
        ValueError: a reward model is enabled but ``rm_scores`` is missing or of the wrong length.
    """
    from stages.reward import overlong_penalty

    rule = np.asarray(rule_scores, dtype=np.float64)
    metrics: dict[str, float] = {}
    rm_cfg = reward_cfg.get("reward_model") or {}
    if rm_cfg.get("enable"):
        if rm_scores is None or len(rm_scores) != len(rule):
            raise ValueError("reward.reward_model.enable is set but reward-model scores are missing for "
                             f"{len(rule)} rows")
        rm = np.asarray(rm_scores, dtype=np.float64)
        score = float(rm_cfg.get("rule_weight", 1.0)) * rule + float(rm_cfg.get("rm_weight", 1.0)) * rm
        if len(rule):
            metrics["reward/rule_score/mean"] = float(rule.mean())
            metrics["reward/rm_score/mean"] = float(rm.mean())
    else:
        score = rule
    ob = reward_cfg.get("overlong_buffer") or {}
    if ob.get("enable"):
        pen = overlong_penalty(np.asarray(response_lengths), max_new_tokens, ob["len"], ob["penalty_factor"])
        score = score + pen
        metrics["reward/overlong_penalty/mean"] = float(np.mean(pen)) if len(pen) else 0.0
    return score.astype(np.float32), metrics


def filter_metric(scores: np.ndarray, extras: Sequence[Any], metric: str) -> np.ndarray:
    """Per-row value that dynamic sampling filters on (``algorithm.filter_groups.metric``).

    ``score``: the final score. ``acc``: the scorer's ``acc`` extra where it reports one, else the
    final score of that row.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if metric == "score":
        return scores
    if metric != "acc":
        raise ValueError(f"algorithm.filter_groups.metric must be 'acc' or 'score', got {metric!r}")
    out = scores.copy()
    for i, e in enumerate(extras):
        if isinstance(e, dict) and isinstance(e.get("acc"), (int, float)) and not isinstance(e.get("acc"), bool):
            out[i] = float(e["acc"])
    return out


def score_rows(data_sources: list[str], solutions: list[str], ground_truths: list[str],
               extra_infos: list[str | None], reward_cfg: dict) -> Any:
    """Score responses with the configured scorers (runs on a Ray worker); returns ``RewardResult``."""
    from stages.reward import compute_scores, load_custom_function

    custom = load_custom_function(reward_cfg["custom_function"]) if reward_cfg.get("custom_function") else None
    infos = [json.loads(x) if x else None for x in extra_infos]
    return compute_scores(data_sources, solutions, ground_truths, infos, custom_function=custom,
                          default_scorer=reward_cfg.get("default_scorer"),
                          scorer_kwargs={"format_bonus": reward_cfg.get("format_bonus", 0.1)})


def reward_table(rollout: pa.Table, scores: np.ndarray, extras: list[dict], *,
                 ref_logprobs: list[np.ndarray] | None, reward_cfg: dict, algorithm_cfg: dict,
                 max_new_tokens: int, kl_coef: float, rm_scores: np.ndarray | None = None,
                 reward_baselines: np.ndarray | None = None) -> tuple[pa.Table, dict]:
    """The reward stage's output: scores, token-level rewards and (with a reference) ref log-probs.

    The sequence score (:func:`final_scores`: rule scores, combined with the reward model's when
    one is enabled, plus DAPO's soft overlong punishment, Yu et al. 2025, eq. 13) sits on the last
    response token (outcome reward). With ``algorithm.use_kl_in_reward`` the per-token penalty
    ``kl_coef * KL`` is subtracted (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022, eq. 2).

    Args:
        rollout: the rollout table.
        scores: ``(rows,)`` rule-based scores from :func:`score_rows`.
        extras: per-row scorer extras.
        ref_logprobs: reference log-probs per row (ragged), or ``None``.
        reward_cfg, algorithm_cfg: config sections as dicts.
        max_new_tokens: ``rollout.max_new_tokens``.
        kl_coef: the KL controller's current coefficient.
        rm_scores: ``(rows,)`` reward-model scores (with ``reward.reward_model.enable``).
        reward_baselines: ``(rows,)`` ReMax baseline score (the greedy response's final score) per row.

    Returns:
        The table (``score``, ``rule_score``/``rm_score`` with a reward model, ``reward_baseline``
        for ReMax, ``token_rewards``, ...) and metrics (``critic/kl``, ``reward/*``).
    """
    from stages.kl import apply_kl_penalty_to_rewards

    resp_len = lengths(rollout.column("response_ids"))
    rule = np.asarray(scores, dtype=np.float32).copy()
    scores, metrics = final_scores(rule, rm_scores, resp_len, reward_cfg, max_new_tokens)
    B, T = len(scores), max(int(resp_len.max()) if len(resp_len) else 1, 1)
    token_scores = torch.zeros((B, T), dtype=torch.float32)
    last = torch.from_numpy(np.maximum(resp_len - 1, 0))
    token_scores[torch.arange(B), last] = torch.from_numpy(scores)
    mask = torch.arange(T)[None, :] < torch.from_numpy(resp_len)[:, None]
    token_scores = token_scores * mask
    token_rewards = token_scores
    if algorithm_cfg.get("use_kl_in_reward"):
        if ref_logprobs is None:
            raise ValueError("algorithm.use_kl_in_reward needs reference log-probs")
        old = pad_ragged(rollout.column("old_logprobs"), 0.0, torch.float32, length=T)
        ref = pad_ragged(pa.array([list(map(float, r)) for r in ref_logprobs], pa.list_(pa.float32())), 0.0,
                         torch.float32, length=T)
        token_rewards, mean_kl = apply_kl_penalty_to_rewards(token_scores, old, ref, mask, kl_coef,
                                                             algorithm_cfg["kl_penalty"])
        metrics["critic/kl"] = float(mean_kl)
        metrics["critic/kl_coef"] = float(kl_coef)
    errors = [e.get("error") if isinstance(e, dict) else None for e in extras]
    cols = {
        "sample_id": rollout.column("sample_id"),
        "score": pa.array(scores, pa.float32()),
        "reward_extra": json_column(extras),
        "reward_error": pa.array([None if e is None else str(e) for e in errors], pa.string()),
        "token_rewards": to_ragged(token_rewards, resp_len),
    }
    if ref_logprobs is not None:
        cols["ref_logprobs"] = list_column(ref_logprobs, pa.float32())
    if (reward_cfg.get("reward_model") or {}).get("enable"):
        cols["rule_score"] = pa.array(rule, pa.float32())
        cols["rm_score"] = pa.array(np.asarray(rm_scores, dtype=np.float32), pa.float32())
    if reward_baselines is not None:
        cols["reward_baseline"] = pa.array(np.asarray(reward_baselines, dtype=np.float32), pa.float32())
        metrics["reward/baseline/mean"] = float(np.mean(reward_baselines)) if len(reward_baselines) else 0.0
    return pa.table(cols), metrics


def advantage_table(joined: pa.Table, algorithm_cfg: dict, values: list[np.ndarray] | None = None,
                    reward_baselines: np.ndarray | None = None) -> pa.Table:
    """The advantage stage's output (``values`` only when a critic supplied them).

    Args:
        joined: rollout + reward columns (needs ``sample_id``, ``group_id``, ``response_ids``,
            ``token_rewards``).
        algorithm_cfg: the ``algorithm`` config section.
        values: critic values per row (ragged, aligned with ``response_ids``), for ``gae``.
        reward_baselines: per-row baseline reward (ReMax's greedy score).
    """
    from stages.advantage import AdvantageConfig, compute_advantage

    resp_len = lengths(joined.column("response_ids"))
    T = max(int(resp_len.max()) if len(resp_len) else 1, 1)
    rewards = pad_ragged(joined.column("token_rewards"), 0.0, torch.float32, length=T)
    mask = torch.arange(T)[None, :] < torch.from_numpy(resp_len)[:, None]
    if "loss_mask" in joined.column_names:
        mask = mask & pad_ragged(joined.column("loss_mask"), 0, torch.float32, length=T).bool()
    conf = AdvantageConfig(gamma=algorithm_cfg["gamma"], lam=algorithm_cfg["lam"],
                           norm_adv_by_std_in_grpo=algorithm_cfg["norm_adv_by_std_in_grpo"])
    extra: dict[str, Any] = {}
    vals_t = None
    if values is not None:
        vals_t = pad_ragged(pa.array([list(map(float, v)) for v in values], pa.list_(pa.float32())), 0.0,
                            torch.float32, length=T)
        extra["values"] = vals_t
    if reward_baselines is not None:
        extra["reward_baselines"] = torch.as_tensor(reward_baselines, dtype=torch.float32)
    index = joined.column("group_id").to_pylist()
    adv, ret = compute_advantage(algorithm_cfg["adv_estimator"], rewards, mask, index, conf, **extra)
    cols = {"sample_id": joined.column("sample_id")}
    if vals_t is not None:
        cols["values"] = to_ragged(vals_t, resp_len)
    cols["advantages"] = to_ragged(adv, resp_len)
    cols["returns"] = to_ragged(ret, resp_len)
    return pa.table(cols)


def fill_dropped_rows(joined: pa.Table, computed: pa.Table | None) -> pa.Table:
    """Advantage table over every row of ``joined``: computed rows as given, the others zero.

    Args:
        joined: all rows of the iteration (``sample_id``, ``response_ids``).
        computed: :func:`advantage_table` over the kept rows (``None`` if none was kept).
    """
    ids = joined.column("sample_id").to_pylist()
    resp_len = lengths(joined.column("response_ids"))
    by_id: dict[str, int] = {}
    cols = ["advantages", "returns"]
    if computed is not None:
        by_id = {sid: i for i, sid in enumerate(computed.column("sample_id").to_pylist())}
        cols = [c for c in computed.column_names if c != "sample_id"]
        if len(by_id) == len(ids):
            return computed.take(pa.array([by_id[s] for s in ids]))
    data = {c: computed.column(c).to_pylist() if computed is not None else None for c in cols}
    out: dict[str, Any] = {"sample_id": joined.column("sample_id")}
    for c in cols:
        out[c] = pa.array([data[c][by_id[s]] if s in by_id else [0.0] * int(n) for s, n in zip(ids, resp_len)],
                          pa.list_(pa.float32()))
    return pa.table(out)


def batch_metrics(joined: pa.Table) -> dict[str, float]:
    """verl's data metrics over one iteration's joined batch."""
    score = joined.column("score").to_numpy(zero_copy_only=False).astype(np.float64)
    resp_len = lengths(joined.column("response_ids"))
    prompt_len = lengths(joined.column("prompt_ids"))
    m: dict[str, float] = {}

    def stats(prefix: str, x: np.ndarray) -> None:
        finite = x[np.isfinite(x)]
        if len(finite):
            m[f"{prefix}/mean"] = float(finite.mean())
            m[f"{prefix}/max"] = float(finite.max())
            m[f"{prefix}/min"] = float(finite.min())

    stats("critic/score", score)
    if "token_rewards" in joined.column_names:
        tr = joined.column("token_rewards")
        stats("critic/rewards", np.array([float(np.sum(r)) if r is not None else 0.0 for r in tr.to_pylist()]))
    for col, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if col in joined.column_names:
            flat = joined.column(col).combine_chunks().flatten().to_numpy(zero_copy_only=False)
            stats(name, flat.astype(np.float64))
    stats("response_length", resp_len.astype(np.float64))
    stats("prompt_length", prompt_len.astype(np.float64))
    fr = joined.column("finish_reason").to_pylist()
    m["response_length/clip_ratio"] = float(np.mean([f == "length" for f in fr])) if fr else 0.0
    total = resp_len + prompt_len
    m["global_seqlen/min"] = float(total.sum())
    m["global_seqlen/max"] = float(total.sum())
    m["global_seqlen/minmax_diff"] = 0.0
    m["perf/total_num_tokens"] = float(total.sum())
    if "reward_error" in joined.column_names:
        m["reward/scorer_errors"] = float(joined.column("reward_error").null_count * -1 + joined.num_rows)
    return m


def iteration_seed(seed: int, iteration: int, salt: int = 0) -> int:
    """Seed for iteration-local randomness (sampling, shuffling): equal across resumes and retries.

    Args:
        seed: ``trainer.seed``.
        iteration: the iteration (or validation step).
        salt: separates streams of one iteration (0 rollout, 1 update shuffle, 2 validation, 3 ReMax
            greedy baseline, 4 critic shuffle, 5 update RNG, 100 + k dynamic-sampling batch k).

    Returns:
        An int in ``[0, 2**31 - 1)``.
    """
    return (seed * 1_000_003 + iteration * 7919 + salt) % (2**31 - 1)
