"""Data behind the dashboard (``dashboards/``), kept out of Streamlit so it is testable and reusable.

- Runs page: :func:`list_runs` (every MLflow run of the tracking store) and
  :func:`trajflow.compare.compare_runs` for curves, final/best values and config differences.
- Trajectory browser: :func:`find_trajectories` (one row per response) and :func:`find_groups` (a
  prompt once with its n responses, for GRPO-style groups) with a :class:`TrajectoryFilter` over a
  run's stored trajectories (the LanceDB audit table when it exists, else the Parquet stage outputs;
  both give the same rows), and :func:`trajectory_facets` for the filter choices.
- Gates page: :func:`gate_reports` from ``<run>/iterations/NNNNNN/gate.json``.

:func:`serve` starts the Streamlit app (``trajflow dashboard``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from trajflow.errors import DashboardError, StoreError
from trajflow.store import RunStore, run_folders

APP = Path(__file__).resolve().with_name("app.py")

#: The columns of a trajectory row (the audit table's contract, ``trajflow.audit.query_audit``).
TRAJECTORY_COLUMNS = ("sample_id", "iteration", "group_id", "prompt_id", "data_source", "prompt_text",
                      "response_text", "ground_truth", "score", "reward_extra", "reward_error", "finish_reason",
                      "response_length", "advantage_mean", "policy_version", "checkpoint_id", "num_turns",
                      "tool_names", "tool_calls", "tool_errors")


# ----------------------------------------------------------------------------------------- runs

def store_runs(store_root: str | Path) -> list[str]:
    """Run ids with a folder (``config.yaml``) under the store root, newest first (by folder mtime)."""
    runs = run_folders(Path(store_root).expanduser().resolve())
    return [p.name for p in sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)]


def has_iterations(store_root: str | Path, run_id: str) -> bool:
    """Whether the run folder holds a stored rollout (a run still at step 0 has none). False for a name that
    is no run folder of the store (an MLflow run name such as ``../x`` names no folder here)."""
    try:
        store = RunStore(Path(store_root).expanduser().resolve(), run_id)
    except StoreError:
        return False
    d = store.run_dir / "iterations"
    return d.is_dir() and any((p / "rollout.parquet").exists() for p in d.iterdir() if p.name.isdigit())


def list_runs(client) -> list[dict]:
    """Every MLflow run of the tracking store, newest first, as plain rows for a table; of a resumed
    run, only its newest session (the segment that holds its whole history).

    Returns:
        Dicts with ``run`` (run name = trajflow run id), ``mlflow_run_id``, ``experiment``, ``kind``
        (tag ``trajflow.kind``: ``train`` when absent, ``evaluation`` for ``trajflow evaluate``), ``status``,
        ``started`` (epoch ms), ``wall_s``, ``planned_iterations``, ``score`` (latest
        ``critic/score/mean``), ``iterations_done`` (whether it logged a finished iteration:
        ``timing_s/step``), ``commit``, ``parent``, ``prefect_flow_run_id`` and
        ``prefect_flow_run_url`` (tags of the Prefect flow run that trained it; "" when absent),
        ``experiment_id``.
    """
    from trajflow.compare import experiments, search
    from trajflow.tracking import TAG_PARENT_ITERATION, TAG_PARENT_RUN, TAG_SUPERSEDED_BY

    exps = experiments(client)
    rows = []
    for r in search(client, exps, max_results=5000):
        info, data = r.info, r.data
        if TAG_SUPERSEDED_BY in data.tags:  # an earlier session of a resumed run: its newest segment has it all
            continue
        end = info.end_time or None
        rows.append({
            # the trajflow run id names the run folder; the MLflow run name may be trainer.experiment_name
            "run": data.tags.get("trajflow.run_id") or info.run_name or info.run_id, "mlflow_run_id": info.run_id,
            "experiment": exps.get(info.experiment_id, info.experiment_id),
            "kind": data.tags.get("trajflow.kind", "train"), "status": info.status,
            "started": info.start_time, "wall_s": ((end - info.start_time) / 1000.0) if end and info.start_time else None,
            "planned_iterations": data.params.get("trainer.total_iterations"),
            "score": data.metrics.get("critic/score/mean"),
            "iterations_done": "timing_s/step" in data.metrics,
            "commit": (data.tags.get("mlflow.source.git.commit") or "")[:10],
            "parent": (f"{data.tags[TAG_PARENT_RUN]}@{data.tags.get(TAG_PARENT_ITERATION, '?')}"
                       if TAG_PARENT_RUN in data.tags else ""),
            "prefect_flow_run_id": data.tags.get("prefect.flow_run_id", ""),
            "prefect_flow_run_url": data.tags.get("prefect.flow_run_url", ""),
            "experiment_id": info.experiment_id,
        })
    return rows


# ----------------------------------------------------------------------------------------- gates

def gate_reports(store_root: str | Path, run_id: str) -> list[dict]:
    """Each iteration's gate result, from ``<run>/iterations/NNNNNN/gate.json`` (written by ``trajflow.run.gate``).

    Returns:
        One dict per iteration with a gate file, ascending: ``iteration``, ``success`` (bool),
        ``failures`` (text), ``quarantined`` (count), ``warnings``, ``data_docs`` (path of GX's
        Data Docs page, or None) and ``gates``: one ``{"gate", "status" (pass / warn / quarantined /
        FAIL / skipped), "policy", "expected" (the threshold), "observed", "unexpected_count",
        "sample_ids", "success", "skipped"}`` per expectation. Gate files of older runs hold no
        thresholds: their rows come from the ``gate/<name>/<field>`` metrics (``None`` where absent).

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
        if report.get("expectations") is not None:
            rows = [{"gate": e["name"], "status": e["status"], "policy": e["policy"], "expected": e.get("threshold"),
                     "observed": e.get("observed"), "unexpected_count": e.get("unexpected_count"),
                     "sample_ids": list(e.get("sample_ids") or []), "success": e["status"] in ("pass", "skipped"),
                     "skipped": e["status"] == "skipped"} for e in report["expectations"]]
        else:
            rows = [{"gate": name, "status": None, "policy": None, "expected": None,
                     "success": (None if "success" not in f else bool(f["success"])),
                     "observed": f.get("observed"), "unexpected_count": f.get("unexpected_count"), "sample_ids": [],
                     "skipped": bool(f.get("skipped", 0.0))} for name, f in sorted(gates.items())]
        docs = report.get("data_docs")
        out.append({"iteration": it, "success": bool(report.get("success", True)),
                    "failures": report.get("failures") or "",
                    "quarantined": len(report.get("quarantined_sample_ids") or []),
                    "warnings": int(metrics.get("gate/warnings", 0) or 0),
                    "data_docs": str(store.iteration_dir(it) / docs) if docs else None, "gates": rows})
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
        sample_ids: keep only these responses (the gates page links failing rows here).
        search: case-insensitive substring of the prompt or response text (``TROM`` finds
            ``trombone``), with or without the audit table.
        fulltext: ranked full-text (BM25, whole words) query; needs the run's audit table.
            Results come in relevance order, so ``sort_by`` does not apply.
        sort_by: one of :data:`SORT_KEYS`.
        descending: sort from the largest value down.
    """

    iterations: tuple[int, int] | None = None
    data_sources: tuple[str, ...] = ()
    score_range: tuple[float, float] | None = None
    finish_reasons: tuple[str, ...] = ()
    sample_ids: tuple[str, ...] = ()
    search: str | None = None
    fulltext: str | None = None
    sort_by: str = "iteration"
    descending: bool = False


#: What the browser sorts by; ties keep iteration and sample id order.
SORT_KEYS = ("iteration", "score", "advantage_mean", "response_length")


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
    if flt.sample_ids:
        parts.append(f"sample_id IN ({', '.join(_sql_str(s) for s in flt.sample_ids)})")
    if flt.search and flt.search.strip():
        # strpos, not LIKE: the user's text may hold % or _ without meaning wildcards.
        q = _sql_str(flt.search.strip().lower())
        parts.append(f"(strpos(lower(prompt_text), {q}) > 0 OR strpos(lower(response_text), {q}) > 0)")
    return " AND ".join(parts) or None


def _store(store_root: str | Path, run_id: str) -> RunStore:
    try:
        store = RunStore(store_root, run_id)
    except StoreError as e:
        raise DashboardError(str(e)) from None
    if not store.run_dir.is_dir():
        raise DashboardError(f"run {run_id!r} has no folder under {store.root}")
    return store


def _stage_file(store: RunStore, it: int, stage: str) -> Path | None:
    """The iteration's stored stage file if there is one, refused unless it is a regular file.

    A run folder is data someone else may have written: a symlink could point the dashboard at any
    file of the machine (or at a FIFO or ``/dev/zero``, which never ends).

    Raises:
        DashboardError: the path is a symlink or not a regular file (names it).
    """
    path = store.stage_path(it, stage)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise DashboardError(f"{path} is {'a symlink' if path.is_symlink() else 'not a regular file'}; the "
                             f"dashboard reads only the run's own files: replace it with the stage's Parquet file")
    return path if path.exists() else None


def _read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """``pq.read_table`` with a damaged file named in one line.

    Raises:
        DashboardError: not Parquet, truncated, or without the columns asked for.
    """
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise DashboardError(f"{path}: cannot be read as Parquet ({str(e).splitlines()[0] if str(e) else e}); "
                             f"the stored file is damaged") from None


def _audit_query():
    """``trajflow.audit.query_audit`` if that module exists, else None."""
    try:
        from trajflow.audit import query_audit
    except ImportError:
        return None
    return query_audit


def prompt_text(prompt: str | list | None) -> str:
    """A stored ``prompt`` (chat messages from the list column, or the JSON text or plain text of older
    runs) as readable text: ``role: content`` lines (the audit table's ``prompt_text`` format)."""
    if prompt is None:
        return ""
    msgs = prompt
    if isinstance(prompt, str):
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

    from trajflow.audit import tool_columns
    from trajflow.batch import join_stages, lengths

    path = _stage_file(store, it, "rollout")
    if path is None:
        return None
    rollout = _read_parquet(path)
    multi = [c for c in ("num_turns", "tool_calls") if c in rollout.column_names]
    tables = [rollout.select(
        ["sample_id", "iteration", "group_id", "prompt_id", "data_source", "prompt", "response_text", "ground_truth",
         "finish_reason", "response_ids", "policy_version"] + multi)]
    reward, advantage = _stage_file(store, it, "reward"), _stage_file(store, it, "advantage")
    if reward is not None:
        tables.append(_read_parquet(reward, ["sample_id", "score", "reward_extra", "reward_error"]))
    if advantage is not None:
        tables.append(_read_parquet(advantage, ["sample_id", "advantages"]))
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
        **tool_columns(t),
    })


def _scan_parquet(store: RunStore, flt: TrajectoryFilter) -> pa.Table:
    """The fallback when there is no audit table: every row of the Parquet stage outputs that
    matches ``flt`` (``search`` as in :func:`where_clause`: a case-insensitive substring)."""
    out = []
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
        if flt.sample_ids:
            mask = pc.and_(mask, pc.is_in(t.column("sample_id"), pa.array(list(flt.sample_ids), pa.string())))
        if flt.score_range is not None:
            s = t.column("score")
            mask = pc.and_(mask, pc.and_(pc.greater_equal(s, flt.score_range[0]), pc.less_equal(s, flt.score_range[1])))
        if flt.search and flt.search.strip():
            q = flt.search.strip().lower()
            hit = pc.or_(pc.match_substring(pc.utf8_lower(t.column("prompt_text")), q),
                         pc.match_substring(pc.utf8_lower(t.column("response_text")), q))
            mask = pc.and_(mask, hit)
        t = t.filter(pc.fill_null(mask, False))
        if t.num_rows:
            out.append(t)
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
    """A run's stored trajectories matching ``flt``, sorted by ``flt.sort_by``: the browser's one data access.

    Reads the LanceDB audit table (``trajflow.audit.query_audit``) when the run has one, else the
    run's Parquet stage outputs; filters, substring search and sorting give the same rows either way.

    Args:
        store_root: the store root.
        run_id: the trajflow run id.
        flt: the filters (see :class:`TrajectoryFilter`).
        limit: at most this many rows (>= 1).

    Returns:
        A table with :data:`TRAJECTORY_COLUMNS`.

    Raises:
        DashboardError: unknown run, ``limit`` < 1, an unknown sort key, or a full-text query on a
            run without an audit table.
    """
    if limit < 1:
        raise DashboardError(f"limit must be >= 1, got {limit}")
    if flt.sort_by not in SORT_KEYS:
        raise DashboardError(f"sort_by={flt.sort_by!r}: choose one of {', '.join(SORT_KEYS)}")
    store = _store(store_root, run_id)
    audit = trajectory_source(store_root, run_id) == "audit"
    fulltext = (flt.fulltext or "").strip() or None
    if fulltext:
        if not audit:
            raise DashboardError(f"run {run_id!r} has no audit table, so there is no full-text index; use the "
                                 f"substring search, or build the table with 'trajflow audit {run_id} --rebuild'")
        return _audit_query()(store.root, run_id, where=where_clause(flt), search=fulltext, limit=limit)
    if audit:
        rows = _audit_query()(store.root, run_id, where=where_clause(flt), limit=2**31 - 1)
    else:
        rows = _scan_parquet(store, flt)
    order = [("iteration", "ascending"), ("sample_id", "ascending")]
    if flt.sort_by != "iteration" or flt.descending:
        order = [(flt.sort_by, "descending" if flt.descending else "ascending")] + order
    return rows.sort_by(order).slice(0, limit)


def find_groups(store_root: str | Path, run_id: str, flt: TrajectoryFilter = TrajectoryFilter(),
                limit: int = 20) -> list[dict]:
    """Whole groups (one prompt, its n sampled responses) that hold a row matching ``flt``.

    The groups come in the order of their first matching row (:func:`find_trajectories`'s order);
    each holds *all* its responses, matching or not, so scores and advantages can be compared
    within the group as the estimator saw them.

    Args:
        store_root, run_id, flt: as :func:`find_trajectories` (``fulltext`` included).
        limit: at most this many groups (>= 1).

    Returns:
        ``[{"iteration", "group_id", "prompt_text", "data_source", "ground_truth", "score_mean",
        "score_std", "rows": [trajectory rows by sample_id]}]``; ``score_std`` is the population
        std over the group's finite scores (GRPO's normaliser up to its epsilon), None without scores.

    Raises:
        DashboardError: as :func:`find_trajectories`.
    """
    if limit < 1:
        raise DashboardError(f"limit must be >= 1, got {limit}")
    matched = find_trajectories(store_root, run_id, flt, limit=2**31 - 1)
    keys = list(dict.fromkeys(zip(matched.column("iteration").to_pylist(), matched.column("group_id").to_pylist())))
    keys = keys[:limit]
    store = _store(store_root, run_id)
    by_iteration: dict[int, pa.Table] = {}
    groups = []
    for it, gid in keys:
        if it not in by_iteration:
            by_iteration[it] = _iteration_rows(store, it)
        groups.append(group_card(by_iteration[it], it, gid))
    return groups


def group_card(table: pa.Table, iteration: int, group_id: str) -> dict:
    """One GRPO group of an iteration's rows as the dashboard shows it.

    Args:
        table: the iteration's joined rows (:func:`_iteration_rows`).
        iteration: the iteration the rows belong to.
        group_id: the group (a prompt's n samples).

    Returns:
        ``{"iteration", "group_id", "prompt_text", "data_source", "ground_truth", "score_mean",
        "score_std", "rows"}``: rows sorted by ``sample_id``; mean and population standard deviation
        (the GRPO normaliser, Shao et al. 2024 eq. 3 without the epsilon) of the finite scores,
        None when there are none.
    """
    rows = sorted(table.filter(pc.equal(table.column("group_id"), group_id)).to_pylist(),
                  key=lambda r: r["sample_id"])
    scores = [r["score"] for r in rows if r["score"] is not None and math.isfinite(r["score"])]
    mean = sum(scores) / len(scores) if scores else None
    std = math.sqrt(sum((x - mean) ** 2 for x in scores) / len(scores)) if scores else None
    first = rows[0]
    return {"iteration": iteration, "group_id": group_id, "prompt_text": first["prompt_text"],
            "data_source": first["data_source"], "ground_truth": first["ground_truth"],
            "score_mean": mean, "score_std": std, "rows": rows}


def trajectory_facets(store_root: str | Path, run_id: str) -> dict:
    """The values the browser's filters offer, read from the run's Parquet files (few columns only).

    Returns:
        ``{"iterations": [...], "data_sources": [...], "finish_reasons": [...], "score_min": float | None,
        "score_max": float | None}``.

    Raises:
        DashboardError: unknown run; a stored file that is a symlink or not Parquet (named).
    """
    store = _store(store_root, run_id)
    its, sources, reasons, scores = [], set(), set(), []
    for it in store.iterations():
        p = _stage_file(store, it, "rollout")
        if p is None:
            continue
        its.append(it)
        t = _read_parquet(p, ["data_source", "finish_reason"])
        sources.update(x for x in t.column("data_source").to_pylist() if x is not None)
        reasons.update(x for x in t.column("finish_reason").to_pylist() if x is not None)
        r = _stage_file(store, it, "reward")
        if r is not None:
            scores += [x for x in _read_parquet(r, ["score"]).column("score").to_pylist() if x is not None]
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
        raise DashboardError(f"dashboard app not found at {APP} (an incomplete trajflow install?)")
    print(f"trajflow dashboard: http://{address}:{port}  (store {root})", flush=True)
    env = dict(os.environ)
    from trajflow import IMPORT_ROOT

    src = str(IMPORT_ROOT)  # the streamlit process imports this same trajflow
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = streamlit_command(root, tracking_uri, port, address)
    os.execve(cmd[0], cmd, env)


# ----------------------------------------------------------------------------------------- multi-turn episodes

def episode_turns(messages: list[dict] | None, tool_calls: list[dict] | None) -> list[dict]:
    """A multi-turn episode's stored ``messages`` and ``tool_calls`` as the browser's turn-by-turn view.

    Args:
        messages: the rollout row's ``messages`` (``role``, ``content``, ``tool_calls`` JSON or None),
            assistant turns and the observations after them, in order.
        tool_calls: the row's ``tool_calls`` (``turn``, ``name``, ``arguments``, ``result``, ``error``,
            ``duration_s``); ``turn`` is the 0-based assistant turn that made the call.

    Returns:
        One dict per message: ``role``, ``content``, ``turn`` (the 1-based assistant turn it belongs to)
        and, on assistant messages, ``calls``: that turn's tool calls (``name``, ``arguments``,
        ``result``, ``error``, ``duration_s``). Empty for single-turn rows (no messages).
    """
    if not messages:
        return []
    by_turn: dict[int, list[dict]] = {}
    for c in tool_calls or []:
        by_turn.setdefault(int(c["turn"]), []).append(
            {k: c.get(k) for k in ("name", "arguments", "result", "error", "duration_s")})
    out, turn = [], 0
    for m in messages:
        if m.get("role") == "assistant":
            turn += 1
            out.append({"role": "assistant", "content": m.get("content") or "", "turn": turn,
                        "calls": by_turn.get(turn - 1, [])})
        else:
            out.append({"role": m.get("role") or "", "content": m.get("content") or "", "turn": turn})
    return out


def episode_messages(store_root: str | Path, run_id: str, iteration: int, sample_id: str) -> list[dict]:
    """:func:`episode_turns` of one stored response, read from its iteration's rollout Parquet file.

    Returns:
        The turns; empty when the run is single-turn (no ``messages`` column) or the row is missing.

    Raises:
        DashboardError: unknown run.
    """
    import pyarrow.parquet as pq

    store = _store(store_root, run_id)
    path = _stage_file(store, int(iteration), "rollout")
    if path is None:
        return []
    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowException) as e:
        raise DashboardError(f"{path}: cannot be read as Parquet ({str(e).splitlines()[0] if str(e) else e}); "
                             f"the stored file is damaged") from None
    if "messages" not in names:
        return []
    t = _read_parquet(path, [c for c in ("sample_id", "messages", "tool_calls") if c in names])
    t = t.filter(pc.equal(t.column("sample_id"), sample_id))
    if not t.num_rows:
        return []
    row = t.to_pylist()[0]
    return episode_turns(row.get("messages"), row.get("tool_calls"))
