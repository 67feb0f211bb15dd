"""Running an estimator by name, and the advantage stage's Arrow output over a joined rollout +
reward table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from trajflow.batch import lengths, pad_ragged, to_ragged, trainable_mask

from trajflow.stages.advantage.registry import ADV_ESTIMATORS, AdvantageConfig


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[str | int] | None,
    config: AdvantageConfig | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the advantage estimator registered as ``name``.

    Args:
        name: config name (``algorithm.adv_estimator``), one of ``ADV_ESTIMATORS.names()``.
        token_level_rewards: ``(batch, response_len)`` float.
        response_mask: ``(batch, response_len)`` bool or 0/1.
        index: length-batch group ids (may be None for gae, reinforce_plus_plus, remax).
        config: :class:`AdvantageConfig`; defaults to ``AdvantageConfig()``.
        **extra: ``values=`` (gae), ``reward_baselines=`` (remax); ignored by estimators that do
            not use them.

    Returns:
        ``(advantages, returns)``, each float32 ``(batch, response_len)``, 0 outside the mask.

    Raises:
        ValueError: unknown ``name`` (lists the registered ones) or malformed inputs.
    """
    fn = ADV_ESTIMATORS.get(name)
    return fn(token_level_rewards, response_mask, index, config if config is not None else AdvantageConfig(), **extra)


def advantage_table(joined: pa.Table, algorithm_cfg: dict, values: list[np.ndarray] | None = None,
                    reward_baselines: np.ndarray | None = None) -> pa.Table:
    """The advantage stage's output (``values`` only when a critic supplied them).

    Args:
        joined: rollout + reward columns (needs ``sample_id``, ``group_id``, ``response_ids``,
            ``token_rewards``; a multi-turn rollout's ``loss_mask`` restricts every estimator to the
            generated tokens, and the other tokens get advantage and return 0).
        algorithm_cfg: the ``algorithm`` config section.
        values: critic values per row (ragged, aligned with ``response_ids``), for ``gae``.
        reward_baselines: per-row baseline reward (ReMax's greedy score).
    """
    resp_len = lengths(joined.column("response_ids"))
    T = max(int(resp_len.max()) if len(resp_len) else 1, 1)
    rewards = pad_ragged(joined.column("token_rewards"), 0.0, torch.float32, length=T)
    mask = trainable_mask(joined, T)  # a multi-turn row's tool/environment tokens take no part
    conf = AdvantageConfig(gamma=algorithm_cfg["gamma"], lam=algorithm_cfg["lam"],
                           norm_adv_by_std_in_grpo=algorithm_cfg["norm_adv_by_std_in_grpo"])
    extra: dict[str, Any] = {}
    vals_t = None
    if values is not None:
        vals_t = pad_ragged(pa.array([list(map(float, v)) for v in values], pa.list_(pa.float32())), 0.0,
                            torch.float32, length=T)
        extra["values"] = vals_t
    if reward_baselines is not None:
        extra["reward_baselines"] = torch.as_tensor(reward_baselines, dtype=torch.float32)
    if algorithm_cfg["adv_estimator"] == "opd":  # the teacher's and the student's log-probs of the sampled tokens
        extra.update(teacher_log_probs=pad_ragged(joined.column("teacher_logprobs"), 0.0, torch.float32, length=T),
                     rollout_log_probs=pad_ragged(joined.column("rollout_logprobs"), 0.0, torch.float32, length=T),
                     opd_coef=float(algorithm_cfg["opd_coef"]), opd_task_coef=float(algorithm_cfg["opd_task_coef"]))
    index = joined.column("group_id").to_pylist()
    adv, ret = compute_advantage(algorithm_cfg["adv_estimator"], rewards, mask, index, conf, **extra)
    cols = {"sample_id": joined.column("sample_id")}
    if vals_t is not None:
        cols["values"] = to_ragged(vals_t, resp_len)
    cols["advantages"] = to_ragged(adv, resp_len)
    cols["returns"] = to_ragged(ret, resp_len)
    return pa.table(cols)


def fill_dropped_rows(joined: pa.Table, computed: pa.Table | None) -> pa.Table:
    """Advantage table over every row of ``joined``: computed rows as given, the others zero.

    Args:
        joined: all rows of the iteration (``sample_id``, ``response_ids``).
        computed: :func:`advantage_table` over the kept rows (``None`` if none was kept).
    """
    ids = joined.column("sample_id").to_pylist()
    resp_len = lengths(joined.column("response_ids"))
    by_id: dict[str, int] = {}
    cols = ["advantages", "returns"]
    if computed is not None:
        by_id = {sid: i for i, sid in enumerate(computed.column("sample_id").to_pylist())}
        cols = [c for c in computed.column_names if c != "sample_id"]
        if len(by_id) == len(ids):
            return computed.take(pa.array([by_id[s] for s in ids]))
    data = {c: computed.column(c).to_pylist() if computed is not None else None for c in cols}
    out: dict[str, Any] = {"sample_id": joined.column("sample_id")}
    for c in cols:
        out[c] = pa.array([data[c][by_id[s]] if s in by_id else [0.0] * int(n) for s, n in zip(ids, resp_len)],
                          pa.list_(pa.float32()))
    return pa.table(out)
