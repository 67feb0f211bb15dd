"""Reward stage: batch scoring with the registered scorers, DAPO's overlong shaping, and the stage's
Arrow output (scores, token-level rewards, reference log-probs).

Plain functions over strings, numpy arrays and Arrow tables (no Ray, no Prefect); the scorers
themselves are in :mod:`trajflow.stages.scorers`. :func:`compute_scores` scores a batch and never raises
because of a scorer (errors become score 0.0 plus an ``"error"`` extra).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from trajflow.stages.scorers import SCORERS, load_custom_function, select_scorer
from trajflow.batch import decode_nested, json_column, lengths, list_column, pad_ragged, to_ragged, trainable_mask_array
from trajflow.errors import DataError

__all__ = ["RewardResult", "check_env_rewards", "compute_scores", "final_scores", "last_trainable_index",
           "no_signal_warning", "overlong_floor_warning", "overlong_penalty", "reward_table", "rollout_env_rewards",
           "score_rows", "shaping_penalties"]

# --------------------------------------------------------------------------------------------- batch scoring


@dataclass
class RewardResult:
    """Scores for a batch of responses.

    Attributes:
        scores: ``(batch,)`` float32; 0.0 where the scorer raised or returned a non-number; NaN passed
            through unchanged where the scorer returned NaN or None (caught by a later data-quality gate).
        extras: ``batch`` dicts, JSON-serialisable: the scorer's dict minus ``"score"`` (``{}`` for a float
            return), or ``{"error": "<ExceptionType>: <message>"}`` for a failed row.
        num_errors: rows whose scorer raised or returned something that is not a number.
    """

    scores: np.ndarray
    extras: list[dict] = field(default_factory=list)
    num_errors: int = 0


def _jsonable(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    return repr(obj)


@functools.lru_cache(maxsize=256)
def _accepted_kwargs(fn: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    """(keyword names fn accepts beyond the four positional ones, whether it takes **kwargs)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset(), False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first_four = {p.name for p in positional[:4]}  # data_source, solution_str, ground_truth, extra_info
    names = frozenset(
        p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in first_four
    )
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def _kwargs_for(fn: Callable[..., Any], scorer_kwargs: Mapping[str, Any]) -> dict:
    names, var_kw = _accepted_kwargs(fn)
    return dict(scorer_kwargs) if var_kw else {k: v for k, v in scorer_kwargs.items() if k in names}


def _to_score(value: Any) -> float:
    """A scorer's ``score`` as a float; None -> NaN; raises TypeError for non-numbers."""
    if value is None:
        return math.nan
    if isinstance(value, (numbers.Real, np.number, np.bool_)):  # bool counts as 0/1
        return float(value)
    if isinstance(value, np.ndarray) and value.size == 1 and np.issubdtype(value.dtype, np.number):
        return float(value.reshape(()))
    raise TypeError(f"scorer returned a score of type {type(value).__name__} ({value!r:.80}); expected a number")


def _takes_env_reward(fn: Callable[..., Any]) -> bool:
    names, var_kw = _accepted_kwargs(fn)
    return var_kw or "env_reward" in names


def _require_env_rewards(uses_env: Sequence[bool], env_rewards: Sequence[float | None] | None,
                         row_prompt_ids: Sequence[str] | None, key: str) -> None:
    """Raise :class:`DataError` for the first row scored by ``env`` that has no environment reward."""
    for i, uses in enumerate(uses_env):
        if not uses or (env_rewards is not None and env_rewards[i] is not None):
            continue
        pid = f" (prompt_id {row_prompt_ids[i]!r})" if row_prompt_ids is not None else ""
        if env_rewards is None:
            raise DataError(f"{key}: row {i}{pid} is single-turn, so it has no env_reward; the env scorer scores "
                            f"multi-turn episodes (rollout.multi_turn.enable=true) with their environment's reward")
        raise DataError(f"{key}: row {i}{pid} has env_reward null: no step of its environment returned a reward "
                        f"and its final_reward gave none; expected a number in StepResult(reward=...) or from "
                        f"Environment.final_reward(messages, finish_reason), or set "
                        f"rollout.multi_turn.default_env_reward")


def check_env_rewards(data_sources: Sequence[str], env_rewards: Sequence[float | None] | None,
                      row_prompt_ids: Sequence[str] | None, reward_cfg: Mapping[str, Any]) -> None:
    """Refuse a batch in which a row scored by the ``env`` scorer has no environment reward.

    The driver calls this before sending rows to the scoring tasks, so that the error is one line
    (the tasks check the same). Rows whose scorer is not ``env`` are not looked at; a data source
    without any scorer is left to :func:`compute_scores` to report.

    Args:
        data_sources: ``(rows,)`` the rows' ``data_source``.
        env_rewards: ``(rows,)`` the rollout's ``env_reward`` (None where null), or None when the
            rollout has no such column (single-turn).
        row_prompt_ids: ``(rows,)`` prompt ids (the ``prompt_id`` column), named in the error; or None.
        reward_cfg: the ``reward`` section as the scorers receive it.

    Raises:
        DataError: names the key that chose ``env`` (``reward.scorer`` or ``reward.default_scorer``),
            the row and its prompt id, and what was expected.
    """
    if reward_cfg.get("custom_function"):
        return
    scorer, default = reward_cfg.get("scorer"), reward_cfg.get("default_scorer")
    if "env" not in (scorer, default):
        return
    uses = []
    for ds in data_sources:
        try:
            uses.append(select_scorer(ds, default, scorer) == "env")
        except ValueError:
            uses.append(False)
    _require_env_rewards(uses, env_rewards, row_prompt_ids, "reward.scorer=env" if scorer == "env"
                         else "reward.default_scorer=env")


def rollout_env_rewards(table: pa.Table) -> list[float | None] | None:
    """A rollout table's ``env_reward`` column as a list (None where null), or None without the column."""
    return table.column("env_reward").to_pylist() if "env_reward" in table.column_names else None


def compute_scores(
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[str],
    extra_infos: Sequence[dict | None],
    *,
    custom_function: Callable[..., Any] | None = None,
    default_scorer: str | None = None,
    scorer_kwargs: Mapping[str, Any] | None = None,
    scorer: str | None = None,
    env_rewards: Sequence[float | None] | None = None,
    row_prompt_ids: Sequence[str] | None = None,
) -> RewardResult:
    """Score a batch of responses, one scorer call per row.

    The scorer is ``custom_function`` for every row when given, else ``SCORERS.get(select_scorer(
    data_source, default_scorer, scorer))``. Each scorer receives the entries of ``scorer_kwargs`` that its
    signature accepts (all of them if it takes ``**kwargs``), e.g. ``{"format_bonus": 0.1}`` reaches
    only ``reasoning_gym``. A scorer that raises, or returns a non-number (or a dict without
    ``"score"``), gives that row score 0.0 and an ``"error"`` extra, and is counted in ``num_errors``;
    nothing propagates. NaN/None scores pass through as NaN, unchanged. With ``env_rewards`` (multi-turn
    rows), a scorer that accepts an ``env_reward`` keyword (the ``env`` scorer, or a custom function
    that declares it) gets its row's value.

    Args:
        data_sources, solutions, ground_truths, extra_infos: ``batch`` entries each, aligned by row.
        custom_function: a scorer with verl's signature (see :func:`load_custom_function`), or None.
        default_scorer: scorer name for data sources :func:`select_scorer` does not map.
        scorer_kwargs: keyword options for scorers.
        scorer: scorer name for every row, whatever its data source (``reward.scorer``).
        env_rewards: ``batch`` environment rewards (the rollout's ``env_reward``; None where the
            episode has none), or None for single-turn rows.
        row_prompt_ids: ``batch`` prompt ids (the ``prompt_id`` column), named in errors; or None.

    Returns:
        :class:`RewardResult` with ``scores`` ``(batch,)`` float32.

    Raises:
        ValueError: the input sequences differ in length; a data source has no scorer and no default
            (raised before any row is scored, naming the row); a ``scorer_kwargs`` key that no
            registered scorer (nor ``custom_function``) accepts.
        DataError: a row scored by ``env`` has no environment reward (:func:`check_env_rewards`),
            raised before any row is scored.
    """
    n = len(solutions)
    lengths = {"data_sources": len(data_sources), "solutions": n, "ground_truths": len(ground_truths),
               "extra_infos": len(extra_infos)}
    if env_rewards is not None:
        lengths["env_rewards"] = len(env_rewards)
    if row_prompt_ids is not None:
        lengths["row_prompt_ids"] = len(row_prompt_ids)
    if len(set(lengths.values())) != 1:
        raise ValueError(f"compute_scores: inputs must have the same length, got {lengths}")
    kwargs = dict(scorer_kwargs or {})
    if kwargs:
        fns = [custom_function] if custom_function is not None else []
        fns += [SCORERS.get(name) for name in SCORERS.names()]
        accepted: set[str] = set()
        for f in fns:
            names, var_kw = _accepted_kwargs(f)
            if var_kw:
                accepted = set(kwargs)
                break
            accepted |= names
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise ValueError(f"compute_scores: scorer_kwargs {unknown} are accepted by no scorer "
                             f"(accepted: {sorted(accepted)})")

    fn_by_source: dict[str, Callable[..., Any]] = {}
    fns_rows: list[Callable[..., Any]] = []
    for i, ds in enumerate(data_sources):
        if custom_function is not None:
            fns_rows.append(custom_function)
            continue
        if ds not in fn_by_source:
            try:
                fn_by_source[ds] = SCORERS.get(select_scorer(ds, default_scorer, scorer))
            except ValueError as e:
                raise ValueError(f"compute_scores: row {i}: {e}") from e
        fns_rows.append(fn_by_source[ds])
    env_fn = SCORERS.get("env")
    _require_env_rewards([fn is env_fn for fn in fns_rows], env_rewards, row_prompt_ids,
                         "reward.scorer=env" if scorer == "env" else "reward.default_scorer=env")

    scores = np.zeros(n, dtype=np.float32)
    extras: list[dict] = []
    num_errors = 0
    for i in range(n):
        fn = fns_rows[i]
        try:
            fn_kwargs = _kwargs_for(fn, kwargs)
            if env_rewards is not None and _takes_env_reward(fn):
                fn_kwargs["env_reward"] = env_rewards[i]
            out = fn(data_sources[i], solutions[i], ground_truths[i], extra_infos[i], **fn_kwargs)
            if isinstance(out, Mapping):
                if "score" not in out:
                    raise TypeError(f"scorer returned a dict without a 'score' key (keys: {sorted(map(str, out))})")
                score = _to_score(out["score"])
                extra = _jsonable({k: v for k, v in out.items() if k != "score"})
            else:
                score = _to_score(out)
                extra = {}
        except Exception as e:  # a scorer must never crash the stage
            scores[i] = 0.0
            extras.append({"error": f"{type(e).__name__}: {e}"})
            num_errors += 1
            continue
        scores[i] = score
        extras.append(extra)
    return RewardResult(scores=scores, extras=extras, num_errors=num_errors)


# --------------------------------------------------------------------------------------------- shaping


def overlong_penalty(
    response_lengths: np.ndarray,
    max_new_tokens: int,
    buffer_len: int,
    penalty_factor: float,
) -> np.ndarray:
    """DAPO soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), to be *added* to the score.

    With ``L_max = max_new_tokens``, ``L_cache = buffer_len`` and response length ``|y|``::

        R_length(y) = 0                                   if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                      -1                                  if |y| > L_max

    and the returned penalty is ``penalty_factor * R_length(y)`` (in ``[-penalty_factor, 0]``).

    Args:
        response_lengths: ``(batch,)`` integer response lengths in tokens (>= 0).
        max_new_tokens: the generation cap ``L_max`` in tokens (>= 1).
        buffer_len: ``L_cache``, the soft-penalty zone before the cap, in tokens (1..max_new_tokens).
        penalty_factor: maximum penalty (>= 0).

    Returns:
        ``(batch,)`` float32 penalties, <= 0.

    Raises:
        ValueError: lengths not 1-D or negative; ``max_new_tokens < 1``; ``buffer_len`` outside
            ``[1, max_new_tokens]``; ``penalty_factor < 0``.
    """
    lengths = np.asarray(response_lengths)
    if lengths.ndim != 1:
        raise ValueError(f"overlong_penalty: response_lengths must be 1-D (batch,), got shape {lengths.shape}")
    if lengths.size and (not np.issubdtype(lengths.dtype, np.number) or np.any(lengths < 0)):
        raise ValueError("overlong_penalty: response_lengths must be non-negative token counts")
    if max_new_tokens < 1:
        raise ValueError(f"overlong_penalty: max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 1 <= buffer_len <= max_new_tokens:
        raise ValueError(
            f"overlong_penalty: buffer_len must be in [1, max_new_tokens={max_new_tokens}], got {buffer_len}"
        )
    if penalty_factor < 0:
        raise ValueError(f"overlong_penalty: penalty_factor must be >= 0, got {penalty_factor}")
    expected = max_new_tokens - buffer_len
    frac = np.clip((lengths.astype(np.float64) - expected) / buffer_len, 0.0, 1.0)
    return (-penalty_factor * frac).astype(np.float32)


def shaping_penalties(response_lengths: np.ndarray, reward_cfg: dict, max_new_tokens: int) -> np.ndarray | None:
    """Each row's overlong penalty (:func:`overlong_penalty`) when ``reward.overlong_buffer.enable``, else None.

    Args:
        response_lengths: ``(rows,)`` int generated tokens per row.
        reward_cfg: the ``reward`` config section as a dict.
        max_new_tokens: ``rollout.max_new_tokens``.

    Returns:
        ``(rows,)`` float32 penalties (<= 0), or None without shaping.
    """
    ob = reward_cfg.get("overlong_buffer") or {}
    if not ob.get("enable"):
        return None
    return overlong_penalty(np.asarray(response_lengths), max_new_tokens, ob["len"], ob["penalty_factor"])


def overlong_floor_warning(scores: np.ndarray, penalties: np.ndarray | None, reward_cfg: dict,
                           max_new_tokens: int) -> str | None:
    """One line when every row got the full overlong penalty and all scores are equal: the batch is
    at the shaping's floor, every group's advantage is 0 and the update learns nothing (the typical
    cause: a response cap too short for the data).

    Args:
        scores: ``(rows,)`` final scores (after shaping).
        penalties: ``(rows,)`` the overlong penalties (:func:`shaping_penalties`), or None.
        reward_cfg: the ``reward`` config section as a dict.
        max_new_tokens: ``rollout.max_new_tokens``.

    Returns:
        The warning (without a ``warning:`` prefix), or None.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if penalties is None or not len(scores):
        return None
    ob = reward_cfg.get("overlong_buffer") or {}
    factor = float(ob.get("penalty_factor", 1.0))
    if factor <= 0 or not np.all(np.asarray(penalties) <= -factor + 1e-6) or np.ptp(scores) > 1e-6:
        return None
    return (f"all {len(scores)} scores are {scores[0]:.3f}, the overlong floor: every response reached "
            f"rollout.max_new_tokens={max_new_tokens} and got the full overlong penalty -{factor:g} "
            f"(reward.overlong_buffer: len={ob.get('len')}, penalty_factor={factor:g}), so every advantage is 0 "
            f"and nothing is learnt; raise rollout.max_new_tokens, set reward.overlong_buffer.enable=false, or "
            f"use the recipe for your data (-c grpo_gsm8k, -c grpo_math)")


def no_signal_warning(scores: np.ndarray, group_ids: Sequence, adv_estimator: str, *, run_id: str, iteration: int,
                      store: str | None = None, kl_in_reward: bool = False) -> str | None:
    """One line when every group of a group-baseline estimator has all-equal scores: every advantage
    is then 0 and the policy gradient learns nothing from the batch (a silent ``actor/grad_norm`` 0).

    Which estimators: those registered with ``needs_groups`` (grpo and Dr. GRPO, rloo,
    reinforce_plus_plus_baseline, opo, gpg, grpo_passk). Each one's baseline comes from the other
    samples of the same prompt (the group mean, leave-one-out mean, length-weighted mean, or the best
    other sample), so a group whose scores are all exactly equal gets advantage exactly 0 (the
    guarantee of :mod:`trajflow.stages.advantage`). Not the others: gae's baseline is the critic's
    V(s_t), reinforce_plus_plus whitens returns-to-go over the whole batch (groups that differ from
    each other still give signal), remax subtracts the greedy response's score, and opd learns from
    the teacher's log-probs, not from scores. With ``kl_in_reward`` (``algorithm.use_kl_in_reward``)
    the rows' KL penalties still differ, so the line says the only signal left is the KL penalty.

    Args:
        scores: ``(rows,)`` float, the final scores (after shaping).
        group_ids: length-``rows`` group ids (the rollout's ``group_id``: rows of one prompt).
        adv_estimator: ``algorithm.adv_estimator``.
        run_id, iteration, store: named in the ``trajflow audit`` command the line suggests (``store``:
            the store root, None for the default ``runs``).
        kl_in_reward: ``algorithm.use_kl_in_reward``.

    Returns:
        The warning (without a ``warning:`` prefix), or None: some group's scores differ, the batch
        is empty or holds a non-finite score (the gate reports those), or the estimator does not
        use groups.

    Raises:
        ValueError: unknown ``adv_estimator``, or ``group_ids`` not of length ``rows``.
    """
    from trajflow.stages.advantage import needs_groups  # torch: the driver's, never the scoring worker's

    scores = np.asarray(scores, dtype=np.float64)
    if len(group_ids) != len(scores):
        raise ValueError(f"group_ids has {len(group_ids)} entries for {len(scores)} scores")
    if not needs_groups(adv_estimator) or not len(scores) or not np.isfinite(scores).all():
        return None
    by_group: dict = {}
    for gid, score in zip(group_ids, scores.tolist()):
        by_group.setdefault(gid, []).append(score)
    if any(min(v) != max(v) for v in by_group.values()):  # exact, as the estimators' all_equal
        return None
    counts: dict[float, int] = {}  # how many groups sit at each value
    for v in by_group.values():
        counts[v[0]] = counts.get(v[0], 0) + 1
    what = f"all {len(scores)} scores are {scores[0]:.3f}" if len(counts) == 1 else \
        f"each of the {len(by_group)} groups has equal scores (" + ", ".join(
            f"{v:.3f} in {n}" for v, n in sorted(counts.items())) + ")"
    effect = ("every advantage is 0 and nothing is learnt from this batch" if not kl_in_reward else
              "the advantages carry only the KL penalty (algorithm.use_kl_in_reward) and nothing is learnt "
              "from the reward")
    audit = f'trajflow audit {run_id} --where "iteration = {iteration}" -f json'
    audit += f" --store {store}" if store else ""
    return (f"{what}, so with {adv_estimator}'s group baseline {effect}. Likely: the reward never matches the "
            f"model's answers (compare response_text with ground_truth and reward_extra: `{audit}`, or the "
            f"dashboard's trajectories; the math scorers read '#### 42', 'Answer: 42' or \\boxed{{42}}), or the "
            f"task is too hard (or too easy) for the model: easier data, more samples per prompt (rollout.n), a "
            f"higher rollout.temperature")


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
    pen = shaping_penalties(response_lengths, reward_cfg, max_new_tokens)
    if pen is not None:
        score = score + pen
        metrics["reward/overlong_penalty/mean"] = float(np.mean(pen)) if len(pen) else 0.0
    return score.astype(np.float32), metrics


def score_rows(data_sources: list[str], solutions: list[str], ground_truths: list[str],
               extra_infos: list[dict | str | None], reward_cfg: dict,
               env_rewards: list[float | None] | None = None, row_prompt_ids: list[str] | None = None) -> Any:
    """Score responses with the configured scorers (runs on a Ray worker); returns ``RewardResult``.

    ``extra_infos`` are the rollout table's ``extra_info`` values: dicts (a struct column) or the
    JSON text of runs stored before it was one. ``env_rewards`` and ``row_prompt_ids`` are as in
    :func:`compute_scores` (multi-turn rows; None for single-turn).
    """
    custom = load_custom_function(reward_cfg["custom_function"]) if reward_cfg.get("custom_function") else None
    infos = [None if x is None or x == "" else decode_nested(x) for x in extra_infos]
    return compute_scores(data_sources, solutions, ground_truths, infos, custom_function=custom,
                          default_scorer=reward_cfg.get("default_scorer"), scorer=reward_cfg.get("scorer"),
                          scorer_kwargs={"format_bonus": reward_cfg.get("format_bonus", 0.1),
                                         "strict_format": reward_cfg.get("strict_format", True)},
                          env_rewards=env_rewards, row_prompt_ids=row_prompt_ids)


def last_trainable_index(mask: np.ndarray) -> np.ndarray:
    """Where an outcome reward goes: the position of each row's last True in ``mask``.

    Args:
        mask: ``(batch, response_len)`` bool array, the generated tokens
            (:func:`trajflow.batch.trainable_mask_array`).

    Returns:
        ``(batch,)`` int64 positions; 0 for a row with no True (its reward is masked away anyway).
    """
    mask = np.asarray(mask, dtype=bool)
    pos = np.broadcast_to(np.arange(mask.shape[-1], dtype=np.int64), mask.shape)
    return np.where(mask, pos, -1).max(axis=-1, initial=-1).clip(min=0)


def reward_table(rollout: pa.Table, scores: np.ndarray, extras: list[dict], *,
                 ref_logprobs: list[np.ndarray] | None, reward_cfg: dict, algorithm_cfg: dict,
                 max_new_tokens: int, kl_coef: float, rm_scores: np.ndarray | None = None,
                 reward_baselines: np.ndarray | None = None,
                 teacher_logprobs: list[np.ndarray] | None = None) -> tuple[pa.Table, dict]:
    """The reward stage's output: scores, token-level rewards and (with a reference) ref log-probs.

    The sequence score (:func:`final_scores`: rule scores, combined with the reward model's when
    one is enabled, plus DAPO's soft overlong punishment, Yu et al. 2025, eq. 13) sits on the last
    response token the policy generated (outcome reward): the last token whose rollout ``loss_mask``
    is 1, which for a single-turn row is the last response token. With
    ``algorithm.use_kl_in_reward`` the per-token penalty ``kl_coef * KL`` is subtracted (Ziegler et
    al. 2019, eq. 2; Ouyang et al. 2022, eq. 2) on the generated tokens only; observation and
    template tokens of a multi-turn row (``loss_mask`` 0) get reward 0, no KL, and do not count in
    ``critic/kl``'s per-row token mean. The overlong penalty's length is the number of generated
    tokens.

    Args:
        rollout: the rollout table.
        scores: ``(rows,)`` rule-based scores from :func:`score_rows`.
        extras: per-row scorer extras; stored as ``reward_extra`` with each row's ``overlong_penalty``
            added when ``reward.overlong_buffer.enable`` (the score is the scorer's plus that penalty).
        ref_logprobs: reference log-probs per row (ragged), or ``None``.
        reward_cfg, algorithm_cfg: config sections as dicts.
        max_new_tokens: ``rollout.max_new_tokens``.
        kl_coef: the KL controller's current coefficient.
        rm_scores: ``(rows,)`` reward-model scores (with ``reward.reward_model.enable``).
        reward_baselines: ``(rows,)`` ReMax baseline score (the greedy response's final score) per row.
        teacher_logprobs: on-policy distillation's teacher log-probs per row (ragged): stored as
            ``teacher_logprobs``, with ``distill/*`` metrics against the rollout's log-probs
            (:func:`trajflow.stages.distillation.reverse_kl_metrics`) over the generated tokens.

    Returns:
        The table (``score``, ``rule_score``/``rm_score`` with a reward model, ``reward_baseline``
        for ReMax, ``token_rewards``, ...) and metrics (``critic/kl``, ``reward/*``).
    """
    resp_len = lengths(rollout.column("response_ids"))
    B, T = len(resp_len), max(int(resp_len.max()) if len(resp_len) else 1, 1)
    # numpy, not torch: the driver computes this table and does not import torch (the KL and
    # distillation paths below do, where a run asks for them).
    mask = trainable_mask_array(rollout, T)
    rule = np.asarray(scores, dtype=np.float32).copy()
    # The overlong penalty measures the generation budget: observation tokens of a multi-turn row
    # were not generated, so they do not count against rollout.max_new_tokens.
    generated = mask.sum(axis=-1)
    scores, metrics = final_scores(rule, rm_scores, generated, reward_cfg, max_new_tokens)
    penalties = shaping_penalties(generated, reward_cfg, max_new_tokens)
    if penalties is not None:  # the shaping each row got, beside what its scorer said (reward_extra)
        extras = [{**(e if isinstance(e, dict) else {}), "overlong_penalty": round(float(p), 6)}
                  for e, p in zip(extras, penalties)]
    token_scores = np.zeros((B, T), dtype=np.float32)
    token_scores[np.arange(B), last_trainable_index(mask)] = scores
    token_scores = token_scores * mask
    token_rewards = token_scores
    if algorithm_cfg.get("use_kl_in_reward"):
        import torch

        from trajflow.stages.kl import apply_kl_penalty_to_rewards

        if ref_logprobs is None:
            raise ValueError("algorithm.use_kl_in_reward needs reference log-probs")
        behaviour = pad_ragged(rollout.column("rollout_logprobs"), 0.0, torch.float32, length=T)
        ref = pad_ragged(pa.array([list(map(float, r)) for r in ref_logprobs], pa.list_(pa.float32())), 0.0,
                         torch.float32, length=T)
        token_rewards, mean_kl = apply_kl_penalty_to_rewards(torch.from_numpy(token_scores), behaviour, ref,
                                                             torch.from_numpy(mask), kl_coef,
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
    if teacher_logprobs is not None:
        import torch

        from trajflow.stages.distillation import reverse_kl_metrics

        cols["teacher_logprobs"] = list_column(teacher_logprobs, pa.float32())
        teacher = pad_ragged(cols["teacher_logprobs"], 0.0, torch.float32, length=T)
        student = pad_ragged(rollout.column("rollout_logprobs"), 0.0, torch.float32, length=T)
        metrics.update(reverse_kl_metrics(teacher, student, torch.from_numpy(mask)))
    if reward_baselines is not None:
        cols["reward_baseline"] = pa.array(np.asarray(reward_baselines, dtype=np.float32), pa.float32())
        metrics["reward/baseline/mean"] = float(np.mean(reward_baselines)) if len(reward_baselines) else 0.0
    return pa.table(cols), metrics
