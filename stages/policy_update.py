"""The policy and critic update: the actor objective, the critic's losses, and their typed input batches.

:func:`actor_loss` is the whole per-micro-batch actor objective (policy gradient - entropy bonus +
KL loss) the policy worker backpropagates; the policy-gradient losses themselves are
:mod:`trajflow.stages.policy_losses`. :func:`update_batch` turns one iteration's stored stage tables into
the typed :class:`UpdateBatch` the policy worker's ``update_actor`` takes (verl's ``DataProto``,
typed: per-row ragged lists plus update settings; the critic's is :mod:`trajflow.stages.critic_update`). Shapes: per-token tensors are ``(batch, response_len)``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import pyarrow as pa
import torch

from trajflow.stages.kl import DEFAULT_KL_LOSS_TYPE, has_k2_gradient, kl_penalty
from trajflow.stages.lr_schedule import lr_factor, warmup_steps
from trajflow.stages.policy_losses import (LOG_RATIO_CLAMP, PolicyLossConfig, agg_loss, bool_mask, check_same_shape,
                                   compute_policy_loss, fill_outside, masked_mean_float)
from trajflow.stages.rollout import rollout_temperature
from trajflow.stages.seeds import Salt, iteration_seed
from trajflow.batch import lengths, trainable_mask

__all__ = [
    "ACTOR_LOSS_SHARES",
    "ActorLossConfig",
    "UpdateBatch",
    "UpdateRows",
    "UpdateSettings",
    "actor_loss",
    "actor_loss_mask",
    "update_batch",
    "update_batch_options",
    "with_loss_mask",
    "entropy_from_logits",
    "value_loss",
    "kl_loss",
    "explained_variance",
]



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

    v_clip = clamp(vpreds, values_old - cliprange_value, values_old + cliprange_value) (the same value
    as verl's ``values_old + clamp(vpreds - values_old, -c, c)``, without its rounding);
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
    check_same_shape(vpreds=vpreds, values_old=values_old, returns=returns, response_mask=response_mask)
    if isinstance(cliprange_value, bool) or not isinstance(cliprange_value, numbers.Real) or not cliprange_value >= 0:
        raise ValueError(f"critic.cliprange_value must be a number >= 0, got {cliprange_value!r}")
    mask = bool_mask(response_mask)
    vpreds, values_old, returns = (fill_outside(t, mask) for t in (vpreds, values_old, returns))
    # Clamp vpreds itself: old + clamp(v - old) rounds twice in fp32, so inside the range it is not
    # exactly v and the clipped error can come out larger than the unclipped one (a spurious clip).
    vclipped = torch.clamp(vpreds, values_old - cliprange_value, values_old + cliprange_value)
    err_unclipped = (vpreds - returns) ** 2
    err_clipped = (vclipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(err_unclipped, err_clipped), mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "critic/vf_clipfrac": masked_mean_float((err_clipped > err_unclipped).float(), mask),
        "critic/vpred_mean": masked_mean_float(vpreds.detach(), mask),
    }
    return loss, metrics


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_type: str,
    loss_agg_mode: str = "token-mean",
    *,
    old_logprob: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> torch.Tensor:
    """KL-in-loss term: ``agg_loss(w * kl_penalty(logprob, ref_logprob, kl_type))`` (GRPO, Shao et al. 2024, eq. 3-4).

    The tokens were sampled from pi_old. For the estimators with k2's gradient
    (:func:`trajflow.stages.kl.has_k2_gradient`), ``w = sg[pi / pi_old] = exp(logprob - old_logprob)``,
    detached, so that the expected gradient is grad KL(pi || pi_ref) also after the first
    optimizer step of an iteration (E_{pi_old}[w * grad k2] = E_pi[grad k2]); w = 1 exactly on
    the first on-policy step (old = current) and for the other estimators, whose gradient is not
    the KL's on any samples (verl weights none).

    Args:
        logprob: ``(batch, response_len)``, the current policy's log-probs (carry the gradient).
        ref_logprob: ``(batch, response_len)``, the reference model's.
        response_mask: ``(batch, response_len)`` bool or 0/1.
        kl_type: a KL estimator name (``actor.kl_loss_type``, e.g. ``low_var_kl+`` or ``k2``).
        loss_agg_mode: one of :data:`AGG_MODES`.
        old_logprob: ``(batch, response_len)``, the behaviour policy's log-probs (no gradient), or
            ``None`` (w = 1).
        **agg_kwargs: forwarded to :func:`agg_loss`.

    Returns:
        0-dim tensor (multiply by ``actor.kl_loss_coef`` and add to the policy loss).

    Raises:
        ValueError: unknown ``kl_type``/``loss_agg_mode`` or mismatched shapes.
    """
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob, response_mask=response_mask)
    mask = bool_mask(response_mask)
    logprob, ref_logprob = (fill_outside(t, mask) for t in (logprob, ref_logprob))
    kl = kl_penalty(logprob, ref_logprob, kl_type)
    if old_logprob is not None and has_k2_gradient(kl_type):
        check_same_shape(logprob=logprob, old_logprob=old_logprob)
        log_w = torch.clamp(logprob.detach() - fill_outside(old_logprob.detach(), mask), -LOG_RATIO_CLAMP,
                            LOG_RATIO_CLAMP)
        kl = kl * torch.exp(log_w)
    return agg_loss(kl, mask, loss_agg_mode, **agg_kwargs)


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
    check_same_shape(values=values, returns=returns, response_mask=response_mask)
    mask = bool_mask(response_mask)
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
        kl_loss_type: the KL estimator (``actor.kl_loss_type``, a name of :data:`trajflow.stages.kl.KL_ESTIMATORS`;
            default ``low_var_kl+``, k3's value with k2's unbiased gradient).
    """

    policy_loss: str = "vanilla"
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_type: str = DEFAULT_KL_LOSS_TYPE

    @classmethod
    def from_actor(cls, actor: Any) -> "ActorLossConfig":
        """From an ``actor`` config section (any object with :class:`trajflow.config.ActorConfig`'s
        attributes ``policy_loss``, ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
        ``clip_ratio_c``, ``loss_agg_mode``, ``entropy_coeff``, ``kl_loss_coef``, ``kl_loss_type``).
        ``clip_ratio_low/high`` reach every policy loss (verl: GSPO reads both, CISPO the high one);
        ``None`` leaves each loss its own default (:class:`PolicyLossConfig`).

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
      :mod:`trajflow.stages.kl` (k1, k2, k3 = ``low_var_kl``; Schulman 2020, "Approximating KL
      divergence"), coefficient ``c_KL = cfg.kl_loss_coef``; only when ``ref_logp`` is given and
      ``c_KL > 0``. With k2's gradient it is importance-weighted by ``sg[exp(logp - old_logp)]``
      (:func:`kl_loss`), which is 1 on a single on-policy step (``old_logp`` = ``logp`` detached)
      and corrects the later mini-batches and epochs, whose tokens came from the older policy.

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
            (:func:`trajflow.stages.rollout_correction.rollout_is_weights`), constants.

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
        kl = kl_loss(logp, ref_logp, mask, cfg.kl_loss_type, mode, old_logprob=old_logp, **agg_kw)
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


def check_rows(rows: Any, names: Sequence[str]) -> None:
    """Raise ValueError unless every field of ``rows`` named in ``names`` (None skipped) has one entry per row."""
    counts = {n: len(getattr(rows, n)) for n in names if getattr(rows, n) is not None}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{type(rows).__name__}: every field needs one entry per row, got {counts}")


@dataclass(frozen=True)
class UpdateRows:
    """The rows of a policy update, one entry per sampled response (ragged lists, row-aligned).

    Attributes:
        prompt_ids: token ids of each row's prompt.
        response_ids: token ids of each row's response.
        rollout_logprobs: the behaviour policy's (the rollout engine's) log-prob of each response token.
        advantages: one advantage per response token.
        loss_mask: optional 0/1 per response token (0: the token is out of the policy loss: tool and
            environment tokens of a multi-turn row, and every token of a quarantined or truncated
            row); ``None``: every token counts. The policy loss, its KL and entropy terms, every
            aggregation mode's token and row counts, and the engine-vs-trainer log-prob comparisons
            (``actor/rollout_logprob_diff``, rollout importance sampling) use only tokens where it is 1.
        ref_logprobs: optional reference log-prob per response token (the KL loss).

    Raises:
        ValueError: the fields have different numbers of rows.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    advantages: list[list[float]]
    loss_mask: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        check_rows(self, ("prompt_ids", "response_ids", "rollout_logprobs", "advantages", "loss_mask", "ref_logprobs"))

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
            rollout importance weights (:mod:`trajflow.stages.rollout_correction`); ``None``: off.
        rollout_is_threshold: their truncation bound ``C``.
        rollout_rs: ``"token"`` (IcePop) / ``"sequence"`` / ``"geometric"``: drop tokens or rows whose
            rollout ratio leaves ``[rollout_rs_threshold_lower, rollout_rs_threshold]`` from the
            policy-gradient loss (:func:`trajflow.stages.rollout_correction.rollout_rs_mask`); ``None``: off.
        rollout_rs_threshold: the upper bound of the kept ratios.
        rollout_rs_threshold_lower: the lower bound; ``None``: ``1 / rollout_rs_threshold``.
        peak_tflops: one device's peak in TFLOP/s for ``perf/mfu/actor`` (``trainer.device_peak_tflops``);
            ``None``: a known GPU's bf16 dense peak, else no MFU.
        defer_weight_sync: do not push the new weights to separate rollout workers at the end of the
            update (``trainer.max_staleness`` > 0: the driver pushes them when no rollout is in flight).
        temperature: the rows' sampling temperature (stored with the rollout), at which the trainer's
            log-probs are computed; ``None``: the worker's ``rollout.temperature`` (hand-built batches).
        lr: the learning rate of this update (warmup / cosine schedule, :mod:`trajflow.stages.lr_schedule`);
            ``None``: the optimizer's as it is (``actor.lr``).
    """

    mini_batch_rows: int | None = None
    shuffle_seed: int = 0
    rng_seed: int | None = None
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float | None = None
    peak_tflops: float | None = None
    defer_weight_sync: bool = False
    temperature: float | None = None
    lr: float | None = None


@dataclass(frozen=True)
class UpdateBatch:
    """The input of ``PolicyWorker.update_actor``: rows plus settings (see :func:`update_batch`)."""

    rows: UpdateRows
    settings: UpdateSettings = field(default_factory=UpdateSettings)


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
    lens = lengths(joined.column("response_ids"))
    truncated = [f == "length" for f in joined.column("finish_reason").to_pylist()]
    rows = []
    for i, n in enumerate(lens):
        row = list(base[i]) if base is not None else [1.0] * int(n)
        rows.append([0.0] * int(n) if truncated[i] else row)
    return rows, {"batch/masked_truncated": float(sum(truncated))}


def with_loss_mask(joined: pa.Table, gate: dict | None) -> pa.Table:
    """The policy loss mask: the rollout's trainable-token ``loss_mask`` times the gate's quarantine.

    A multi-turn rollout stores ``loss_mask`` (list<int8>: 1 where the model generated the token);
    single-turn rows have none (every token counts). Rows the gate quarantined are zeroed. The
    result replaces the column, as list<float32>, so the update and the critic read one mask.

    Args:
        joined: the iteration's joined stages (needs ``sample_id``, ``response_ids``; optionally the
            rollout's ``loss_mask``).
        gate: the gate result (``quarantined_sample_ids``); ``None`` or none quarantined: the rollout's
            mask as it is.

    Returns:
        ``joined``, unchanged when nothing is quarantined; otherwise with ``loss_mask`` (list<float32>,
        one entry per response token) = rollout mask (1 when absent) * (0 on quarantined rows, else 1).

    Raises:
        trajflow.errors.BatchError: a rollout ``loss_mask`` row of another length than its response.
    """
    dropped = set((gate or {}).get("quarantined_sample_ids") or ())
    if not dropped:
        return joined
    lens = lengths(joined.column("response_ids"))
    keep = [sid not in dropped for sid in joined.column("sample_id").to_pylist()]
    trainable = trainable_mask(joined)
    mask = [trainable[i, :int(n)].float().tolist() if k else [0.0] * int(n) for i, (k, n) in enumerate(zip(keep, lens))]
    column = pa.array(mask, pa.list_(pa.float32()))
    if "loss_mask" in joined.column_names:
        return joined.set_column(joined.column_names.index("loss_mask"), "loss_mask", column)
    return joined.append_column("loss_mask", column)


def update_batch(joined: pa.Table, iteration: int, *, seed: int, n: int, ppo_mini_batch_size: int,
                 use_ref_logprobs: bool, mask_truncated: bool = False, rollout_is: str | None = None,
                 rollout_is_threshold: float = 2.0, rollout_rs: str | None = None,
                 rollout_rs_threshold: float | None = None, rollout_rs_threshold_lower: float | None = None,
                 peak_tflops: float | None = None, defer_weight_sync: bool = False, temperature: float = 1.0,
                 lr_schedule: tuple | None = None) -> UpdateBatch:
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
            policy-gradient loss by truncated importance weights (:mod:`trajflow.stages.rollout_correction`).
        rollout_is_threshold: ``algorithm.rollout_is_threshold``.
        rollout_rs: ``algorithm.rollout_rs`` (``token``/``sequence``/``geometric``/None): the worker
            drops tokens or rows with an outlying rollout ratio from the policy-gradient loss.
        rollout_rs_threshold: ``algorithm.rollout_rs_threshold`` (None: ``rollout_is_threshold``).
        rollout_rs_threshold_lower: ``algorithm.rollout_rs_threshold_lower`` (None: the reciprocal).
        peak_tflops: ``trainer.device_peak_tflops`` (``perf/mfu/actor``).
        defer_weight_sync: the worker does not push the new weights to the rollout workers; the
            driver does, when no rollout is in flight (``trainer.max_staleness`` > 0).
        temperature: ``rollout.temperature``, for a rollout stored before schema 3 (a stored one wins).
        lr_schedule: ``(lr, total_steps, num_warmup, style, min_lr_ratio)``: the update's ``lr`` is
            ``lr * lr_factor(iteration - 1, ...)`` (:func:`trajflow.stages.lr_schedule.lr_factor`); None: no schedule.

    Returns:
        :class:`UpdateBatch`: rows ``prompt_ids``, ``response_ids``, ``rollout_logprobs``,
        ``advantages``, optional ``loss_mask`` and ``ref_logprobs``; settings ``mini_batch_rows``,
        ``shuffle_seed`` (salt 1), ``rng_seed`` (salt 5: the worker seeds torch with it before
        updating, so no draw depends on what ran before) and, with rollout IS, ``rollout_is`` and
        ``rollout_is_threshold``, and the rows' sampling ``temperature``. Raises ``ValueError`` when
        the rows were sampled at several temperatures (:func:`trajflow.stages.rollout.rollout_temperature`).
    """
    cols = {c: joined.column(c).to_pylist() for c in ("prompt_ids", "response_ids", "rollout_logprobs", "advantages")}
    loss_mask, _ = actor_loss_mask(joined, mask_truncated)
    ref = joined.column("ref_logprobs").to_pylist() if use_ref_logprobs and "ref_logprobs" in joined.column_names \
        else None
    rows = UpdateRows(**cols, loss_mask=loss_mask, ref_logprobs=ref)
    settings = UpdateSettings(mini_batch_rows=ppo_mini_batch_size * n, shuffle_seed=iteration_seed(seed, iteration, Salt.UPDATE_SHUFFLE),
                              rng_seed=iteration_seed(seed, iteration, Salt.UPDATE_RNG),
                              rollout_is=str(rollout_is) if rollout_is else None,
                              rollout_is_threshold=float(rollout_is_threshold) if rollout_is else 2.0,
                              rollout_rs=str(rollout_rs) if rollout_rs else None,
                              rollout_rs_threshold=float(rollout_rs_threshold if rollout_rs_threshold is not None
                                                         else rollout_is_threshold) if rollout_rs else 2.0,
                              rollout_rs_threshold_lower=float(rollout_rs_threshold_lower)
                              if rollout_rs and rollout_rs_threshold_lower is not None else None,
                              peak_tflops=float(peak_tflops) if peak_tflops else None,
                              defer_weight_sync=bool(defer_weight_sync),
                              temperature=rollout_temperature(joined, temperature),
                              lr=None if lr_schedule is None else
                              float(lr_schedule[0]) * lr_factor(iteration - 1, *lr_schedule[1:]))
    return UpdateBatch(rows, settings)


def update_batch_options(cfg: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`update_batch` from a run config (shared by the update stage and
    the replay of stored updates when a policy worker is recreated)."""
    return dict(seed=int(cfg.trainer.seed), n=int(cfg.rollout.n),
                ppo_mini_batch_size=int(cfg.actor.ppo_mini_batch_size),
                use_ref_logprobs=cfg.actor.kl_loss_coef > 0,
                mask_truncated=bool(cfg.algorithm.mask_truncated_samples),
                rollout_is=None if cfg.algorithm.rollout_is == "disable" else cfg.algorithm.rollout_is,
                rollout_is_threshold=float(cfg.algorithm.rollout_is_threshold),
                rollout_rs=cfg.algorithm.get("rollout_rs"),
                rollout_rs_threshold=cfg.algorithm.get("rollout_rs_threshold"),
                rollout_rs_threshold_lower=cfg.algorithm.get("rollout_rs_threshold_lower"),
                peak_tflops=cfg.trainer.get("device_peak_tflops"),
                defer_weight_sync=int(cfg.trainer.max_staleness) > 0,
                temperature=float(cfg.rollout.temperature), lr_schedule=_lr_schedule(cfg))


def _lr_schedule(cfg: Any) -> tuple | None:
    """``update_batch``'s ``lr_schedule`` from ``actor.lr_warmup_steps(_ratio)``, ``warmup_style``,
    ``min_lr_ratio``; None when the rate never moves (no warmup, constant)."""
    a, total = cfg.actor, int(cfg.trainer.total_iterations)
    num_warmup = warmup_steps(total, int(a.get("lr_warmup_steps", -1)), float(a.get("lr_warmup_steps_ratio", 0.0)))
    style = str(a.get("warmup_style", "constant"))
    if num_warmup <= 0 and style == "constant":
        return None
    return (float(a.lr), total, num_warmup, style, float(a.get("min_lr_ratio", 0.0)))
