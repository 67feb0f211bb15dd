"""The PPO update loop of the policy: mini-batches, micro-batches, the loss, the optimizer steps.

:class:`PPOActor` is what verl's ``dp_actor.DataParallelPPOActor`` is to its ``fsdp_workers``: the
algorithm's update over one batch, apart from the worker process that hosts it
(:class:`trajflow.workers.policy.PolicyWorker` owns the model, the engine and the checkpoints and
calls :meth:`PPOActor.update`). The loss itself is :func:`trajflow.stages.policy_update.actor_loss`; the
distribution strategy (one process, DeepSpeed) is the backend's (:mod:`trajflow.modeling.backends`).

Log-probs are named by their policy (docs/architecture.md, "Whose log-prob is it"): ``logp`` the
current policy's (with gradient), ``old`` / ``old_logprobs`` the proximal policy's (the trainer's
before this update, PPO's ``pi_old``), ``rollout_lp`` / ``rollout_logprobs`` the behaviour policy's
(the rollout engine's, stored with the rollout).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from trajflow.stages.policy_update import ACTOR_LOSS_SHARES, ActorLossConfig, UpdateBatch, UpdateRows, UpdateSettings, actor_loss
from trajflow.stages.rollout_correction import (rollout_is_kept_metrics, rollout_is_weights, rollout_mismatch_metrics,
                                       rollout_rs_mask)
from trajflow.config import ActorConfig
from trajflow.modeling.flops import device_peak_tflops, mfu, train_flops
from trajflow.modeling.packing import micro_batch_plan, pack


def max_tokens(actor: ActorConfig) -> int | None:
    """The micro-batches' token budget (``actor.use_dynamic_bsz``), or None for fixed-size ones."""
    return int(actor.ppo_max_token_len_per_gpu) if actor.use_dynamic_bsz else None


@dataclass
class StepCounters:
    """Optimizer steps across updates (saved with a checkpoint).

    Attributes:
        optimizer_steps: steps taken.
        nonfinite_in_a_row: consecutive steps skipped because the gradient norm was not finite; the
            driver stops a run at ``trainer.max_nonfinite_steps``.
    """

    optimizer_steps: int = 0
    nonfinite_in_a_row: int = 0


#: Metrics that are one value per optimizer step (averaged over steps, not weighted by tokens).
STEP_METRICS = frozenset({"actor/grad_norm", "actor/kl_coef"})
#: Rank-additive parts of actor/rollout_logprob_diff, combined after the ranks' metrics are.
_DIFF_SUM, _DIFF_TOKENS = "_rollout_logprob_diff/sum", "_rollout_logprob_diff/tokens"


@dataclass
class UpdateState:
    """What one :meth:`PPOActor.update` call collects across its micro-batches."""

    old_logprobs: list[np.ndarray] | None  # the proximal policy's: the trainer's before the update (None: fully on-policy)
    temperature: float  # the rows' sampling temperature: every log-prob of the update is computed at it
    diff_sum: float = 0.0  # sum of |old - rollout| log-prob over the tokens that count (epoch 0, this rank)
    diff_tokens: float = 0.0  # how many tokens that sum is over
    step_tokens: float = 0.0  # the tokens (all ranks) of the last optimizer step's mini-batch
    is_rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)  # rollout-IS inputs
    first_step_ratio_dev: float | None = None
    nonfinite_steps: int = 0  # optimizer steps skipped because the gradient norm was not finite


class PPOActor:
    """The policy update over one batch (PPO-style; the loss picks GRPO, DAPO, GSPO, ... variants).

    Args:
        model: the policy module (put in training mode).
        backend: the model's backend (:class:`trajflow.modeling.backends.LocalBackend` or DeepSpeed's):
            forward, backward, step, metric reduction across ranks.
        actor: the ``actor`` config section (epochs, micro-batches, clipping, loss).
        pad_id: the tokenizer's pad id (packing).
        device: torch device of the model.
        horizon: ``rollout.max_new_tokens``: Dr. GRPO's constant normaliser.
        compute_log_prob: ``(prompt_ids, response_ids, temperature) -> [float32 (len,)]`` the current
            weights' log-probs, packed as the update packs (the proximal policy's, before the first step).
        steps: the counters to advance (the worker's, so they survive a new backend).
    """

    def __init__(self, model: torch.nn.Module, backend: Any, actor: ActorConfig, pad_id: int, device: Any,
                 horizon: int | None, compute_log_prob: Callable[..., list[np.ndarray]], steps: StepCounters) -> None:
        self.model = model
        self.backend = backend
        self.actor = actor
        self.pad_id = pad_id
        self.device = device
        self.horizon = horizon
        self.compute_log_prob = compute_log_prob
        self.steps = steps

    def update(self, batch: UpdateBatch, temperature: float) -> dict:
        """PPO-style policy update over one iteration's batch (:func:`trajflow.stages.policy_update.update_batch`).

        The loss of each micro-batch is :func:`trajflow.stages.policy_update.actor_loss` (policy gradient,
        entropy bonus, KL loss), with every log-prob under ``softmax(logits / temperature)``, the
        rows' sampling temperature. The proximal policy's log-probs in the PPO ratio
        (``old_logprobs``) are the trainer's own: when the whole batch is one optimizer step of one
        epoch (fully on-policy), they are the current forward's log-probs detached, so the ratio is
        exactly 1 and no extra forward pass is spent; otherwise they are recomputed before the first
        step with the same packing as the update. The behaviour policy's log-probs
        (``rollout_logprobs``, the engine's) are compared with them (``actor/rollout_logprob_diff``)
        and, with ``settings.rollout_is`` (``"token"``/``"sequence"``, threshold
        ``settings.rollout_is_threshold``), weight the policy-gradient loss by
        min(pi_old / pi_rollout, threshold), and with ``settings.rollout_rs`` drop outlying tokens or rows
        from it (:mod:`trajflow.stages.rollout_correction`; metrics ``rollout_corr/*``). ``settings.shuffle_seed`` sets the mini-batch order and
        ``settings.rng_seed`` (optional) seeds torch's global RNG first. The batch is cut into
        mini-batches of ``settings.mini_batch_rows`` rows (one optimizer step each) and those into
        micro-batches of ``ppo_micro_batch_size`` rows, or of at most ``ppo_max_token_len_per_gpu``
        computed tokens with ``use_dynamic_bsz`` (gradient accumulation, exact thanks to the
        mini-batch-wide denominators of :func:`trajflow.stages.policy_update.agg_loss`), for ``ppo_epochs``
        passes. Under DeepSpeed every rank gets the whole batch, keeps the mini-batch-wide
        denominators and trains on its token-balanced share of each mini-batch
        (:class:`trajflow.modeling.backends.DeepSpeedBackend`); metrics are combined across ranks.

        Returns:
            Metrics averaged over optimizer steps, verl names (``actor/pg_loss``, ``actor/pg_clipfrac``,
            ``actor/ppo_kl``, ``actor/entropy``, ``actor/kl_loss``, ``actor/grad_norm``, ``actor/lr``,
            ``actor/ratio_first_step_max_abs_dev``, ``actor/rollout_logprob_diff``,
            ``actor/grad_norm_nonfinite``, ``actor/nonfinite_steps_in_a_row``, ``rollout_corr/*``,
            ``perf/mfu/actor`` on a device with a known peak).
        """
        t0 = time.perf_counter()
        rows, settings = batch.rows, batch.settings
        sums: dict[str, list[float]] = {}
        n_rows = len(rows.response_ids)
        mini_rows = int(settings.mini_batch_rows or n_rows)
        loss_cfg = ActorLossConfig.from_actor(self.actor)
        rng = np.random.default_rng(int(settings.shuffle_seed))
        if settings.rng_seed is not None:
            # Any draw inside the update (dropout, ...) depends on (seed, iteration) only, not on
            # whatever ran in this process before: a resumed run updates exactly as an uninterrupted one.
            torch.manual_seed(int(settings.rng_seed))
        if settings.lr is not None:  # warmup / cosine: the rate of this iteration (trajflow.stages.lr_schedule)
            self.backend.set_lr(settings.lr)
        old_logprobs = None  # the proximal policy's (the trainer's before this update)
        if not (self.actor.ppo_epochs == 1 and mini_rows >= n_rows):
            t_old = time.perf_counter()
            old_logprobs = self.compute_log_prob(rows.prompt_ids, rows.response_ids, temperature)
            sums["timing_s/old_log_prob"] = [time.perf_counter() - t_old]
        state = UpdateState(old_logprobs, temperature)
        weighted: dict[str, float] = {}  # sum over steps of value * the step's tokens (all ranks)
        all_steps_tokens = 0.0  # the same on every rank, also where a rank had no rows in a step
        self.model.train()
        for epoch in range(self.actor.ppo_epochs):
            order = rng.permutation(n_rows) if self.actor.shuffle else np.arange(n_rows)
            for m0 in range(0, n_rows, mini_rows):
                step = self._mini_batch_step(batch, order[m0:m0 + mini_rows], epoch, loss_cfg, state)
                if step is not None:
                    all_steps_tokens += state.step_tokens
                for k, v in (step or {}).items():
                    sums.setdefault(k, []).append(v)
                    weighted[k] = weighted.get(k, 0.0) + float(v) * state.step_tokens
        train_s = time.perf_counter() - t0 - sum(sums.get("timing_s/old_log_prob", []))
        self.backend.zero_grad()
        # Token-level metrics are token means over the whole update: each step's value is already a
        # token mean over its mini-batch (micro-batches weighted by their tokens, ranks adding their
        # shares), and steps are weighted by their mini-batch's tokens, the same on every rank, so the
        # weighted mean stays additive across ranks. Per-step values (grad norm, KL coefficient) are
        # plain means over the steps.
        means_of_steps = {k: weighted[k] / all_steps_tokens if k in weighted and k not in STEP_METRICS
                          and all_steps_tokens > 0 else float(np.mean(v)) for k, v in sums.items()}
        # verl's training/rollout_probs_diff (actor/rollout_logprob_diff): how far the engine's
        # log-probs are from the trainer's, a mean over every counted token of every rank.
        means_of_steps.update({_DIFF_SUM: state.diff_sum, _DIFF_TOKENS: state.diff_tokens})
        metrics = self.backend.reduce_metrics(
            means_of_steps, maxima={"actor/ratio_first_step_max_abs_dev": float(state.first_step_ratio_dev or 0.0)})
        diff_sum, diff_tokens = metrics.pop(_DIFF_SUM), metrics.pop(_DIFF_TOKENS)
        if diff_tokens > 0:
            metrics["actor/rollout_logprob_diff"] = diff_sum / diff_tokens
        metrics["actor/lr"] = self.backend.lr()
        peak = settings.peak_tflops or device_peak_tflops(self.device)
        if peak and train_s > 0:  # PaLM's model FLOPs utilisation of the update (trajflow.modeling.flops)
            seq = [len(p) + len(r) for p, r in zip(rows.prompt_ids, rows.response_ids)]
            flops = self.actor.ppo_epochs * train_flops(self.model, seq)
            metrics["perf/mfu/actor"] = mfu(flops, train_s, peak, self.backend.world_size)
        metrics["actor/grad_norm_nonfinite"] = float(state.nonfinite_steps)
        metrics["actor/nonfinite_steps_in_a_row"] = float(self.steps.nonfinite_in_a_row)
        is_rows = self.backend.gather_rows(state.is_rows)  # every rank's rows (data parallel)
        if is_rows:
            metrics.update(self._rollout_is_metrics(is_rows, settings))
        return metrics

    def _mini_batch_step(self, batch: UpdateBatch, mini: np.ndarray, epoch: int, loss_cfg: ActorLossConfig,
                         state: UpdateState) -> dict[str, float] | None:
        """One optimizer step over the rows ``mini``: its metrics, or None when no token counts."""
        rows = batch.rows
        masks = [np.asarray(rows.loss_mask[r], dtype=np.float32) if rows.loss_mask is not None
                 else np.ones(len(rows.response_ids[r]), np.float32) for r in mini]
        global_tokens = float(sum(m.sum() for m in masks))
        global_seqs = float(sum(1 for m in masks if m.sum() > 0))
        if global_tokens == 0:
            return None
        state.step_tokens = global_tokens
        self.backend.zero_grad()
        step: dict[str, float] = {}
        tokens = [len(rows.prompt_ids[r]) + len(rows.response_ids[r]) for r in mini]
        for ids, live in self.backend.micro_batches(mini, self._split_rows(rows), tokens):
            self._micro_batch(batch, ids, live, epoch, loss_cfg, state, step, global_tokens, global_seqs)
        gn, stepped = self.backend.step(self.actor.grad_clip)
        self.steps.optimizer_steps += int(stepped)
        if math.isfinite(gn):
            step["actor/grad_norm"] = gn
            self.steps.nonfinite_in_a_row = 0
        else:  # the backend did not step: the weights stay finite; the driver stops a run that keeps doing this
            state.nonfinite_steps += 1
            self.steps.nonfinite_in_a_row += 1
        return step

    def _micro_batch(self, batch: UpdateBatch, ids: list[int], live: bool, epoch: int, loss_cfg: ActorLossConfig,
                     state: UpdateState, step: dict[str, float], global_tokens: float, global_seqs: float) -> None:
        """Forward and backward of the rows ``ids``; adds their metrics to ``step`` (``live`` only:
        a padding micro-batch of a data-parallel rank backpropagates zero and reports nothing)."""
        rows, settings = batch.rows, batch.settings
        packed = pack([rows.prompt_ids[r] for r in ids], [rows.response_ids[r] for r in ids], self.pad_id, self.device)
        T = packed.responses.shape[1]
        mask = packed.response_mask.float() * self._ragged(rows.loss_mask, ids, T) if rows.loss_mask is not None \
            else packed.response_mask.float()
        # logp: the current policy's; old: the proximal policy's; rollout_lp: the behaviour policy's.
        logp, ent = self.backend.forward(packed, state.temperature, compute_entropy=True,
                                         entropy_grad=bool(loss_cfg.entropy_coeff))
        if state.old_logprobs is None:
            old = logp.detach()
        else:
            old = torch.zeros_like(logp)
            for j, r in enumerate(ids):
                old[j, :len(state.old_logprobs[r])] = torch.from_numpy(state.old_logprobs[r])
        is_w = None
        if live:
            rollout_lp = self._ragged(rows.rollout_logprobs, ids, T)
            # The engine's log-probs exist only where it sampled: a multi-turn row stores 0.0 on its
            # tool/environment tokens, so engine and trainer are compared on the masked tokens only.
            m = packed.response_mask & (mask > 0)
            if epoch == 0:
                state.diff_sum += float(((old - rollout_lp).abs() * m).sum())
                state.diff_tokens += float(m.sum())
            if settings.rollout_is:  # truncated IS: min(pi_old / pi_rollout, C), a constant weight
                is_w, _ = rollout_is_weights(old, rollout_lp, m, settings.rollout_is,
                                             float(settings.rollout_is_threshold))
            if settings.rollout_rs:  # rejection: an outlying token or row weighs 0 (the denominator stays)
                keep, _ = rollout_rs_mask(old, rollout_lp, m, settings.rollout_rs, float(settings.rollout_rs_threshold),
                                          settings.rollout_rs_threshold_lower)
                keep_w = keep.to(torch.float32)
                # Tokens outside m (tool output, padding) keep weight 1: their loss mask already zeroes them.
                keep_w = torch.where(m, keep_w, torch.ones_like(keep_w))
                is_w = keep_w if is_w is None else torch.where(m, is_w * keep_w, is_w)
            if epoch == 0:  # the mismatch metrics are logged every iteration, correction or not
                for j, r in enumerate(ids):
                    n = len(rows.response_ids[r])
                    state.is_rows[r] = (old[j, :n].detach().cpu().numpy(), rollout_lp[j, :n].cpu().numpy(),
                                        m[j, :n].cpu().numpy())
        adv = self._ragged(rows.advantages, ids, T)
        # Dr. GRPO's constant normaliser is the response cap (verl pads responses to it), not the
        # micro-batch's longest response, so micro-batches add up to the mini-batch loss.
        agg_kw = dict(global_num_tokens=global_tokens, global_num_seqs=global_seqs,
                      horizon=int(self.horizon or T))
        use_kl = loss_cfg.kl_loss_coef > 0 and rows.ref_logprobs is not None
        ref = self._ragged(rows.ref_logprobs, ids, T) if use_kl else None
        loss, loss_metrics = actor_loss(logp, old, adv, mask, entropy=ent, ref_logp=ref, cfg=loss_cfg, agg_kw=agg_kw,
                                        rollout_is_weights=is_w)
        if not live:
            self.backend.backward(loss * 0.0)
            return
        self.backend.backward(loss)
        if state.first_step_ratio_dev is None:
            with torch.no_grad():
                dev = ((logp - old).exp() - 1).abs() * mask
                state.first_step_ratio_dev = float(dev.max())
        frac = float(mask.sum()) / global_tokens
        for k, v in loss_metrics.items():
            if k == "actor/kl_coef":
                step[k] = v
            elif k in ACTOR_LOSS_SHARES:
                step[k] = step.get(k, 0.0) + v
            else:  # token means of this micro-batch: weighted by its share of the mini-batch's tokens
                step[k] = step.get(k, 0.0) + float(v) * frac

    @staticmethod
    def _rollout_is_metrics(rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], settings: UpdateSettings
                            ) -> dict:
        """``rollout_corr/*`` over the whole batch from each row's (trainer old, engine) log-probs and
        the mask of the tokens that count: the mismatch diagnostics
        (:func:`trajflow.stages.rollout_correction.rollout_mismatch_metrics`) always, the IS weights'
        statistics when ``settings.rollout_is`` is set, the rejection's when ``settings.rollout_rs`` is."""
        threshold = float(settings.rollout_is_threshold)
        ordered = [rows[r] for r in sorted(rows)]
        width = max([len(o) for o, _, _ in ordered] + [1])
        old = torch.zeros((len(ordered), width), dtype=torch.float64)
        eng = torch.zeros_like(old)
        mask = torch.zeros((len(ordered), width), dtype=torch.bool)
        for i, (o, e, k) in enumerate(ordered):
            old[i, :len(o)] = torch.from_numpy(o.astype(np.float64))
            eng[i, :len(e)] = torch.from_numpy(e.astype(np.float64))
            mask[i, :len(k)] = torch.from_numpy(k.astype(bool))
        out = rollout_mismatch_metrics(old, eng, mask, threshold)
        weights = keep = None
        if settings.rollout_is:
            weights, m = rollout_is_weights(old, eng, mask, settings.rollout_is, threshold)
            out.update(m)
        if settings.rollout_rs:
            keep, m = rollout_rs_mask(old, eng, mask, settings.rollout_rs, float(settings.rollout_rs_threshold),
                                      settings.rollout_rs_threshold_lower)
            out.update(m)
        if weights is not None and keep is not None:
            out.update(rollout_is_kept_metrics(weights, keep, mask))
        return out

    def _split_rows(self, rows: UpdateRows):
        """Row ids -> micro-batches, as :func:`trajflow.modeling.packing.micro_batch_plan` cuts them."""
        def split(ids: list[int]) -> list[list[int]]:
            plan = micro_batch_plan([rows.prompt_ids[r] for r in ids], [rows.response_ids[r] for r in ids],
                                    int(self.actor.ppo_micro_batch_size), max_tokens(self.actor))
            return [ids[sl] for sl in plan]
        return split

    def _ragged(self, values: Sequence[Sequence[float]], rows: Sequence[int], width: int) -> torch.Tensor:
        """``(len(rows), width)`` float32 on the device: each row's values, zero-padded (or cut) to ``width``."""
        t = torch.full((len(rows), width), 0.0, dtype=torch.float32)
        for j, r in enumerate(rows):
            v = np.asarray(values[r], dtype=np.float32)
            t[j, :len(v)] = torch.from_numpy(v[:width])
        return t.to(self.device)
