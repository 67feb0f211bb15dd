"""The audit table: every stored trajectory of a run, searchable, each row traced to its policy.

After each iteration the flow appends that iteration's rows to a LanceDB table at
``<root>/<run_id>/audit.lance`` (one row per sampled response): the scalar columns of the rollout,
reward and advantage outputs, the prompt and response text, and where the response came from:
``policy_version`` (policy updates applied before the rollout) and ``checkpoint_id``, the checkpoint
the rollout policy came from (``checkpoints/000004`` in this run, ``<other run>/checkpoints/000004``
for rows a replay copied from its parent, ``initial`` for the model at ``model.path``; when a
checkpoint was not saved after every iteration, the rollout policy is that checkpoint plus
``policy_version`` minus the checkpoint's version further updates, which ``trajflow replay``
re-derives). ``prompt_text`` and ``response_text`` carry a full-text (BM25) index.

Types match the dashboard's Parquet fallback (``trajflow.dashboards.data``): ``score`` and
``advantage_mean`` float64 (the stored float32 widened exactly), ``response_length`` int64.

The table is derived data: the Parquet files are the record. Appending an iteration first deletes
that iteration's rows, so re-running an iteration (resume) never duplicates rows, and
:func:`rebuild_audit` recreates the whole table from the stored files.

Python API (also used by the dashboard): :func:`append_iteration`, :func:`query_audit`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa

from trajflow.errors import AuditError
from trajflow.batch import join_stages, lengths
from trajflow.store import RunStore

log = logging.getLogger(__name__)

TABLE = "audit"
TEXT_COLUMNS = ("prompt_text", "response_text")
AUDIT_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("iteration", pa.int64()),
    ("group_id", pa.string()),
    ("prompt_id", pa.string()),
    ("data_source", pa.string()),
    ("prompt_text", pa.string()),
    ("response_text", pa.string()),
    ("ground_truth", pa.string()),
    ("score", pa.float64()),
    ("reward_extra", pa.string()),
    ("reward_error", pa.string()),
    ("finish_reason", pa.string()),
    ("response_length", pa.int64()),
    ("advantage_mean", pa.float64()),
    ("policy_version", pa.int64()),
    ("checkpoint_id", pa.string()),
    ("num_turns", pa.int64()),
    ("tool_names", pa.string()),
    ("tool_calls", pa.int64()),
    ("tool_errors", pa.int64()),
])
AUDIT_COLUMNS = tuple(AUDIT_SCHEMA.names)


def tool_columns(table: pa.Table) -> dict[str, pa.Array]:
    """The audit's multi-turn columns of rollout rows: ``num_turns``, ``tool_names`` (the tools called,
    in order of first call, as ``",calculator,python,"`` so that ``tool_names LIKE '%,python,%'``
    matches one name exactly), ``tool_calls`` and ``tool_errors`` (counts). Null for single-turn rows.
    """
    n = table.num_rows
    if "tool_calls" not in table.column_names:
        return {"num_turns": pa.nulls(n, pa.int64()), "tool_names": pa.nulls(n, pa.string()),
                "tool_calls": pa.nulls(n, pa.int64()), "tool_errors": pa.nulls(n, pa.int64())}
    calls = [row or [] for row in table.column("tool_calls").to_pylist()]
    names = ["," + ",".join(dict.fromkeys(c["name"] for c in row if c["name"])) + "," if row else "" for row in calls]
    return {"num_turns": table.column("num_turns").cast(pa.int64()),
            "tool_names": pa.array(names, pa.string()),
            "tool_calls": pa.array([len(row) for row in calls], pa.int64()),
            "tool_errors": pa.array([sum(c["error"] is not None for c in row) for row in calls], pa.int64())}


def prompt_text(prompt: str | list | None) -> str | None:
    """The stored ``prompt`` as text: one ``role: content`` line per turn.

    Args:
        prompt: chat messages as read from the ``prompt`` list column, or the JSON text (messages or a
            string) that runs stored before it was one.
    """
    if prompt is None:
        return None
    if isinstance(prompt, str):
        try:
            value = json.loads(prompt)
        except (TypeError, ValueError):
            return str(prompt)
    else:
        value = prompt
    if isinstance(value, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                         for m in value)
    return value if isinstance(value, str) else json.dumps(value)


def _row_means(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Mean of each row of a ragged list column, float64 ``(rows,)``; NaN for empty rows."""
    lens = lengths(col)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float64)
    out = np.full(len(lens), np.nan)
    nonempty = lens > 0
    if nonempty.any():
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        sums = np.add.reduceat(flat, starts[nonempty]) if len(flat) else np.zeros(int(nonempty.sum()))
        out[nonempty] = sums / lens[nonempty]
    return out


def audit_rows(store: RunStore, iteration: int, checkpoint_id: str | None) -> pa.Table:
    """The audit rows of one stored iteration, built from its Parquet files (schema :data:`AUDIT_SCHEMA`).

    The reward and advantage columns are null when that stage has no stored output (e.g. an
    iteration stopped by its gate has no advantages).

    Raises:
        trajflow.store.StoreError: the rollout output is missing or does not verify.
    """
    rollout = store.read_stage(iteration, "rollout")
    n = rollout.num_rows
    parts = [rollout]
    has_reward = store.stage_entry(iteration, "reward") is not None
    has_adv = store.stage_entry(iteration, "advantage") is not None
    if has_reward:
        parts.append(store.read_stage(iteration, "reward").select(["sample_id", "score", "reward_extra",
                                                                  "reward_error"]))
    if has_adv:
        parts.append(store.read_stage(iteration, "advantage").select(["sample_id", "advantages"]))
    joined = join_stages(parts) if len(parts) > 1 else rollout

    def col(name: str, typ: pa.DataType) -> pa.Array:
        if name in joined.column_names:
            return joined.column(name).cast(typ)
        return pa.nulls(n, typ)

    if not has_adv:
        adv = pa.nulls(n, pa.float64())
    elif "loss_mask" in joined.column_names:  # multi-turn: over the tokens the policy generated
        means = [float(np.mean(np.asarray(a, np.float64)[np.asarray(m) > 0])) if any(m) else np.nan
                 for a, m in zip(joined.column("advantages").to_pylist(), joined.column("loss_mask").to_pylist())]
        adv = pa.array(means, pa.float64(), from_pandas=True)
    else:
        adv = pa.array(_row_means(joined.column("advantages")), pa.float64(), from_pandas=True)
    return pa.table({
        "sample_id": col("sample_id", pa.string()),
        "iteration": col("iteration", pa.int64()),
        "group_id": col("group_id", pa.string()),
        "prompt_id": col("prompt_id", pa.string()),
        "data_source": col("data_source", pa.string()),
        "prompt_text": pa.array([prompt_text(p) for p in joined.column("prompt").to_pylist()], pa.string()),
        "response_text": col("response_text", pa.string()),
        "ground_truth": col("ground_truth", pa.string()),
        "score": col("score", pa.float64()),
        "reward_extra": col("reward_extra", pa.string()),
        "reward_error": col("reward_error", pa.string()),
        "finish_reason": col("finish_reason", pa.string()),
        "response_length": pa.array(lengths(joined.column("response_ids")), pa.int64()),
        "advantage_mean": adv,
        "policy_version": col("policy_version", pa.int64()),
        "checkpoint_id": pa.array([checkpoint_id] * n, pa.string()),
        **tool_columns(joined),
    }, schema=AUDIT_SCHEMA)


def _connect(run_dir: Path):
    import lancedb

    return lancedb.connect(str(run_dir))


def _open(db):
    try:
        return db.open_table(TABLE)
    except (FileNotFoundError, ValueError):
        return None


def _index_text(table) -> None:
    from lancedb.index import FTS

    for c in TEXT_COLUMNS:
        table.create_index(c, config=FTS(), replace=True)


def append_iteration(store: RunStore, iteration: int, checkpoint_id: str | None, optimize: bool = True) -> int:
    """Append one iteration's trajectories to the run's audit table (replacing that iteration's rows).

    Args:
        store: the run's store.
        iteration: a stored iteration (its rollout output must verify).
        checkpoint_id: the checkpoint the iteration's rollout policy came from (see the module doc).
        optimize: fold the table's new rows into its full-text index now. Rows not yet indexed are
            still found (LanceDB searches them flat), so the train loop does it only at checkpoints
            and at the end: it is most of an append's cost (~37 of ~50 ms per iteration).

    Returns:
        Rows appended (= the iteration's rollout rows).

    Raises:
        trajflow.store.StoreError: the iteration's rollout output is missing or does not verify.
    """
    rows = audit_rows(store, iteration, checkpoint_id)
    db = _connect(store.run_dir)
    table = _open(db)
    if table is None:
        table = db.create_table(TABLE, rows, schema=AUDIT_SCHEMA)
        _index_text(table)
        return rows.num_rows
    if table.schema.names != list(AUDIT_COLUMNS):
        # A table written before the multi-turn columns existed: rebuilt from the Parquet record.
        rebuild_audit(store)
        return rows.num_rows
    table.delete(f"iteration = {int(iteration)}")
    table.add(rows)
    if optimize:
        table.optimize()
    return rows.num_rows


def rebuild_audit(store: RunStore) -> int:
    """Recreate the audit table from the stored iterations (those with a verified rollout output).

    The checkpoint id of each iteration is the one its rollout output recorded when it was written.
    Iterations whose rollout output cannot be read back (manifest missing, file truncated or
    altered) are left out of the table and named in the error raised once the others are in:
    nothing recomputes them later, so the table would be silently short.

    Returns:
        Rows written.

    Raises:
        AuditError: some iterations were left out (each named, with why).
    """
    db = _connect(store.run_dir)
    if _open(db) is not None:
        db.drop_table(TABLE)
    total, skipped = 0, []
    for it in store.iterations():
        problem = store.stage_problem(it, "rollout")
        if problem is not None:
            skipped.append(f"iteration {it}: {problem}")
            continue
        meta = (store.stage_entry(it, "rollout") or {}).get("meta", {})
        total += append_iteration(store, it, meta.get("checkpoint_id"), optimize=False)
    table = _open(db)
    if table is not None:
        table.optimize()  # once, after every iteration is in
    if skipped:
        raise AuditError(f"audit table of run {store.run_id!r} rebuilt without {len(skipped)} iteration(s) "
                         f"({total} rows in): " + "; ".join(skipped) + "; restore those files to audit them")
    return total


def query_audit(store_root: str | Path, run_id: str, where: str | None = None, search: str | None = None,
                limit: int = 50) -> pa.Table:
    """Rows of a run's audit table matching a SQL filter and/or a full-text search.

    Args:
        store_root: the store root (``store.root``).
        run_id: the run.
        where: a SQL predicate over the columns (e.g. ``"iteration >= 2 AND score > 0.5"``).
        search: full-text (BM25) query over ``prompt_text`` and ``response_text``; results are
            ordered by relevance. Without it, rows are ordered by ``iteration``, ``sample_id``.
        limit: at most this many rows (>= 1).

    Returns:
        A pyarrow Table with the columns :data:`AUDIT_COLUMNS`.

    Raises:
        AuditError: unknown run (names the store root), no audit table, ``where`` is not valid SQL
            over these columns, ``limit`` < 1.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise AuditError(f"limit must be an integer >= 1, got {limit!r}")
    store = RunStore(store_root, run_id)
    if not store.exists():
        raise AuditError(f"no run {run_id!r} in store root {store.root}")
    table = _open(_connect(store.run_dir))
    if table is None:
        raise AuditError(f"run {run_id!r} has no audit table yet ({store.run_dir / (TABLE + '.lance')}): no iteration "
                         f"has completed, or it was deleted ('trajflow audit {run_id} --rebuild' recreates it)")
    where = where.strip() if where else None
    if where:
        try:
            table.count_rows(where)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise AuditError(f"--where {where!r} is not valid SQL over the audit columns "
                             f"({', '.join(AUDIT_COLUMNS)}): {first}") from None
    if search:
        q = table.search(search, query_type="fts")
        if where:
            q = q.where(where, prefilter=True)
        out = q.limit(limit).to_arrow()
    else:
        q = table.search()
        if where:
            q = q.where(where)
        out = q.limit(max(table.count_rows(where) if where else table.count_rows(), 1)).to_arrow()
        out = out.sort_by([("iteration", "ascending"), ("sample_id", "ascending")]).slice(0, limit)
    return out.select(list(AUDIT_COLUMNS)).cast(AUDIT_SCHEMA)
