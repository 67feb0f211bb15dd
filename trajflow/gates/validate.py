"""Running the gate: one iteration's reward output validated with Great Expectations 1.x.

The gate sits between the reward and advantage stages. It takes the *gate view* of one iteration
(a ``pyarrow.Table`` with one row per sampled response) and validates it against an expectation
suite file (``datasets/expectations/reward_default.json`` by default): a plain GX 1.x
``ExpectationSuite`` serialised as JSON, whose numeric limits are GX suite parameters
(``{"$PARAMETER": "score_max"}``) filled from the ``gates.*`` settings on every run.

Each expectation runs on one of two tables (``meta.table`` in the suite file):

``samples``
    the gate view itself, one row per response, plus the derived boolean column
    ``score_is_finite``. Row-level (map) expectations report the offending ``sample_id`` s through
    GX's ``result_format="COMPLETE"`` with ``unexpected_index_column_names=["sample_id"]``.
``summary``
    one row of per-iteration metrics computed here with pyarrow (GX has no group-level or
    cross-iteration expectations): ``equal_reward_group_frac``, ``truncated_frac``,
    ``scorer_error_rate``, ``score_mean``, ``history_mean``, ``score_mean_drift``, ``rows``,
    ``groups``. A metric that is undefined for this iteration (no history, no group with two
    finite scores, ...) is null, and the expectations on it are reported as *skipped*.

Every expectation has a policy (``fail | warn | quarantine``): the suite file's ``meta.policy``,
overridden by ``gates.policies[name]``. ``fail`` makes :attr:`GateReport.success` false; ``warn``
only records; ``quarantine`` excludes the offending rows (row-level expectations) or the rows named
by the expectation's ``meta.quarantine`` row set (summary expectations, e.g. whole equal-reward
groups) when the expectation fails.

Great Expectations is imported lazily on the first :func:`run_gate` (it costs ~5 s); one ephemeral
context per process is kept in a module-level singleton and each suite file is parsed once, so
later iterations cost tens of milliseconds (see ``benchmarks/gate.py``). Guide: ``docs/gates.md``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from trajflow.config import GatesConfig
from trajflow.gates.docs import json_safe, to_py
from trajflow.gates.report import ExpectationOutcome, GateReport
from trajflow.gates.runtime import TABLES, GxRuntime, gx_runtime
from trajflow.gates.settings import check_max_new_tokens, resolve_settings, suite_parameters
from trajflow.gates.suite import Entry, SuiteSpec, load_suite, suite_policies
from trajflow.gates.summary import QUARANTINE_ROWS, summarize

#: Columns the gate view must have, and the Arrow type family each must belong to.
REQUIRED_COLUMNS: dict[str, str] = {
    "sample_id": "string", "group_id": "string", "iteration": "integer", "score": "floating",
    "response_length": "integer", "finish_reason": "string", "reward_error": "string",
}
#: ``result_format`` used on the samples table: every offending row, identified by sample_id.
RESULT_FORMAT = {"result_format": "COMPLETE", "unexpected_index_column_names": ["sample_id"]}
_DETAIL_IDS = 20  # sample ids kept in ExpectationOutcome.details (all are in quarantine)


def _check_view(view: pa.Table) -> None:
    if not isinstance(view, pa.Table):
        raise TypeError(f"gate view must be a pyarrow.Table, got {type(view).__name__}")
    checks = {"string": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)
              or pa.types.is_null(t),
              "integer": lambda t: pa.types.is_integer(t),
              "floating": lambda t: pa.types.is_floating(t) or pa.types.is_null(t)}
    for col, kind in REQUIRED_COLUMNS.items():
        if col not in view.column_names:
            raise ValueError(f"gate view: missing column {col!r} ({kind}); has "
                             f"{', '.join(view.column_names)}")
        if not checks[kind](view.schema.field(col).type):
            raise ValueError(f"gate view: column {col!r} has type {view.schema.field(col).type}, "
                             f"expected {kind}")
    if view.num_rows == 0:
        raise ValueError("gate view: no rows (an iteration must have at least one response)")
    if view["sample_id"].null_count:
        raise ValueError(f"gate view: column 'sample_id' has {view['sample_id'].null_count} null(s)")
    if pc.count_distinct(view["sample_id"]).as_py() != view.num_rows:
        counts = pc.value_counts(view["sample_id"])
        dup = [c["values"].as_py() for c in counts if c["counts"].as_py() > 1][:5]
        raise ValueError(f"gate view: column 'sample_id' is not unique (e.g. {dup})")
    if view["group_id"].null_count:
        raise ValueError(f"gate view: column 'group_id' has {view['group_id'].null_count} null(s)")


def _samples_frame(view: pa.Table) -> Any:
    """The samples table as pandas: the view's scalar columns plus ``score_is_finite``.

    List/struct/binary columns are dropped (GX's pandas engine validates scalars)."""
    keep = [f.name for f in view.schema
            if not (pa.types.is_nested(f.type) or pa.types.is_binary(f.type)
                    or pa.types.is_large_binary(f.type))]
    t = view.select(keep)
    if "score_is_finite" not in t.column_names:
        t = t.append_column("score_is_finite", pc.is_finite(pc.cast(t["score"], pa.float64())))
    return t.to_pandas()


def _exception_message(info: Any) -> str | None:
    """GX's exception message(s) from ``exception_info``: either one
    ``{"raised_exception", "exception_message", ...}`` dict or such dicts keyed by metric id."""
    if not isinstance(info, Mapping):
        return None
    if "raised_exception" in info:
        return str(info.get("exception_message")) if info.get("raised_exception") else None
    messages = [str(v.get("exception_message")) for v in info.values()
                if isinstance(v, Mapping) and v.get("raised_exception")]
    return "; ".join(dict.fromkeys(messages)) or None


def run_gate(view: pa.Table, settings: Any = None, max_new_tokens: int | None = None, *,
             history: Sequence[float] = ()) -> GateReport:
    """Validate one iteration's reward output against the gate's expectation suite.

    Args:
        view: one row per sampled response with columns ``sample_id`` (string, unique),
            ``group_id`` (string; the samples of one prompt share it), ``iteration`` (int),
            ``score`` (float; may hold NaN/inf/null), ``response_length`` (int, tokens),
            ``finish_reason`` (string, ``stop``/``length``), ``reward_error`` (string, null when
            the scorer did not raise). Extra scalar columns are passed to GX (usable by added
            expectations); list/struct columns are dropped.
        settings: the ``gates`` config section (a ``DictConfig``) or a
            :class:`~trajflow.config.GatesConfig` (see :func:`resolve_settings`); None = the
            config's defaults.
        max_new_tokens: ``rollout.max_new_tokens`` (tokens); required unless the gate is disabled.
        history: the mean scores (:attr:`GateReport.score_mean`) of previous iterations, oldest
            first; the last ``drift_window`` are averaged for ``score_mean_drift``.

    Returns:
        A :class:`GateReport`. With ``settings.enabled`` false: an empty, successful report
        (GX is not imported).

    Raises:
        ValueError: bad settings (key named), a bad suite file, a missing/mistyped view column,
            no rows, null or duplicate ``sample_id``, or no ``max_new_tokens``.
        TypeError: ``view`` is not a ``pyarrow.Table``.
    """
    t0 = time.perf_counter()
    s = resolve_settings(settings)
    check_max_new_tokens(max_new_tokens)
    if not s.enabled:
        return GateReport(success=True, results=[], quarantined_sample_ids=set(),
                          quarantined_reason={}, gx_result_json={}, rows=getattr(view, "num_rows", 0))
    if max_new_tokens is None:
        raise ValueError("max_new_tokens is not set: pass run_gate(view, cfg.gates, "
                         "cfg.rollout.max_new_tokens)")
    _check_view(view)
    spec = load_suite(s.suite)
    policies = suite_policies(spec, s.policies)
    rt = gx_runtime()

    summary = summarize(view, history, s)
    iterations = pc.unique(view["iteration"]).to_pylist()
    skipped = _skipped(spec, summary)
    params = _parameters(view, s, max_new_tokens)
    gx_results, suites = _validate(rt, spec, view, summary, skipped, params)
    outcomes, quarantined = _outcomes(spec, policies, skipped, gx_results, view, params)
    report = GateReport(
        success=True, results=outcomes,
        quarantined_sample_ids={i for ids in quarantined.values() for i in ids},
        quarantined_reason=quarantined,
        gx_result_json={t: json_safe(res.to_json_dict()) for t, res in gx_results.items()},
        iteration=iterations[0] if len(iterations) == 1 else None, rows=view.num_rows,
        summary=summary, score_mean=summary.get("score_mean"), suite_path=spec.path,
        _gx_results=gx_results, _suites=suites)
    report.success = not report.blocking()
    report.elapsed_s = time.perf_counter() - t0
    return report


def _skipped(spec: SuiteSpec, summary: dict[str, float | None]) -> dict[str, str]:
    """Summary expectations whose metric is undefined for this iteration: name -> reason.

    Raises:
        ValueError: an expectation uses a summary column that no registered metric computes.
    """
    skipped: dict[str, str] = {}
    for e in spec.entries:
        if e.table == "summary" and e.column is not None:
            if e.column not in summary:
                raise ValueError(f"gate suite {spec.path}: expectation {e.name} uses summary column "
                                 f"{e.column!r}; summary columns: {', '.join(summary)}")
            if summary[e.column] is None:
                no_history = (e.column in ("score_mean_drift", "history_mean")
                              and summary.get("history_mean") is None)
                skipped[e.name] = (f"summary metric {e.column} is undefined for this iteration"
                                   + (" (no score history yet)" if no_history else ""))
    return skipped


def _parameters(view: pa.Table, settings: GatesConfig, max_new_tokens: int) -> dict[str, float]:
    """The suite parameters, with the score bounds at the precision of the view's score column."""
    params = suite_parameters(settings, max_new_tokens)
    score_type = view.schema.field("score").type
    if pa.types.is_float32(score_type) or pa.types.is_float16(score_type):
        # compare at the score column's precision: float32(1.1) > 1.1 in float64, yet a scorer
        # that returned 1.1 must pass score_max=1.1
        for key in ("score_min", "score_max"):
            params[key] = pa.scalar(params[key], pa.float64()).cast(pa.float32()).as_py()
    return params


def _validate(rt: GxRuntime, spec: SuiteSpec, view: pa.Table, summary: dict[str, float | None],
              skipped: dict[str, str], params: dict[str, float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run GX on each table that has expectations left: (GX results, GX suites), keyed by table."""
    gx_results: dict[str, Any] = {}
    suites: dict[str, Any] = {}
    with rt.lock:
        for table in TABLES:
            suite = rt.suite(spec, table, frozenset(skipped))
            if not suite.expectations:
                continue
            if table == "samples":
                frame = _samples_frame(view)
            else:
                import pandas as pd
                frame = pd.DataFrame({k: [v] for k, v in summary.items()}, dtype="float64")
            batch = rt.batch_definitions[table].get_batch(batch_parameters={"dataframe": frame})
            gx_results[table] = batch.validate(suite, result_format=RESULT_FORMAT,
                                               expectation_parameters=params)
            suites[table] = suite
    return gx_results, suites


def threshold_text(kwargs: dict[str, Any], params: dict[str, float], expectation_type: str = "") -> str | None:
    """What an expectation accepts, for a person: ``in [0, 1.1] (gates.score_min, gates.score_max)``,
    ``<= 0.5 (gates.max_truncated_frac)``, ``in {True}``, ``not null``; None when it has no bound.

    Args:
        kwargs: the expectation's ``kwargs`` from the suite file (``{"$PARAMETER": name}`` allowed).
        params: the suite parameters of this validation (:func:`suite_parameters`).
        expectation_type: the GX expectation type (``expect_column_values_to_not_be_null`` -> ``not null``).
    """
    names = []

    def value(v: Any) -> Any:
        if isinstance(v, dict) and "$PARAMETER" in v:
            key = v["$PARAMETER"]
            names.append("rollout.max_new_tokens" if key == "max_new_tokens" else f"gates.{key}")
            return params.get(v["$PARAMETER"])
        return v

    lo, hi = value(kwargs.get("min_value")), value(kwargs.get("max_value"))
    if lo is not None and hi is not None:
        text = f"in [{_fmt_bound(lo)}, {_fmt_bound(hi)}]"
    elif lo is not None:
        text = f">= {_fmt_bound(lo)}"
    elif hi is not None:
        text = f"<= {_fmt_bound(hi)}"
    elif kwargs.get("value_set") is not None:
        text = "in {" + ", ".join(str(x) for x in value(kwargs["value_set"])) + "}"
    elif expectation_type.endswith("_to_not_be_null"):
        text = "not null"
    elif expectation_type.endswith("_to_be_null"):
        text = "null"
    else:
        return None
    return text + (f" ({', '.join(names)})" if names else "")


def _fmt_bound(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _outcomes(spec: SuiteSpec, policies: dict[str, str], skipped: dict[str, str],
              gx_results: dict[str, Any], view: pa.Table, params: dict[str, float]
              ) -> tuple[list[ExpectationOutcome], dict[str, list[str]]]:
    """One outcome per expectation in suite order, and the rows each ``quarantine`` one excludes."""
    by_name: dict[str, Any] = {}
    for res in gx_results.values():
        for r in res.results:
            by_name[r.expectation_config.meta.get("name")] = r
    outcomes: list[ExpectationOutcome] = []
    quarantined: dict[str, list[str]] = {}
    for e in spec.entries:
        policy = policies[e.name]
        details: dict[str, Any] = {"type": e.type, "table": e.table, "column": e.column,
                                   "description": e.description,
                                   "threshold": threshold_text(e.config.get("kwargs") or {}, params, e.type)}
        if e.name in skipped:
            details["skipped"] = skipped[e.name]
            outcomes.append(ExpectationOutcome(e.name, True, None, None, policy, details))
            continue
        outcome, ids = _outcome(e, policy, details, by_name[e.name], view)
        if not outcome.success and policy == "quarantine" and ids and "exception" not in details:
            quarantined[e.name] = sorted(ids)
        outcomes.append(outcome)
    return outcomes, quarantined


def _outcome(e: Entry, policy: str, details: dict[str, Any], r: Any,
             view: pa.Table) -> tuple[ExpectationOutcome, list[str]]:
    """One expectation's outcome from its GX result ``r``, and the ``sample_id`` s it names."""
    result = r.result or {}
    message = _exception_message(r.exception_info)
    if message:
        details["exception"] = message
    ids: list[str] = []
    if e.row_level:
        ids = [str(d["sample_id"]) for d in result.get("unexpected_index_list") or []
               if isinstance(d, dict) and "sample_id" in d]
        unexpected = result.get("unexpected_count")
        unexpected = None if unexpected is None else int(unexpected)
        observed = result.get("observed_value", unexpected)
    else:
        observed = result.get("observed_value")
        unexpected = None
        if e.quarantine:
            mask = QUARANTINE_ROWS.get(e.quarantine)(view)
            ids = pc.filter(view["sample_id"], mask).to_pylist()
            unexpected = len(ids)
    success = bool(r.success) and "exception" not in details
    if ids:
        details["sample_ids"] = ids[:_DETAIL_IDS]
    return ExpectationOutcome(e.name, success, to_py(observed), unexpected, policy, details), ids


def apply_quarantine(table: pa.Table, report: GateReport) -> pa.Table:
    """Drop the quarantined rows from any table keyed by ``sample_id``.

    Args:
        table: a stage output with a ``sample_id`` column (e.g. the reward output).
        report: the gate report of the same iteration.

    Returns:
        ``table`` without the rows whose ``sample_id`` is in ``report.quarantined_sample_ids``
        (the same table object when nothing is quarantined).

    Raises:
        ValueError: ``table`` has no ``sample_id`` column.
    """
    if "sample_id" not in table.column_names:
        raise ValueError("apply_quarantine: table has no 'sample_id' column")
    if not report.quarantined_sample_ids:
        return table
    drop = pa.array(sorted(report.quarantined_sample_ids), pa.string())
    keep = pc.invert(pc.fill_null(pc.is_in(pc.cast(table["sample_id"], pa.string()),
                                           value_set=drop), False))
    return table.filter(keep)
