"""Data-quality gates on each iteration's reward output, validated with Great Expectations 1.x.

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

import copy
import dataclasses
import difflib
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc

from stages.registry import Registry

__all__ = [
    "DEFAULT_SUITE",
    "POLICIES",
    "QUARANTINE_ROWS",
    "SUMMARY_METRICS",
    "ExpectationOutcome",
    "GateFailedError",
    "GateReport",
    "GateSettings",
    "apply_quarantine",
    "load_suite",
    "report_to_json",
    "resolve_settings",
    "run_gate",
    "summarize",
    "write_data_docs",
]

#: Folder of the shipped suites: ``<repo>/datasets/expectations``.
SUITE_DIR = Path(__file__).resolve().parents[1] / "datasets" / "expectations"
#: The suite used when ``gates.suite`` is None.
DEFAULT_SUITE = SUITE_DIR / "reward_default.json"
#: Allowed policies.
POLICIES = ("fail", "warn", "quarantine")
#: Tables an expectation can run on (``meta.table``).
TABLES = ("samples", "summary")
#: Settings exposed to suite files as GX suite parameters (``{"$PARAMETER": name}``).
PARAMETER_NAMES = ("score_min", "score_max", "max_new_tokens", "max_equal_group_frac",
                   "max_truncated_frac", "max_error_rate", "drift_band", "drift_window")
#: Columns the gate view must have, and the Arrow type family each must belong to.
REQUIRED_COLUMNS: dict[str, str] = {
    "sample_id": "string", "group_id": "string", "iteration": "integer", "score": "floating",
    "response_length": "integer", "finish_reason": "string", "reward_error": "string",
}
#: ``result_format`` used on the samples table: every offending row, identified by sample_id.
RESULT_FORMAT = {"result_format": "COMPLETE", "unexpected_index_column_names": ["sample_id"]}
_DETAIL_IDS = 20  # sample ids kept in ExpectationOutcome.details (all are in quarantine)


class GateFailedError(RuntimeError):
    """Raised by :meth:`GateReport.raise_for_failure` when a ``fail`` expectation failed."""


# --------------------------------------------------------------------------------------------
# settings


@dataclass
class GateSettings:
    """Resolved gate settings (the ``gates`` config section plus ``rollout.max_new_tokens``).

    Defaults mirror ``trajflow.config.GatesConfig``; a settings object missing an attribute gets
    the default below.
    """

    enabled: bool = True  #: run the gate at all
    suite: Optional[str] = None  #: suite file; None = datasets/expectations/reward_default.json
    score_min: float = -10.0  #: lowest allowed score (inclusive)
    score_max: float = 10.0  #: highest allowed score (inclusive)
    max_new_tokens: Optional[int] = None  #: rollout.max_new_tokens (tokens); required to run
    max_equal_group_frac: float = 1.0  #: max share of groups whose scores are all equal (1.0 = off)
    max_truncated_frac: float = 1.0  #: max share of responses with finish_reason "length" (1.0 = off)
    max_error_rate: float = 0.5  #: max share of responses whose scorer raised
    drift_band: float = 1.0  #: max |mean score - mean of the previous drift_window means|
    drift_window: int = 5  #: previous iterations averaged for the drift check
    policies: dict[str, str] = field(default_factory=dict)  #: name -> fail|warn|quarantine

    def parameters(self) -> dict[str, float]:
        """The suite parameters (``$PARAMETER`` values) these settings provide."""
        return {name: getattr(self, name) for name in PARAMETER_NAMES}


def resolve_settings(settings: Any = None, *, max_new_tokens: int | None = None) -> GateSettings:
    """Read and check gate settings from any object with the ``gates.*`` attributes.

    Args:
        settings: a ``DictConfig`` section ``gates``, a dataclass, a ``SimpleNamespace``, a mapping,
            or None (all defaults). Missing attributes take the :class:`GateSettings` defaults.
        max_new_tokens: ``rollout.max_new_tokens``; overrides ``settings.max_new_tokens``.

    Returns:
        A checked :class:`GateSettings` (``policies`` is a plain dict).

    Raises:
        ValueError: a value out of range, naming the key ``gates.<field>``, the value and what
            is allowed (policy names are checked against the suite later, in :func:`run_gate`).
    """
    if isinstance(settings, GateSettings) and max_new_tokens is None:
        out = dataclasses.replace(settings, policies=dict(settings.policies))
    else:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(GateSettings):
            if settings is None:
                continue
            if isinstance(settings, Mapping):  # a dict or a DictConfig
                if f.name in settings:
                    values[f.name] = settings[f.name]
            else:
                try:
                    value = getattr(settings, f.name)
                except AttributeError:  # includes omegaconf's ConfigAttributeError
                    continue
                values[f.name] = value
        if max_new_tokens is not None:
            values["max_new_tokens"] = max_new_tokens
        policies = values.pop("policies", None)
        out = GateSettings(**values)
        out.policies = {str(k): str(v) for k, v in dict(policies or {}).items()}
    _check_settings(out)
    return out


def _check_settings(s: GateSettings) -> None:
    def bad(key: str, value: Any, allowed: str) -> ValueError:
        return ValueError(f"gates.{key}={value!r} is not allowed: expected {allowed}")

    for key in ("score_min", "score_max", "max_equal_group_frac", "max_truncated_frac",
                "max_error_rate", "drift_band"):
        value = getattr(s, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise bad(key, value, "a number")
        setattr(s, key, float(value))
    for key in ("max_equal_group_frac", "max_truncated_frac", "max_error_rate"):
        if not 0.0 <= getattr(s, key) <= 1.0:
            raise bad(key, getattr(s, key), "a fraction in [0, 1]")
    if s.drift_band < 0:
        raise bad("drift_band", s.drift_band, "a number >= 0")
    if s.score_min > s.score_max:
        raise ValueError(f"gates.score_min={s.score_min} must be <= gates.score_max={s.score_max}")
    if isinstance(s.drift_window, bool) or not isinstance(s.drift_window, int) or s.drift_window < 1:
        raise bad("drift_window", s.drift_window, "an integer >= 1")
    if s.max_new_tokens is not None and (isinstance(s.max_new_tokens, bool)
                                         or not isinstance(s.max_new_tokens, int)
                                         or s.max_new_tokens < 1):
        raise bad("max_new_tokens", s.max_new_tokens,
                  "an integer >= 1 (pass rollout.max_new_tokens)")
    for name, policy in s.policies.items():
        if policy not in POLICIES:
            raise ValueError(f"gates.policies.{name}={policy!r} is not allowed: choose one of "
                             f"{', '.join(POLICIES)}")
    s.enabled = bool(s.enabled)


# --------------------------------------------------------------------------------------------
# the summary table and quarantine row sets (registries: open to new metrics / row sets)

#: Summary metrics: ``fn(view, history, settings) -> float | None`` registered by column name.
SUMMARY_METRICS = Registry("gate summary metric")
#: Row sets a failed summary expectation can quarantine (``meta.quarantine`` in the suite):
#: ``fn(view) -> pa.BooleanArray`` (True = the row belongs to the set), length ``view.num_rows``.
QUARANTINE_ROWS = Registry("gate quarantine row set")


def _finite_scores(view: pa.Table) -> pa.Array:
    """``score`` as float64 with NaN/inf turned into nulls."""
    score = pc.cast(view["score"], pa.float64())
    return pc.if_else(pc.is_finite(score), score, pa.scalar(None, pa.float64()))


def _equal_group_ids(view: pa.Table) -> tuple[pa.Array, int]:
    """Groups with >= 2 finite scores whose scores are all equal, and the count of such groups
    with >= 2 finite scores (the denominator)."""
    t = pa.table({"group_id": view["group_id"], "s": _finite_scores(view)})
    g = t.group_by("group_id").aggregate([("s", "min"), ("s", "max"), ("s", "count")])
    judged = pc.greater_equal(g["s_count"], 2)
    equal = pc.and_(judged, pc.equal(g["s_min"], g["s_max"]))
    return pc.filter(g["group_id"], equal), pc.sum(pc.cast(judged, pa.int64())).as_py() or 0


@SUMMARY_METRICS.register("rows")
def _rows(view: pa.Table, history: Sequence[float], settings: GateSettings) -> float:
    """Number of rows (responses) in the view."""
    return float(view.num_rows)


@SUMMARY_METRICS.register("groups")
def _groups(view: pa.Table, history: Sequence[float], settings: GateSettings) -> float:
    """Number of distinct ``group_id`` (prompts)."""
    return float(pc.count_distinct(view["group_id"]).as_py())


@SUMMARY_METRICS.register("equal_reward_group_frac")
def _equal_reward_group_frac(view, history, settings) -> float | None:
    """Share of groups whose finite scores are all equal (GRPO gives them zero advantage).

    Only groups with >= 2 finite scores are judged; None when there is none.
    """
    equal_ids, judged = _equal_group_ids(view)
    return len(equal_ids) / judged if judged else None


@SUMMARY_METRICS.register("truncated_frac")
def _truncated_frac(view, history, settings) -> float | None:
    """Share of responses with ``finish_reason == "length"``."""
    if view.num_rows == 0:
        return None
    return pc.sum(pc.cast(_truncated_rows(view), pa.int64())).as_py() / view.num_rows


@SUMMARY_METRICS.register("scorer_error_rate")
def _scorer_error_rate(view, history, settings) -> float | None:
    """Share of responses whose scorer raised (``reward_error`` not null)."""
    if view.num_rows == 0:
        return None
    return pc.sum(pc.cast(_scorer_error_rows(view), pa.int64())).as_py() / view.num_rows


def _score_mean(view: pa.Table) -> float | None:
    ok = pc.is_null(view["reward_error"])
    mean = pc.mean(pc.filter(_finite_scores(view), ok)).as_py()
    return None if mean is None else float(mean)


def _history_mean(history: Sequence[float], window: int) -> float | None:
    recent = [float(h) for h in list(history)[-window:] if h is not None and math.isfinite(h)]
    return sum(recent) / len(recent) if recent else None


@SUMMARY_METRICS.register("score_mean")
def _score_mean_metric(view, history, settings) -> float | None:
    """Mean of the finite scores of rows whose scorer did not raise; None if there is none."""
    return _score_mean(view)


@SUMMARY_METRICS.register("history_mean")
def _history_mean_metric(view, history, settings) -> float | None:
    """Mean of the last ``drift_window`` finite entries of ``history``; None without history."""
    return _history_mean(history, settings.drift_window)


@SUMMARY_METRICS.register("score_mean_drift")
def _score_mean_drift(view, history, settings) -> float | None:
    """``|score_mean - history_mean|``; None without history or without a finite score."""
    mean, ref = _score_mean(view), _history_mean(history, settings.drift_window)
    return None if mean is None or ref is None else abs(mean - ref)


@QUARANTINE_ROWS.register("truncated_rows")
def _truncated_rows(view: pa.Table) -> pa.Array:
    """Rows cut at ``max_new_tokens`` (``finish_reason == "length"``)."""
    return pc.fill_null(pc.equal(view["finish_reason"], "length"), False)


@QUARANTINE_ROWS.register("scorer_error_rows")
def _scorer_error_rows(view: pa.Table) -> pa.Array:
    """Rows whose scorer raised (``reward_error`` not null)."""
    return pc.is_valid(view["reward_error"])


@QUARANTINE_ROWS.register("equal_reward_groups")
def _equal_reward_groups(view: pa.Table) -> pa.Array:
    """Every row of a group whose finite scores are all equal (>= 2 of them)."""
    equal_ids, _ = _equal_group_ids(view)
    return pc.fill_null(pc.is_in(view["group_id"], value_set=pc.cast(equal_ids, pa.string())),
                        False)


def summarize(view: pa.Table, history: Sequence[float] = (),
              settings: GateSettings | None = None) -> dict[str, float | None]:
    """Compute the one-row ``summary`` table the summary expectations run on.

    Args:
        view: the gate view (see :func:`run_gate`).
        history: mean scores of previous iterations, oldest first.
        settings: resolved settings (``drift_window`` is used); None = defaults.

    Returns:
        ``{column: value}`` for every registered summary metric; None where undefined.
    """
    settings = settings or GateSettings()
    return {name: SUMMARY_METRICS.get(name)(view, history, settings)
            for name in SUMMARY_METRICS.names()}


# --------------------------------------------------------------------------------------------
# the report


@dataclass
class ExpectationOutcome:
    """One expectation's result in a gate run.

    Attributes:
        name: the stable short name (``meta.name`` in the suite), used in ``gate/<name>/*``.
        success: GX's verdict (True for a skipped expectation).
        observed_value: for row-level expectations the number of offending rows; otherwise GX's
            ``observed_value`` (e.g. the fraction for ``scorer_error_rate``); None when skipped.
        unexpected_count: rows that violate it (row-level), or rows in its quarantine row set
            (summary expectations with ``meta.quarantine``); None when not defined.
        policy: ``fail``, ``warn`` or ``quarantine``.
        details: ``type``, ``table``, ``column``, ``description``, ``sample_ids`` (first 20
            offending ids), ``skipped`` (reason) or ``exception`` (GX's message) where they apply.
    """

    name: str
    success: bool
    observed_value: Any
    unexpected_count: Optional[int]
    policy: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class GateReport:
    """The outcome of one gate run.

    Attributes:
        success: False iff an expectation with policy ``fail`` failed (or one with policy
            ``quarantine`` raised inside GX, so no rows could be attributed).
        results: one :class:`ExpectationOutcome` per expectation, in suite order.
        quarantined_sample_ids: rows to exclude from the rest of the iteration.
        quarantined_reason: expectation name -> sorted sample ids it quarantined.
        gx_result_json: ``{"samples": ..., "summary": ...}``, GX's own
            ``ExpectationSuiteValidationResult.to_json_dict()`` per table, made strict-JSON-safe
            (NaN/inf floats become the strings "NaN"/"Infinity"/"-Infinity").
        iteration: the view's iteration (None for an empty or mixed view).
        rows: rows in the view.
        summary: the summary table's values (see :func:`summarize`).
        score_mean: mean finite score of this iteration; append it to the ``history`` passed to
            the next :func:`run_gate`.
        suite_path: the suite file used (None when the gate is disabled).
        elapsed_s: wall time of :func:`run_gate`, seconds.
    """

    success: bool
    results: list[ExpectationOutcome]
    quarantined_sample_ids: set[str]
    quarantined_reason: dict[str, list[str]]
    gx_result_json: dict[str, Any]
    iteration: Optional[int] = None
    rows: int = 0
    summary: dict[str, Optional[float]] = field(default_factory=dict)
    score_mean: Optional[float] = None
    suite_path: Optional[str] = None
    elapsed_s: float = 0.0
    _gx_results: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _suites: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def outcome(self, name: str) -> ExpectationOutcome:
        """The outcome named ``name``.

        Raises:
            KeyError: no such expectation in this report; the message lists the names.
        """
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no gate expectation {name!r}; have {[r.name for r in self.results]}")

    def failed(self, policy: str | None = None) -> list[ExpectationOutcome]:
        """Failed outcomes, optionally only those with ``policy``."""
        return [r for r in self.results if not r.success and (policy is None or r.policy == policy)]

    def metrics(self) -> dict[str, float]:
        """Flat float metrics for MLflow, under ``gate/``.

        Returns:
            ``gate/success``, ``gate/rows``, ``gate/quarantined_rows``, ``gate/failed`` (failed
            ``fail`` expectations), ``gate/warnings`` (failed ``warn`` expectations),
            ``gate/score_mean`` (when defined), and per expectation ``gate/<name>/success``
            (1.0/0.0), ``gate/<name>/observed`` and ``gate/<name>/unexpected_count`` (when
            numeric), ``gate/<name>/skipped`` (1.0 when skipped).
        """
        out: dict[str, float] = {
            "gate/success": float(self.success),
            "gate/rows": float(self.rows),
            "gate/quarantined_rows": float(len(self.quarantined_sample_ids)),
            "gate/failed": float(len(self._blocking())),
            "gate/warnings": float(len(self.failed("warn"))),
        }
        if self.score_mean is not None:
            out["gate/score_mean"] = float(self.score_mean)
        for r in self.results:
            out[f"gate/{r.name}/success"] = float(r.success)
            if _is_number(r.observed_value):
                out[f"gate/{r.name}/observed"] = float(r.observed_value)
            if r.unexpected_count is not None:
                out[f"gate/{r.name}/unexpected_count"] = float(r.unexpected_count)
            if r.details.get("skipped"):
                out[f"gate/{r.name}/skipped"] = 1.0
        return out

    def _blocking(self) -> list[ExpectationOutcome]:
        return [r for r in self.results if not r.success and (
            r.policy == "fail" or (r.policy == "quarantine" and "exception" in r.details))]

    def failure_message(self) -> str:
        """One line per failed ``fail`` expectation: name, observed value, offending row count.

        Returns:
            ``""`` when the gate passed.
        """
        lines = []
        for r in self._blocking():
            rows = "n/a" if r.unexpected_count is None else str(r.unexpected_count)
            what = f"{r.details.get('type')}" + (f" on {r.details['column']}"
                                                  if r.details.get("column") else "")
            line = (f"gate expectation {r.name} failed (policy {r.policy}, {what}): "
                    f"observed {_fmt(r.observed_value)}, rows {rows}")
            if r.details.get("sample_ids"):
                line += f", e.g. sample_ids {', '.join(r.details['sample_ids'][:5])}"
            if r.details.get("exception"):
                line += f"; GX raised: {r.details['exception']}"
            lines.append(line)
        return "\n".join(lines)

    def raise_for_failure(self) -> None:
        """Raise :class:`GateFailedError` with :meth:`failure_message` if the gate failed."""
        if not self.success:
            where = "" if self.iteration is None else f" at iteration {self.iteration}"
            raise GateFailedError(f"reward gate failed{where}:\n{self.failure_message()}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else repr(v)


# --------------------------------------------------------------------------------------------
# suite files


@dataclass(frozen=True)
class _Entry:
    name: str
    table: str
    type: str
    config: dict  # the expectation's JSON, with meta.name filled in
    default_policy: str
    quarantine: Optional[str]  # QUARANTINE_ROWS name (summary table)
    row_level: bool  # a map expectation: GX lists the offending sample_ids
    column: Optional[str]
    description: str


@dataclass(frozen=True)
class SuiteSpec:
    """A parsed suite file: its expectations split by table, each with name and policy."""

    path: str
    name: str
    entries: tuple[_Entry, ...]

    def names(self) -> list[str]:
        """Expectation names in file order."""
        return [e.name for e in self.entries]


_SUITE_CACHE: dict[tuple[str, str], SuiteSpec] = {}


def _resolve_suite_path(suite: str | os.PathLike | None) -> Path:
    if suite is None or str(suite) == "":
        return DEFAULT_SUITE
    p = Path(suite).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, SUITE_DIR.parents[1] / p, SUITE_DIR / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise ValueError(f"gates.suite={str(suite)!r}: no such file (looked in "
                     f"{', '.join(str(c) for c in candidates)})")


def load_suite(suite: str | os.PathLike | None = None) -> SuiteSpec:
    """Parse and check a suite file (cached by path and content).

    Args:
        suite: path to a GX 1.x ``ExpectationSuite`` JSON file; None = :data:`DEFAULT_SUITE`.
            A relative path is tried against the working directory, the repository root and
            ``datasets/expectations/``.

    Returns:
        The :class:`SuiteSpec`.

    Raises:
        ValueError: the file is missing or not JSON, an expectation is not a valid GX
            expectation (unknown type, bad kwargs), or its ``meta`` has a bad ``table``,
            ``policy`` or ``quarantine`` value, or two expectations share a name. The message
            names the file and the expectation's index and type.
    """
    path = _resolve_suite_path(suite)
    raw = path.read_bytes()
    key = (str(path), hashlib.sha256(raw).hexdigest())
    if key in _SUITE_CACHE:
        return _SUITE_CACHE[key]
    _gx()  # imports GX (expectation classes are checked against it)
    from great_expectations.expectations.expectation import (
        ColumnMapExpectation, ColumnPairMapExpectation, MulticolumnMapExpectation)
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"gate suite {path}: not valid JSON: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("expectations"), list):
        raise ValueError(f"gate suite {path}: expected a GX ExpectationSuite JSON object with an "
                         "'expectations' list")
    entries: list[_Entry] = []
    seen: set[str] = set()
    for i, exp in enumerate(doc["expectations"]):
        where = f"gate suite {path}: expectations[{i}]"
        if not isinstance(exp, dict) or "type" not in exp:
            raise ValueError(f"{where}: expected an object with 'type' and 'kwargs'")
        where += f" ({exp['type']})"
        cfg = copy.deepcopy({k: v for k, v in exp.items() if k != "id"})
        cfg.setdefault("kwargs", {})
        meta = dict(cfg.get("meta") or {})
        column = cfg["kwargs"].get("column")
        name = meta.get("name") or (exp["type"].removeprefix("expect_")
                                    + (f"__{column}" if column else ""))
        if not isinstance(name, str) or "/" in name or not name.strip():
            raise ValueError(f"{where}: meta.name={name!r} must be a non-empty string without '/'")
        if name in seen:
            raise ValueError(f"{where}: meta.name {name!r} is used twice; names must be unique")
        seen.add(name)
        table = meta.get("table", "samples")
        if table not in TABLES:
            raise ValueError(f"{where}: meta.table={table!r}; choose one of {', '.join(TABLES)}")
        policy = meta.get("policy", "fail")
        if policy not in POLICIES:
            raise ValueError(f"{where}: meta.policy={policy!r}; choose one of {', '.join(POLICIES)}")
        quarantine = meta.get("quarantine")
        if quarantine is not None:
            try:
                QUARANTINE_ROWS.get(quarantine)
            except ValueError as e:
                raise ValueError(f"{where}: meta.quarantine: {e}") from e
        meta["name"] = name
        cfg["meta"] = meta
        try:
            obj = ExpectationConfiguration(**cfg).to_domain_obj()
        except Exception as e:  # GX raises pydantic/GX errors of many types
            raise ValueError(f"{where}: not a valid GX expectation: {e}") from e
        row_level = table == "samples" and isinstance(
            obj, (ColumnMapExpectation, ColumnPairMapExpectation, MulticolumnMapExpectation))
        entries.append(_Entry(name=name, table=table, type=exp["type"], config=cfg,
                              default_policy=policy, quarantine=quarantine, row_level=row_level,
                              column=column, description=str(meta.get("description", ""))))
    spec = SuiteSpec(path=str(path), name=str(doc.get("name") or path.stem), entries=tuple(entries))
    _SUITE_CACHE[key] = spec
    return spec


def _policies(spec: SuiteSpec, settings: GateSettings) -> dict[str, str]:
    names = spec.names()
    for name, policy in settings.policies.items():
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"gates.policies.{name}={policy!r}: no expectation named {name!r} in "
                             f"{spec.path}{hint}; names: {', '.join(names)}")
    out = {e.name: settings.policies.get(e.name, e.default_policy) for e in spec.entries}
    for e in spec.entries:
        if out[e.name] == "quarantine" and not (e.row_level or e.quarantine):
            raise ValueError(
                f"gates.policies.{e.name}=quarantine is not possible: {e.type} on the {e.table} "
                "table names no offending rows (only row-level expectations on the samples "
                "table, or summary expectations with meta.quarantine, can quarantine); use fail "
                "or warn")
    return out


# --------------------------------------------------------------------------------------------
# the GX context (one per process)


class _GxRuntime:
    """The process-wide ephemeral GX context, its data assets and cached suites."""

    def __init__(self) -> None:
        os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
        t0 = time.perf_counter()
        import great_expectations as gx
        from great_expectations.data_context.types.base import ProgressBarsConfig

        self.import_s = time.perf_counter() - t0
        self.gx = gx
        self.context = gx.get_context(mode="ephemeral")
        self.context.variables.progress_bars = ProgressBarsConfig(globally=False)
        source = self.context.data_sources.add_pandas("trajflow_gates")
        self.batch_definitions = {
            table: source.add_dataframe_asset(table).add_batch_definition_whole_dataframe(table)
            for table in TABLES}
        self.suites: dict[tuple, Any] = {}
        self.lock = threading.RLock()
        self.startup_s = time.perf_counter() - t0

    def suite(self, spec: SuiteSpec, table: str, skip: frozenset[str]) -> Any:
        """The GX ExpectationSuite for ``table`` without the ``skip`` expectations (cached)."""
        key = (spec.path, id(spec), table, skip)
        if key not in self.suites:
            from great_expectations.expectations.expectation_configuration import (
                ExpectationConfiguration)

            exps = [ExpectationConfiguration(**copy.deepcopy(e.config)).to_domain_obj()
                    for e in spec.entries if e.table == table and e.name not in skip]
            self.suites[key] = self.gx.ExpectationSuite(name=f"{spec.name}.{table}",
                                                        expectations=exps)
        return self.suites[key]


_RUNTIME: _GxRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def _gx() -> _GxRuntime:
    """The process-wide GX runtime, started on first use (imports great_expectations)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = _GxRuntime()
        return _RUNTIME


# --------------------------------------------------------------------------------------------
# running the gate


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


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        if math.isnan(obj):
            return "NaN"
        if math.isinf(obj):
            return "Infinity" if obj > 0 else "-Infinity"
        return obj
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _to_py(v: Any) -> Any:
    """numpy scalars -> Python scalars (GX returns e.g. np.float32 observed values)."""
    if hasattr(v, "item") and callable(v.item) and not isinstance(v, (list, dict, str)):
        try:
            return v.item()
        except (ValueError, TypeError):
            return v
    return v


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


def run_gate(view: pa.Table, settings: Any = None, *, history: Sequence[float] = (),
             max_new_tokens: int | None = None) -> GateReport:
    """Validate one iteration's reward output against the gate's expectation suite.

    Args:
        view: one row per sampled response with columns ``sample_id`` (string, unique),
            ``group_id`` (string; the samples of one prompt share it), ``iteration`` (int),
            ``score`` (float; may hold NaN/inf/null), ``response_length`` (int, tokens),
            ``finish_reason`` (string, ``stop``/``length``), ``reward_error`` (string, null when
            the scorer did not raise). Extra scalar columns are passed to GX (usable by added
            expectations); list/struct columns are dropped.
        settings: the ``gates`` config section or any object with its attributes (see
            :func:`resolve_settings`).
        history: the mean scores (:attr:`GateReport.score_mean`) of previous iterations, oldest
            first; the last ``drift_window`` are averaged for ``score_mean_drift``.
        max_new_tokens: ``rollout.max_new_tokens`` (tokens), if ``settings`` lacks it.

    Returns:
        A :class:`GateReport`. With ``settings.enabled`` false: an empty, successful report
        (GX is not imported).

    Raises:
        ValueError: bad settings (key named), a bad suite file, a missing/mistyped view column,
            no rows, null or duplicate ``sample_id``, or no ``max_new_tokens``.
        TypeError: ``view`` is not a ``pyarrow.Table``.
    """
    t0 = time.perf_counter()
    s = resolve_settings(settings, max_new_tokens=max_new_tokens)
    if not s.enabled:
        return GateReport(success=True, results=[], quarantined_sample_ids=set(),
                          quarantined_reason={}, gx_result_json={}, rows=getattr(view, "num_rows", 0))
    if s.max_new_tokens is None:
        raise ValueError("gates.max_new_tokens is not set: pass run_gate(..., "
                         "max_new_tokens=cfg.rollout.max_new_tokens)")
    _check_view(view)
    spec = load_suite(s.suite)
    policies = _policies(spec, s)
    rt = _gx()

    summary = summarize(view, history, s)
    iterations = pc.unique(view["iteration"]).to_pylist()
    iteration = iterations[0] if len(iterations) == 1 else None
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
    params = s.parameters()
    if pa.types.is_float32(view.schema.field("score").type) or pa.types.is_float16(
            view.schema.field("score").type):
        # compare at the score column's precision: float32(1.1) > 1.1 in float64, yet a scorer
        # that returned 1.1 must pass score_max=1.1
        for key in ("score_min", "score_max"):
            params[key] = pa.scalar(params[key], pa.float64()).cast(pa.float32()).as_py()
    frames = {"samples": None, "summary": None}
    gx_results: dict[str, Any] = {}
    suites: dict[str, Any] = {}
    with rt.lock:
        for table in TABLES:
            suite = rt.suite(spec, table, frozenset(skipped))
            if not suite.expectations:
                continue
            if table == "samples":
                frames[table] = _samples_frame(view)
            else:
                import pandas as pd
                frames[table] = pd.DataFrame({k: [v] for k, v in summary.items()}, dtype="float64")
            batch = rt.batch_definitions[table].get_batch(batch_parameters={"dataframe": frames[table]})
            gx_results[table] = batch.validate(suite, result_format=RESULT_FORMAT,
                                               expectation_parameters=params)
            suites[table] = suite

    by_name: dict[str, Any] = {}
    for res in gx_results.values():
        for r in res.results:
            by_name[r.expectation_config.meta.get("name")] = r

    outcomes: list[ExpectationOutcome] = []
    quarantined: dict[str, list[str]] = {}
    sample_ids = view["sample_id"]
    for e in spec.entries:
        policy = policies[e.name]
        details: dict[str, Any] = {"type": e.type, "table": e.table, "column": e.column,
                                   "description": e.description}
        if e.name in skipped:
            details["skipped"] = skipped[e.name]
            outcomes.append(ExpectationOutcome(e.name, True, None, None, policy, details))
            continue
        r = by_name[e.name]
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
                ids = pc.filter(sample_ids, mask).to_pylist()
                unexpected = len(ids)
        observed = _to_py(observed)
        success = bool(r.success) and "exception" not in details
        if ids:
            details["sample_ids"] = ids[:_DETAIL_IDS]
        if not success and policy == "quarantine" and ids and "exception" not in details:
            quarantined[e.name] = sorted(ids)
        outcomes.append(ExpectationOutcome(e.name, success, observed, unexpected, policy, details))

    report = GateReport(
        success=True, results=outcomes,
        quarantined_sample_ids={i for ids in quarantined.values() for i in ids},
        quarantined_reason=quarantined,
        gx_result_json={t: _json_safe(res.to_json_dict()) for t, res in gx_results.items()},
        iteration=iteration, rows=view.num_rows, summary=summary,
        score_mean=summary.get("score_mean"), suite_path=spec.path,
        _gx_results=gx_results, _suites=suites)
    report.success = not report._blocking()
    report.elapsed_s = time.perf_counter() - t0
    return report


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


def report_to_json(report: GateReport) -> dict[str, Any]:
    """A strict-JSON-safe dict of the report (for the run store, MLflow ``log_dict``, audits).

    Returns:
        ``success``, ``iteration``, ``rows``, ``suite_path``, ``elapsed_s``, ``score_mean``,
        ``summary``, ``failure_message``, ``results`` (one dict per expectation),
        ``quarantined_sample_ids`` (sorted), ``quarantined_reason``, ``metrics``, ``gx_result``
        (GX's validation results per table). NaN/inf floats become "NaN"/"Infinity"/"-Infinity".
    """
    return _json_safe({
        "success": report.success,
        "iteration": report.iteration,
        "rows": report.rows,
        "suite_path": report.suite_path,
        "elapsed_s": report.elapsed_s,
        "score_mean": report.score_mean,
        "summary": report.summary,
        "failure_message": report.failure_message(),
        "results": [{**dataclasses.asdict(r), "observed_value": _to_py(r.observed_value)}
                    for r in report.results],
        "quarantined_sample_ids": sorted(report.quarantined_sample_ids),
        "quarantined_reason": report.quarantined_reason,
        "metrics": report.metrics(),
        "gx_result": report.gx_result_json,
    })


def write_data_docs(report: GateReport, out_dir: str | os.PathLike) -> Path:
    """Render GX's HTML Data Docs for this gate run into ``out_dir``.

    Uses a GX ``SiteBuilder`` site on the process's ephemeral context whose store is
    ``out_dir``: one validation page per table (samples, summary), the suite pages and an
    ``index.html``. The site is rebuilt in full, so use one folder per report (e.g.
    ``iterations/000007/gate_docs``). Pages load Bootstrap etc. from CDNs; offline they render
    unstyled but complete.

    Args:
        report: a report returned by :func:`run_gate` in this process.
        out_dir: folder to write (created if missing).

    Returns:
        Path of the site's ``index.html``.

    Raises:
        ValueError: the report carries no GX results (disabled gate, or rebuilt from JSON).
    """
    if not report._gx_results:
        raise ValueError("write_data_docs: this report has no GX validation results (the gate "
                         "was disabled, or the report was not produced by run_gate here)")
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.data_context.types.resource_identifiers import (
        ExpectationSuiteIdentifier, ValidationResultIdentifier)
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    rt = _gx()
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = rt.context
    site = "trajflow_gate"
    site_config = {"class_name": "SiteBuilder",
                   "store_backend": {"class_name": "TupleFilesystemStoreBackend",
                                     "base_directory": str(out)},
                   "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"}}
    run_name = "gate" if report.iteration is None else f"iteration-{report.iteration:06d}"
    with rt.lock:
        if site in ctx.list_data_docs_sites():
            ctx.update_data_docs_site(site, site_config)
        else:
            ctx.add_data_docs_site(site, site_config)
        keys, added_suites = [], []
        try:
            for table, res in report._gx_results.items():
                suite = report._suites[table]
                # a fresh copy: adding to the context's store assigns ids to the expectations
                ctx.suites.add(rt.gx.ExpectationSuite(name=suite.name, expectations=[
                    ExpectationConfiguration(**e.configuration.to_json_dict()).to_domain_obj()
                    for e in suite.expectations]))
                added_suites.append(suite.name)
                key = ValidationResultIdentifier(
                    expectation_suite_identifier=ExpectationSuiteIdentifier(name=suite.name),
                    run_id=RunIdentifier(run_name=run_name), batch_identifier=f"{table}")
                ctx.validation_results_store.set(key, res)
                keys.append(key)
            urls = ctx.build_data_docs(site_names=[site])
        finally:
            for key in keys:
                ctx.validation_results_store.remove_key(key)
            for name in added_suites:
                ctx.suites.delete(name)
    index = out / "index.html"
    if not index.is_file():
        raise RuntimeError(f"write_data_docs: GX built {urls} but {index} is missing")
    return index
