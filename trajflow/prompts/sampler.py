"""The data cursor: deterministic epoch-based batches of prompts, saved and restored with checkpoints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trajflow.prompts.spec import PromptRecord


class PromptSampler:
    """Deterministic epoch-based batches of prompts, resumable from a checkpoint.

    Epoch ``e`` visits the records in the order of a permutation drawn from ``(seed, e)``
    (``numpy.random.default_rng([seed, e])``), cut into consecutive batches of ``batch_size``.
    Batches never straddle epochs: when fewer than ``batch_size`` prompts remain in an epoch, that
    tail is dropped (like a ``DataLoader(drop_last=True)``) and the next batch starts the next epoch
    with a fresh permutation. So every prompt appears at most once per epoch, and exactly once
    when ``len(records) % batch_size == 0``; the dropped tail differs from epoch to epoch because
    the permutation does.

    Args:
        records: the prompts (any sequence; typically ``PromptDatasets.train``).
        batch_size: prompts per batch, ``1 <= batch_size <= len(records)``.
        seed: integer seed of the permutations.

    Raises:
        ValueError: ``batch_size`` < 1 or larger than ``len(records)`` (no full batch would exist).
    """

    def __init__(self, records: Sequence[PromptRecord], batch_size: int, seed: int = 0) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size must be an integer >= 1, got {batch_size!r}")
        if len(records) < batch_size:
            raise ValueError(
                f"PromptSampler: batch_size {batch_size} exceeds the number of prompts {len(records)}; "
                f"no full batch exists (the tail of each epoch is dropped)"
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"PromptSampler: seed must be an integer, got {seed!r}")
        self.records = list(records)
        self.batch_size = batch_size
        self.seed = int(seed)
        self._epoch = 0
        self._cursor = 0  # prompts of the current epoch already handed out
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def iterations_per_epoch(self) -> int:
        """Full batches per epoch: ``len(records) // batch_size``."""
        return len(self.records) // self.batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based), before any pending epoch roll-over."""
        return self._epoch

    @property
    def cursor(self) -> int:
        """Prompts of the current epoch already handed out (a multiple of ``batch_size``)."""
        return self._cursor

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.records))
            self._perm_epoch = epoch
        return self._perm  # type: ignore[return-value]

    def next_batch(self) -> list[PromptRecord]:
        """The next ``batch_size`` prompts (starting a new epoch when the current one has no full batch left)."""
        if self._cursor + self.batch_size > len(self.records):
            self._epoch += 1
            self._cursor = 0
        perm = self._permutation(self._epoch)
        idx = perm[self._cursor : self._cursor + self.batch_size]
        self._cursor += self.batch_size
        return [self.records[i] for i in idx]

    def state_dict(self) -> dict:
        """``{"epoch": int, "cursor": int, "seed": int}``: JSON-serialisable position for checkpoints."""
        return {"epoch": self._epoch, "cursor": self._cursor, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`; the next batch is the one that would have followed.

        Raises:
            ValueError: a missing key, or ``cursor`` not a multiple of ``batch_size`` in ``[0, len(records)]``
                (a checkpoint from a different batch size or dataset).
        """
        missing = [k for k in ("epoch", "cursor", "seed") if k not in state]
        if missing:
            raise ValueError(f"PromptSampler.load_state_dict: missing keys {missing} (got {sorted(state)})")
        epoch, cursor, seed = int(state["epoch"]), int(state["cursor"]), int(state["seed"])
        if epoch < 0:
            raise ValueError(f"PromptSampler.load_state_dict: 'epoch' must be >= 0, got {epoch}")
        if cursor < 0 or cursor > len(self.records) or cursor % self.batch_size:
            raise ValueError(
                f"PromptSampler.load_state_dict: 'cursor' {cursor} must be a multiple of batch_size "
                f"{self.batch_size} within [0, {len(self.records)}]: the checkpoint was made with a different "
                f"batch size or dataset"
            )
        self._epoch, self._cursor, self.seed = epoch, cursor, seed
        self._perm_epoch = -1

    def __len__(self) -> int:
        return self.iterations_per_epoch
