"""The policy and critic update: its losses and its typed input batches.

Losses: PPO-clip (dual clip, clip-higher), GSPO, CISPO, GPG, loss aggregation modes, the KL loss,
the value loss with clipping, token entropy, and :func:`actor_loss`, the whole per-micro-batch
actor objective (policy gradient - entropy bonus + KL loss) the policy worker backpropagates.

Batches: :func:`update_batch` and :func:`critic_batch` turn one iteration's stored stage tables
into the typed :class:`UpdateBatch` / :class:`CriticBatch` the workers' ``update_actor`` /
``update_critic`` take (verl's ``DataProto``, typed: per-row ragged lists plus update settings).

Shapes: every per-token tensor is ``(batch, response_len)``; masks are bool or 0/1 (a nonzero
entry marks a token that counts). Values stored outside the mask never reach a loss.

Policy losses are registered in :data:`POLICY_LOSSES` under their config name
(``actor.policy_loss.loss_mode``) with one signature::

    fn(old_log_prob, log_prob, advantages, response_mask, config, *, rollout_is_weights=None, **agg_kwargs)
        -> (loss: 0-dim tensor, metrics: dict[str, float])

where ``agg_kwargs`` are passed to :func:`agg_loss` (``global_num_tokens``,
``global_num_seqs``, ``horizon``) and ``metrics`` always holds ``actor/pg_clipfrac``,
``actor/ppo_kl`` and ``actor/pg_clipfrac_lower`` (verl's names). ``rollout_is_weights``
(``(batch, response_len)``, from :func:`stages.rollout_correction.rollout_is_weights`) multiplies
the per-token policy-gradient loss before aggregation (truncated importance sampling for a rollout
engine whose log-probs differ from the trainer's; Yao et al. 2025); it is treated as a constant.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from stages.kl import kl_penalty
from stages.registry import Registry

__all__ = [
    "AGG_MODES",
    "ACTOR_LOSS_SHARES",
    "POLICY_LOSSES",
    "ActorLossConfig",
    "CriticBatch",
    "CriticRows",
    "CriticSettings",
    "PolicyLossConfig",
    "UpdateBatch",
    "UpdateRows",
    "UpdateSettings",
    "actor_loss",
    "actor_loss_mask",
    "critic_batch",
    "update_batch",
    "update_batch_options",
    "with_loss_mask",
    "agg_loss",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_cispo",
    "compute_policy_loss_gpg",
    "entropy_from_logits",
    "value_loss",
    "kl_loss",
    "explained_variance",
]

POLICY_LOSSES = Registry("policy loss")

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: The log importance ratio is clamped to [-20, 20] before exp() (overflow guard, as verl).
LOG_RATIO_CLAMP = 20.0
#: GSPO's token ratio is clamped above at exp(10) in log space (as verl).
GSPO_LOG_RATIO_MAX = 10.0


@dataclass
class PolicyLossConfig:
    """Settings of the policy losses (config section ``actor.policy_loss`` / ``actor``).

    Attributes:
        clip_ratio_low: PPO lower clip epsilon: the ratio is clipped below at 1 - clip_ratio_low.
            None falls back to ``clip_ratio``.
        clip_ratio_high: PPO upper clip epsilon (1 + clip_ratio_high); set it above
            ``clip_ratio_low`` for DAPO's clip-higher. None falls back to ``clip_ratio``.
        clip_ratio_c: dual-clip constant c > 1: for negative advantages the loss is capped at
            c * |A| (Ye et al. 2020).
        loss_agg_mode: how the token losses become a scalar, one of :data:`AGG_MODES`.
        clip_ratio: the symmetric epsilon used where clip_ratio_low/high are None.
        gspo_clip_ratio_low: GSPO's lower clip on the sequence ratio (paper: 3e-4).
        gspo_clip_ratio_high: GSPO's upper clip on the sequence ratio (paper: 4e-4).
        cispo_clip_ratio_low: CISPO's lower bound on the IS weight is 1 - this; None (default)
            means no lower bound, as MiniMax-M1 and ScaleRL use.
        cispo_clip_ratio_high: CISPO's upper bound on the IS weight is 1 + this (default 4.0, an
            IS weight of at most 5, ScaleRL's recipe, arXiv:2510.13786).
    """

    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    gspo_clip_ratio_low: float = 3e-4
    gspo_clip_ratio_high: float = 4e-4
    cispo_clip_ratio_low: float | None = None
    cispo_clip_ratio_high: float = 4.0

    def __post_init__(self) -> None:
        for name in ("clip_ratio", "gspo_clip_ratio_low", "gspo_clip_ratio_high", "cispo_clip_ratio_high"):
            _check_nonneg(name, getattr(self, name))
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


def _check_nonneg(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise ValueError(f"PolicyLossConfig.{name} must be a number >= 0, got {value!r}")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_same_shape(**tensors: torch.Tensor) -> None:
    items = list(tensors.items())
    ref_name, ref = items[0]
    if not isinstance(ref, torch.Tensor) or ref.dim() != 2:
        raise ValueError(f"{ref_name} must be a 2-D tensor (batch, response_len), got {getattr(ref, 'shape', type(ref).__name__)}")
    for name, t in items[1:]:
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape:
            raise ValueError(
                f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {getattr(t, 'shape', type(t).__name__)}"
            )


def _fill_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on the valid tokens and 0 elsewhere, so that values stored after EOS (even NaN/inf)
    reach neither the loss nor, through 0 * NaN in the backward pass, the gradient."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


@torch.no_grad()
def _masked_mean_float(x: torch.Tensor, mask: torch.Tensor) -> float:
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
    w = _fill_outside(weights.detach().to(pg_losses.dtype), mask)
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
    _check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    mask = _bool_mask(loss_mask)
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
    _check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask)
    mask = _bool_mask(response_mask)
    old_log_prob, log_prob, advantages = (_fill_outside(t, mask) for t in (old_log_prob, log_prob, advantages))
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
        "actor/pg_clipfrac": _masked_mean_float((loss_clipped > loss_unclipped).float(), mask),
        "actor/ppo_kl": _masked_mean_float(-log_ratio, mask),
        "actor/pg_clipfrac_lower": _masked_mean_float(((loss_ppo > -advantages * config.clip_ratio_c) & negative).float(), mask),
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
    loss_it = max(-A_it * s_it, -A_it * clip(s_it, 1 - gspo_low, 1 + gspo_high)). With
    sequence-level advantages this is GSPO's gradient. Aggregated with ``config.loss_agg_mode``
    (the paper's objective is ``seq-mean-token-mean``).

    Args/Raises: as :func:`compute_policy_loss_vanilla`; uses ``config.gspo_clip_ratio_low/high``.

    Returns:
        ``(loss, metrics)``: ``actor/pg_clipfrac`` is the fraction of valid tokens whose clipped
        term is active; ``actor/pg_clipfrac_lower`` is 0.0 (no dual clip).
    """
    config = config or PolicyLossConfig()
    _check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask)
    mask = _bool_mask(response_mask)
    old_log_prob, log_prob, advantages = (_fill_outside(t, mask) for t in (old_log_prob, log_prob, advantages))
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(log_prob.dtype)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    token_log_ratio = torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(token_log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - config.gspo_clip_ratio_low, 1.0 + config.gspo_clip_ratio_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    loss = agg_loss(_apply_is_weights(pg_losses, rollout_is_weights, mask), mask, config.loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": _masked_mean_float((loss_clipped > loss_unclipped).float(), mask),
        "actor/ppo_kl": _masked_mean_float(-log_ratio, mask),
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

    Args/Raises: as :func:`compute_policy_loss_vanilla`; uses ``config.cispo_clip_ratio_low/high``.

    Returns:
        ``(loss, metrics)``: ``actor/pg_clipfrac`` is the fraction of valid tokens whose weight
        hit the upper bound, ``actor/pg_clipfrac_lower`` those at the lower bound.
    """
    config = config or PolicyLossConfig()
    _check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask)
    mask = _bool_mask(response_mask)
    old_log_prob, log_prob, advantages = (_fill_outside(t, mask) for t in (old_log_prob, log_prob, advantages))
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio).detach()
    upper = 1.0 + config.cispo_clip_ratio_high
    lower = None if config.cispo_clip_ratio_low is None else 1.0 - config.cispo_clip_ratio_low
    weight = torch.clamp(ratio, min=lower, max=upper)
    pg_losses = -weight * advantages * log_prob
    loss = agg_loss(_apply_is_weights(pg_losses, rollout_is_weights, mask), mask, config.loss_agg_mode, **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": _masked_mean_float((ratio > upper).float(), mask),
        "actor/ppo_kl": _masked_mean_float(-log_ratio, mask),
        "actor/pg_clipfrac_lower": 0.0 if lower is None else _masked_mean_float((ratio < lower).float(), mask),
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
    _check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask)
    mask = _bool_mask(response_mask)
    old_log_prob, log_prob, advantages = (_fill_outside(t, mask) for t in (old_log_prob, log_prob, advantages))
    loss = agg_loss(_apply_is_weights(-advantages * log_prob, rollout_is_weights, mask), mask, config.loss_agg_mode,
                    **agg_kwargs)
    metrics = {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": _masked_mean_float(-(log_prob - old_log_prob).detach(), mask),
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


# --------------------------------------------------------------------------------------------
# entropy, value loss, KL loss
# --------------------------------------------------------------------------------------------


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution softmax(logits) over the last dimension.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, which never forms log(softmax) and so stays
    finite for large logits; vocabulary entries with logit -inf (filtered out) contribute 0.

    Args:
        logits: ``(..., vocab)`` float, e.g. ``(batch, response_len, vocab)``.

    Returns:
        ``(...)`` entropy in nats, in the dtype of ``logits``.
    """
    probs = torch.softmax(logits, dim=-1)
    weighted = torch.where(probs > 0, probs * logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.logsumexp(logits, dim=-1) - weighted.sum(dim=-1)


def value_loss(
    vpreds: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped value loss (Schulman et al. 2017 as implemented in OpenAI baselines ppo2; verl).

    v_clip = values_old + clamp(vpreds - values_old, -cliprange_value, cliprange_value);
    loss = 0.5 * agg(max((vpreds - R)^2, (v_clip - R)^2)).

    Args:
        vpreds: ``(batch, response_len)``, the critic's current predictions (carry the gradient).
        values_old: ``(batch, response_len)``, the predictions at rollout time.
        returns: ``(batch, response_len)``, the targets (e.g. GAE returns).
        response_mask: ``(batch, response_len)`` bool or 0/1.
        cliprange_value: the clip range, >= 0 (``critic.cliprange_value``).
        loss_agg_mode: one of :data:`AGG_MODES`.
        **agg_kwargs: forwarded to :func:`agg_loss`.

    Returns:
        ``(loss, metrics)``: 0-dim loss; ``critic/vf_clipfrac`` (fraction of valid tokens where
        the clipped error is the larger one) and ``critic/vpred_mean``.

    Raises:
        ValueError: mismatched shapes or a negative ``cliprange_value``.
    """
    _check_same_shape(vpreds=vpreds, values_old=values_old, returns=returns, response_mask=response_mask)
    if isinstance(cliprange_value, bool) or not isinstance(cliprange_value, numbers.Real) or not cliprange_value >= 0:
        raise ValueError(f"critic.cliprange_value must be a number >= 0, got {cliprange_value!r}")
    mask = _bool_mask(response_mask)
    vpreds, values_old, returns = (_fill_outside(t, mask) for t in (vpreds, values_old, returns))
    vclipped = values_old + torch.clamp(vpreds - values_old, -cliprange_value, cliprange_value)
    err_unclipped = (vpreds - returns) ** 2
    err_clipped = (vclipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(err_unclipped, err_clipped), mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "critic/vf_clipfrac": _masked_mean_float((err_clipped > err_unclipped).float(), mask),
        "critic/vpred_mean": _masked_mean_float(vpreds.detach(), mask),
    }
    return loss, metrics


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_type: str,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> torch.Tensor:
    """KL-in-loss term: ``agg_loss(kl_penalty(logprob, ref_logprob, kl_type))`` (GRPO, Shao et al. 2024, eq. 3-4).

    Args:
        logprob: ``(batch, response_len)``, the current policy's log-probs (carry the gradient).
        ref_logprob: ``(batch, response_len)``, the reference model's.
        response_mask: ``(batch, response_len)`` bool or 0/1.
        kl_type: a KL estimator name (``actor.kl_loss_type``, e.g. ``low_var_kl`` or ``k3+``).
        loss_agg_mode: one of :data:`AGG_MODES`.
        **agg_kwargs: forwarded to :func:`agg_loss`.

    Returns:
        0-dim tensor (multiply by ``actor.kl_loss_coef`` and add to the policy loss).

    Raises:
        ValueError: unknown ``kl_type``/``loss_agg_mode`` or mismatched shapes.
    """
    _check_same_shape(logprob=logprob, ref_logprob=ref_logprob, response_mask=response_mask)
    mask = _bool_mask(response_mask)
    logprob, ref_logprob = (_fill_outside(t, mask) for t in (logprob, ref_logprob))
    return agg_loss(kl_penalty(logprob, ref_logprob, kl_type), mask, loss_agg_mode, **agg_kwargs)


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> float:
    """How much of the return's variance the critic explains: ``1 - Var[R - V] / Var[R]``.

    Computed over the valid tokens of the batch with unbiased (Bessel-corrected) variances and
    ``1e-5`` added to the denominator, as verl's ``critic/vf_explained_var``: 1 is a perfect
    critic, 0 one that predicts the mean, negative one worse than the mean.

    Args:
        values: ``(batch, response_len)`` the critic's predictions V(s_t).
        returns: ``(batch, response_len)`` the targets R_t.
        response_mask: ``(batch, response_len)`` bool or 0/1.

    Returns:
        A Python float (0.0 with fewer than two valid tokens).

    Raises:
        ValueError: mismatched shapes.
    """
    _check_same_shape(values=values, returns=returns, response_mask=response_mask)
    mask = _bool_mask(response_mask)
    if int(mask.sum()) < 2:
        return 0.0
    v = values.to(torch.float64)[mask]
    r = returns.to(torch.float64)[mask]
    var_r = torch.var(r, unbiased=True)
    var_diff = torch.var(r - v, unbiased=True)
    return float(1.0 - var_diff / (var_r + 1e-5))


# --------------------------------------------------------------------------------------------
# the actor objective
# --------------------------------------------------------------------------------------------

#: :func:`actor_loss` metrics that are a micro-batch's share of its mini-batch's loss (they add up
#: over the micro-batches of a mini-batch; the policy loss's own metrics are token means instead).
ACTOR_LOSS_SHARES = ("actor/pg_loss", "actor/entropy", "actor/kl_loss")


@dataclass(frozen=True)
class ActorLossConfig:
    """What :func:`actor_loss` needs of the ``actor`` config section.

    Attributes:
        policy_loss: the policy loss's name in :data:`POLICY_LOSSES` (``actor.policy_loss``).
        loss: its clip settings and aggregation mode (``loss.loss_agg_mode`` also aggregates the
            entropy and KL terms).
        entropy_coeff: the entropy bonus coefficient (``actor.entropy_coeff``, >= 0).
        kl_loss_coef: the KL loss coefficient (``actor.kl_loss_coef``, >= 0; 0 = no KL term).
        kl_loss_type: the KL estimator (``actor.kl_loss_type``, a name of :data:`stages.kl.KL_ESTIMATORS`).
    """

    policy_loss: str = "vanilla"
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"

    @classmethod
    def from_actor(cls, actor: Any) -> "ActorLossConfig":
        """From an ``actor`` config section (any object with :class:`trajflow.config.ActorConfig`'s
        attributes ``policy_loss``, ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
        ``clip_ratio_c``, ``loss_agg_mode``, ``entropy_coeff``, ``kl_loss_coef``, ``kl_loss_type``).

        Raises:
            ValueError: invalid clip settings or aggregation mode (:class:`PolicyLossConfig`).
        """
        loss = PolicyLossConfig(clip_ratio=actor.clip_ratio, clip_ratio_low=actor.clip_ratio_low,
                                clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c,
                                loss_agg_mode=actor.loss_agg_mode)
        return cls(policy_loss=actor.policy_loss, loss=loss, entropy_coeff=actor.entropy_coeff,
                   kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type)


def actor_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    entropy: torch.Tensor,
    ref_logp: torch.Tensor | None,
    cfg: ActorLossConfig,
    agg_kw: Mapping[str, Any],
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's objective on one micro-batch: policy gradient - entropy bonus + KL loss.

    ``loss = L_pg - c_H * H + c_KL * KL`` with

    * ``L_pg``: the policy loss ``cfg.policy_loss`` of :data:`POLICY_LOSSES` (for ``vanilla`` the
      clipped surrogate of PPO, Schulman et al. 2017, arXiv:1707.06347, eq. 7, as a loss, with
      dual clip and clip-higher), its per-token terms multiplied by ``rollout_is_weights`` when given;
    * ``H``: the mean token entropy of the policy, the entropy bonus of PPO's eq. 9 with
      coefficient ``c_H = cfg.entropy_coeff`` (detached, a metric only, when ``c_H = 0``);
    * ``KL``: the KL-to-reference loss of GRPO (Shao et al. 2024, arXiv:2402.03300, eq. 3-4),
      ``agg(kl_penalty(logp, ref_logp, cfg.kl_loss_type))`` with one of the per-token estimators of
      :mod:`stages.kl` (k1, k2, k3 = ``low_var_kl``; Schulman 2020, "Approximating KL
      divergence"), coefficient ``c_KL = cfg.kl_loss_coef``; only when ``ref_logp`` is given and
      ``c_KL > 0``.

    All three terms are aggregated with ``cfg.loss.loss_agg_mode`` and the same ``agg_kw``
    (:func:`agg_loss`): with the mini-batch's token and row counts there, the micro-batches' losses
    add up to the mini-batch's loss (exact gradient accumulation).

    Args:
        logp: ``(batch, response_len)`` float32 log-probs of the sampled tokens under the current
            policy (carry the gradient).
        old_logp: ``(batch, response_len)`` float32, under the behaviour policy (no gradient).
        advantages: ``(batch, response_len)`` float32.
        mask: ``(batch, response_len)`` bool or 0/1 float: the tokens that count.
        entropy: ``(batch, response_len)`` float32 token entropies of the current policy
            (differentiable when ``cfg.entropy_coeff > 0``).
        ref_logp: ``(batch, response_len)`` float32 reference log-probs, or ``None`` (no KL term).
        cfg: :class:`ActorLossConfig`.
        agg_kw: ``global_num_tokens`` / ``global_num_seqs`` / ``horizon`` for :func:`agg_loss`.
        rollout_is_weights: optional ``(batch, response_len)`` truncated rollout importance weights
            (:func:`stages.rollout_correction.rollout_is_weights`), constants.

    Returns:
        ``(loss, metrics)``: the 0-dim differentiable loss; ``metrics`` holds ``actor/kl_loss`` and
        ``actor/kl_coef`` (with the KL term), ``actor/pg_loss`` and ``actor/entropy`` (the terms'
        values; these and ``actor/kl_loss`` are :data:`ACTOR_LOSS_SHARES`), then the policy loss's
        own metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``: means
        over this micro-batch's valid tokens).

    Raises:
        ValueError: mismatched shapes, an unknown policy loss, KL estimator or aggregation mode.
    """
    mode = cfg.loss.loss_agg_mode
    pg_loss, pg_metrics = compute_policy_loss(cfg.policy_loss, old_logp, logp, advantages, mask, cfg.loss,
                                              rollout_is_weights=rollout_is_weights, **agg_kw)
    loss = pg_loss
    ent_loss = agg_loss(entropy.detach() if cfg.entropy_coeff == 0 else entropy, mask, mode, **agg_kw)
    if cfg.entropy_coeff:
        loss = loss - cfg.entropy_coeff * ent_loss
    metrics: dict[str, float] = {}
    if ref_logp is not None and cfg.kl_loss_coef > 0:
        kl = kl_loss(logp, ref_logp, mask, cfg.kl_loss_type, mode, **agg_kw)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.item()
        metrics["actor/kl_coef"] = cfg.kl_loss_coef
    metrics["actor/pg_loss"] = pg_loss.item()
    metrics["actor/entropy"] = ent_loss.item()
    metrics.update(pg_metrics)
    return loss, metrics


# --------------------------------------------------------------------------------------------
# update batches: one iteration's stored stages -> the workers' typed update inputs
# --------------------------------------------------------------------------------------------


def _lengths(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per-row lengths of an Arrow list column, int64 ``(rows,)``."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_large_list(col.type):
        col = col.cast(pa.list_(col.type.value_type))
    return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)


def _iteration_seed(seed: int, iteration: int, salt: int) -> int:
    """``trajflow.pipeline.iteration_seed``'s derivation (stages import nothing of trajflow): the
    seed of one iteration's stream ``salt`` (1 update shuffle, 4 critic shuffle, 5 update RNG)."""
    return (seed * 1_000_003 + iteration * 7919 + salt) % (2**31 - 1)


def _check_rows(rows: Any, names: Sequence[str]) -> None:
    counts = {n: len(getattr(rows, n)) for n in names if getattr(rows, n) is not None}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{type(rows).__name__}: every field needs one entry per row, got {counts}")


@dataclass(frozen=True)
class UpdateRows:
    """The rows of a policy update, one entry per sampled response (ragged lists, row-aligned).

    Attributes:
        prompt_ids: token ids of each row's prompt.
        response_ids: token ids of each row's response.
        old_logprobs: the rollout engine's log-prob of each response token.
        advantages: one advantage per response token.
        loss_mask: optional 0/1 per response token (0: the token is out of the policy loss; whole
            quarantined or truncated rows are all 0); ``None``: every token counts. A per-token
            mask over the response also covers multi-turn responses (tool output tokens masked).
        ref_logprobs: optional reference log-prob per response token (the KL loss).

    Raises:
        ValueError: the fields have different numbers of rows.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    old_logprobs: list[list[float]]
    advantages: list[list[float]]
    loss_mask: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        _check_rows(self, ("prompt_ids", "response_ids", "old_logprobs", "advantages", "loss_mask", "ref_logprobs"))

    def __len__(self) -> int:
        return len(self.response_ids)


@dataclass(frozen=True)
class UpdateSettings:
    """How a policy update walks its rows.

    Attributes:
        mini_batch_rows: rows per optimizer step (``actor.ppo_mini_batch_size * rollout.n``);
            ``None``: the whole batch is one step.
        shuffle_seed: seed of the mini-batch order (used with ``actor.shuffle``).
        rng_seed: seeds torch's global RNG before the update (no draw depends on what ran before in
            the worker's process), or ``None``.
        rollout_is: ``"token"`` / ``"sequence"``: weight the policy-gradient loss by truncated
            rollout importance weights (:mod:`stages.rollout_correction`); ``None``: off.
        rollout_is_threshold: their truncation bound ``C``.
    """

    mini_batch_rows: int | None = None
    shuffle_seed: int = 0
    rng_seed: int | None = None
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0


@dataclass(frozen=True)
class UpdateBatch:
    """The input of ``PolicyWorker.update_actor``: rows plus settings (see :func:`update_batch`)."""

    rows: UpdateRows
    settings: UpdateSettings = field(default_factory=UpdateSettings)


@dataclass(frozen=True)
class CriticRows:
    """The rows of a critic update (ragged lists, row-aligned).

    Attributes:
        prompt_ids, response_ids: as :class:`UpdateRows`.
        values: the critic's value of each response token before the update.
        returns: the regression target of each response token (e.g. GAE returns).
        loss_mask: optional 0/1 per response token (quarantined rows); ``None``: every token counts.

    Raises:
        ValueError: the fields have different numbers of rows.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    values: list[list[float]]
    returns: list[list[float]]
    loss_mask: list[list[float]] | None = None

    def __post_init__(self) -> None:
        _check_rows(self, ("prompt_ids", "response_ids", "values", "returns", "loss_mask"))

    def __len__(self) -> int:
        return len(self.response_ids)


@dataclass(frozen=True)
class CriticSettings:
    """How a critic update walks its rows.

    Attributes:
        mini_batch_rows: rows per optimizer step; ``None``: the whole batch.
        shuffle: shuffle the rows between mini-batches (``actor.shuffle``).
        shuffle_seed: seed of that order.
    """

    mini_batch_rows: int | None = None
    shuffle: bool = False
    shuffle_seed: int = 0


@dataclass(frozen=True)
class CriticBatch:
    """The input of ``CriticWorker.update_critic`` (see :func:`critic_batch`)."""

    rows: CriticRows
    settings: CriticSettings = field(default_factory=CriticSettings)


def actor_loss_mask(joined: pa.Table, mask_truncated: bool) -> tuple[list[list[float]] | None, dict[str, float]]:
    """The policy loss mask: the table's ``loss_mask`` (quarantined rows) and, with
    ``algorithm.mask_truncated_samples``, zero on every row whose ``finish_reason`` is ``length``
    (DAPO's overlong filtering, Yu et al. 2025, sec. 3.4; TRL's ``mask_truncated_completions``).

    Returns:
        ``(mask, metrics)``: ragged 0/1 rows aligned with ``response_ids``, or ``None`` when every
        token counts; ``batch/masked_truncated`` (rows masked for truncation) when masking is on.
    """
    base = joined.column("loss_mask").to_pylist() if "loss_mask" in joined.column_names else None
    if not mask_truncated:
        return base, {}
    lens = _lengths(joined.column("response_ids"))
    truncated = [f == "length" for f in joined.column("finish_reason").to_pylist()]
    rows = []
    for i, n in enumerate(lens):
        row = list(base[i]) if base is not None else [1.0] * int(n)
        rows.append([0.0] * int(n) if truncated[i] else row)
    return rows, {"batch/masked_truncated": float(sum(truncated))}


def with_loss_mask(joined: pa.Table, gate: dict | None) -> pa.Table:
    """Add a ragged 0/1 float32 ``loss_mask`` column that drops the gate's quarantined rows.

    Args:
        joined: the iteration's joined stages (needs ``sample_id``, ``response_ids``).
        gate: the gate result (``quarantined_sample_ids``); ``None`` or none quarantined: unchanged.

    Returns:
        ``joined``, plus ``loss_mask`` (list<float32>, one entry per response token) when rows are dropped.
    """
    dropped = set((gate or {}).get("quarantined_sample_ids") or ())
    if not dropped:
        return joined
    lens = _lengths(joined.column("response_ids"))
    keep = [sid not in dropped for sid in joined.column("sample_id").to_pylist()]
    mask = [[1.0 if k else 0.0] * int(n) for k, n in zip(keep, lens)]
    return joined.append_column("loss_mask", pa.array(mask, pa.list_(pa.float32())))


def update_batch(joined: pa.Table, iteration: int, *, seed: int, n: int, ppo_mini_batch_size: int,
                 use_ref_logprobs: bool, mask_truncated: bool = False, rollout_is: str | None = None,
                 rollout_is_threshold: float = 2.0) -> UpdateBatch:
    """The policy worker's ``update_actor`` batch for one iteration, from its stored stages.

    The same stored tables always give the same batch (the shuffle seed derives from the
    iteration), so an update re-run after a worker died reproduces the original one.

    Args:
        joined: rollout + reward + advantage joined on ``sample_id`` (optionally with ``loss_mask``).
        iteration: the iteration (shuffle seed).
        seed: ``trainer.seed``.
        n: ``rollout.n`` (rows per prompt).
        ppo_mini_batch_size: prompts per optimizer step.
        use_ref_logprobs: pass ``ref_logprobs`` (KL loss on) when the column exists.
        mask_truncated: ``algorithm.mask_truncated_samples``: zero loss mask on responses cut at the
            length cap (:func:`actor_loss_mask`).
        rollout_is: ``algorithm.rollout_is`` (``token``/``sequence``/None): the worker weights the
            policy-gradient loss by truncated importance weights (:mod:`stages.rollout_correction`).
        rollout_is_threshold: ``algorithm.rollout_is_threshold``.

    Returns:
        :class:`UpdateBatch`: rows ``prompt_ids``, ``response_ids``, ``old_logprobs``,
        ``advantages``, optional ``loss_mask`` and ``ref_logprobs``; settings ``mini_batch_rows``,
        ``shuffle_seed`` (salt 1), ``rng_seed`` (salt 5: the worker seeds torch with it before
        updating, so no draw depends on what ran before) and, with rollout IS, ``rollout_is`` and
        ``rollout_is_threshold``.
    """
    cols = {c: joined.column(c).to_pylist() for c in ("prompt_ids", "response_ids", "old_logprobs", "advantages")}
    loss_mask, _ = actor_loss_mask(joined, mask_truncated)
    ref = joined.column("ref_logprobs").to_pylist() if use_ref_logprobs and "ref_logprobs" in joined.column_names \
        else None
    rows = UpdateRows(**cols, loss_mask=loss_mask, ref_logprobs=ref)
    settings = UpdateSettings(mini_batch_rows=ppo_mini_batch_size * n, shuffle_seed=_iteration_seed(seed, iteration, 1),
                              rng_seed=_iteration_seed(seed, iteration, 5),
                              rollout_is=str(rollout_is) if rollout_is else None,
                              rollout_is_threshold=float(rollout_is_threshold) if rollout_is else 2.0)
    return UpdateBatch(rows, settings)


def update_batch_options(cfg: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`update_batch` from a run config (shared by the update stage and
    the replay of stored updates when a policy worker is recreated)."""
    return dict(seed=int(cfg.trainer.seed), n=int(cfg.rollout.n),
                ppo_mini_batch_size=int(cfg.actor.ppo_mini_batch_size),
                use_ref_logprobs=cfg.actor.kl_loss_coef > 0,
                mask_truncated=bool(cfg.algorithm.mask_truncated_samples),
                rollout_is=cfg.algorithm.rollout_is, rollout_is_threshold=float(cfg.algorithm.rollout_is_threshold))


def critic_batch(joined: pa.Table, iteration: int, cfg: Any) -> CriticBatch:
    """The critic worker's ``update_critic`` batch for one iteration, from its stored stages.

    Rows: ``prompt_ids``, ``response_ids``, ``values`` (the critic's values before the update),
    ``returns``, optional ``loss_mask`` (quarantined rows); settings: the actor's mini-batch size
    and shuffle flag, and a shuffle seed of its own (salt 4). Deterministic, so a recreated critic
    replays it exactly.
    """
    cols = {c: joined.column(c).to_pylist() for c in ("prompt_ids", "response_ids", "values", "returns")}
    loss_mask = joined.column("loss_mask").to_pylist() if "loss_mask" in joined.column_names else None
    settings = CriticSettings(mini_batch_rows=int(cfg.actor.ppo_mini_batch_size) * int(cfg.rollout.n),
                              shuffle=bool(cfg.actor.shuffle),
                              shuffle_seed=_iteration_seed(int(cfg.trainer.seed), iteration, 4))
    return CriticBatch(CriticRows(**cols, loss_mask=loss_mask), settings)
