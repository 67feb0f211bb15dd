"""The ``python`` tool: runs a snippet and returns what it printed. Only ever called inside the sandbox
(:mod:`trajflow.envs.sandbox`), whose process limits are what make running model-written code
acceptable."""

from __future__ import annotations

import contextlib
import io
import traceback


def run_python(code: str) -> str:
    """Execute ``code`` in a fresh namespace and return its standard output (and a traceback's last
    line if it raised), or ``"(no output)"``.

    Raises:
        ValueError: ``code`` is not a string.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string, got {type(code).__name__}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(code, "<tool>", "exec"), {"__name__": "__tool__"})  # noqa: S102 - sandboxed by design
        except BaseException as e:  # the model reads its own error, as in a REPL
            if isinstance(e, MemoryError):
                raise
            print(traceback.format_exception_only(type(e), e)[-1].rstrip())
    return out.getvalue() or "(no output)"
