"""Data-quality gates on each iteration's reward output, validated with Great Expectations 1.x.

:func:`run_gate` checks one iteration's gate view against an expectation suite (:mod:`.suite`) and
returns a :class:`GateReport`; :mod:`.summary` computes the per-iteration metrics, :mod:`.docs`
writes JSON and HTML Data Docs, :mod:`.iteration` re-checks stored runs (the gate step of a training
run is :mod:`trajflow.run.gate`). How a gate run works: :mod:`trajflow.gates.validate`. Guide:
``docs/gates.md``.
"""

from trajflow.errors import GateFailed
from trajflow.gates.docs import report_to_json, write_data_docs
from trajflow.gates.iteration import gate_view, recheck_run
from trajflow.gates.report import POLICIES, ExpectationOutcome, GateReport
from trajflow.gates.runtime import TABLES
from trajflow.gates.settings import PARAMETER_NAMES, resolve_settings
from trajflow.gates.suite import DEFAULT_SUITE, SUITE_DIR, SuiteSpec, load_suite
from trajflow.gates.summary import QUARANTINE_ROWS, SUMMARY_METRICS, summarize
from trajflow.gates.validate import apply_quarantine, run_gate

__all__ = [
    "DEFAULT_SUITE",
    "PARAMETER_NAMES",
    "POLICIES",
    "QUARANTINE_ROWS",
    "SUITE_DIR",
    "SUMMARY_METRICS",
    "TABLES",
    "ExpectationOutcome",
    "GateFailed",
    "GateReport",
    "SuiteSpec",
    "apply_quarantine",
    "gate_view",
    "load_suite",
    "recheck_run",
    "report_to_json",
    "resolve_settings",
    "run_gate",
    "summarize",
    "write_data_docs",
]
