"""Batch-level stage functions: Arrow table in, Arrow table out.

Each wraps the tensor math of ``stages/`` for one stage and produces exactly the columns that stage
owns (design.md's schema), keyed by ``sample_id``. They import neither Ray nor Prefect: the flow's
tasks run them on Ray workers and persist what they return.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from stages.seeds import iteration_seed
from trajflow.batch import lengths


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
    lens = lengths(joined.column("response_ids"))
    keep = [sid not in dropped for sid in joined.column("sample_id").to_pylist()]
    mask = [[1.0 if k else 0.0] * int(n) for k, n in zip(keep, lens)]
    return joined.append_column("loss_mask", pa.array(mask, pa.list_(pa.float32())))


def update_batch(joined: pa.Table, iteration: int, *, seed: int, n: int, ppo_mini_batch_size: int,
                 use_ref_logprobs: bool, mask_truncated: bool = False, rollout_is: str | None = None,
                 rollout_is_threshold: float = 2.0) -> dict[str, Any]:
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
        Per-row lists ``prompt_ids``, ``response_ids``, ``old_logprobs``, ``advantages`` (ragged), optional
        ``loss_mask`` and ``ref_logprobs``, plus ``mini_batch_rows``, ``shuffle_seed``, ``rng_seed`` (the
        worker seeds torch with it before updating, so no draw depends on what ran before) and, with
        rollout IS, ``rollout_is`` and ``rollout_is_threshold``.
    """
    batch: dict[str, Any] = {c: joined.column(c).to_pylist()
                             for c in ("prompt_ids", "response_ids", "old_logprobs", "advantages")}
    loss_mask, _ = actor_loss_mask(joined, mask_truncated)
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    if use_ref_logprobs and "ref_logprobs" in joined.column_names:
        batch["ref_logprobs"] = joined.column("ref_logprobs").to_pylist()
    if rollout_is:
        batch["rollout_is"] = str(rollout_is)
        batch["rollout_is_threshold"] = float(rollout_is_threshold)
    batch["mini_batch_rows"] = ppo_mini_batch_size * n
    batch["shuffle_seed"] = iteration_seed(seed, iteration, salt=1)
    batch["rng_seed"] = iteration_seed(seed, iteration, salt=5)
    return batch


def update_batch_options(cfg: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`update_batch` from a run config (shared by the update stage and
    the replay of stored updates when a policy worker is recreated)."""
    return dict(seed=int(cfg.trainer.seed), n=int(cfg.rollout.n),
                ppo_mini_batch_size=int(cfg.actor.ppo_mini_batch_size),
                use_ref_logprobs=cfg.actor.kl_loss_coef > 0,
                mask_truncated=bool(cfg.algorithm.mask_truncated_samples),
                rollout_is=cfg.algorithm.rollout_is, rollout_is_threshold=float(cfg.algorithm.rollout_is_threshold))


def critic_batch(joined: pa.Table, iteration: int, cfg: Any) -> dict[str, Any]:
    """The critic worker's ``update_critic`` batch for one iteration, from its stored stages.

    Rows: ``prompt_ids``, ``response_ids``, ``values`` (the critic's values before the update),
    ``returns``, optional ``loss_mask`` (quarantined rows); the actor's mini-batch size and shuffle
    flag, and a shuffle seed of its own. Deterministic, so a recreated critic replays it exactly.
    """
    batch: dict[str, Any] = {c: joined.column(c).to_pylist() for c in ("prompt_ids", "response_ids", "values", "returns")}
    if "loss_mask" in joined.column_names:
        batch["loss_mask"] = joined.column("loss_mask").to_pylist()
    batch.update(mini_batch_rows=int(cfg.actor.ppo_mini_batch_size) * int(cfg.rollout.n),
                 shuffle=bool(cfg.actor.shuffle), shuffle_seed=iteration_seed(int(cfg.trainer.seed), iteration, salt=4))
    return batch
