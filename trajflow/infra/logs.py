"""Where the driver's output goes: the console shows the run, a file keeps every library's log.

The console of ``trajflow train``/``resume``/``replay`` shows only what trajflow prints itself: the
run folder, one tqdm line while an iteration runs and one ``step:N - key:value`` line per finished
iteration (:mod:`trajflow.run.progress`), and one-line errors. Everything else a library logs goes
to ``<run_dir>/logs/driver.log``; ``-v/--verbose`` puts it back on the console as well (the file
still gets it). Records logged before the run folder exists (Prefect's temporary server, preflight)
are held in memory and written to the file when the folder is attached; if a run never gets a
folder (bad input), they are dropped: the CLI's one-line error is all the user needs then.

Where each library's output goes, and why this way:

- **Prefect** configures logging on first use of its API: a console handler on the root logger
  (every ``prefect.*`` record, its flow- and task-run lines included, propagates there) plus API
  handlers on ``prefect.flow_runs``/``prefect.task_runs``. :func:`configure_driver` applies that
  config first, then replaces the root's console handler by the file handler; the API handlers are kept, so
  a Prefect server still shows the run's logs. ``prefect._internal``, ``uvicorn`` and ``fastapi``
  have their own stderr handlers and do not propagate; they are adopted (below).
- **Ray** installs its own stderr handler on the ``ray`` logger (at ``import ray``) and does not
  propagate: adopted. Ray workers' stdout/stderr reach the driver only with ``log_to_driver``,
  which :func:`ray_log_to_driver` turns off unless verbose: worker output then stays in the Ray
  session's log folder (``<session dir>/logs/worker-*.out``; the path is in ``driver.log``).
- **MLflow** installs a stderr handler on ``mlflow`` at import unless ``MLFLOW_CONFIGURE_LOGGING``
  is false, which :func:`configure_driver` sets; its logger then propagates to the root at INFO.
- **transformers** adds a stderr handler to ``transformers`` on first use and stops propagation:
  adopted once it is imported.
- **LanceDB**, **Great Expectations** and everything else log through the root logger, or raise
  Python ``warnings`` (LanceDB's fork warning), which ``logging.captureWarnings`` turns into
  ``py.warnings`` records: both reach the file.
- **trajflow**'s own loggers (``trajflow.*``, ``flows.*``) log at INFO to the file.

"Adopted" means: the logger's stream handlers are removed and it propagates to the root, so its
records go wherever the root's go. Libraries imported after :func:`configure_driver` are adopted
by :func:`adopt_library_loggers`, which runs again when the run folder is attached and after Ray
starts.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from pathlib import Path

#: The driver's log file, relative to the run folder.
LOG_FILE = Path("logs") / "driver.log"
#: Records kept before the run folder exists; a run that never starts needs none of them.
BUFFER_RECORDS = 20_000
#: trajflow's own loggers: INFO goes to the file (the root stays at WARNING for other libraries).
OWN_LOGGERS = ("trajflow", "flows")
#: Library loggers that log at INFO to the file (Prefect's flow- and task-run lines, MLflow's).
INFO_LOGGERS = ("prefect", "mlflow")

_FORMAT = "%(asctime)s.%(msecs)03d | %(levelname)-7s | %(name)s - %(message)s"
_DATEFMT = "%Y-%m-%d %H:%M:%S"

_state: dict = {"configured": False, "verbose": False, "handler": None, "console": None}


class _RunLogFile(logging.FileHandler):
    """The log file itself. When it cannot be written (the store's disk is full) it drops records
    quietly: logging's default prints a traceback per record to stderr, dozens around the one line
    that says the disk is full (trajflow.store reports the failed write that matters)."""

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self.failed = True

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the last flush of what the full disk refused
            self.failed = True


class RunLogHandler(logging.Handler):
    """Writes records to ``<run_dir>/logs/driver.log``; before a folder is attached, keeps them in
    memory (the newest :data:`BUFFER_RECORDS`) and writes them when it is."""

    #: Filters that hide expected errors from the console leave this handler alone (see
    #: ``trajflow.flows.reporting.quiet_expected_errors``): the file keeps the whole story.
    keeps_everything = True

    def __init__(self, prefect: bool = True) -> None:
        super().__init__(level=logging.NOTSET)
        self.prefect_format = False
        self.use_formatter(prefect)
        self.buffer: deque[logging.LogRecord] = deque(maxlen=BUFFER_RECORDS)
        self.file: logging.FileHandler | None = None
        self.path: Path | None = None

    def use_formatter(self, prefect: bool) -> None:
        """Format with Prefect's formatter (it names a record's flow or task run), else a plain one
        with the same layout (before Prefect is imported)."""
        fmt = _formatter() if prefect else logging.Formatter(_FORMAT, datefmt=_DATEFMT)
        self.prefect_format = prefect
        self.setFormatter(fmt)
        if getattr(self, "file", None) is not None:
            self.file.setFormatter(fmt)

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record`` to the file, or keep it until a run folder is attached."""
        if self.file is None:
            self.buffer.append(record)
        else:
            self.file.emit(record)

    def attach(self, run_dir: str | os.PathLike) -> Path:
        """Write to ``<run_dir>/logs/driver.log`` from now on (appending: a resumed run adds to its
        file), starting with the records held so far; returns the file's path."""
        path = Path(run_dir) / LOG_FILE
        self.acquire()
        try:
            if self.path == path:
                return path
            path.parent.mkdir(parents=True, exist_ok=True)
            new = _RunLogFile(path, mode="a", encoding="utf-8")
            new.setFormatter(self.formatter)
            old, self.file, self.path = self.file, new, path
            while self.buffer:
                new.emit(self.buffer.popleft())
        finally:
            self.release()
        if old is not None:
            old.close()
        return path

    def close(self) -> None:
        """Close the file (records held in memory are dropped)."""
        self.acquire()
        try:
            if self.file is not None:
                self.file.close()
            self.buffer.clear()
        finally:
            self.release()
        super().close()


def _formatter() -> logging.Formatter:
    try:  # Prefect's formatter names the flow or task run a record belongs to
        from prefect.logging.formatters import PrefectFormatter

        return PrefectFormatter(
            format=_FORMAT, datefmt=_DATEFMT,
            flow_run_fmt="%(asctime)s.%(msecs)03d | %(levelname)-7s | Flow run %(flow_run_name)r - %(message)s",
            task_run_fmt="%(asctime)s.%(msecs)03d | %(levelname)-7s | Task run %(task_run_name)r - %(message)s")
    except ImportError:
        return logging.Formatter(_FORMAT, datefmt=_DATEFMT)


def _is_console(handler: logging.Handler) -> bool:
    """A handler that writes to the process's stdout or stderr (not a file, not pytest's capture)."""
    if isinstance(handler, (logging.FileHandler, RunLogHandler)) or not isinstance(handler, logging.StreamHandler):
        return False
    return getattr(handler, "stream", None) in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


def adopt_library_loggers() -> None:
    """Make every logger that writes to the console with its own handler and does not propagate
    (Ray, transformers, Prefect's internal and server loggers, ...) propagate to the root instead,
    so that its records go where the root's go (the file; the console too when verbose).

    A no-op before :func:`configure_driver`.
    """
    if not _state["configured"]:
        return
    if "transformers" in sys.modules:
        try:  # its own switch, so that transformers does not add its handler back on a later call
            from transformers.utils import logging as hf_logging

            hf_logging.disable_default_handler()
            hf_logging.enable_propagation()
        except Exception:  # an older or partial transformers: the generic sweep below still runs
            pass
    for logger in list(logging.root.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger) or logger.propagate:
            continue
        console = [h for h in logger.handlers if _is_console(h)]
        if not console:
            continue
        for h in console:
            logger.removeHandler(h)
        logger.propagate = True


def configure_driver(verbose: bool = False, prefect: bool = True) -> None:
    """Send library logs and Python warnings to the run's log file; on the console too if ``verbose``.

    Call once per process, before the run starts (the CLI does, for the commands that run flows).
    Prefect's logging config is applied here first, since this goes on top of it. Calling it again
    adds nothing; without ``verbose`` it removes console handlers that appeared since.

    Args:
        verbose: library logs on the console too.
        prefect: apply Prefect's logging config first. The CLI passes False for the checks before a
            flow (importing Prefect costs seconds, a bad config key must not) and calls again with
            True just before the flow's module is imported.
    """
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    if prefect:
        # Prefect's logging config is applied on first use of its API, not by ``import prefect``; apply
        # it now, so that it is there to be changed (a later application only adjusts levels).
        from prefect.logging.configuration import ensure_logging_setup

        ensure_logging_setup()

    root = logging.getLogger()
    handler = _state["handler"]
    if handler is None:
        handler = RunLogHandler(prefect)
        _state["handler"] = handler
        root.addHandler(handler)
    elif prefect and not handler.prefect_format:
        handler.use_formatter(True)
    _state["configured"] = True
    _state["verbose"] = bool(verbose)
    if not verbose:
        for h in [h for h in root.handlers if _is_console(h)]:
            root.removeHandler(h)
    elif not any(_is_console(h) for h in root.handlers) or _state["console"] in root.handlers:
        # Prefect adds its console handler to the root only when the root has no handler with a
        # formatter, and ours (the file's) is there first: the console that -v asks for is ours to add.
        console = _state["console"]
        if console is None:
            console = _state["console"] = logging.StreamHandler(sys.stderr)
            root.addHandler(console)
        console.setFormatter(handler.formatter)
    for name in OWN_LOGGERS + INFO_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
    logging.captureWarnings(True)
    adopt_library_loggers()


def attach_run_dir(run_dir: str | os.PathLike) -> Path | None:
    """Start writing the log file of the run in ``run_dir`` (flushing what was logged so far).

    Returns the file's path, or None when :func:`configure_driver` was not called (the Python API
    and Prefect deployments keep the logging their process set up).
    """
    handler = _state["handler"]
    if handler is None:
        return None
    adopt_library_loggers()
    return handler.attach(run_dir)


def verbose() -> bool:
    """Whether library logs are shown on the console (``-v``, or trajflow's logging not configured)."""
    return _state["verbose"] or not _state["configured"]


def ray_log_to_driver() -> bool:
    """``log_to_driver`` for a Ray this process starts: worker output on the console only when verbose."""
    return verbose()
