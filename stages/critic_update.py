"""Critic update batches: one iteration's stored stages -> the critic worker's typed inputs.

The value loss itself is :func:`trajflow.stages.policy_update.value_loss`; the worker is
:class:`trajflow.workers.critic.CriticWorker`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from trajflow.stages.policy_update import check_rows
from trajflow.stages.seeds import Salt, iteration_seed


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
        check_rows(self, ("prompt_ids", "response_ids", "values", "returns", "loss_mask"))

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
                              shuffle_seed=iteration_seed(int(cfg.trainer.seed), iteration, Salt.CRITIC_SHUFFLE))
    return CriticBatch(CriticRows(**cols, loss_mask=loss_mask), settings)
