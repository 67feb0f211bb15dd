"""Input checks and per-group statistics shared by the advantage estimators (:mod:`trajflow.stages.advantage`).

Rewards and masks are validated here, at the estimators' boundary: errors name the argument, the
row and what was expected. Statistics are float64 so that a group of equal scores gives exactly 0.
"""

from __future__ import annotations

from typing import Any

import torch


def check_inputs(token_level_rewards: Any, response_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate rewards and mask; return (rewards as float64 with 0 outside the mask, bool mask)."""
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
        raise ValueError(
            "token_level_rewards must be a 2-D torch.Tensor of shape (batch, response_len), got "
            f"{type(token_level_rewards).__name__} with shape {getattr(token_level_rewards, 'shape', None)}"
        )
    if not token_level_rewards.is_floating_point():
        raise ValueError(f"token_level_rewards must be a float tensor, got dtype {token_level_rewards.dtype}")
    if not isinstance(response_mask, torch.Tensor) or response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask must be a torch.Tensor with the shape of token_level_rewards "
            f"{tuple(token_level_rewards.shape)}, got {getattr(response_mask, 'shape', type(response_mask).__name__)}"
        )
    mask = as_bool_mask(response_mask, "response_mask")
    rewards = masked_finite(token_level_rewards, mask, "token_level_rewards")
    return rewards, mask


def as_bool_mask(mask: torch.Tensor, name: str) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must be bool or hold only 0 and 1, got values outside {{0, 1}}")
    return mask != 0


def masked_finite(x: torch.Tensor, mask: torch.Tensor, name: str) -> torch.Tensor:
    """float64 copy of ``x`` with 0 outside ``mask``; raise on non-finite values inside it."""
    x64 = x.detach().to(torch.float64)
    bad = mask & ~torch.isfinite(x64)
    if bool(bad.any()):
        row, col = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{name} has a non-finite value {x64[row, col].item()} at row {row}, token {col} (inside the mask)")
    return torch.where(mask, x64, torch.zeros_like(x64))


def group_ids(index: Any, batch: int, device: torch.device) -> tuple[torch.Tensor, list[Any]]:
    """Map group ids to ``0..G-1`` in order of first appearance; return (ids (batch,), keys)."""
    if index is None:
        raise ValueError("index (one group id per row) is required by this advantage estimator, got None")
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    try:
        keys_per_row = list(index)
    except TypeError:
        raise ValueError(f"index must be a sequence of group ids, got {type(index).__name__}") from None
    if len(keys_per_row) != batch:
        raise ValueError(f"index must have one group id per row: expected length {batch}, got {len(keys_per_row)}")
    lookup: dict[Any, int] = {}
    ids = []
    for row, key in enumerate(keys_per_row):
        if hasattr(key, "item") and not isinstance(key, (str, bytes)):
            key = key.item()  # numpy / torch scalars hash like the Python value
        try:
            ids.append(lookup.setdefault(key, len(lookup)))
        except TypeError:
            raise ValueError(f"index[{row}] must be a hashable group id (str or int), got {key!r}") from None
    return torch.tensor(ids, dtype=torch.long, device=device), list(lookup)


class GroupStats:
    """Per-group statistics of one scalar score per row, all in float64.

    Attributes (per group, shape (num_groups,)): ``count``, ``sum``, ``mean``, ``std`` (unbiased,
    like ``torch.std``; 0 for groups of one) and ``all_equal`` (max == min, true for groups of one).
    """

    def __init__(self, scores: torch.Tensor, ids: torch.Tensor, num_groups: int) -> None:
        zeros = torch.zeros(num_groups, dtype=torch.float64, device=scores.device)
        self.count = zeros.index_add(0, ids, torch.ones_like(scores))
        self.sum = zeros.index_add(0, ids, scores)
        self.mean = self.sum / self.count
        sq = zeros.index_add(0, ids, (scores - self.mean[ids]) ** 2)
        self.std = torch.where(self.count > 1, sq / (self.count - 1).clamp(min=1), zeros).sqrt()
        gmax = torch.full_like(zeros, -torch.inf).scatter_reduce(0, ids, scores, "amax")
        gmin = torch.full_like(zeros, torch.inf).scatter_reduce(0, ids, scores, "amin")
        self.all_equal = gmax == gmin


def broadcast_rows(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(batch,) float64 -> (batch, response_len) float32 on the valid tokens, 0 elsewhere."""
    out = torch.where(mask, per_row.unsqueeze(-1).expand(mask.shape), torch.zeros((), dtype=per_row.dtype, device=mask.device))
    return out.to(torch.float32)


def masked_tokens(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x))
