"""Data behind the dashboard (``dashboards/``), kept out of Streamlit so it is testable and reusable.

- Runs page: :func:`list_runs` (every MLflow run of the tracking store) and
  :func:`trajflow.compare.compare_runs` for curves, final/best values and config differences.
- Trajectory browser: :func:`find_trajectories` with a :class:`TrajectoryFilter` over a run's
  stored trajectories (the LanceDB audit table through ``trajflow.audit.query_audit`` when it exists,
  else the run's Parquet stage outputs), and :func:`trajectory_facets` for the filter choices.
- Gates page: :func:`gate_reports` from ``<run>/iterations/NNNNNN/gate.json``.

:func:`serve` starts the Streamlit app (``trajflow dashboard``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from trajflow.errors import DashboardError
from trajflow.errors import StoreError
from trajflow.store import RunStore

APP = Path(__file__).resolve().with_name("app.py")

#: The columns of a trajectory row (the audit table's contract, ``trajflow.audit.query_audit``).
TRAJECTORY_COLUMNS = ("sample_id", "iteration", "group_id", "prompt_id", "data_source", "prompt_text",
                      "response_text", "ground_truth", "score", "reward_extra", "reward_error", "finish_reason",
                      "response_length", "advantage_mean", "policy_version", "checkpoint_id")


# ----------------------------------------------------------------------------------------- runs

def store_runs(store_root: str | Path) -> list[str]:
    """Run ids with a folder (``config.yaml``) under the store root, newest first (by folder mtime)."""
    root = Path(store_root).expanduser().resolve()
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if p.is_dir() and (p / "config.yaml").exists()]
    return [p.name for p in sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)]


def list_runs(client) -> list[dict]:
    """Every MLflow run of the tracking store, newest first, as plain rows for a table.

    Returns:
        Dicts with ``run`` (run name = trajflow run id), ``mlflow_run_id``, ``experiment``, ``kind``
        (tag ``trajflow.kind``: ``train`` when absent, ``evaluation`` for ``trajflow evaluate``), ``status``,
        ``started`` (epoch ms), ``wall_s``, ``planned_iterations``, ``score`` (latest
        ``critic/score/mean``), ``commit``, ``parent``.
    """
    from trajflow.compare import experiments, search
    from trajflow.tracking import TAG_PARENT_ITERATION, TAG_PARENT_RUN

    exps = experiments(client)
    rows = []
    for r in search(client, exps, max_results=5000):
        info, data = r.info, r.data
        end = info.end_time or None
        rows.append({
            "run": info.run_name or info.run_id, "mlflow_run_id": info.run_id,
            "experiment": exps.get(info.experiment_id, info.experiment_id),
            "kind": data.tags.get("trajflow.kind", "train"), "status": info.status,
            "started": info.start_time, "wall_s": ((end - info.start_time) / 1000.0) if end and info.start_time else None,
            "planned_iterations": data.params.get("trainer.total_iterations"),
            "score": data.metrics.get("critic/score/mean"),
            "commit": (data.tags.get("mlflow.source.git.commit") or "")[:10],
            "parent": (f"{data.tags[TAG_PARENT_RUN]}@{data.tags.get(TAG_PARENT_ITERATION, '?')}"
                       if TAG_PARENT_RUN in data.tags else ""),
        })
    return rows


# ----------------------------------------------------------------------------------------- gates

def gate_reports(store_root: str | Path, run_id: str) -> list[dict]:
    """Each iteration's gate result, from ``<run>/iterations/NNNNNN/gate.json`` (written by ``trajflow.gates.iteration``).

    Returns:
        One dict per iteration with a gate file, ascending: ``iteration``, ``success`` (bool),
        ``failures`` (text), ``quarantined`` (count), ``warnings``, and ``gates``: a list of
        ``{"gate", "success", "observed", "unexpected_count", "skipped"}`` parsed from the
        ``gate/<name>/<field>`` metrics (``None`` where a field is absent).

    Raises:
        DashboardError: the run has no folder under the store root.
    """
    store = _store(store_root, run_id)
    out = []
    for it in store.iterations():
        report = store.read_iteration_json(it, "gate.json")
        if not report:
            continue
        metrics = report.get("metrics", {}) or {}
        gates: dict[str, dict] = {}
        for key, value in metrics.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "gate":
                gates.setdefault(parts[1], {})[parts[2]] = value
        rows = [{"gate": name, "success": (None if "success" not in f else bool(f["success"])),
                 "observed": f.get("observed"), "unexpected_count": f.get("unexpected_count"),
                 "skipped": bool(f.get("skipped", 0.0))} for name, f in sorted(gates.items())]
        out.append({"iteration": it, "success": bool(report.get("success", True)),
                    "failures": report.get("failures") or "",
                    "quarantined": len(report.get("quarantined_sample_ids") or []),
                    "warnings": int(metrics.get("gate/warnings", 0) or 0), "gates": rows})
    return out


# ----------------------------------------------------------------------------------------- trajectories

@dataclass(frozen=True)
class TrajectoryFilter:
    """What the trajectory browser asks for. Empty/None fields do not filter.

    Attributes:
        iterations: inclusive ``(first, last)`` iteration range.
        data_sources: keep rows whose ``data_source`` is one of these.
        score_range: inclusive ``(low, high)`` on ``score``.
        finish_reasons: keep rows whose ``finish_reason`` is one of these (``stop``, ``length``).
        search: full-text search over prompt and response text.
    """

    iterations: tuple[int, int] | None = None
    data_sources: tuple[str, ...] = ()
    score_range: tuple[float, float] | None = None
    finish_reasons: tuple[str, ...] = ()
    search: str | None = None


def _sql_str(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


def where_clause(flt: TrajectoryFilter) -> str | None:
    """The filter as an SQL ``WHERE`` expression for the audit table (None when it filters nothing).

    Example: ``iteration >= 2 AND iteration <= 3 AND data_source IN ('gsm8k') AND score >= 0.5``.
    """
    parts = []
    if flt.iterations is not None:
        parts.append(f"iteration >= {int(flt.iterations[0])} AND iteration <= {int(flt.iterations[1])}")
    if flt.data_sources:
        parts.append(f"data_source IN ({', '.join(_sql_str(s) for s in flt.data_sources)})")
    if flt.score_range is not None:
        parts.append(f"score >= {float(flt.score_range[0])!r} AND score <= {float(flt.score_range[1])!r}")
    if flt.finish_reasons:
        parts.append(f"finish_reason IN ({', '.join(_sql_str(s) for s in flt.finish_reasons)})")
    return " AND ".join(parts) or None


def _store(store_root: str | Path, run_id: str) -> RunStore:
    try:
        store = RunStore(store_root, run_id)
    except StoreError as e:
        raise DashboardError(str(e)) from None
    if not store.run_dir.is_dir():
        raise DashboardError(f"run {run_id!r} has no folder under {store.root}")
    return store


def _audit_query():
    """``trajflow.audit.query_audit`` if that module exists, else None."""
    try:
        from trajflow.audit import query_audit
    except ImportError:
        return None
    return query_audit


def prompt_text(prompt: str | None) -> str:
    """A stored ``prompt`` (chat messages as JSON, or plain text) as readable text: ``role: content`` lines
    (the audit table's ``prompt_text`` format)."""
    if prompt is None:
        return ""
    try:
        msgs = json.loads(prompt)
    except (TypeError, ValueError):
        return str(prompt)
    if isinstance(msgs, list) and all(isinstance(m, dict) and "content" in m for m in msgs):
        return "\n".join(f"{m.get('role', '')}: {m['content']}" for m in msgs)
    return str(prompt)


def _iteration_rows(store: RunStore, it: int) -> pa.Table | None:
    """One iteration's trajectories with the audit columns, from its Parquet files (None if no rollout)."""
    import numpy as np

    from trajflow.batch import join_stages, lengths

    if not store.stage_path(it, "rollout").exists():
        return None
    tables = [store.read_stage(it, "rollout", verify=False).select(
        ["sample_id", "iteration", "group_id", "prompt_id", "data_source", "prompt", "response_text", "ground_truth",
         "finish_reason", "response_ids", "policy_version"])]
    if store.stage_path(it, "reward").exists():
        tables.append(store.read_stage(it, "reward", verify=False).select(["sample_id", "score", "reward_extra",
                                                                          "reward_error"]))
    if store.stage_path(it, "advantage").exists():
        tables.append(store.read_stage(it, "advantage", verify=False).select(["sample_id", "advantages"]))
    t = join_stages(tables) if len(tables) > 1 else tables[0]
    n = t.num_rows

    def col(name: str, typ: pa.DataType) -> pa.Array:
        return t.column(name) if name in t.column_names else pa.nulls(n, typ)

    if "advantages" in t.column_names:
        adv = [float(np.mean(a)) if a else None for a in t.column("advantages").to_pylist()]
    else:
        adv = [None] * n
    return pa.table({
        "sample_id": t.column("sample_id"), "iteration": t.column("iteration").cast(pa.int64()),
        "group_id": t.column("group_id"), "prompt_id": t.column("prompt_id"), "data_source": t.column("data_source"),
        "prompt_text": pa.array([prompt_text(p) for p in t.column("prompt").to_pylist()], pa.string()),
        "response_text": t.column("response_text"), "ground_truth": t.column("ground_truth").cast(pa.string()),
        "score": col("score", pa.float32()).cast(pa.float64()), "reward_extra": col("reward_extra", pa.string()),
        "reward_error": col("reward_error", pa.string()), "finish_reason": t.column("finish_reason"),
        "response_length": pa.array(lengths(t.column("response_ids")), pa.int64()),
        "advantage_mean": pa.array(adv, pa.float64()), "policy_version": t.column("policy_version").cast(pa.int64()),
        "checkpoint_id": pa.nulls(n, pa.string()),
    })


def _scan_parquet(store: RunStore, flt: TrajectoryFilter, limit: int) -> pa.Table:
    """The fallback when there is no audit table: filter the Parquet stage outputs in memory.

    ``search`` is a case-insensitive substring match over prompt and response text.
    """
    out, total = [], 0
    its = store.iterations()
    if flt.iterations is not None:
        its = [i for i in its if flt.iterations[0] <= i <= flt.iterations[1]]
    for it in its:
        t = _iteration_rows(store, it)
        if t is None:
            continue
        mask = pa.array([True] * t.num_rows)
        if flt.data_sources:
            mask = pc.and_(mask, pc.is_in(t.column("data_source"), pa.array(list(flt.data_sources), pa.string())))
        if flt.finish_reasons:
            mask = pc.and_(mask, pc.is_in(t.column("finish_reason"), pa.array(list(flt.finish_reasons), pa.string())))
        if flt.score_range is not None:
            s = t.column("score")
            mask = pc.and_(mask, pc.and_(pc.greater_equal(s, flt.score_range[0]), pc.less_equal(s, flt.score_range[1])))
        if flt.search:
            hit = pc.or_(pc.match_substring(t.column("prompt_text"), flt.search, ignore_case=True),
                         pc.match_substring(t.column("response_text"), flt.search, ignore_case=True))
            mask = pc.and_(mask, hit)
        t = t.filter(pc.fill_null(mask, False))
        if t.num_rows:
            out.append(t.slice(0, limit - total))
            total += min(t.num_rows, limit - total)
        if total >= limit:
            break
    if not out:
        return _iteration_schema().empty_table()
    return pa.concat_tables(out)


def _iteration_schema() -> pa.Schema:
    return pa.schema([("sample_id", pa.string()), ("iteration", pa.int64()), ("group_id", pa.string()),
                      ("prompt_id", pa.string()), ("data_source", pa.string()), ("prompt_text", pa.string()),
                      ("response_text", pa.string()), ("ground_truth", pa.string()), ("score", pa.float64()),
                      ("reward_extra", pa.string()), ("reward_error", pa.string()), ("finish_reason", pa.string()),
                      ("response_length", pa.int64()), ("advantage_mean", pa.float64()),
                      ("policy_version", pa.int64()), ("checkpoint_id", pa.string())])


def trajectory_source(store_root: str | Path, run_id: str) -> str:
    """``"audit"`` when the run has a LanceDB audit table and ``trajflow.audit`` is importable, else ``"parquet"``."""
    store = _store(store_root, run_id)
    return "audit" if _audit_query() is not None and (store.run_dir / "audit.lance").exists() else "parquet"


def find_trajectories(store_root: str | Path, run_id: str, flt: TrajectoryFilter = TrajectoryFilter(),
                      limit: int = 50) -> pa.Table:
    """A run's stored trajectories matching ``flt``: the browser's one data access.

    Uses ``trajflow.audit.query_audit(store_root, run_id, where=..., search=..., limit=...)`` (LanceDB,
    full-text index) when that module is importable and the run has ``audit.lance``; otherwise reads
    the run's Parquet stage outputs (``search`` is then a case-insensitive substring match).

    Args:
        store_root: the store root.
        run_id: the trajflow run id.
        flt: the filters (see :class:`TrajectoryFilter`).
        limit: at most this many rows (>= 1).

    Returns:
        A table with :data:`TRAJECTORY_COLUMNS`.

    Raises:
        DashboardError: unknown run or ``limit`` < 1.
    """
    if limit < 1:
        raise DashboardError(f"limit must be >= 1, got {limit}")
    store = _store(store_root, run_id)
    search = (flt.search or "").strip() or None
    if trajectory_source(store_root, run_id) == "audit":
        return _audit_query()(store.root, run_id, where=where_clause(flt), search=search, limit=limit)
    return _scan_parquet(store, TrajectoryFilter(flt.iterations, flt.data_sources, flt.score_range,
                                                 flt.finish_reasons, search), limit)


def trajectory_facets(store_root: str | Path, run_id: str) -> dict:
    """The values the browser's filters offer, read from the run's Parquet files (few columns only).

    Returns:
        ``{"iterations": [...], "data_sources": [...], "finish_reasons": [...], "score_min": float | None,
        "score_max": float | None}``.
    """
    import pyarrow.parquet as pq

    store = _store(store_root, run_id)
    its, sources, reasons, scores = [], set(), set(), []
    for it in store.iterations():
        p = store.stage_path(it, "rollout")
        if not p.exists():
            continue
        its.append(it)
        t = pq.read_table(p, columns=["data_source", "finish_reason"])
        sources.update(x for x in t.column("data_source").to_pylist() if x is not None)
        reasons.update(x for x in t.column("finish_reason").to_pylist() if x is not None)
        r = store.stage_path(it, "reward")
        if r.exists():
            scores += [x for x in pq.read_table(r, columns=["score"]).column("score").to_pylist() if x is not None]
    return {"iterations": its, "data_sources": sorted(sources), "finish_reasons": sorted(reasons),
            "score_min": min(scores) if scores else None, "score_max": max(scores) if scores else None}


# ----------------------------------------------------------------------------------------- serving

def streamlit_command(store_root: str | Path, tracking_uri: str | None = None, port: int = 8501,
                      address: str = "127.0.0.1") -> list[str]:
    """The ``streamlit run`` command line that serves the dashboard (headless, no usage stats)."""
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true",
           "--server.port", str(port), "--server.address", address, "--browser.gatherUsageStats", "false",
           "--server.fileWatcherType", "none", "--client.toolbarMode", "viewer", "--", "--store", str(Path(store_root).expanduser().resolve())]
    if tracking_uri:
        cmd += ["--tracking-uri", tracking_uri]
    return cmd


def serve(store_root: str | Path = "runs", tracking_uri: str | None = None, port: int = 8501,
          address: str = "127.0.0.1") -> None:
    """Replace this process with the Streamlit server (so signals such as SIGTERM reach it directly).

    Returns only if the checks fail (by raising).

    Raises:
        DashboardError: the store root does not exist and no tracking URI is given, or the app file is
            missing.
    """
    root = Path(store_root).expanduser().resolve()
    if not root.is_dir() and not tracking_uri:
        raise DashboardError(f"store root {root} does not exist (--store); pass the folder that holds your runs")
    if not APP.exists():
        raise DashboardError(f"dashboard app not found at {APP} (trajflow must run from a source checkout)")
    print(f"trajflow dashboard: http://{address}:{port}  (store {root})", flush=True)
    env = dict(os.environ)
    src = str(APP.parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = streamlit_command(root, tracking_uri, port, address)
    os.execve(cmd[0], cmd, env)
