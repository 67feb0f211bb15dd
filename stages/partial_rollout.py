"""Partial rollouts (``trainer.partial_rollout``): the rows in flight across weight updates, as one Arrow table.

With partial rollouts the rollout workers keep a *pool* of groups in flight. Each iteration's rollout
is one *segment* of generation under one policy version: it continues the rows left unfinished by
the segment before (their prompt plus the response so far is prefilled again under the new weights,
with the budget that is left), starts the iteration's new prompts, and generates in chunks of
``rollout.partial_chunk_tokens`` decode steps until the iteration has the groups it needs. Rows that
are still running when it stops stay in the pool, stored with their tokens so far
(``inflight.parquet`` of the iteration); the next segment resumes them. Every pause point is counted in
chunks and completed groups, never in wall-clock time, so a run's samples are a function of its
seed and schedule (the Kimi k1.5 report's partial rollouts, and the pause/resume of AReaL's and
verl's fully-async trainers, made deterministic).

A pool row has the columns of a rollout row (``stages/rollout.py``'s :func:`rollout_table`) plus
``token_policy_versions`` (list<int64>: the policy version that sampled each response token);
``rollout_logprobs`` holds each token's log-prob under the version that sampled it (the behaviour
policy *per token*), and ``finish_reason`` is null while the row is still running. When a group is
handed to an iteration its ``policy_version`` is the version of its **oldest** token, so the
staleness the update counts (``stages/staleness.py``) is the oldest token's.

Plain Arrow and Python; no Ray, no Prefect.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from trajflow.batch import list_column

__all__ = ["TOKEN_VERSIONS", "ChunkRequest", "new_pool_rows", "concat_pools", "chunk_requests", "apply_chunk",
           "finished", "complete_groups", "must_finish_groups", "take_batch", "chunk_seed", "chunk_size",
           "segment_done", "provenance_metrics", "rollout_depth"]

#: The ragged per-token policy-version column of a partial rollout's rows.
TOKEN_VERSIONS = "token_policy_versions"


def rollout_depth(max_staleness: int) -> int:
    """How many segments run ahead of the update with partial rollouts: one (generation beside the
    update) when ``max_staleness >= 2``, else none (segment k runs after update k-1). The rest of the
    staleness budget, ``max_staleness - depth`` >= 1, is how many later segments a row may still be
    finished in: a row started by segment j and used at iteration j + c is ``depth + c`` versions old."""
    return 1 if int(max_staleness) >= 2 else 0


def chunk_size(chunk_tokens: int, max_new_tokens: int) -> int:
    """Decode steps per chunk: ``rollout.partial_chunk_tokens``, or a quarter of
    ``rollout.max_new_tokens`` (at least 1) when it is 0."""
    return int(chunk_tokens) if int(chunk_tokens) > 0 else max(1, int(max_new_tokens) // 4)


def chunk_seed(seed: int, chunk: int, budget: int) -> int:
    """Sampling seed of chunk ``chunk`` (0-based within a segment) for its rows with ``budget`` new
    tokens: a function of the segment's seed and the chunk only (never of time), in ``[0, 2**62)``."""
    h = hashlib.sha256(f"{int(seed)}:{int(chunk)}:{int(budget)}".encode()).digest()
    return int.from_bytes(h[:8], "little") % (2**62)


def new_pool_rows(table: pa.Table) -> pa.Table:
    """Rows entering the pool: a rollout table (:func:`~trajflow.stages.rollout.rollout_table` plus its
    sampling columns) of prompts not started yet; their responses, log-probs and versions emptied,
    ``finish_reason`` null."""
    rows = table.num_rows
    empty_i = list_column([[] for _ in range(rows)], pa.int32())
    out = table
    for name, col in (("response_ids", empty_i), ("rollout_logprobs", list_column([[] for _ in range(rows)], pa.float32())),
                      ("response_text", pa.array([""] * rows, pa.string())),
                      ("finish_reason", pa.array([None] * rows, pa.string()))):
        out = out.set_column(out.schema.get_field_index(name), name, col)
    return out.append_column(TOKEN_VERSIONS, list_column([[] for _ in range(rows)], pa.int64()))


def concat_pools(tables: Sequence[pa.Table]) -> pa.Table:
    """The pool rows of ``tables`` in order (carried rows first, then new ones), one schema."""
    tables = [t for t in tables if t is not None]
    schema = tables[0].schema
    return pa.concat_tables([t.select(schema.names).cast(schema) for t in tables])


def finished(pool: pa.Table) -> np.ndarray:
    """``(rows,)`` bool: the rows whose response has ended (``finish_reason`` not null)."""
    return np.asarray(pool.column("finish_reason").is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _groups(pool: pa.Table) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, g in enumerate(pool.column("group_id").to_pylist()):
        out.setdefault(g, []).append(i)
    return out


def complete_groups(pool: pa.Table) -> list[str]:
    """Group ids whose every row has ended, oldest first (group ids sort by the iteration that
    started them, then the prompt)."""
    done = finished(pool)
    return sorted(g for g, rows in _groups(pool).items() if done[rows].all())


def _oldest(pool: pa.Table) -> dict[str, int | None]:
    versions = pool.column(TOKEN_VERSIONS).to_pylist()
    out: dict[str, int | None] = {}
    for g, rows in _groups(pool).items():
        vs = [min(versions[i]) for i in rows if versions[i]]
        out[g] = min(vs) if vs else None
    return out


def must_finish_groups(pool: pa.Table, next_use_version: int, max_staleness: int) -> set[str]:
    """Groups that cannot wait for the next iteration: at its update (trainer version
    ``next_use_version``) their oldest token would be more than ``max_staleness`` versions old. They
    are generated to their end in this segment and handed to this iteration."""
    return {g for g, v in _oldest(pool).items() if v is not None and int(next_use_version) - v > int(max_staleness)}


@dataclass(frozen=True)
class ChunkRequest:
    """One row's next chunk: ``row`` in the pool, ``token_ids`` (prompt + response so far: what is
    prefilled again under the new weights) and ``budget`` (new tokens this chunk may add)."""

    row: int
    token_ids: list[int]
    budget: int


def chunk_requests(pool: pa.Table, chunk: int, max_new_tokens: int, max_model_len: int | None) -> list[ChunkRequest]:
    """The next chunk of every running row.

    A row that has generated ``g`` of its ``max_new_tokens`` tokens gets
    ``min(chunk, max_new_tokens - g, max_model_len - len(prompt) - g)`` new tokens: its budget is what
    is left of its own cap, never recomputed from the configured prompt length, and prompt plus
    response never exceeds ``max_model_len``. Rows with no budget left are not requested (see
    :func:`apply_chunk`, which ends them).

    Args:
        pool: the pool table.
        chunk: decode steps per chunk (>= 1).
        max_new_tokens: ``rollout.max_new_tokens``.
        max_model_len: the model's context length (``max_position_embeddings``), None for no limit.

    Returns:
        One :class:`ChunkRequest` per running row with a budget >= 1, in pool order.
    """
    done = finished(pool)
    prompts = pool.column("prompt_ids").to_pylist()
    responses = pool.column("response_ids").to_pylist()
    out = []
    for i in np.flatnonzero(~done):
        budget = _budget(len(prompts[i]), len(responses[i]), chunk, max_new_tokens, max_model_len)
        if budget > 0:
            out.append(ChunkRequest(int(i), list(prompts[i]) + list(responses[i]), budget))
    return out


def _budget(prompt_len: int, generated: int, chunk: int, max_new_tokens: int, max_model_len: int | None) -> int:
    left = int(max_new_tokens) - int(generated)
    if max_model_len is not None:
        left = min(left, int(max_model_len) - int(prompt_len) - int(generated))
    return max(0, min(int(chunk), left))


def apply_chunk(pool: pa.Table, rows: Sequence[int], response_ids: Sequence[Sequence[int]],
                logprobs: Sequence[Sequence[float]], finish_reason: Sequence[str], version: int,
                max_new_tokens: int, max_model_len: int | None) -> pa.Table:
    """Append a chunk's tokens to its rows and end the rows that are done.

    Args:
        pool: the pool table.
        rows: the pool rows the chunk generated for (``ChunkRequest.row``).
        response_ids, logprobs, finish_reason: the engine's output for them (cut after the first EOS).
        version: the policy version that sampled the chunk (the rollout workers' weights).
        max_new_tokens, max_model_len: as in :func:`chunk_requests`.

    A row ends with ``stop`` when the chunk ended with an EOS, with ``length`` when it has used its
    ``max_new_tokens`` or reached ``max_model_len``; otherwise it is paused (null). Running rows that
    the chunk did not cover because no budget was left end with ``length`` too.

    Returns:
        The pool with the chunk applied.
    """
    resp = pool.column("response_ids").to_pylist()
    lps = pool.column("rollout_logprobs").to_pylist()
    vers = pool.column(TOKEN_VERSIONS).to_pylist()
    fin = pool.column("finish_reason").to_pylist()
    prompts = pool.column("prompt_ids").to_pylist()
    for i, ids, lp, reason in zip(rows, response_ids, logprobs, finish_reason):
        if len(lp) != len(ids):
            raise ValueError(f"chunk of pool row {i}: {len(ids)} tokens but {len(lp)} log-probs")
        resp[i] = list(resp[i]) + list(ids)
        lps[i] = list(lps[i]) + [float(x) for x in lp]
        vers[i] = list(vers[i]) + [int(version)] * len(ids)
        if reason == "stop":
            fin[i] = "stop"
    for i in range(len(fin)):
        if fin[i] is None and _budget(len(prompts[i]), len(resp[i]), 1, max_new_tokens, max_model_len) == 0:
            fin[i] = "length"
    out = pool
    for name, col in (("response_ids", list_column(resp, pa.int32())), ("rollout_logprobs", list_column(lps, pa.float32())),
                      (TOKEN_VERSIONS, list_column(vers, pa.int64())), ("finish_reason", pa.array(fin, pa.string()))):
        out = out.set_column(out.schema.get_field_index(name), name, col)
    return out


def segment_done(pool: pa.Table, batch_groups: int, must_finish: set[str]) -> bool:
    """Whether a segment may stop: no row is running, or at least ``batch_groups`` groups are complete
    and every group of ``must_finish`` is."""
    done = finished(pool)
    if done.all():
        return True
    complete = set(complete_groups(pool))
    return len(complete) >= int(batch_groups) and must_finish <= complete


def take_batch(pool: pa.Table, batch_groups: int, iteration: int, use_version: int, max_staleness: int,
               response_text: Sequence[str]) -> tuple[pa.Table, pa.Table]:
    """Split the pool into the iteration's rows and the rows that stay in flight.

    The ``batch_groups`` oldest complete groups are the iteration's. Their rows get ``iteration``,
    ``response_text`` and ``policy_version``, the version of the row's oldest token (of the segment's
    weights for a row with no token), so that staleness counts the oldest token.

    Args:
        pool: the pool after the segment.
        batch_groups: groups per iteration (``data.train_batch_size``).
        iteration: the iteration that trains on the rows.
        use_version: the trainer's version at that iteration's update.
        max_staleness: ``trainer.max_staleness``: a taken row's oldest token may be at most this old.
        response_text: the decoded response of every pool row.

    Returns:
        ``(batch, rest)``: the iteration's rows (group order, then sample order) and the pool's others.

    Raises:
        ValueError: fewer complete groups than ``batch_groups``, or a taken row older than allowed
            (neither happens with the segment's stop rule; both would be a bug).
    """
    complete = complete_groups(pool)
    if len(complete) < int(batch_groups):
        raise ValueError(f"iteration {iteration}: {len(complete)} complete groups, {batch_groups} needed")
    chosen = set(complete[:int(batch_groups)])
    gids = pool.column("group_id").to_pylist()
    take = np.array([g in chosen for g in gids])
    pool = pool.set_column(pool.schema.get_field_index("response_text"), "response_text",
                           pa.array(list(response_text), pa.string()))
    batch, rest = pool.filter(pa.array(take)), pool.filter(pa.array(~take))
    vers = batch.column(TOKEN_VERSIONS).to_pylist()
    oldest = [min(v) if v else int(use_version) for v in vers]
    too_old = [i for i, v in enumerate(oldest) if int(use_version) - v > int(max_staleness)]
    if too_old:
        i = too_old[0]
        raise ValueError(f"iteration {iteration}: row {batch.column('sample_id')[i].as_py()} has a token of policy "
                         f"version {oldest[i]}, more than trainer.max_staleness={max_staleness} behind {use_version}")
    batch = batch.set_column(batch.schema.get_field_index("policy_version"), "policy_version",
                             pa.array(oldest, pa.int64()))
    batch = batch.set_column(batch.schema.get_field_index("iteration"), "iteration",
                             pa.array([int(iteration)] * batch.num_rows, pa.int64()))
    return batch, rest


def provenance_metrics(token_versions: Sequence[Sequence[int]], trainer_version: int) -> dict[str, float]:
    """Staleness per token and per row of the rows an update trains on, and how many rows crossed a
    weight update.

    ``rollout/staleness/token_mean|token_max``: ``trainer_version - v_t`` over every response token;
    ``rollout/staleness/row_mean|row_max``: per row, of its oldest token (the one admission checks);
    ``rollout/partial/resumed_frac``: rows whose tokens come from more than one version;
    ``rollout/partial/version_span_max``: the most versions one row's tokens span, minus one.

    Args:
        token_versions: ``(rows, ragged)`` ints, the ``token_policy_versions`` column.
        trainer_version: the trainer's version at the update.
    """
    rows = [np.asarray(v, dtype=np.int64) for v in token_versions]
    tokens = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    nonempty = [v for v in rows if v.size]
    out = {"rollout/staleness/token_mean": 0.0, "rollout/staleness/token_max": 0.0,
           "rollout/staleness/row_mean": 0.0, "rollout/staleness/row_max": 0.0,
           "rollout/partial/resumed_frac": 0.0, "rollout/partial/version_span_max": 0.0}
    if tokens.size:
        t = int(trainer_version) - tokens
        row = np.array([int(trainer_version) - int(v.min()) for v in nonempty])
        span = np.array([int(v.max() - v.min()) for v in nonempty])
        out.update({"rollout/staleness/token_mean": float(t.mean()), "rollout/staleness/token_max": float(t.max()),
                    "rollout/staleness/row_mean": float(row.mean()), "rollout/staleness/row_max": float(row.max()),
                    "rollout/partial/resumed_frac": float((span > 0).mean()),
                    "rollout/partial/version_span_max": float(span.max())})
    return out
