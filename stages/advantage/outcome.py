"""Outcome estimators: one score per response, a baseline from the other responses of the same
prompt (GRPO / Dr. GRPO, RLOO, REINFORCE++ with a group baseline, OPO, GPG, pass@k), broadcast to
every generated token.

All follow the contract of :mod:`trajflow.stages.advantage` (signature, shapes, masking guarantees).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trajflow.stages.advantage.registry import ADV_ESTIMATORS, AdvantageConfig, masked_whiten
from trajflow.stages.group_stats import GroupStats, broadcast_rows, check_inputs, group_ids


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
