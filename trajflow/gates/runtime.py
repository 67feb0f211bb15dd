"""The process-wide Great Expectations runtime: one ephemeral context, its data assets, cached suites.

Great Expectations is imported on first use (it costs ~5 s); later gate runs reuse the context.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from typing import Any

#: Tables an expectation can run on (``meta.table``).
TABLES = ("samples", "summary")


class GxRuntime:
    """The process-wide ephemeral GX context, its data assets and cached suites."""

    def __init__(self) -> None:
        os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
        t0 = time.perf_counter()
        import great_expectations as gx
        from great_expectations.data_context.types.base import ProgressBarsConfig

        self.import_s = time.perf_counter() - t0
        # GX announces its ephemeral docs folder at INFO on every start: not a line for the console
        # (set after the import, which configures GX's loggers).
        for name in ("great_expectations", "great_expectations.data_context.types.base"):
            logging.getLogger(name).setLevel(logging.WARNING)
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

    def suite(self, spec: Any, table: str, skip: frozenset[str]) -> Any:
        """The GX ExpectationSuite for ``table`` of ``spec`` (a :class:`trajflow.gates.suite.SuiteSpec`,
        which imports this module) without the ``skip`` expectations (cached)."""
        key = (spec.path, id(spec), table, skip)
        if key not in self.suites:
            from great_expectations.expectations.expectation_configuration import (
                ExpectationConfiguration)

            exps = [ExpectationConfiguration(**copy.deepcopy(e.config)).to_domain_obj()
                    for e in spec.entries if e.table == table and e.name not in skip]
            self.suites[key] = self.gx.ExpectationSuite(name=f"{spec.name}.{table}",
                                                        expectations=exps)
        return self.suites[key]


_RUNTIME: GxRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def gx_runtime() -> GxRuntime:
    """The process-wide GX runtime, started on first use (imports great_expectations)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = GxRuntime()
        return _RUNTIME
