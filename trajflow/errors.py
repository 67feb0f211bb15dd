"""Every error trajflow raises on purpose, under one base class the CLI catches.

A leaf module: it imports nothing from trajflow, so any layer may raise these without an import
cycle. Each class keeps the builtin it has always been (``ValueError`` for bad input,
``RuntimeError`` for a store or gate failure), so ``except ValueError`` callers keep working.
"""

from __future__ import annotations


class TrajflowError(Exception):
    """Base of the errors trajflow raises for bad input or a refused operation (one-line message)."""


class ConfigError(TrajflowError, ValueError):
    """A config problem, explained in one line (key path, bad value, what is allowed)."""


class DeviceError(ConfigError):
    """A requested device (``trainer.device``, a vLLM engine, a GPU pool) is not available here."""


class DataError(TrajflowError, ValueError):
    """A dataset spec or a data row is invalid. The message names the file, row/key and what was expected."""


class DynamicSamplingError(DataError):
    """Dynamic sampling found no group with reward variance within its generation-batch budget: the data
    (or the scorer) gives the policy no learning signal."""


class ModelLoadError(TrajflowError, ValueError):
    """``model.path`` names nothing loadable; the message says what was looked for."""


class BatchError(TrajflowError, ValueError):
    """Stage tables that do not line up (missing sample ids, missing columns)."""


class StoreError(TrajflowError, RuntimeError):
    """A stored file is missing, truncated, or does not match its manifest."""


class ReplayError(StoreError):
    """A replay that cannot run: unknown run or stage, an iteration or checkpoint that is not stored."""


class RunExistsError(TrajflowError, ValueError):
    """A new run would overwrite an existing run folder."""


class AuditError(TrajflowError, ValueError):
    """A bad audit request: unknown run, no audit table, a ``where`` clause that is not valid SQL."""


class CompareError(TrajflowError, ValueError):
    """Bad input to ``trajflow compare`` (unknown or ambiguous run, unknown metric, no store)."""


class DashboardError(TrajflowError, ValueError):
    """Bad input to the dashboard (missing store, unknown run)."""


class DeployError(TrajflowError, ValueError):
    """A deployment definition is invalid or the Prefect server cannot be used (one line)."""


class NonFiniteError(TrajflowError, RuntimeError):
    """Training produced non-finite numbers it cannot recover from (gradients that stay NaN/inf, or
    non-finite weights that must not be exported); the message says what and what to change."""


class GateFailed(TrajflowError, RuntimeError):
    """A ``fail``-policy expectation of a reward gate failed; the message names each one, its observed
    value and rows. The iteration is marked ``gated``; nothing written before it is removed."""


class StageTimeoutError(TrajflowError, TimeoutError):
    """A stage did not finish within its time limit (``trainer.stage_timeouts``); the message names
    the stage, the limit and the key. A ``TimeoutError``, so a retry still follows."""
