"""A gate report as strict JSON, and as GX's HTML Data Docs."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from trajflow.gates.report import GateReport
from trajflow.gates.runtime import gx_runtime


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN/inf floats as "NaN"/"Infinity"/"-Infinity", inside dicts and lists too."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "NaN"
        if math.isinf(obj):
            return "Infinity" if obj > 0 else "-Infinity"
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def to_py(v: Any) -> Any:
    """numpy scalars -> Python scalars (GX returns e.g. np.float32 observed values)."""
    if hasattr(v, "item") and callable(v.item) and not isinstance(v, (list, dict, str)):
        try:
            return v.item()
        except (ValueError, TypeError):
            return v
    return v


def report_to_json(report: GateReport) -> dict[str, Any]:
    """A strict-JSON-safe dict of the report (for the run store, MLflow ``log_dict``, audits).

    Returns:
        ``success``, ``iteration``, ``rows``, ``suite_path``, ``elapsed_s``, ``score_mean``,
        ``summary``, ``failure_message``, ``results`` (one dict per expectation),
        ``quarantined_sample_ids`` (sorted), ``quarantined_reason``, ``metrics``, ``gx_result``
        (GX's validation results per table). NaN/inf floats become "NaN"/"Infinity"/"-Infinity".
    """
    return json_safe({
        "success": report.success,
        "iteration": report.iteration,
        "rows": report.rows,
        "suite_path": report.suite_path,
        "elapsed_s": report.elapsed_s,
        "score_mean": report.score_mean,
        "summary": report.summary,
        "failure_message": report.failure_message(),
        "results": [{**dataclasses.asdict(r), "observed_value": to_py(r.observed_value)}
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

    rt = gx_runtime()
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
