"""The tool sandbox: every tool call runs in its own short-lived worker process with limits.

Each call is a fresh Python interpreter (``python -m trajflow.envs.sandbox``) that imports only this
module and the tool: it shares no memory with the caller (no model, no torch, no Ray state; a
``fork`` of a multi-threaded policy worker would also be unsafe), and a call that hangs or crashes
takes down only its own process. The request goes in on stdin as JSON and the answer comes back as
JSON on a private pipe, so whatever the tool prints cannot be taken for its result. In the child,
before the tool is imported:

* ``RLIMIT_CPU`` (``Tool.cpu_time_s``) and ``RLIMIT_AS`` (``Tool.memory_mb``) are set;
* the network is cut by moving the process into a new, empty network namespace
  (``unshare(CLONE_NEWNET)``); that needs root (or ``CAP_SYS_ADMIN``) on Linux, and when it fails the
  call still runs, without network isolation, and :attr:`Sandbox.isolation` says why.

The parent waits ``Tool.timeout_s`` of wall-clock time and kills the child after that. Every
failure is returned as a :class:`ToolResult` whose ``error`` starts with its kind (``timeout:``,
``exception:``, ``memory:``, ``cpu:``, ``crashed:``, ``result:``, ``unknown tool:``, ``arguments:``,
``malformed:``): the episode shows it to the model and never stops for it.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from trajflow.envs.tools import Tool, check_arguments, import_callable

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from an assistant message.

    Attributes:
        name: the tool's name as written (``""`` when the call could not be parsed).
        arguments: the parsed arguments (``None`` when the call could not be parsed).
        raw: the call's text as the model wrote it.
        error: why the call could not be parsed (``"malformed: ..."``), or ``None``.
    """

    name: str
    arguments: Any
    raw: str
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call.

    Attributes:
        name: the tool's name as the model wrote it.
        arguments: the arguments as JSON text (the raw text when they did not parse).
        result: what the model is shown: the tool's output, cut to ``max_tool_response_length``
            characters, or ``"Error: <error>"``.
        error: ``None`` when the call succeeded, else ``"<kind>: <message>"`` (see the module doc).
        duration_s: wall-clock seconds of the call, process start included.
    """

    name: str
    arguments: str
    result: str
    error: str | None
    duration_s: float


def _drop_network() -> str:
    """Enter a new network namespace; returns ``"netns"`` or why not."""
    unshare = getattr(os, "unshare", None)
    try:
        if unshare is not None:
            unshare(CLONE_NEWNET)
        else:  # Python < 3.12
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        return "netns"
    except (OSError, AttributeError) as e:
        return f"no network isolation: unshare(CLONE_NEWNET) failed: {e}"


def _child(request: dict) -> tuple[str, str, str]:
    """Body of a call's process: limits, network cut, the call; returns ``(status, value, isolation)``."""
    net = _drop_network()
    cpu_s, memory_mb = int(request["cpu_s"]), int(request["memory_mb"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    try:
        value = import_callable(request["function"])(**request["arguments"], **request["options"])
        if not isinstance(value, str):
            return "error", f"result: the tool returned {type(value).__name__}, not a string", net
        return "ok", value, net
    except MemoryError:
        return "error", f"memory: the call ran out of its {memory_mb} MiB", net
    except BaseException as e:  # everything the tool raises is the model's to read
        return "error", f"exception: {type(e).__name__}: {e}", net


def _main() -> None:
    """Entry point of a call's process: request on stdin, answer on the fd named by ``argv[1]``."""
    import sys

    out = os.fdopen(int(sys.argv[1]), "w")
    request = json.loads(sys.stdin.read())
    try:
        status, value, net = _child(request)
        text = json.dumps([status, value, net])
    except MemoryError:
        text = json.dumps(["error", f"memory: the call ran out of its {request.get('memory_mb')} MiB", "?"])
    out.write(text)
    out.close()


def _probe() -> str:
    return "probe"


class Sandbox:
    """Runs tool calls in limited worker processes, up to ``workers`` at a time.

    Args:
        tools: the tools callable by name.
        max_response_chars: a result longer than this is cut to it (``max_tool_response_length``).
        workers: calls running at once, over every episode of the batch.
    """

    def __init__(self, tools: Sequence[Tool], max_response_chars: int = 256, workers: int = 4) -> None:
        self.tools = {t.name: t for t in tools}
        self.max_response_chars = int(max_response_chars)
        self.workers = int(workers)
        self._slots = threading.BoundedSemaphore(self.workers)
        self.isolation: str | None = None

    def _truncate(self, text: str) -> str:
        if len(text) <= self.max_response_chars:
            return text
        return text[:self.max_response_chars] + f"... [truncated {len(text) - self.max_response_chars} characters]"

    def _spawn(self, function: str, arguments: dict, options: dict, tool: Tool) -> tuple[str, str | None]:
        """``(output, error)`` of one call in its own process."""
        read_fd, write_fd = os.pipe()
        request = json.dumps({"function": function, "arguments": arguments, "options": options,
                              "cpu_s": tool.cpu_time_s, "memory_mb": tool.memory_mb})
        # The child imports what this process can: the same sys.path, whatever set it.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            proc = subprocess.Popen([sys.executable, "-m", "trajflow.envs.sandbox", str(write_fd)],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    pass_fds=(write_fd,), env=env, close_fds=True, start_new_session=True)
        finally:
            os.close(write_fd)
        with os.fdopen(read_fd, "r") as answer:
            try:
                proc.communicate(request.encode(), timeout=tool.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return "", f"timeout: the call took longer than {tool.timeout_s:g} s and was stopped"
            text = answer.read()
        if not text:
            code = proc.returncode
            if code is not None and code < 0 and -code == signal.SIGXCPU:
                return "", f"cpu: the call used more than {tool.cpu_time_s} s of CPU time"
            if code is not None and code < 0 and -code == signal.SIGKILL:
                return "", f"crashed: killed (SIGKILL), likely out of its {tool.memory_mb} MiB"
            return "", f"crashed: the call's process exited with code {code}"
        status, value, net = json.loads(text)
        if self.isolation is None:
            self.isolation = net
            if net != "netns":
                log.warning("tool sandbox: %s; tools run with CPU, memory and time limits only", net)
        return (value, None) if status == "ok" else ("", value)

    def call(self, call: ToolCall) -> ToolResult:
        """Run one parsed call; every failure becomes the result's ``error`` (never raised)."""
        t0 = time.perf_counter()
        args_text = call.raw if call.arguments is None else json.dumps(call.arguments, ensure_ascii=False)
        error: str | None = call.error
        out = ""
        if error is None:
            tool = self.tools.get(call.name)
            if tool is None:
                error = f"unknown tool: {call.name!r}; available: {', '.join(sorted(self.tools))}"
            else:
                why = check_arguments(tool, call.arguments)
                if why is not None:
                    error = f"arguments: {why}"
                else:
                    with self._slots:
                        out, error = self._spawn(tool.function, call.arguments, tool.options, tool)
        result = self._truncate(out) if error is None else self._truncate(f"Error: {error}")
        return ToolResult(name=call.name, arguments=args_text, result=result, error=error,
                          duration_s=time.perf_counter() - t0)

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run ``calls`` concurrently (at most ``workers`` at once); results in the calls' order."""
        if not calls:
            return []
        if len(calls) == 1:
            return [self.call(calls[0])]
        with ThreadPoolExecutor(max_workers=min(len(calls), self.workers)) as pool:
            return list(pool.map(self.call, calls))

    def probe_isolation(self) -> str:
        """Run an empty call and return the isolation it had (``"netns"`` or why there was none)."""
        probe = Tool(name="probe", description="", parameters={"type": "object"},
                     function="trajflow.envs.sandbox:_probe", timeout_s=30.0)
        self._spawn(probe.function, {}, {}, probe)
        return self.isolation or "unknown"


if __name__ == "__main__":
    _main()
