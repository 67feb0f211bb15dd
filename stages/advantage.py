"""Advantage estimators: GAE, GRPO / Dr. GRPO, RLOO, REINFORCE++, ReMax, OPO, GPG, pass@k.

Every estimator is a pure function registered in :data:`ADV_ESTIMATORS` under its config name
(``algorithm.adv_estimator``) with one signature::

    fn(token_level_rewards, response_mask, index, config, *, values=None, reward_baselines=None)
        -> (advantages, returns)

Shapes and dtypes:
    token_level_rewards: ``(batch, response_len)`` float; the reward of each response token (for
        outcome rewards, the score sits on the last valid token and the rest are 0).
    response_mask: ``(batch, response_len)`` bool or 0/1 float/int; 1 on tokens the policy
        generated. Gaps (0s in the middle, e.g. tool/observation tokens of a multi-turn rollout)
        and rows without EOS (all ones) are both valid.
    index: length-``batch`` sequence of group ids (``str`` or ``int``, e.g. the prompt uid): rows
        with the same id are samples for the same prompt.
    advantages, returns: ``(batch, response_len)`` float32, exactly 0 outside the mask.

Guarantees, for every valid input (finite rewards on masked tokens):
    * no NaN/inf in the outputs; anything stored outside the mask (garbage after EOS, even NaN)
      never reaches the outputs;
    * group statistics are computed in float64, and a group whose scores are all equal (including
      a group of one) gets an advantage of exactly ``0.0`` from every group-baseline estimator;
    * outcome-level advantages are broadcast to every valid token of the row.

Inputs are validated at this boundary; errors name the argument, the row and what was expected.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from trajflow.batch import lengths, pad_ragged, to_ragged, trainable_mask

from stages.distillation import opd_advantage
from stages.group_stats import (GroupStats, broadcast_rows, check_inputs, group_ids,
                                masked_finite, masked_tokens)
from stages.registry import Registry

__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageConfig",
    "EstimatorMeta",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "masked_whiten",
    "needs_greedy_baseline",
    "needs_groups",
    "needs_values",
]


@dataclass(frozen=True)
class EstimatorMeta:
    """What an advantage estimator needs besides rewards (read by placement and the rollout stage).

    Attributes:
        needs_values: it takes the critic's ``values=``, so the run creates a critic worker.
        needs_greedy_baseline: it takes ``reward_baselines=`` scored from a greedy rollout of each prompt.
        needs_groups: its baseline is computed from the other samples of the same prompt, so it needs
            ``rollout.n >= 2`` (with one sample per prompt every advantage is exactly 0).
    """

    needs_values: bool = False
    needs_greedy_baseline: bool = False
    needs_groups: bool = False


ADV_ESTIMATORS = Registry("advantage estimator", meta=EstimatorMeta)

#: Variance floor inside the square root of :func:`masked_whiten` (verl's value).
WHITEN_EPS = 1e-8


@dataclass
class AdvantageConfig:
    """Settings shared by the advantage estimators (config section ``algorithm``).

    Attributes:
        gamma: discount factor per response token, in [0, 1] (gae, reinforce_plus_plus).
        lam: GAE lambda, in [0, 1] (gae).
        norm_adv_by_std_in_grpo: divide the group-centred score by the group std (GRPO). False
            gives Dr. GRPO (also used by grpo_passk).
        epsilon: added to the group std before dividing, >= 0.
        pass_k: grpo_passk only: size of the sample sets the pass@k advantage is computed over;
            each group is split, in batch order, into consecutive blocks of ``pass_k`` rows.
            ``None`` uses the whole group as one block.
    """

    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6
    pass_k: int | None = None

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
                raise ValueError(f"AdvantageConfig.{name} must be a number in [0, 1], got {value!r}")
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, numbers.Real) or not self.epsilon >= 0:
            raise ValueError(f"AdvantageConfig.epsilon must be a number >= 0, got {self.epsilon!r}")
        if self.pass_k is not None and (
            isinstance(self.pass_k, bool) or not isinstance(self.pass_k, numbers.Integral) or self.pass_k < 2
        ):
            raise ValueError(f"AdvantageConfig.pass_k must be None or an int >= 2, got {self.pass_k!r}")


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten ``values`` with the mean and variance of its masked entries.

    ``(x - mean) / sqrt(var + 1e-8)`` with the unbiased (Bessel-corrected) variance over the
    masked entries of the whole batch, as verl's ``masked_whiten``. With ``shift_mean=False`` the
    mean is added back (scale only).

    Args:
        values: any shape, float.
        mask: same shape, bool or 0/1.
        shift_mean: subtract the masked mean (default) or only rescale.

    Returns:
        Tensor of the shape and dtype of ``values``; 0 outside the mask. With no masked entry
        all zeros; with one masked entry the variance is taken as 0 (no NaN).
    """
    bool_mask = mask if mask.dtype == torch.bool else mask != 0
    x = values.to(torch.float64)
    n = bool_mask.sum()
    if int(n) == 0:
        return torch.zeros_like(values)
    xm = torch.where(bool_mask, x, torch.zeros_like(x))
    mean = xm.sum() / n
    centered = torch.where(bool_mask, x - mean, torch.zeros_like(x))
    var = (centered**2).sum() / (n - 1) if int(n) > 1 else torch.zeros((), dtype=torch.float64, device=x.device)
    out = centered * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return torch.where(bool_mask, out, torch.zeros_like(out)).to(values.dtype)


def _returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted return-to-go over the valid tokens only (float64).

    G_t = r_t + gamma * G_next, where ``next`` is the next *valid* token: masked positions are
    skipped (they neither add reward nor count as a discount step) and get 0.
    """
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in range(rewards.shape[1] - 1, -1, -1):
        valid = mask[:, t]
        candidate = rewards[:, t] + gamma * running
        running = torch.where(valid, candidate, running)
        out[:, t] = torch.where(valid, candidate, torch.zeros_like(candidate))
    return out


# --------------------------------------------------------------------------------------------
# estimators
# --------------------------------------------------------------------------------------------


@ADV_ESTIMATORS.register("gae", needs_values=True)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int] | None,
    config: AdvantageConfig,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 11-16).

    delta_t = r_t + gamma * V(s_next) - V(s_t);  A_t = delta_t + gamma * lam * A_next, computed
    backwards over the valid tokens only: ``next`` is the next token inside the mask (0 after the
    last one), so values and rewards after EOS or inside a gap never reach earlier positions
    (verl's treatment of masked/observation tokens). ``returns = A + V`` (the critic's target,
    before whitening); the advantages are then whitened over all masked tokens of the batch
    (:func:`masked_whiten`, as verl).

    Args:
        token_level_rewards: ``(batch, response_len)`` float.
        response_mask: ``(batch, response_len)`` bool or 0/1.
        index: unused (accepted for the common signature; may be None).
        config: uses ``gamma`` and ``lam``.
        values: ``(batch, response_len)`` float, the critic's V(s_t) per token. Required.
        reward_baselines: unused.

    Returns:
        ``(advantages, returns)``, each ``(batch, response_len)`` float32, 0 outside the mask.

    Raises:
        ValueError: ``values`` missing or of the wrong shape, non-finite values/rewards inside the
            mask, or a malformed mask.
    """
    rewards, mask = check_inputs(token_level_rewards, response_mask)
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs values=(batch, response_len) from the critic, got None")
    if not isinstance(values, torch.Tensor) or values.shape != rewards.shape:
        raise ValueError(
            f"values must be a tensor of shape {tuple(rewards.shape)} (batch, response_len), got "
            f"{getattr(values, 'shape', type(values).__name__)}"
        )
    v = masked_finite(values, mask, "values")
    gamma, lam = float(config.gamma), float(config.lam)
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(batch, dtype=torch.float64, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(length - 1, -1, -1):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_adv = torch.where(valid, adv_t, next_adv)
        next_value = torch.where(valid, v[:, t], next_value)
        advantages[:, t] = torch.where(valid, adv_t, torch.zeros_like(adv_t))
    returns = masked_tokens(advantages + v, mask)
    advantages = masked_whiten(advantages, mask)
    return advantages.to(torch.float32), returns.to(torch.float32)


def _outcome_setup(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, GroupStats, list[Any]]:
    """Scores (sum of the valid token rewards, float64), bool mask, group ids, group stats, keys."""
    rewards, mask = check_inputs(token_level_rewards, response_mask)
    ids, keys = group_ids(index, rewards.shape[0], rewards.device)
    scores = rewards.sum(dim=-1)
    return scores, mask, ids, GroupStats(scores, ids, len(keys)), keys


@ADV_ESTIMATORS.register("grpo", needs_groups=True)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int],
    config: AdvantageConfig,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, sec. 4.1.2).

    Score r_i = sum of the row's valid token rewards;
    A_i = (r_i - mean_group(r)) / (std_group(r) + epsilon), std unbiased (``torch.std``).
    With ``config.norm_adv_by_std_in_grpo=False``: A_i = r_i - mean_group(r) (Dr. GRPO, Liu et al.
    2025, arXiv:2503.20783, sec. 3.2). A group whose scores are all equal, including a group of
    one, gets exactly 0. A_i is broadcast to every valid token of row i.

    Args:
        token_level_rewards: ``(batch, response_len)`` float.
        response_mask: ``(batch, response_len)`` bool or 0/1.
        index: length-batch group ids.
        config: uses ``norm_adv_by_std_in_grpo`` and ``epsilon``.
        values, reward_baselines: unused.

    Returns:
        ``(advantages, returns)``, the same ``(batch, response_len)`` float32 tensor twice.

    Raises:
        ValueError: malformed inputs (see module docstring).
    """
    scores, mask, ids, g, _ = _outcome_setup(token_level_rewards, response_mask, index)
    centered = scores - g.mean[ids]
    adv = centered / (g.std[ids] + config.epsilon) if config.norm_adv_by_std_in_grpo else centered
    adv = torch.where(g.all_equal[ids], torch.zeros_like(adv), adv)
    out = broadcast_rows(adv, mask)
    return out, out.clone()


@ADV_ESTIMATORS.register("rloo", needs_groups=True)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int],
    config: AdvantageConfig,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740, eq. 6; Kool et al. 2019).

    A_i = r_i - (1 / (k - 1)) * sum_{j != i} r_j over the k rows of the group (r = sum of the
    valid token rewards). Groups of one, and groups whose scores are all equal, get exactly 0.

    Args/Returns/Raises: as :func:`compute_grpo_outcome_advantage` (``config`` unused).
    """
    scores, mask, ids, g, _ = _outcome_setup(token_level_rewards, response_mask, index)
    k = g.count[ids]
    loo_mean = (g.sum[ids] - scores) / (k - 1).clamp(min=1)
    adv = torch.where(g.all_equal[ids] | (k < 2), torch.zeros_like(scores), scores - loo_mean)
    out = broadcast_rows(adv, mask)
    return out, out.clone()


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int] | None,
    config: AdvantageConfig,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, sec. 3).

    Returns-to-go G_t = sum_{s >= t} gamma^(s - t) r_s over the valid tokens (masked tokens are
    skipped: they add no reward and are not a discount step); advantages are G whitened over all
    masked tokens of the batch (global batch normalisation).

    Args:
        token_level_rewards, response_mask: as above.
        index: unused (may be None).
        config: uses ``gamma``.

    Returns:
        ``(advantages, returns)`` float32 ``(batch, response_len)``: whitened and raw
        returns-to-go, 0 outside the mask.
    """
    rewards, mask = check_inputs(token_level_rewards, response_mask)
    returns = _returns_to_go(rewards, mask, float(config.gamma))
    advantages = masked_whiten(returns, mask)
    return advantages.to(torch.float32), returns.to(torch.float32)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline", needs_groups=True)
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int],
    config: AdvantageConfig,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262, sec. 3, group-mean baseline variant).

    A'_i = r_i - mean_group(r), broadcast to the row's valid tokens, then whitened over all masked
    tokens of the batch. Rows of groups whose scores are all equal (including groups of one) are
    set to exactly 0 after whitening: they carry no learning signal, and the batch shift of the
    whitening would otherwise give them a small, meaningless advantage. (verl keeps a group of one
    at r_i and does not zero degenerate groups.)

    Args/Raises: as :func:`compute_grpo_outcome_advantage` (``config`` unused).

    Returns:
        ``(advantages, returns)``: the same float32 ``(batch, response_len)`` tensor twice.
    """
    scores, mask, ids, g, _ = _outcome_setup(token_level_rewards, response_mask, index)
    degenerate = g.all_equal[ids]
    centered = torch.where(degenerate, torch.zeros_like(scores), scores - g.mean[ids])
    tokens = torch.where(mask, centered.unsqueeze(-1).expand(mask.shape), torch.zeros((), dtype=torch.float64, device=mask.device))
    adv = masked_whiten(tokens, mask)
    adv = torch.where(degenerate.unsqueeze(-1), torch.zeros_like(adv), adv).to(torch.float32)
    return adv, adv.clone()


@ADV_ESTIMATORS.register("remax", needs_greedy_baseline=True)
def compute_remax_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int] | None,
    config: AdvantageConfig,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505, Algorithm 1 / eq. 6).

    A_t = (sum_{s >= t} r_s) - r(x, greedy response): the undiscounted return-to-go over the valid
    tokens minus the reward of the greedy rollout for the same prompt. ReMax is defined without
    discounting, so ``config.gamma`` is not used.

    Args:
        token_level_rewards, response_mask: as above.
        index: unused (may be None).
        config: unused.
        reward_baselines: ``(batch,)`` float, the greedy response's score per row. Required.

    Returns:
        ``(advantages, returns)`` float32 ``(batch, response_len)``; returns are the raw
        returns-to-go.

    Raises:
        ValueError: ``reward_baselines`` missing, of the wrong size or non-finite.
    """
    rewards, mask = check_inputs(token_level_rewards, response_mask)
    batch = rewards.shape[0]
    if reward_baselines is None:
        raise ValueError("the 'remax' advantage estimator needs reward_baselines=(batch,) (the greedy rollout's score), got None")
    if not isinstance(reward_baselines, torch.Tensor) or reward_baselines.numel() != batch:
        raise ValueError(
            f"reward_baselines must be a tensor with one score per row (batch={batch}), got "
            f"{getattr(reward_baselines, 'shape', type(reward_baselines).__name__)}"
        )
    baseline = reward_baselines.detach().reshape(batch).to(device=rewards.device, dtype=torch.float64)
    if not bool(torch.isfinite(baseline).all()):
        row = int((~torch.isfinite(baseline)).nonzero()[0])
        raise ValueError(f"reward_baselines[{row}] is not finite: {baseline[row].item()}")
    returns = _returns_to_go(rewards, mask, 1.0)
    advantages = masked_tokens(returns - baseline.unsqueeze(-1), mask)
    return advantages.to(torch.float32), returns.to(torch.float32)


@ADV_ESTIMATORS.register("opo", needs_groups=True)
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int],
    config: AdvantageConfig,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: on-policy RL with the optimal reward baseline (Hao et al. 2025, arXiv:2505.23585, sec. 3).

    b = sum_i(len_i * r_i) / sum_i(len_i) over the group, len_i = number of valid tokens of row i;
    A_i = r_i - b. Groups whose scores are all equal (including groups of one) get exactly 0; a
    group whose responses are all empty uses the plain mean (their advantages are masked anyway).

    Args/Returns/Raises: as :func:`compute_grpo_outcome_advantage` (``config`` unused).
    """
    scores, mask, ids, g, _ = _outcome_setup(token_level_rewards, response_mask, index)
    lengths = mask.sum(dim=-1).to(torch.float64)
    zeros = torch.zeros_like(g.sum)
    len_sum = zeros.index_add(0, ids, lengths)
    weighted = zeros.index_add(0, ids, lengths * scores)
    baseline = torch.where(len_sum > 0, weighted / len_sum.clamp(min=1), g.mean)
    adv = torch.where(g.all_equal[ids], torch.zeros_like(scores), scores - baseline[ids])
    out = broadcast_rows(adv, mask)
    return out, out.clone()


@ADV_ESTIMATORS.register("gpg", needs_groups=True)
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int],
    config: AdvantageConfig,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546, sec. 3.2, AGE correction).

    A_i = alpha * (r_i - mean_group(r)) / F_norm with F_norm = 1 (verl's default) and the
    accurate-gradient-estimation factor alpha = B / (B - M), where B is the number of rows in the
    batch and M the number of rows whose group-centred advantage is 0 (rows of groups with all
    equal scores, which contribute no gradient); alpha = B when no row has a signal. Groups whose
    scores are all equal (including groups of one) get exactly 0.

    Note: verl counts rows with a non-zero *score* for M; with 0/1 rewards that differs from the
    paper's count of zero-gradient rows, which is what this follows.

    Args/Returns/Raises: as :func:`compute_grpo_outcome_advantage` (``config`` unused).
    """
    scores, mask, ids, g, _ = _outcome_setup(token_level_rewards, response_mask, index)
    centered = torch.where(g.all_equal[ids], torch.zeros_like(scores), scores - g.mean[ids])
    batch = scores.shape[0]
    n_signal = int((centered != 0).sum())
    alpha = batch / max(n_signal, 1)
    out = broadcast_rows(alpha * centered, mask)
    return out, out.clone()


@ADV_ESTIMATORS.register("grpo_passk", needs_groups=True)
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int],
    config: AdvantageConfig,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (Chen et al. 2025, arXiv:2503.19595; as verl's ``grpo_passk``).

    For the objective max(r_1..r_k) of a set of k samples, only the best sample's reward matters,
    so with the leave-one-out baseline (the max of the others) only the best response of each set
    gets a non-zero advantage: A_best = r_max - r_second_max, divided by (std_set + epsilon) when
    ``config.norm_adv_by_std_in_grpo`` (std unbiased); every other row gets 0. Ties for the
    maximum give 0. A set is the whole group (``config.pass_k=None``) or each consecutive block of
    ``pass_k`` rows of the group, in batch order.

    Args:
        token_level_rewards, response_mask, index: as above.
        config: uses ``pass_k``, ``norm_adv_by_std_in_grpo`` and ``epsilon``.

    Returns:
        ``(advantages, returns)``: the same float32 ``(batch, response_len)`` tensor twice.

    Raises:
        ValueError: a set has fewer than 2 rows, or a group's size is not a multiple of ``pass_k``.
    """
    scores, mask, ids, _, keys = _outcome_setup(token_level_rewards, response_mask, index)
    rows_by_group: dict[int, list[int]] = {}
    for row, gid in enumerate(ids.tolist()):
        rows_by_group.setdefault(gid, []).append(row)
    score_list = scores.tolist()
    adv = [0.0] * len(score_list)
    for gid, rows in rows_by_group.items():
        k = config.pass_k or len(rows)
        if len(rows) < 2 or len(rows) % k != 0:
            raise ValueError(
                f"grpo_passk needs groups of at least 2 rows split into sets of pass_k={config.pass_k}: "
                f"group {keys[gid]!r} has {len(rows)} row(s)"
            )
        for start in range(0, len(rows), k):
            block = rows[start : start + k]
            vals = torch.tensor([score_list[r] for r in block], dtype=torch.float64)
            top = torch.topk(vals, 2)
            gap = float(top.values[0] - top.values[1])
            if gap == 0.0:
                continue
            if config.norm_adv_by_std_in_grpo:
                gap = gap / (float(vals.std()) + config.epsilon)
            adv[block[int(top.indices[0])]] = gap
    out = broadcast_rows(torch.tensor(adv, dtype=torch.float64, device=mask.device), mask)
    return out, out.clone()


def needs_values(name: str) -> bool:
    """Whether the estimator registered as ``name`` needs a critic's values.

    Raises:
        ValueError: unknown ``name`` (lists the registered ones).
    """
    return ADV_ESTIMATORS.meta(name).needs_values


def needs_groups(name: str) -> bool:
    """Whether estimator ``name`` needs several samples per prompt (:attr:`EstimatorMeta.needs_groups`).

    Raises:
        ValueError: unknown estimator (lists the registered ones).
    """
    return ADV_ESTIMATORS.meta(name).needs_groups


def needs_greedy_baseline(name: str) -> bool:
    """Whether the estimator registered as ``name`` needs a greedy-rollout baseline reward per prompt.

    Raises:
        ValueError: unknown ``name`` (lists the registered ones).
    """
    return ADV_ESTIMATORS.meta(name).needs_greedy_baseline


@ADV_ESTIMATORS.register("opd")
def compute_opd_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[str | int],
                          config: AdvantageConfig, *, teacher_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                          opd_coef: float = 1.0, opd_task_coef: float = 0.0, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (:func:`stages.distillation.opd_advantage`): per token
    ``opd_coef * (teacher - student) + opd_task_coef * A_grpo`` (the task reward's GRPO advantage)."""
    task = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, config)[0] if opd_task_coef \
        else None
    return opd_advantage(teacher_log_probs, rollout_log_probs, response_mask, opd_coef, task, opd_task_coef)


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int] | None,
    config: AdvantageConfig | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the advantage estimator registered as ``name``.

    Args:
        name: config name (``algorithm.adv_estimator``), one of ``ADV_ESTIMATORS.names()``.
        token_level_rewards: ``(batch, response_len)`` float.
        response_mask: ``(batch, response_len)`` bool or 0/1.
        index: length-batch group ids (may be None for gae, reinforce_plus_plus, remax).
        config: :class:`AdvantageConfig`; defaults to ``AdvantageConfig()``.
        **extra: ``values=`` (gae), ``reward_baselines=`` (remax); ignored by estimators that do
            not use them.

    Returns:
        ``(advantages, returns)``, each float32 ``(batch, response_len)``, 0 outside the mask.

    Raises:
        ValueError: unknown ``name`` (lists the registered ones) or malformed inputs.
    """
    fn = ADV_ESTIMATORS.get(name)
    return fn(token_level_rewards, response_mask, index, config if config is not None else AdvantageConfig(), **extra)


def advantage_table(joined: pa.Table, algorithm_cfg: dict, values: list[np.ndarray] | None = None,
                    reward_baselines: np.ndarray | None = None) -> pa.Table:
    """The advantage stage's output (``values`` only when a critic supplied them).

    Args:
        joined: rollout + reward columns (needs ``sample_id``, ``group_id``, ``response_ids``,
            ``token_rewards``; a multi-turn rollout's ``loss_mask`` restricts every estimator to the
            generated tokens, and the other tokens get advantage and return 0).
        algorithm_cfg: the ``algorithm`` config section.
        values: critic values per row (ragged, aligned with ``response_ids``), for ``gae``.
        reward_baselines: per-row baseline reward (ReMax's greedy score).
    """
    resp_len = lengths(joined.column("response_ids"))
    T = max(int(resp_len.max()) if len(resp_len) else 1, 1)
    rewards = pad_ragged(joined.column("token_rewards"), 0.0, torch.float32, length=T)
    mask = trainable_mask(joined, T)  # a multi-turn row's tool/environment tokens take no part
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
    if algorithm_cfg["adv_estimator"] == "opd":  # the teacher's and the student's log-probs of the sampled tokens
        extra.update(teacher_log_probs=pad_ragged(joined.column("teacher_logprobs"), 0.0, torch.float32, length=T),
                     rollout_log_probs=pad_ragged(joined.column("rollout_logprobs"), 0.0, torch.float32, length=T),
                     opd_coef=float(algorithm_cfg["opd_coef"]), opd_task_coef=float(algorithm_cfg["opd_task_coef"]))
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
