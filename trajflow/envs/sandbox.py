"""The tool sandbox: every tool call runs in its own short-lived, confined worker process.

Each call is a fresh Python interpreter (``python -m trajflow.envs.sandbox_worker``) that imports only
trajflow's sandbox modules and the tool: it shares no memory with the caller (no model, no torch, no
Ray state; a ``fork`` of a multi-threaded policy worker would also be unsafe). That interpreter is a
trusted *supervisor*: it confines the tool in a process of its own (new user, network, PID and mount
namespaces, uid ``nobody``, a private root, a memory cgroup, ``RLIMIT_CPU/AS/NPROC/FSIZE``, an
environment allow-list, no capabilities, ``no_new_privs``, a seccomp deny-list; see :mod:`trajflow.envs.sandbox_worker`),
reads the tool's framed answer with a deadline and a byte cap, kills every process of the call and
writes one validated JSON answer on its stdout, which no tool process holds. This process reads that
answer with a deadline and a cap of its own and validates it again, so nothing a tool writes, prints
or forges can raise here.

Where the kernel refuses part of the isolation (a container without user namespaces, say), the
sandbox says what is missing in :attr:`Sandbox.missing` and refuses tools (:class:`SandboxUnavailable`)
unless ``allow_weaker`` is set (``rollout.multi_turn.allow_weaker_sandbox``). Every failure of a call
is returned as a :class:`ToolResult` whose ``error`` starts with its kind (``timeout:``,
``exception:``, ``memory:``, ``cpu:``, ``crashed:``, ``result:``, ``unknown tool:``, ``arguments:``,
``malformed:``): the episode shows it to the model and never stops for it.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from trajflow.envs.sandbox_worker import ENV_ALLOWED, remove_leftovers
from trajflow.envs.tools import Tool, check_arguments

log = logging.getLogger(__name__)

#: seconds the caller waits for the supervisor beyond the tool's own timeout
SUPERVISOR_GRACE_S = 10.0


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


class SandboxUnavailable(RuntimeError):
    """The kernel refused part of the isolation and the user did not allow a weaker sandbox."""


#: what the sandbox's supervisor process may see of the caller's environment (no secrets)
SUPERVISOR_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")


def _probe() -> str:
    return "probe"


def describe(isolation: dict, missing: list[str]) -> str:
    """One line saying what a call was isolated by, e.g. ``"user, net, pid, mount namespaces; memory: cgroup;
    seccomp: yes"``."""
    spaces = [k for k in ("user", "net", "pid", "mount") if k in isolation and "no user" not in str(isolation[k])]
    line = (f"{', '.join(spaces) or 'no'} namespaces; memory: {isolation.get('memory', 'per process')}; "
            f"seccomp: {'yes' if isolation.get('seccomp', 'none') != 'none' else 'no'}")
    return line + (f"; missing: {'; '.join(missing)}" if missing else "")


class Sandbox:
    """Runs tool calls in confined worker processes, up to ``workers`` at a time.

    Args:
        tools: the tools callable by name.
        max_response_chars: a result longer than this is cut to it (``max_tool_response_length``).
        workers: calls running at once, over every episode of the batch.
        allow_weaker: run tools even where the kernel refused part of the isolation
            (``rollout.multi_turn.allow_weaker_sandbox``); otherwise the first call raises
            :class:`SandboxUnavailable`.

    Attributes:
        isolation: one line saying what the calls are isolated by (:func:`describe`), ``None`` before
            the first call.
        missing: what the kernel refused (``"net: unshare(CLONE_NEWNET): Operation not permitted"``, ...).
    """

    def __init__(self, tools: Sequence[Tool], max_response_chars: int = 256, workers: int = 4,
                 allow_weaker: bool = False) -> None:
        self.tools = {t.name: t for t in tools}
        self.max_response_chars = int(max_response_chars)
        self.workers = int(workers)
        self.allow_weaker = bool(allow_weaker)
        self._slots = threading.BoundedSemaphore(self.workers)
        self._probe_lock = threading.Lock()
        self.isolation: str | None = None
        self.missing: list[str] = []
        # The supervisor imports what this process can (the same sys.path); nothing else of the
        # environment is passed on, and the tool gets even less (sandbox_worker.ENV_ALLOWED).
        pythonpath = os.pathsep.join(p for p in sys.path if p)
        self._supervisor_env = {k: os.environ[k] for k in SUPERVISOR_ENV if k in os.environ}
        self._supervisor_env["PYTHONPATH"] = pythonpath
        self._tool_env = {k: os.environ[k] for k in ENV_ALLOWED if k in os.environ}
        self._tool_env.update(PYTHONPATH=pythonpath, PATH=os.pathsep.join(
            dict.fromkeys([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"])))

    def _truncate(self, text: str) -> str:
        if len(text) <= self.max_response_chars:
            return text
        return text[:self.max_response_chars] + f"... [truncated {len(text) - self.max_response_chars} characters]"

    def _spawn(self, function: str, arguments: dict, options: dict, tool: Tool) -> tuple[str, str | None]:
        """``(output, error)`` of one call, run by a supervisor process (:mod:`trajflow.envs.sandbox_worker`)."""
        request = json.dumps({
            "function": function, "arguments": arguments, "options": options, "timeout_s": tool.timeout_s,
            "cpu_s": tool.cpu_time_s, "memory_mb": tool.memory_mb, "max_processes": tool.max_processes,
            "file_size": tool.file_size_mb * 1024 * 1024, "max_chars": self.max_response_chars,
            "env": self._tool_env}).encode()
        deadline = time.monotonic() + tool.timeout_s + SUPERVISOR_GRACE_S
        proc = subprocess.Popen([sys.executable, "-m", "trajflow.envs.sandbox_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self._supervisor_env,
                                close_fds=True, start_new_session=True)
        why: str | None = "did not start"
        try:
            try:
                proc.stdin.write(request)
                proc.stdin.close()
            except OSError:
                pass  # it died first: its exit says why below
            text, why = _read_capped(proc.stdout.fileno(), deadline, 12 * self.max_response_chars + 65536)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the supervisor's group; the tool's processes die with it
            except OSError:
                pass
            proc.wait()
            proc.stdout.close()
            if why is not None or proc.returncode != 0:  # killed before it could clean up after itself
                remove_leftovers(proc.pid)
        if why is not None:
            return "", f"crashed: the sandbox's supervisor {why}"
        try:
            answer = json.loads(text)
            status, value, length = answer["status"], answer["value"], answer["length"]
            isolation, missing = answer["isolation"], answer["missing"]
            if (status not in ("ok", "error") or not isinstance(value, str) or type(length) is not int
                    or not isinstance(isolation, dict) or not isinstance(missing, list)):
                raise ValueError(status)
        except (ValueError, KeyError, TypeError):
            return "", "crashed: the sandbox's supervisor wrote a malformed answer"
        if isolation and self.isolation is None:
            self.isolation, self.missing = describe(isolation, missing), [str(m) for m in missing]
        if status == "error":
            return "", value
        value = value[:self.max_response_chars]
        if length > len(value):
            value += f"... [truncated {length - len(value)} characters]"
        return value, None

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
                    self.check_isolation()
                    with self._slots:
                        out, error = self._spawn(tool.function, call.arguments, tool.options, tool)
        result = out if error is None else self._truncate(f"Error: {error}")
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
        """Run an empty call (once) and return the isolation line it had (:func:`describe`)."""
        with self._probe_lock:
            if self.isolation is None:
                probe = Tool(name="probe", description="", parameters={"type": "object"},
                             function="trajflow.envs.sandbox:_probe", timeout_s=30.0)
                _, error = self._spawn(probe.function, {}, {}, probe)
                if self.isolation is None:
                    raise SandboxUnavailable(f"tool sandbox: the isolation probe failed: {error}")
                if self.missing:
                    log.warning("tool sandbox: weaker isolation (%s)%s", self.isolation,
                                "" if self.allow_weaker else "; tools are refused unless "
                                "rollout.multi_turn.allow_weaker_sandbox=true")
        return self.isolation

    def check_isolation(self) -> None:
        """Raise :class:`SandboxUnavailable` when the kernel refused part of the isolation and a weaker
        sandbox is not allowed (probes once)."""
        self.probe_isolation()
        if self.missing and not self.allow_weaker:
            raise SandboxUnavailable(
                f"tool sandbox: the kernel refused part of the isolation ({'; '.join(self.missing)}); "
                "set rollout.multi_turn.allow_weaker_sandbox=true to run tools without it")


def _read_capped(fd: int, deadline: float, cap: int) -> tuple[bytes, str | None]:
    """What ``fd`` gives until EOF, or ``(partial, why)`` past ``deadline`` or ``cap`` bytes."""
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return buf, "did not answer in time"
        chunk = os.read(fd, 65536)
        if not chunk:
            return buf, None
        buf += chunk
        if len(buf) > cap:
            return buf, f"answered more than {cap} bytes"


_RECORDS: dict[bool, dict] = {}


def tool_sandbox_record(multi_turn: Any) -> dict:
    """Probe the sandbox on this machine (once per process) and say what it isolates, for the run's
    ``run.json`` (``tool_sandbox``): ``{"isolation": line, "missing": [...], "allow_weaker": bool}``.

    Args:
        multi_turn: the ``rollout.multi_turn`` section (``allow_weaker_sandbox`` is read).

    Raises:
        trajflow.errors.ConfigError: the kernel refused part of the isolation and
            ``rollout.multi_turn.allow_weaker_sandbox`` is false (one line naming what is missing).
    """
    from trajflow.errors import ConfigError

    allow = bool(getattr(multi_turn, "allow_weaker_sandbox", False))
    if allow not in _RECORDS:
        sb = Sandbox([], allow_weaker=allow)
        try:
            sb.check_isolation()
        except SandboxUnavailable as e:
            raise ConfigError(f"rollout.multi_turn.enable=true: {e}") from None
        _RECORDS[allow] = {"isolation": sb.isolation, "missing": list(sb.missing), "allow_weaker": allow}
    return dict(_RECORDS[allow])
