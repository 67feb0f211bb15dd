"""The trajectory batch: Arrow tables of ragged columns, padded to tensors only inside workers.

One row per sampled response. Ragged token columns (``prompt_ids``, ``response_ids``,
``rollout_logprobs``, ...) are Arrow ``list<...>`` columns on disk; :func:`pad_ragged` turns one into a
padded ``(rows, max_len)`` tensor and :func:`to_ragged` goes back, keeping only the first
``lengths[i]`` entries of each row. Stage outputs are separate tables keyed by ``sample_id``;
:func:`join_stages` lines them up into one table.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trajflow.errors import BatchError

if TYPE_CHECKING:  # torch is imported where tensors are made, not for Arrow-only callers
    import torch

#: 3: the behaviour policy's log-probs are the rollout column ``rollout_logprobs`` (2 called it
#: ``old_logprobs``; :func:`upgrade_stage_table` renames it on read) and every rollout row stores the
#: ``temperature``, ``top_p`` and ``top_k`` it was sampled with (absent before 3: the run config's apply).
#: 2: ``prompt`` and ``extra_info`` are Arrow lists/structs (1 stored them as JSON text; still read).
SCHEMA_VERSION = 3

#: Stored column names of earlier schemas -> today's (see :func:`upgrade_stage_table`).
RENAMED_COLUMNS = {"old_logprobs": "rollout_logprobs"}

#: The ``prompt`` column: chat messages, in verl's field order.
PROMPT_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))

# Columns each stage writes (the contract in design.md). `sample_id` keys every stage table.
# `rollout_logprobs` holds the behaviour policy's (the rollout engine's) log-probs (empty rows for greedy
# decoding); `temperature`/`top_p`/`top_k` the sampling settings. Optional columns: rollout `baseline_response_ids`
# and `baseline_response_text` (ReMax), and the multi-turn columns of MULTI_TURN_COLUMNS; reward
# `rule_score`/`rm_score` (reward model), `reward_baseline` (ReMax); advantage `staleness` int64 (the
# trainer's policy version at the update minus the row's `policy_version`; trainer.max_staleness > 0);
# rollout `token_policy_versions` list<int64> (the version that sampled each response token;
# trainer.partial_rollout, stages/partial_rollout.py).
#: Rollout columns of multi-turn episodes: `loss_mask` list<int8> (1 where the model generated the
#: response token, 0 on tool/environment and template tokens; absent = all ones), `turn_spans`
#: list<int32> (flat [start, end) offsets of each assistant turn in `response_ids`), `num_turns` int32,
#: `messages` and `tool_calls` (list<struct>, for audit and display only; training never reads them),
#: `env_reward` float32 (the environment's own reward, nullable) and `env_reward_source` string (`step`,
#: `final`, `default` or null: where `env_reward` came from; see stages/multi_turn.py).
MULTI_TURN_COLUMNS = ("loss_mask", "turn_spans", "num_turns", "messages", "tool_calls", "env_reward",
                      "env_reward_source")
ROLLOUT_COLUMNS = ("sample_id", "prompt_id", "group_id", "iteration", "policy_version", "prompt",
                   "prompt_ids", "response_ids", "response_text", "rollout_logprobs", "finish_reason",
                   "ground_truth", "data_source", "extra_info", "temperature", "top_p", "top_k", "baseline_response_ids",
                   "baseline_response_text", "token_policy_versions", *MULTI_TURN_COLUMNS)
REWARD_COLUMNS = ("sample_id", "score", "reward_extra", "reward_error", "token_rewards", "ref_logprobs",
                  "rule_score", "rm_score", "reward_baseline")
ADVANTAGE_COLUMNS = ("sample_id", "values", "advantages", "returns", "staleness")


def _as_list_array(col: pa.Array | pa.ChunkedArray) -> pa.ListArray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_large_list(col.type):
        col = col.cast(pa.list_(col.type.value_type))
    return col


def lengths(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per-row lengths of a list column, int64 ``(rows,)``."""
    return pc.list_value_length(_as_list_array(col)).to_numpy(zero_copy_only=False).astype(np.int64)


def pad_ragged(col: pa.Array | pa.ChunkedArray, pad_value: float | int = 0, dtype: Any = None,
               side: str = "right", length: int | None = None) -> "torch.Tensor":
    """Pad a ragged list column into a dense tensor.

    Args:
        col: Arrow list column with ``rows`` entries.
        pad_value: value written where a row is shorter than ``length``.
        dtype: torch dtype of the result (default: from the Arrow value type).
        side: ``"right"`` (content starts at column 0) or ``"left"`` (content ends at the last column).
        length: width of the result (default: the longest row). Rows longer than it are an error.

    Returns:
        Tensor ``(rows, length)``.

    Raises:
        BatchError: a row is longer than ``length``, or ``side`` is not left/right.
    """
    import torch

    arr = _as_list_array(col)
    lens = lengths(arr)
    width = int(lens.max()) if length is None and len(lens) else int(length or 0)
    _check_width(lens, width)
    values = arr.flatten().to_numpy(zero_copy_only=False).copy()  # torch needs a writable buffer
    if dtype is None:
        dtype = torch.from_numpy(values[:0].copy()).dtype if values.dtype != object else torch.float32
    out = torch.full((len(lens), width), pad_value, dtype=dtype)
    if len(values) == 0:
        return out
    rows, cols = _padded_positions(lens, width, side)
    out[torch.from_numpy(rows), torch.from_numpy(cols)] = torch.from_numpy(values).to(dtype)
    return out


def _check_width(lens: np.ndarray, width: int) -> None:
    if len(lens) and lens.max() > width:
        raise BatchError(f"row {int(lens.argmax())} has {int(lens.max())} entries, more than length={width}")


def _padded_positions(lens: np.ndarray, width: int, side: str = "right") -> tuple[np.ndarray, np.ndarray]:
    """Where each flattened value of a list column with row lengths ``lens`` goes in a padded
    ``(rows, width)`` array: int64 ``(values,)`` row and column indices."""
    rows = np.repeat(np.arange(len(lens)), lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    cols = np.arange(int(lens.sum())) - np.repeat(starts, lens)
    if side == "left":
        cols = cols + np.repeat(width - lens, lens)
    elif side != "right":
        raise BatchError(f"side must be 'left' or 'right', got {side!r}")
    return rows, cols


def to_ragged(t: "torch.Tensor", lens: Sequence[int] | np.ndarray, arrow_type: pa.DataType = pa.float32()) -> pa.ListArray:
    """Inverse of right-padding: keep the first ``lens[i]`` entries of row ``i``.

    Args:
        t: tensor or array ``(rows, width)``.
        lens: ``(rows,)`` lengths, each ``<= width``.
        arrow_type: Arrow value type of the result.
    """
    arr = t if isinstance(t, np.ndarray) else t.detach().cpu().numpy()
    lens = np.asarray(lens, dtype=np.int64)
    mask = np.arange(arr.shape[1])[None, :] < lens[:, None]
    flat = arr[mask]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, type=arrow_type))


def trainable_mask_array(table: pa.Table, width: int | None = None) -> np.ndarray:
    """Which response tokens the policy generated, as a padded bool array (no torch: the driver's path).

    The rollout's ``loss_mask`` (multi-turn rows: 0 on observation and template tokens) within each
    row's ``response_ids``; every response token when the column is absent (single-turn rows).

    Args:
        table: a table with ``response_ids`` and optionally ``loss_mask`` (any 0/1 number type).
        width: the padded width (default: the longest response, at least 1).

    Returns:
        ``(rows, width)`` bool, False on padding.

    Raises:
        BatchError: a ``loss_mask`` row whose length differs from its ``response_ids`` row, or a row
            longer than ``width``.
    """
    resp_len = lengths(table.column("response_ids"))
    if width is None:
        width = max(int(resp_len.max()) if len(resp_len) else 1, 1)
    mask = np.arange(width)[None, :] < resp_len[:, None]
    if "loss_mask" not in table.column_names:
        return mask
    col = _as_list_array(table.column("loss_mask"))
    lens = lengths(col)
    bad = np.nonzero(lens != resp_len)[0]
    if len(bad):
        r = int(bad[0])
        raise BatchError(f"row {r}: loss_mask has {int(lens[r])} entries but response_ids has "
                         f"{int(resp_len[r])}; they must be the same length")
    _check_width(lens, width)
    values = col.flatten().to_numpy(zero_copy_only=False)
    generated = np.zeros((len(lens), width), dtype=bool)
    generated[_padded_positions(lens, width)] = values.astype(np.float32) != 0
    return mask & generated


def trainable_mask(table: pa.Table, width: int | None = None) -> "torch.Tensor":
    """:func:`trainable_mask_array` as a torch bool tensor ``(rows, width)``.

    Raises:
        BatchError: as :func:`trainable_mask_array`.
    """
    import torch

    return torch.from_numpy(trainable_mask_array(table, width))


def trainable_lengths(table: pa.Table) -> np.ndarray:
    """Per-row count of generated response tokens (:func:`trainable_mask_array`), int64 ``(rows,)``."""
    return trainable_mask_array(table).sum(axis=-1).astype(np.int64)


def list_column(rows: Iterable[Sequence[Any]], arrow_type: pa.DataType) -> pa.ListArray:
    """Build a ``list<arrow_type>`` column from Python/numpy sequences."""
    return pa.array([list(r) for r in rows], type=pa.list_(arrow_type))


def json_column(values: Iterable[Any]) -> pa.Array:
    """JSON-encode dicts/lists into a string column (heterogeneous structs do not fit Arrow structs)."""
    return pa.array([None if v is None else json.dumps(v, sort_keys=True, default=str) for v in values],
                    type=pa.string())


def _canonical(value: Any) -> Any:
    """Dicts with sorted keys (a stable struct field order), tuples as lists, numpy scalars as Python,
    and empty dicts as None: Parquet cannot store a struct without fields."""
    if isinstance(value, dict):
        if not value:
            return None
        return {str(k): _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def nested_type(values: Iterable[Any]) -> pa.DataType:
    """The Arrow type to store ``values`` (JSON-like dicts) as: the struct/list type that holds every
    one of them, or ``string`` (JSON text) when none does (a key that is a number in one row and
    text in another) or there is nothing to store.

    Inferring it once over a whole dataset gives every stage file of a run, and every batch that
    dynamic sampling concatenates, the same schema.
    """
    try:
        inferred = pa.array([_canonical(v) for v in values]).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        return pa.string()
    return pa.string() if pa.types.is_null(inferred) else inferred


def nested_column(values: Sequence[Any], arrow_type: pa.DataType | None = None) -> pa.Array:
    """JSON-like dicts/lists as an Arrow struct/list column (readable as such in pandas, pyarrow, duckdb).

    Args:
        values: one dict (or list, or None) per row.
        arrow_type: the column's type (see :func:`nested_type`; ``string`` stores JSON text);
            default: :func:`nested_type` of ``values``.

    Returns:
        The column; JSON text (:func:`json_column`) when the values fit no Arrow type.
        :func:`decode_nested` reads either back.
    """
    if arrow_type is None:
        arrow_type = nested_type(values)
    if pa.types.is_string(arrow_type):
        return json_column(values)
    try:
        return pa.array([_canonical(v) for v in values], type=arrow_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        return json_column(values)


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def decode_nested(value: Any) -> Any:
    """One stored ``prompt`` / ``extra_info`` value as Python: a struct's dict or a list as read by
    pyarrow, or the JSON text older runs stored (and :func:`nested_column`'s fallback).

    Struct fields a row did not have read back as null; they are dropped, so a scorer sees the
    row's own keys (a key stored as null reads as absent).
    """
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return _drop_nulls(value)


def upgrade_stage_table(table: pa.Table) -> pa.Table:
    """A stage table read from disk, with the column names of today's schema (:data:`SCHEMA_VERSION`):
    a file written by an earlier version reads as if written now (``old_logprobs`` of schema <= 2 is
    ``rollout_logprobs``). Columns an older file lacks stay absent; their readers fall back (e.g.
    :func:`trajflow.stages.rollout.rollout_temperature`)."""
    names = table.column_names
    if not any(old in names and new not in names for old, new in RENAMED_COLUMNS.items()):
        return table
    return table.rename_columns([RENAMED_COLUMNS.get(n, n) if RENAMED_COLUMNS.get(n) not in names else n
                                 for n in names])


def join_stages(tables: Sequence[pa.Table]) -> pa.Table:
    """Line up stage tables on ``sample_id`` (the first table's row order wins).

    Raises:
        BatchError: a table lacks ``sample_id``, misses ids of the first table, or repeats a column.
    """
    base = tables[0]
    if "sample_id" not in base.column_names:
        raise BatchError("stage table has no 'sample_id' column")
    out = base
    ids = base.column("sample_id")
    for t in tables[1:]:
        if "sample_id" not in t.column_names:
            raise BatchError("stage table has no 'sample_id' column")
        other = t.column("sample_id")
        if not other.equals(ids):
            idx = pc.index_in(ids, value_set=other)
            if idx.null_count:
                missing = pc.filter(ids, pc.is_null(idx)).to_pylist()[:3]
                raise BatchError(f"stage table is missing sample_id(s) {missing}")
            t = t.take(idx)
        for name in t.column_names:
            if name == "sample_id":
                continue
            if name in out.column_names:
                raise BatchError(f"column {name!r} is written by two stages")
            out = out.append_column(name, t.column(name))
    return out
