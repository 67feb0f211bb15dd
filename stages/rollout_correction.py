"""Rollout importance-sampling correction for a rollout engine whose log-probs differ from the trainer's.

A fast inference engine (vLLM, SGLang, another precision or kernel) samples responses from
``pi_rollout``, which is not bit-identical to the trainer's ``pi_old`` even with the same weights. The
PPO ratio ``pi_theta / pi_old`` then corrects for the wrong distribution. Truncated importance
sampling (TIS; Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", https://fengyao.notion.site/off-policy-rl) multiplies the policy-gradient loss by

    w = min(pi_old(y) / pi_rollout(y), C)

computed per token (``level="token"``), once per sequence from the product of the token ratios
(``level="sequence"``: ``w_i = min(exp(sum_t (log pi_old - log pi_rollout)), C)``, broadcast to the
row's tokens) or from their geometric mean (``level="geometric"``: ``w_i = min(exp(mean_t (log pi_old -
log pi_rollout)), C)``, the length-normalised sequence ratio of GSPO, Zheng et al. 2025, Eq. 7), with
``C = algorithm.rollout_is_threshold``. The weight is a constant (no gradient).

Rejection (masking) instead of truncation, :func:`rollout_rs_mask` (``algorithm.rollout_rs``): a token
or a whole sequence whose ratio leaves ``[lower, upper]`` is dropped from the policy loss.
``level="token"`` is IcePop (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for
Trillion-Scale Thinking Model", Sec. 2.2: mask tokens with ``pi_train / pi_infer`` outside
``[alpha, beta]``), ``level="sequence"`` masks whole rows by their product ratio (with ``lower=0`` and
``rollout_is=sequence`` at the same bound this is TRL's ``vllm_importance_sampling_mode="sequence_mask"``),
``level="geometric"`` by the geometric mean of their token ratios (Liu, Li et al. 2025, "When Speed
Kills Stability", part 3: geometric rejection sampling).

Plain tensor functions; no Ray, no Prefect.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["ROLLOUT_IS_LEVELS", "ROLLOUT_IS_LOG_CLAMP", "ROLLOUT_RS_LEVELS", "rollout_is_weights",
           "rollout_mismatch_metrics", "rollout_rs_mask"]

#: Allowed values of ``algorithm.rollout_is``.
ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")
#: Allowed values of ``algorithm.rollout_rs`` (rejection sampling: masking instead of truncation).
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")
#: The log of the ratio is clamped to [-20, 20] before exp() (overflow guard, as for the PPO ratio).
ROLLOUT_IS_LOG_CLAMP = 20.0


@torch.no_grad()
def _checked_mask(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                  threshold: float) -> torch.Tensor:
    """The bool mask, after checking the threshold and that the tensors are ``(batch, response_len)`` alike.

    Raises:
        ValueError: a non-positive ``threshold`` or mismatched shapes.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not threshold > 0:
        raise ValueError(f"algorithm.rollout_is_threshold must be a number > 0, got {threshold!r}")
    for name, t in (("rollout_log_prob", rollout_log_prob), ("response_mask", response_mask)):
        if not isinstance(t, torch.Tensor) or t.shape != old_log_prob.shape or old_log_prob.dim() != 2:
            raise ValueError(f"{name} must have the shape of old_log_prob {tuple(old_log_prob.shape)} "
                             f"(batch, response_len), got {getattr(t, 'shape', type(t).__name__)}")
    return response_mask if response_mask.dtype == torch.bool else response_mask != 0


def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    threshold: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(pi_old / pi_rollout, threshold)`` (Yao et al. 2025, TIS).

    token level:     w_it = min(exp(clamp(old_it - rollout_it, -20, 20)), C)
    sequence level:  w_i  = min(exp(clamp(sum_t m_it (old_it - rollout_it), -20, 20)), C), the same
                     value on every valid token of row i.
    geometric level: w_i  = min(exp(clamp(sum_t m_it (old_it - rollout_it) / n_i, -20, 20)), C), the
                     geometric mean of the row's token ratios (GSPO's length-normalised ratio,
                     Zheng et al. 2025, Eq. 7), on every valid token of row i (n_i valid tokens).

    Args:
        old_log_prob: ``(batch, response_len)`` float, the trainer's log-probs of the sampled tokens
            under the policy that generated them (pi_old, computed by the trainer).
        rollout_log_prob: ``(batch, response_len)`` float, the rollout engine's log-probs of the
            same tokens (the stored ``rollout_logprobs`` column).
        response_mask: ``(batch, response_len)`` bool or 0/1.
        level: ``"token"``, ``"sequence"`` or ``"geometric"`` (``algorithm.rollout_is``).
        threshold: the truncation bound C > 0 (``algorithm.rollout_is_threshold``).

    Returns:
        ``(weights, metrics)``: weights ``(batch, response_len)`` float32, no gradient, 0 outside the
        mask; metrics ``rollout_corr/rollout_is_mean|max|min`` (over valid tokens for ``token``, over
        rows with a valid token for ``sequence``/``geometric``; the mean after truncation at C, max/min
        before), ``rollout_corr/rollout_is_raw_mean|raw_max`` (the raw weights before truncation: how
        far off-policy the batch was, which the truncated mean hides),
        ``rollout_corr/rollout_is_clipfrac`` (share truncated at C) and
        ``rollout_corr/log_ratio_mean`` (mean of old - rollout over valid tokens: a k1 estimate of
        KL(pi_rollout || pi_old)).

    Raises:
        ValueError: unknown ``level``, a non-positive ``threshold`` or mismatched shapes.
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"algorithm.rollout_is must be one of {list(ROLLOUT_IS_LEVELS)} or null, got {level!r}")
    mask = _checked_mask(old_log_prob, rollout_log_prob, response_mask, threshold)
    zero = torch.zeros((), dtype=torch.float64, device=old_log_prob.device)
    diff = torch.where(mask, old_log_prob.double() - rollout_log_prob.double(), zero)
    if level == "token":
        log_w = diff.clamp(-ROLLOUT_IS_LOG_CLAMP, ROLLOUT_IS_LOG_CLAMP)
        raw = torch.exp(log_w)
        sel = mask
        stats = raw[sel]
    else:
        log_w = _row_log_ratio(diff, mask, level).clamp(-ROLLOUT_IS_LOG_CLAMP, ROLLOUT_IS_LOG_CLAMP)
        raw_row = torch.exp(log_w)
        raw = raw_row.unsqueeze(-1).expand(mask.shape)
        stats = raw_row[mask.any(dim=-1)]
    weights = torch.where(mask, raw.clamp(max=float(threshold)), zero).to(torch.float32)
    n_tok = int(mask.sum())
    metrics = {
        "rollout_corr/rollout_is_mean": float(stats.clamp(max=float(threshold)).mean()) if stats.numel() else 1.0,
        "rollout_corr/rollout_is_max": float(stats.max()) if stats.numel() else 1.0,
        "rollout_corr/rollout_is_min": float(stats.min()) if stats.numel() else 1.0,
        "rollout_corr/rollout_is_raw_mean": float(stats.mean()) if stats.numel() else 1.0,
        "rollout_corr/rollout_is_raw_max": float(stats.max()) if stats.numel() else 1.0,
        "rollout_corr/rollout_is_clipfrac": float((stats > threshold).double().mean()) if stats.numel() else 0.0,
        "rollout_corr/log_ratio_mean": float(diff.sum() / n_tok) if n_tok else 0.0,
    }
    return weights, metrics


def rollout_is_kept_metrics(weights: torch.Tensor, keep: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """The importance weights the loss applies once rejection has masked tokens out: mean and max of
    the truncated weights over the valid tokens rejection kept (``rollout_corr/rollout_is_kept_mean``,
    ``rollout_corr/rollout_is_kept_max``; 1.0 when none is kept). With :func:`rollout_is_weights`'
    ``raw_*`` (before truncation and masking) and ``rollout_is_mean`` (after truncation) they show
    each step from the raw ratios to the weights trained with.

    Args:
        weights: ``(batch, response_len)`` truncated weights from :func:`rollout_is_weights`.
        keep: ``(batch, response_len)`` bool, the tokens :func:`rollout_rs_mask` kept.
        response_mask: ``(batch, response_len)`` bool or 0/1, the valid tokens.
    """
    valid = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    kept = weights[valid & keep.bool()].double()
    return {"rollout_corr/rollout_is_kept_mean": float(kept.mean()) if kept.numel() else 1.0,
            "rollout_corr/rollout_is_kept_max": float(kept.max()) if kept.numel() else 1.0}


def _row_log_ratio(diff: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``(batch,)`` log of a row's sequence ratio: the sum of its masked token log-ratios
    (``sequence``) or their mean (``geometric``; 0 for a row without a valid token)."""
    total = diff.sum(dim=-1)
    if level == "sequence":
        return total
    return total / mask.sum(dim=-1).clamp(min=1).to(total.dtype)


@torch.no_grad()
def rollout_rs_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection sampling: which tokens keep a place in the policy loss, by their rollout ratio.

    With ``r_it = exp(clamp(old_it - rollout_it, -20, 20))`` (pi_old / pi_rollout) on valid tokens:

    - ``token`` (IcePop; Ling Team 2025, Sec. 2.2): keep token (i, t) iff ``lower <= r_it <= upper``;
    - ``sequence``: ``R_i = exp(clamp(sum_t log r_it, -20, 20))`` (the product of the row's ratios);
      keep every token of row i iff ``lower <= R_i <= upper`` (TRL's ``sequence_mask`` is this with
      ``lower = 0``);
    - ``geometric``: ``G_i = exp(mean_t log r_it)`` (geometric mean, Liu, Li et al. 2025, part 3); keep
      row i iff ``lower <= G_i <= upper``.

    A rejected token's policy-gradient term is multiplied by 0; the loss's denominator is unchanged
    (as TRL applies its masked ratio), so one rejected outlier does not re-weight the rest.

    Args:
        old_log_prob: ``(batch, response_len)`` float, the trainer's log-probs of the sampled tokens.
        rollout_log_prob: ``(batch, response_len)`` float, the rollout engine's log-probs of them.
        response_mask: ``(batch, response_len)`` bool or 0/1, the tokens that count.
        level: ``"token"``, ``"sequence"`` or ``"geometric"`` (``algorithm.rollout_rs``).
        upper: upper bound > 0 on the ratio (``algorithm.rollout_rs_threshold``).
        lower: lower bound in ``[0, upper]`` (``algorithm.rollout_rs_threshold_lower``); ``None``:
            ``1 / upper`` (IcePop's symmetric band ``[1/beta, beta]``).

    Returns:
        ``(keep, metrics)``: ``keep`` ``(batch, response_len)`` bool, True on the valid tokens kept.
        Metrics (verl's names where verl has one): raw statistic before rejection
        ``rollout_corr/rollout_rs_mean|max|min`` (of r_it over valid tokens for ``token``, of R_i or
        G_i over rows with a valid token otherwise), ``rollout_corr/rollout_rs_ratio_fraction_high|low``
        (share of that statistic above ``upper`` / below ``lower``); what was rejected,
        ``rollout_corr/rollout_rs_masked_fraction`` (share of valid tokens) and
        ``rollout_corr/rollout_rs_seq_masked_fraction`` (share of rows with a valid token that lost at
        least one); and the corrected statistics over what was kept,
        ``rollout_corr/rollout_rs_kept_mean`` (the statistic's mean over kept tokens / rows; 1 when
        nothing is kept) and ``rollout_corr/rollout_rs_kept_kl`` (token mean of
        ``rollout_it - old_it`` over kept tokens, the k1 estimate of KL(pi_rollout || pi_old) that the
        update still sees; 0 when nothing is kept).

    Raises:
        ValueError: unknown ``level``, ``upper <= 0``, ``lower`` outside ``[0, upper]`` or mismatched
            shapes.
    """
    if level not in ROLLOUT_RS_LEVELS:
        raise ValueError(f"algorithm.rollout_rs must be one of {list(ROLLOUT_RS_LEVELS)} or null, got {level!r}")
    if isinstance(upper, bool) or not isinstance(upper, numbers.Real) or not upper > 0:
        raise ValueError(f"algorithm.rollout_rs_threshold must be a number > 0, got {upper!r}")
    mask = _checked_mask(old_log_prob, rollout_log_prob, response_mask, upper)
    lo = 1.0 / float(upper) if lower is None else lower
    if isinstance(lo, bool) or not isinstance(lo, numbers.Real) or not 0.0 <= lo <= upper:
        raise ValueError(f"algorithm.rollout_rs_threshold_lower must be a number in [0, rollout_rs_threshold="
                         f"{upper}], got {lower!r}")
    zero = torch.zeros((), dtype=torch.float64, device=old_log_prob.device)
    diff = torch.where(mask, old_log_prob.double() - rollout_log_prob.double(), zero)
    rows = mask.any(dim=-1)
    if level == "token":
        stat = torch.exp(diff.clamp(-ROLLOUT_IS_LOG_CLAMP, ROLLOUT_IS_LOG_CLAMP))
        inside = (stat >= lo) & (stat <= upper)
        keep = mask & inside
        raw, kept_stat = stat[mask], stat[keep]
    else:
        row_stat = torch.exp(_row_log_ratio(diff, mask, level).clamp(-ROLLOUT_IS_LOG_CLAMP, ROLLOUT_IS_LOG_CLAMP))
        inside = (row_stat >= lo) & (row_stat <= upper)
        keep = mask & inside.unsqueeze(-1)
        raw, kept_stat = row_stat[rows], row_stat[rows & inside]
    n_valid, n_keep = int(mask.sum()), int(keep.sum())
    n_rows = int(rows.sum())
    lost_rows = int((rows & (mask & ~keep).any(dim=-1)).sum())
    metrics = {
        "rollout_corr/rollout_rs_mean": float(raw.mean()) if raw.numel() else 1.0,
        "rollout_corr/rollout_rs_max": float(raw.max()) if raw.numel() else 1.0,
        "rollout_corr/rollout_rs_min": float(raw.min()) if raw.numel() else 1.0,
        "rollout_corr/rollout_rs_ratio_fraction_high": float((raw > upper).double().mean()) if raw.numel() else 0.0,
        "rollout_corr/rollout_rs_ratio_fraction_low": float((raw < lo).double().mean()) if raw.numel() else 0.0,
        "rollout_corr/rollout_rs_masked_fraction": (n_valid - n_keep) / n_valid if n_valid else 0.0,
        "rollout_corr/rollout_rs_seq_masked_fraction": lost_rows / n_rows if n_rows else 0.0,
        "rollout_corr/rollout_rs_kept_mean": float(kept_stat.mean()) if kept_stat.numel() else 1.0,
        "rollout_corr/rollout_rs_kept_kl": float(-diff[keep].mean()) if n_keep else 0.0,
    }
    return keep, metrics


@torch.no_grad()
def rollout_mismatch_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the trainer's, over the response tokens.

    With ``d_it = log pi_rollout(y_it) - log pi_old(y_it)`` on valid tokens (tokens sampled from
    pi_rollout), ``rho_it = pi_old / pi_rollout = exp(-d_it)`` and ``n_i`` valid tokens in row i,
    the names and definitions are verl's rollout-correction diagnostics (Liu, Li et al. 2025, "When
    Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"):

    - ``rollout_corr/kl``: token mean of ``d`` (k1 estimate of KL(pi_rollout || pi_old));
    - ``rollout_corr/k3_kl``: token mean of ``rho - log rho - 1`` (Schulman's k3, >= 0 per token);
    - ``rollout_corr/training_log_ppl`` / ``rollout_log_ppl``: row mean of ``-mean_t log pi`` under
      the trainer / the engine; ``rollout_corr/training_ppl`` / ``rollout_ppl``: row mean of their exp;
    - ``rollout_corr/log_ppl_diff``: row mean of ``D_i = mean_t d_it`` (= log PPL_train - log
      PPL_rollout of row i); ``_abs_diff``, ``_max``, ``_min``: mean |D_i|, max D_i, min D_i;
    - ``rollout_corr/ppl_ratio``: row mean of ``exp(D_i)``;
    - ``rollout_corr/chi2_token``: token mean of ``rho^2`` minus 1 (chi-square divergence estimate);
    - ``rollout_corr/max_abs_diff``: max over tokens of ``|d|``;
    - ``rollout_corr/truncated_frac``: share of tokens whose token-level IS weight ``rho`` exceeds
      ``threshold`` (the ones truncated IS would cut at C, whether or not the correction is on);
    - ``training/rollout_probs_diff_mean`` / ``_max``: token mean / max of
      ``|pi_old - pi_rollout|`` in probability space (verl's names).

    Args:
        old_log_prob: ``(batch, response_len)`` float, the trainer's log-probs of the sampled tokens.
        rollout_log_prob: ``(batch, response_len)`` float, the behaviour policy's (``rollout_logprobs`` column).
        response_mask: ``(batch, response_len)`` bool or 0/1.
        threshold: the truncation bound C > 0 (``algorithm.rollout_is_threshold``).

    Returns:
        The metrics above as floats (all 0, ppl ratios 1, when no token is valid). Computed in float64.

    Raises:
        ValueError: mismatched shapes or a non-positive ``threshold``.
    """
    mask = _checked_mask(old_log_prob, rollout_log_prob, response_mask, threshold)
    old, eng = old_log_prob.double()[mask], rollout_log_prob.double()[mask]
    if old.numel() == 0:
        names = ("kl", "k3_kl", "training_log_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff",
                 "log_ppl_diff_max", "log_ppl_diff_min", "chi2_token", "max_abs_diff", "truncated_frac")
        out = {f"rollout_corr/{k}": 0.0 for k in names}
        out.update({"rollout_corr/training_ppl": 1.0, "rollout_corr/rollout_ppl": 1.0, "rollout_corr/ppl_ratio": 1.0,
                    "training/rollout_probs_diff_mean": 0.0, "training/rollout_probs_diff_max": 0.0})
        return out
    d = eng - old
    log_rho = (-d).clamp(-ROLLOUT_IS_LOG_CLAMP, ROLLOUT_IS_LOG_CLAMP)
    rho = torch.exp(log_rho)
    # Per-row means over each row's valid tokens (rows without one do not count).
    m = mask.double()
    n = m.sum(-1)
    rows = n > 0
    zero = torch.zeros((), dtype=torch.float64, device=old_log_prob.device)

    def row_mean(x: torch.Tensor) -> torch.Tensor:
        return (torch.where(mask, x, zero).sum(-1)[rows] / n[rows])

    train_lppl = row_mean(-old_log_prob.double())
    roll_lppl = row_mean(-rollout_log_prob.double())
    D = row_mean(rollout_log_prob.double() - old_log_prob.double())
    pdiff = (old.exp() - eng.exp()).abs()
    return {
        "rollout_corr/kl": float(d.mean()),
        "rollout_corr/k3_kl": float((rho - log_rho - 1).mean()),
        "rollout_corr/training_log_ppl": float(train_lppl.mean()),
        "rollout_corr/rollout_log_ppl": float(roll_lppl.mean()),
        "rollout_corr/training_ppl": float(train_lppl.exp().mean()),
        "rollout_corr/rollout_ppl": float(roll_lppl.exp().mean()),
        "rollout_corr/log_ppl_diff": float(D.mean()),
        "rollout_corr/log_ppl_abs_diff": float(D.abs().mean()),
        "rollout_corr/log_ppl_diff_max": float(D.max()),
        "rollout_corr/log_ppl_diff_min": float(D.min()),
        "rollout_corr/ppl_ratio": float(D.exp().mean()),
        "rollout_corr/chi2_token": float((rho ** 2).mean() - 1.0),
        "rollout_corr/max_abs_diff": float(d.abs().max()),
        "rollout_corr/truncated_frac": float((rho > threshold).double().mean()),
        "training/rollout_probs_diff_mean": float(pdiff.mean()),
        "training/rollout_probs_diff_max": float(pdiff.max()),
    }
