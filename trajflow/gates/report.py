"""The outcome of one gate run: :class:`GateReport` and its :class:`ExpectationOutcome` s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from trajflow.errors import GateFailed

#: Allowed policies.
POLICIES = ("fail", "warn", "quarantine")


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
        details: ``type``, ``table``, ``column``, ``description``, ``threshold`` (what passes, e.g.
            ``<= 0.5 (gates.max_truncated_frac)``), ``sample_ids`` (first 20 offending ids),
            ``skipped`` (reason) or ``exception`` (GX's message) where they apply.
    """

    name: str
    success: bool
    observed_value: Any
    unexpected_count: Optional[int]
    policy: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """``pass``, ``skipped``, or for a failed expectation what its policy made of it: ``FAIL``
        (stops the run), ``warn`` (logged only) or ``quarantined`` (its rows left out)."""
        if self.details.get("skipped"):
            return "skipped"
        if self.success:
            return "pass"
        return {"fail": "FAIL", "warn": "warn", "quarantine": "quarantined"}.get(self.policy, self.policy)

    def line(self) -> str:
        """One line a person reads: name, status, policy, threshold, observed value, offending rows."""
        rows = "" if self.unexpected_count is None else f", rows {self.unexpected_count}"
        threshold = self.details.get("threshold")
        text = (f"{self.name}: {self.status} (policy {self.policy}"
                + (f", expected {threshold}" if threshold else "") + f", observed {_fmt(self.observed_value)}{rows})")
        if self.details.get("skipped"):
            text += f": {self.details['skipped']}"
        return text

    def to_json(self) -> dict[str, Any]:
        """What ``gate.json``'s ``expectations`` list holds for this expectation."""
        d = self.details
        return {"name": self.name, "status": self.status, "policy": self.policy, "threshold": d.get("threshold"),
                "observed": self.observed_value, "unexpected_count": self.unexpected_count,
                "sample_ids": list(d.get("sample_ids") or []), "description": d.get("description"),
                "skipped": d.get("skipped"), "exception": d.get("exception")}


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
            "gate/failed": float(len(self.blocking())),
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

    def blocking(self) -> list[ExpectationOutcome]:
        return [r for r in self.results if not r.success and (
            r.policy == "fail" or (r.policy == "quarantine" and "exception" in r.details))]

    def failure_message(self) -> str:
        """One line per failed ``fail`` expectation: name, observed value, offending row count.

        Returns:
            ``""`` when the gate passed.
        """
        lines = []
        for r in self.blocking():
            rows = "n/a" if r.unexpected_count is None else str(r.unexpected_count)
            what = f"{r.details.get('type')}" + (f" on {r.details['column']}"
                                                  if r.details.get("column") else "")
            threshold = f", expected {r.details['threshold']}" if r.details.get("threshold") else ""
            line = (f"gate expectation {r.name} failed (policy {r.policy}, {what}{threshold}): "
                    f"observed {_fmt(r.observed_value)}, rows {rows}")
            if r.details.get("sample_ids"):
                line += f", e.g. sample_ids {', '.join(r.details['sample_ids'][:5])}"
            if r.details.get("exception"):
                line += f"; GX raised: {r.details['exception']}"
            lines.append(line)
        return "\n".join(lines)

    def raise_for_failure(self) -> None:
        """Raise :class:`trajflow.errors.GateFailed` with :meth:`failure_message` if the gate failed."""
        if not self.success:
            where = "" if self.iteration is None else f" at iteration {self.iteration}"
            raise GateFailed(f"reward gate failed{where}:\n{self.failure_message()}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else repr(v)
