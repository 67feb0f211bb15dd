"""The advantage estimators' registry, the settings they share and batch whitening.

Estimators register here (:mod:`trajflow.stages.advantage.token_level`, :mod:`trajflow.stages.advantage.outcome`) with
:class:`EstimatorMeta`; :mod:`trajflow.stages.advantage` imports them all, so import the registry from there.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from trajflow.stages.registry import Registry


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
