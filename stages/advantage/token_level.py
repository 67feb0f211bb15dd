"""Token-level estimators, whose advantage differs from token to token of a response: GAE with a
critic, REINFORCE++ and ReMax (returns-to-go, whitened or minus a greedy baseline), on-policy
distillation (the teacher's log-probs against the student's).

All follow the contract of :mod:`trajflow.stages.advantage` (signature, shapes, masking guarantees).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trajflow.stages.advantage.outcome import compute_grpo_outcome_advantage
from trajflow.stages.advantage.registry import ADV_ESTIMATORS, AdvantageConfig, masked_whiten
from trajflow.stages.distillation import opd_advantage
from trajflow.stages.group_stats import check_inputs, masked_finite, masked_tokens


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


@ADV_ESTIMATORS.register("opd")
def compute_opd_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[str | int],
                          config: AdvantageConfig, *, teacher_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                          opd_coef: float = 1.0, opd_task_coef: float = 0.0, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (:func:`trajflow.stages.distillation.opd_advantage`): per token
    ``opd_coef * (teacher - student) + opd_task_coef * A_grpo`` (the task reward's GRPO advantage)."""
    task = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, config)[0] if opd_task_coef \
        else None
    return opd_advantage(teacher_log_probs, rollout_log_probs, response_mask, opd_coef, task, opd_task_coef)
