"""The policy-gradient loss family: PPO-clip (dual clip, clip-higher), GSPO, CISPO, GPG, and the loss
aggregation modes they share.

Shapes: every per-token tensor is ``(batch, response_len)``; masks are bool or 0/1 (a nonzero
entry marks a token that counts). Values stored outside the mask never reach a loss.

Policy losses are registered in :data:`POLICY_LOSSES` under their config name
(``actor.policy_loss.loss_mode``) with one signature::

    fn(old_log_prob, log_prob, advantages, response_mask, config, *, rollout_is_weights=None, **agg_kwargs)
        -> (loss: 0-dim tensor, metrics: dict[str, float])

where ``agg_kwargs`` are passed to :func:`agg_loss` (``global_num_tokens``,
``global_num_seqs``, ``horizon``) and ``metrics`` always holds ``actor/pg_clipfrac``,
``actor/ppo_kl`` and ``actor/pg_clipfrac_lower`` (verl's names). ``rollout_is_weights``
(``(batch, response_len)``, from :func:`trajflow.stages.rollout_correction.rollout_is_weights`) multiplies
the per-token policy-gradient loss before aggregation (truncated importance sampling for a rollout
engine whose log-probs differ from the trainer's; Yao et al. 2025); it is treated as a constant.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from trajflow.stages.registry import Registry

__all__ = ["AGG_MODES", "POLICY_LOSSES", "PolicyLossConfig", "agg_loss", "compute_policy_loss",
           "compute_policy_loss_cispo", "compute_policy_loss_gpg", "compute_policy_loss_gspo",
           "compute_policy_loss_vanilla"]

POLICY_LOSSES = Registry("policy loss")

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: The log importance ratio is clamped to [-20, 20] before exp() (overflow guard, as verl).
LOG_RATIO_CLAMP = 20.0
#: GSPO's token ratio is clamped above at exp(10) in log space (as verl).
GSPO_LOG_RATIO_MAX = 10.0
#: GSPO's clip range on the sequence ratio when ``actor.clip_ratio_low/high`` are unset (Zheng et al.
#: 2025, sec. 5.1: 3e-4 and 4e-4; ratios of sequences sit much closer to 1 than those of tokens).
GSPO_CLIP_RATIO_LOW = 3e-4
GSPO_CLIP_RATIO_HIGH = 4e-4
#: CISPO's upper epsilon when ``actor.clip_ratio_high`` is unset: an IS weight of at most 5
#: (ScaleRL's recipe, arXiv:2510.13786).
CISPO_CLIP_RATIO_HIGH = 4.0


@dataclass
class PolicyLossConfig:
    """Settings of the policy losses (config section ``actor``).

    ``clip_ratio_low`` / ``clip_ratio_high`` are shared by the losses as verl shares
    ``actor.clip_ratio_low/high``; ``None`` means "the loss's own default", because the losses clip
    different quantities on different scales (PPO a token ratio by ~0.2, GSPO a sequence ratio by
    ~3e-4, CISPO an importance weight up to ~5).

    Attributes:
        clip_ratio_low: lower clip epsilon. ``vanilla``: the ratio is clipped below at
            1 - clip_ratio_low (None: ``clip_ratio``); ``gspo``: the sequence ratio is clipped below
            at 1 - clip_ratio_low (None: :data:`GSPO_CLIP_RATIO_LOW`, the paper's 3e-4); not used by
            ``cispo`` (see ``cispo_clip_ratio_low``).
        clip_ratio_high: upper clip epsilon. ``vanilla``: 1 + clip_ratio_high (None: ``clip_ratio``;
            above ``clip_ratio_low`` it is DAPO's clip-higher); ``gspo``: 1 + clip_ratio_high (None:
            :data:`GSPO_CLIP_RATIO_HIGH`, 4e-4); ``cispo``: the IS weight is at most
            1 + clip_ratio_high (None: :data:`CISPO_CLIP_RATIO_HIGH`, a weight of at most 5).
        clip_ratio_c: dual-clip constant c > 1: for negative advantages the loss is capped at
            c * |A| (Ye et al. 2020).
        loss_agg_mode: how the token losses become a scalar, one of :data:`AGG_MODES`.
        clip_ratio: the symmetric PPO epsilon used where clip_ratio_low/high are None.
        cispo_clip_ratio_low: CISPO's lower bound on the IS weight is 1 - this; None (default)
            means no lower bound, as MiniMax-M1 and ScaleRL use.
    """

    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    cispo_clip_ratio_low: float | None = None

    def __post_init__(self) -> None:
        _check_nonneg("clip_ratio", self.clip_ratio)
        for name in ("clip_ratio_low", "clip_ratio_high", "cispo_clip_ratio_low"):
            if getattr(self, name) is not None:
                _check_nonneg(name, getattr(self, name))
        c = self.clip_ratio_c
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not c > 1.0:
            raise ValueError(f"PolicyLossConfig.clip_ratio_c must be a number > 1 (dual-clip PPO), got {c!r}")
        if self.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"PolicyLossConfig.loss_agg_mode must be one of {list(AGG_MODES)}, got {self.loss_agg_mode!r}")

    @property
    def low(self) -> float:
        """The effective PPO lower clip epsilon."""
        return float(self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low)

    @property
    def high(self) -> float:
        """The effective PPO upper clip epsilon."""
        return float(self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high)

    @property
    def gspo_low(self) -> float:
        """GSPO's effective lower clip on the sequence ratio."""
        return float(GSPO_CLIP_RATIO_LOW if self.clip_ratio_low is None else self.clip_ratio_low)

    @property
    def gspo_high(self) -> float:
        """GSPO's effective upper clip on the sequence ratio."""
        return float(GSPO_CLIP_RATIO_HIGH if self.clip_ratio_high is None else self.clip_ratio_high)

    @property
    def cispo_high(self) -> float:
        """CISPO's effective upper epsilon: the IS weight is at most 1 + this."""
        return float(CISPO_CLIP_RATIO_HIGH if self.clip_ratio_high is None else self.clip_ratio_high)


def _check_nonneg(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise ValueError(f"PolicyLossConfig.{name} must be a number >= 0, got {value!r}")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def check_same_shape(**tensors: torch.Tensor) -> None:
    items = list(tensors.items())
    ref_name, ref = items[0]
    if not isinstance(ref, torch.Tensor) or ref.dim() != 2:
        raise ValueError(f"{ref_name} must be a 2-D tensor (batch, response_len), got {getattr(ref, 'shape', type(ref).__name__)}")
    for name, t in items[1:]:
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape:
            raise ValueError(
                f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {getattr(t, 'shape', type(t).__name__)}"
            )


def fill_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on the valid tokens and 0 elsewhere, so that values stored after EOS (even NaN/inf)
    reach neither the loss nor, through 0 * NaN in the backward pass, the gradient."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


@torch.no_grad()
def masked_mean_float(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``x`` over the masked entries as a Python float (0.0 with no masked entry)."""
    n = int(mask.sum())
    if n == 0:
        return 0.0
    return float(torch.where(mask, x.to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device)).sum() / n)


def _apply_is_weights(pg_losses: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """``pg_losses * weights`` on the valid tokens (rollout importance-sampling correction), detached weights.

    Raises:
        ValueError: ``weights`` is not of the shape of ``pg_losses``.
    """
    if weights is None:
        return pg_losses
    if not isinstance(weights, torch.Tensor) or weights.shape != pg_losses.shape:
        raise ValueError(f"rollout_is_weights must have the shape of log_prob {tuple(pg_losses.shape)}, got "
                         f"{getattr(weights, 'shape', type(weights).__name__)}")
    w = fill_outside(weights.detach().to(pg_losses.dtype), mask)
    return pg_losses * w


def _positive(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar.

    With ``l`` the loss, ``m`` the mask, ``N`` the number of rows (``global_num_seqs`` or the
    batch size) and ``T`` the padded length:

    * ``token-mean``: sum(l * m) / (global_num_tokens or sum(m)) -- every valid token weighs the
      same (DAPO, Yu et al. 2025, eq. 8).
    * ``seq-mean-token-sum``: sum_i sum_t l_it m_it / N.
    * ``seq-mean-token-mean``: sum_i (sum_t l_it m_it / sum_t m_it) / N -- the original GRPO
      objective (Shao et al. 2024, eq. 3); a row without valid tokens contributes 0.
    * ``seq-mean-token-sum-norm``: sum_i (sum_t l_it m_it / H) / N with H = ``horizon`` (default
      T) -- Dr. GRPO's constant normaliser (Liu et al. 2025, sec. 3.2). (Older verl divides by H
      only, without the 1/N.)

    Gradient accumulation: split a mini-batch into micro-batches by rows and pass each the whole
    mini-batch's ``global_num_tokens`` (valid tokens) and ``global_num_seqs`` (rows), and the same
    ``horizon``; then the micro-batch losses sum exactly to the mini-batch's loss.

    Args:
        loss_mat: ``(batch, response_len)`` float.
        loss_mask: ``(batch, response_len)`` bool or 0/1.
        mode: one of :data:`AGG_MODES` (``actor.loss_agg_mode``).
        global_num_tokens: token-mean denominator, > 0 (default: this batch's valid tokens).
        global_num_seqs: seq-* denominator, > 0 (default: this batch's rows).
        horizon: seq-mean-token-sum-norm's per-row normaliser, > 0 (default: ``response_len``).

    Returns:
        0-dim tensor in the dtype of ``loss_mat``, differentiable; 0 when nothing is valid.

    Raises:
        ValueError: unknown ``mode``, mismatched shapes, or non-positive denominators.
    """
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    mask = bool_mask(loss_mask)
    masked = torch.where(mask, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    batch, length = loss_mat.shape
    num_seqs = _positive("global_num_seqs", global_num_seqs) if global_num_seqs is not None else float(max(batch, 1))
    if mode == "token-mean":
        if global_num_tokens is not None:
            return masked.sum() / _positive("global_num_tokens", global_num_tokens)
        return masked.sum() / max(int(mask.sum()), 1)
    if mode == "seq-mean-token-sum":
        return masked.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        per_row = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(loss_mat.dtype)
        return per_row.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        h = _positive("horizon", horizon) if horizon is not None else float(max(length, 1))
        return masked.sum() / h / num_seqs
    raise ValueError(f"Unknown loss_agg_mode {mode!r}; expected one of {list(AGG_MODES)}")


# --------------------------------------------------------------------------------------------
# policy losses
# --------------------------------------------------------------------------------------------


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


@POLICY_LOSSES.register("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric and dual clipping.

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20));
    L1 = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))   (Schulman et al. 2017,
    arXiv:1707.06347, eq. 7, as a loss; eps_high > eps_low is DAPO's clip-higher, Yu et al. 2025,
    arXiv:2503.14476, eq. 10); for A < 0 the loss is further capped: min(L1, -A * c) (dual-clip
    PPO, Ye et al. 2020, arXiv:1912.09729, eq. 5). Aggregated with ``config.loss_agg_mode``.

    Args:
        old_log_prob: ``(batch, response_len)``, log-probs of the sampled tokens under the
            behaviour (rollout-time) policy.
        log_prob: ``(batch, response_len)``, under the current policy (carries the gradient).
        advantages: ``(batch, response_len)``.
        response_mask: ``(batch, response_len)`` bool or 0/1.
        config: :class:`PolicyLossConfig` (default ``PolicyLossConfig()``).
        rollout_is_weights: optional ``(batch, response_len)`` rollout importance weights that
            multiply each token's loss before aggregation (no gradient flows through them).
        **agg_kwargs: ``global_num_tokens``/``global_num_seqs``/``horizon`` for :func:`agg_loss`.

    Returns:
        ``(loss, metrics)``: 0-dim loss; ``actor/pg_clipfrac`` (fraction of valid tokens where the
        clipped term is the larger loss), ``actor/ppo_kl`` (mean of old - new log-prob over the
        mask), ``actor/pg_clipfrac_lower`` (fraction where the dual clip is active).

    Raises:
        ValueError: mismatched shapes.
    """
    config = config or PolicyLossConfig()
    check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask)
    mask = bool_mask(response_mask)
    old_log_prob, log_prob, advantages = (fill_outside(t, mask) for t in (old_log_prob, log_prob, advantages))
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - config.low, 1.0 + config.high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_ppo, -advantages * config.clip_ratio_c)
    negative = advantages < 0
    pg_losses = torch.where(negative, loss_dual, loss_ppo)
    loss = agg_loss(_apply_is_weights(pg_losses, rollout_is_weights, mask), mask, config.loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": masked_mean_float((loss_clipped > loss_unclipped).float(), mask),
        "actor/ppo_kl": masked_mean_float(-log_ratio, mask),
        "actor/pg_clipfrac_lower": masked_mean_float(((loss_ppo > -advantages * config.clip_ratio_c) & negative).float(), mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token (Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071, eq. 13-14).

    Sequence ratio s_i = exp(mean over the row's valid tokens of (log_prob - old_log_prob));
    token ratio s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)] -- equal to s_i in value, with the
    gradient of the token's own log-prob (computed in log space, clamped above at 10);
    loss_it = max(-A_it * s_it, -A_it * clip(s_it, 1 - eps_low, 1 + eps_high)). With
    sequence-level advantages this is GSPO's gradient. Aggregated with ``config.loss_agg_mode``;
    the paper's objective (eq. 5-7: the mean over sequences of each sequence's term) is
    ``seq-mean-token-mean``, and the other modes weight a sequence by its length, so the run
    config accepts GSPO with that mode only (:func:`trajflow.config.validate`).

    Args/Raises: as :func:`compute_policy_loss_vanilla`; eps_low/eps_high are
    ``config.clip_ratio_low/high`` (``actor.clip_ratio_low/high``), or 3e-4/4e-4 when unset.

    Returns:
        ``(loss, metrics)``: ``actor/pg_clipfrac`` is the fraction of valid tokens whose clipped
        term is active; ``actor/pg_clipfrac_lower`` is 0.0 (no dual clip).
    """
    config = config or PolicyLossConfig()
    check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask)
    mask = bool_mask(response_mask)
    old_log_prob, log_prob, advantages = (fill_outside(t, mask) for t in (old_log_prob, log_prob, advantages))
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(log_prob.dtype)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    token_log_ratio = torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(token_log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - config.gspo_low, 1.0 + config.gspo_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    loss = agg_loss(_apply_is_weights(pg_losses, rollout_is_weights, mask), mask, config.loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": masked_mean_float((loss_clipped > loss_unclipped).float(), mask),
        "actor/ppo_kl": masked_mean_float(-log_ratio, mask),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, sec. 3.1, eq. 4-5).

    loss_it = -sg[clip(r_it, 1 - eps_low, 1 + eps_high)] * A_it * log_prob_it with
    r_it = exp(clamp(log_prob - old_log_prob, -20, 20)): the importance-sampling *weight* is
    clipped and detached, so every token keeps the gradient A * grad log pi scaled by the weight
    (PPO instead drops clipped tokens). Aggregated with ``config.loss_agg_mode``.

    Args/Raises: as :func:`compute_policy_loss_vanilla`; eps_high is ``config.clip_ratio_high``
    (``actor.clip_ratio_high``, as verl's CISPO reads it), 4.0 when unset; eps_low is
    ``config.cispo_clip_ratio_low`` (None: no lower bound).

    Returns:
        ``(loss, metrics)``: ``actor/pg_clipfrac`` is the fraction of valid tokens whose weight
        hit the upper bound, ``actor/pg_clipfrac_lower`` those at the lower bound.
    """
    config = config or PolicyLossConfig()
    check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask)
    mask = bool_mask(response_mask)
    old_log_prob, log_prob, advantages = (fill_outside(t, mask) for t in (old_log_prob, log_prob, advantages))
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio).detach()
    upper = 1.0 + config.cispo_high
    lower = None if config.cispo_clip_ratio_low is None else 1.0 - config.cispo_clip_ratio_low
    weight = torch.clamp(ratio, min=lower, max=upper)
    pg_losses = -weight * advantages * log_prob
    loss = agg_loss(_apply_is_weights(pg_losses, rollout_is_weights, mask), mask, config.loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": masked_mean_float((ratio > upper).float(), mask),
        "actor/ppo_kl": masked_mean_float(-log_ratio, mask),
        "actor/pg_clipfrac_lower": 0.0 if lower is None else masked_mean_float((ratio < lower).float(), mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG policy-gradient loss (Chu et al. 2025, arXiv:2504.02546, eq. 5): -A_it * log_prob_it.

    No ratio and no clipping: the plain REINFORCE objective with the group baseline carried by
    the advantages (use with the ``gpg`` advantage estimator). Aggregated with
    ``config.loss_agg_mode``.

    Args/Raises: as :func:`compute_policy_loss_vanilla`.

    Returns:
        ``(loss, metrics)``: the clip fractions are 0.0; ``actor/ppo_kl`` as for vanilla.
    """
    config = config or PolicyLossConfig()
    check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask)
    mask = bool_mask(response_mask)
    old_log_prob, log_prob, advantages = (fill_outside(t, mask) for t in (old_log_prob, log_prob, advantages))
    loss = agg_loss(_apply_is_weights(-advantages * log_prob, rollout_is_weights, mask), mask, config.loss_agg_mode,
                    **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": masked_mean_float(-(log_prob - old_log_prob).detach(), mask),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


def compute_policy_loss(
    name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the policy loss registered as ``name`` (``actor.policy_loss.loss_mode``).

    Args:
        name: one of ``POLICY_LOSSES.names()``.
        old_log_prob, log_prob, advantages, response_mask: ``(batch, response_len)``.
        config: :class:`PolicyLossConfig` (default ``PolicyLossConfig()``).
        rollout_is_weights: optional ``(batch, response_len)`` rollout importance weights
            multiplied into the per-token loss (see the module docstring).
        **agg_kwargs: forwarded to :func:`agg_loss`.

    Returns:
        ``(loss, metrics)`` as the registered function.

    Raises:
        ValueError: unknown ``name`` (lists the registered ones) or malformed inputs.
    """
    fn = POLICY_LOSSES.get(name)
    return fn(old_log_prob, log_prob, advantages, response_mask, config or PolicyLossConfig(),
              rollout_is_weights=rollout_is_weights, **agg_kwargs)
