"""Tools in the sandbox: the calculator's arithmetic, the tool config's errors, and every failure mode
of a call in a real worker process (timeout, exception, memory, CPU, network, bad result)."""

from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time
import uuid

import pytest

from trajflow.envs.calculator import evaluate
from trajflow.envs.registry import EnvContext, make_environment
from trajflow.envs.sandbox import Sandbox, SandboxUnavailable, ToolCall
from trajflow.envs.tool_format import parse_tool_calls
from trajflow.envs.tools import BUILTIN_TOOLS, Tool, load_tool_config
from trajflow.errors import ConfigError


def _sandbox(tools, **kw) -> Sandbox:
    """A sandbox for tests of behaviour, not isolation: runs where the kernel refuses a namespace too."""
    return Sandbox(tools, allow_weaker=True, **kw)


def _tool(name: str, fn: str, props: dict, **kw) -> Tool:
    return Tool(name=name, description="", function=f"tests.sandbox_tools:{fn}",
                parameters={"type": "object", "properties": props}, **kw)


# ----------------------------------------------------------------------------------- calculator

@pytest.mark.parametrize("expr, value", [
    ("1234 * 5678", "7006652"),          # 1234 * 5678 = 7,006,652
    ("4821 + 903 + 7710 + 256", "13690"),
    ("-(3 - 10) * 2", "14"),
    ("2 ** 10", "1024"),
    ("7 // 2 + 7 % 2", "4"),
    ("6 / 3", "2"),
    ("1 / 4", "0.25"),
])
def test_calculator_values(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "not allowed"),
    ("x + 1", "not allowed"),
    ("2 ** 100000", "exponent"),
    ("1 / 0", "division by zero"),
    ("3 ^ 2", "not allowed"),
    ("1 +", "cannot parse"),
    ("9" * 300, "characters long"),
])
def test_calculator_refuses(expr, why):
    with pytest.raises(ValueError, match=why):
        evaluate(expr)


# ----------------------------------------------------------------------------------- format

def test_hermes_parsing_keeps_malformed_calls():
    text = ('a <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> b '
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2\\"}"}</tool_call>'
            '<tool_call>not json</tool_call><tool_call>{"name": "x"')
    calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["calculator", "calculator", "", ""]
    assert calls[0].arguments == {"expression": "1+1"} and calls[1].arguments == {"expression": "2"}
    assert calls[2].error.startswith("malformed: the call is not valid JSON")
    assert calls[3].error.startswith("malformed: <tool_call> is not closed")
    assert parse_tool_calls("Answer: 4") == []


# ----------------------------------------------------------------------------------- tool config

def test_tool_config_builtin_and_custom(tmp_path):
    p = tmp_path / "tools.yaml"
    p.write_text("tools:\n  - name: calculator\n    options: {max_exponent: 8}\n    timeout_s: 2\n"
                 "  - name: echo\n    function: tests.sandbox_tools:echo\n    description: echo\n"
                 "    parameters: {type: object, properties: {text: {type: string}}, required: [text]}\n"
                 "    options: {prefix: '>'}\n")
    calc, echo = load_tool_config(p)
    assert calc.function == BUILTIN_TOOLS["calculator"].function and calc.options == {"max_exponent": 8}
    assert calc.timeout_s == 2 and echo.schema()["function"]["name"] == "echo"
    sb = _sandbox([calc, echo])
    res = sb.run([ToolCall("echo", {"text": "hi"}, ""), ToolCall("calculator", {"expression": "2**9"}, "")])
    assert res[0].result == ">hi" and res[0].error is None
    assert res[1].error.startswith("exception: ValueError: exponent 9 is larger than 8")


@pytest.mark.parametrize("body, field", [
    ("tools:\n  - name: nope\n", "tools[0] (nope): field 'function' is required"),
    ("tools:\n  - name: calculator\n    timeout: 3\n", "tools[0] (calculator): unknown field 'timeout'"),
    ("tools:\n  - name: calculator\n    options: {expression: '1'}\n",
     "tools[0] (calculator): field 'options' sets 'expression'"),
    ("tools:\n  - name: calculator\n  - name: f\n    function: tests.sandbox_tools:missing\n"
     "    parameters: {type: object}\n", "tools[1] (f): field 'function': cannot import"),
    ("tools:\n  - name: calculator\n    memory_mb: -1\n", "tools[0] (calculator): field 'memory_mb'=-1"),
    ("tools: []\n", "non-empty list 'tools'"),
])
def test_tool_config_errors_name_file_tool_and_field(tmp_path, body, field):
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(ConfigError) as e:
        load_tool_config(p)
    assert str(p) in str(e.value) and field in str(e.value)


# ----------------------------------------------------------------------------------- sandbox

def test_timeout_is_an_error_result_and_is_enforced():
    sb = _sandbox([_tool("sleepy", "sleepy", {"seconds": {"type": "number"}}, timeout_s=1.0)])
    t0 = time.perf_counter()
    r = sb.call(ToolCall("sleepy", {"seconds": 30}, ""))
    assert time.perf_counter() - t0 < 10  # killed at ~1 s, not after 30
    assert r.error.startswith("timeout:") and r.result.startswith("Error: timeout:")
    assert sb.call(ToolCall("sleepy", {"seconds": 0}, "")).result == "woke up"


def test_exception_unknown_tool_bad_arguments_and_non_string():
    sb = _sandbox([_tool("raises", "raises", {"message": {"type": "string"}}),
                  _tool("nonstr", "not_a_string", {}), BUILTIN_TOOLS["calculator"]])
    r = sb.run([ToolCall("raises", {"message": "boom"}, ""), ToolCall("nonstr", {}, ""),
                ToolCall("search", {}, ""), ToolCall("calculator", {"expr": "1"}, ""),
                ToolCall("calculator", {"expression": 5}, "")])
    assert r[0].error == "exception: RuntimeError: boom"
    assert r[1].error == "result: the tool returned int, not a string"
    assert r[2].error.startswith("unknown tool: 'search'")
    assert r[3].error == "arguments: missing required argument 'expression'"
    assert r[4].error.startswith("arguments: argument 'expression' must be a JSON string")


def test_memory_limit():
    sb = _sandbox([_tool("alloc", "allocate", {"megabytes": {"type": "integer"}}, memory_mb=256)])
    assert sb.call(ToolCall("alloc", {"megabytes": 16}, "")).result == "allocated 16 MiB"
    r = sb.call(ToolCall("alloc", {"megabytes": 1024}, ""))
    assert r.error.startswith("memory:")


def test_cpu_time_limit():
    sb = _sandbox([_tool("spin", "spin", {}, cpu_time_s=1, timeout_s=20.0)])
    r = sb.call(ToolCall("spin", {}, ""))
    assert r.error.startswith("cpu:"), r.error


def test_no_network_inside_the_sandbox():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve():
        conn, _ = server.accept()
        conn.sendall(b"hello")
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    from tests.sandbox_tools import connect

    assert connect(port) == "hello"  # reachable from this process
    sb = _strict([_tool("connect", "connect", {"port": {"type": "integer"}})])
    r = sb.call(ToolCall("connect", {"port": port}, ""))
    assert r.error is not None and r.error.startswith("exception:") and "Error" in r.error
    assert sb.isolation.startswith("user, net, pid, mount namespaces")
    server.close()


def test_output_truncated_and_calls_run_concurrently():
    sb = _sandbox([_tool("sleepy", "sleepy", {"seconds": {"type": "number"}}), _tool("echo", "echo", {})],
                 max_response_chars=5, workers=4)
    assert sb.call(ToolCall("echo", {"text": "abcdefghij"}, "")).result.startswith("abcde... [truncated 5")
    t0 = time.perf_counter()
    r = sb.run([ToolCall("sleepy", {"seconds": 1.0}, "")] * 4)
    wall = time.perf_counter() - t0
    assert all(x.result == "woke ... [truncated 2 characters]" for x in r)  # "woke up" cut to 5 characters
    assert wall < 3.0, wall  # four 1 s calls, at once: well under 4 s


def test_tool_environment_turns_calls_into_tool_messages():
    env = make_environment("tool_calculator", EnvContext([], _sandbox([BUILTIN_TOOLS["calculator"]])))
    msgs = env.reset({"messages": [{"role": "user", "content": "Calculate 1234 * 5678."}]})
    assert msgs[0]["role"] == "system" and "<tool_call>" in msgs[0]["content"]
    # A worked episode before the problem: call, tool answer (right: 4021 - 387 + 1290 - 56 = 4868), final line.
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert msgs[3]["content"] == "4868" and msgs[4]["content"] == "Answer: 4868"
    assert msgs[-1]["content"] == "Calculate 1234 * 5678."
    step = env.step({"role": "assistant", "content":
                     '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>'})
    assert not step.done and step.observations == [{"role": "tool", "content": "7006652"}]
    assert env.step({"role": "assistant", "content": "Answer: 7006652"}).done


# ----------------------------------------------------------------------------------- hostile tools
# Each attack below worked against the sandbox of 27a1d0f, run as root (issue 35, section 2).

def _strict(tools, **kw) -> Sandbox:
    """A sandbox that must have its full isolation: skips where the kernel refuses part of it (the
    sandbox then refuses tools, which test_weaker_sandbox_is_refused_unless_allowed covers)."""
    sb = Sandbox(tools, **kw)
    sb.probe_isolation()
    if sb.missing:
        pytest.skip(f"the kernel refuses part of the tool sandbox here: {sb.missing}")
    return sb


class _Server:
    """A TCP server on 127.0.0.1 that counts the connections it accepted."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port, self.accepted, self.stop = self.sock.getsockname()[1], 0, False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.sendall(b"hello")
            conn.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close()


def _processes_with(marker: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(name))
            except OSError:
                pass
    return pids


def test_setns_back_into_the_callers_network_namespace_fails():
    server = _Server()
    try:
        from tests.sandbox_tools import connect

        assert connect(server.port) == "hello" and server.accepted == 1  # reachable from here
        sb = _strict([_tool("escape", "netns_escape", {"pid": {"type": "integer"}, "port": {"type": "integer"}})])
        r = sb.call(ToolCall("escape", {"pid": os.getpid(), "port": server.port}, ""))
        assert r.error is not None and r.error.startswith("exception:"), r
        time.sleep(0.3)
        assert server.accepted == 1  # nothing came from the sandbox
    finally:
        server.close()


@pytest.mark.parametrize("payload", [
    "x",                                        # one byte
    '["ok", 42, "netns"]',                      # the old answer's shape, wrong types
    'TFSB\xff\xff\xff\xff',                     # a frame header announcing 4 GiB
    'TFSB\x00\x00\x00\x05[1,2]',                # a frame whose body is not an answer
    'TFSB\x00\x00\x00\x30["error", "timeout: forged", 0]',  # cut short, and an error kind it may not claim
])
def test_garbage_in_the_answer_channel_is_an_error_result(payload):
    sb = _strict([_tool("forge", "forge_answer", {"payload": {"type": "string"}})])
    isolation = sb.isolation
    env = make_environment("tool_calculator", EnvContext([], sb))
    env.reset({"messages": [{"role": "user", "content": "hi"}]})
    call = json.dumps({"name": "forge", "arguments": {"payload": payload}})
    step = env.step({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})  # never raises
    content = step.observations[0]["content"]
    assert content.startswith(("Error: result:", "Error: crashed:")), content
    assert sb.isolation == isolation  # the tool cannot speak for the sandbox


@pytest.mark.parametrize("megabytes, seconds", [(0, 12), (256, 0)])
def test_a_grandchild_holding_the_pipe_neither_delays_nor_floods_the_caller(megabytes, seconds):
    sb = _strict([_tool("flood", "grandchild_flood", {"megabytes": {"type": "integer"},
                                                       "seconds": {"type": "number"}}, timeout_s=2.0)],
                 max_response_chars=64)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    r = sb.call(ToolCall("flood", {"megabytes": megabytes, "seconds": seconds}, ""))
    wall = time.perf_counter() - t0
    assert wall < 6.0, (wall, r.error)  # the 2 s limit holds (12 s before)
    assert r.result == "parent done", r  # the answer came before the grandchild could do anything
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 64 * 1024  # KiB: not 256 MiB read


def _gone(marker: str) -> list[int]:
    """The processes carrying ``marker`` that are still alive after up to 3 s (killed here, so that a
    failing sandbox leaves nothing behind)."""
    left = _processes_with(marker)
    for _ in range(60):
        if not left:
            break
        time.sleep(0.05)
        left = _processes_with(marker)
    for pid in left:
        os.kill(pid, 9)
    return left


def test_timeout_kills_the_tools_subprocesses():
    marker = f"trajflow-test-{uuid.uuid4().hex}"
    sb = _strict([_tool("hang", "spawn_and_hang", {"marker": {"type": "string"}}, timeout_s=1.5)])
    r = sb.call(ToolCall("hang", {"marker": marker}, ""))
    assert r.error.startswith("timeout:")
    assert _gone(marker) == []


def test_a_killed_supervisor_takes_the_tools_processes_with_it(monkeypatch):
    import trajflow.envs.sandbox as sandbox

    marker = f"trajflow-test-{uuid.uuid4().hex}"
    sb = _strict([_tool("hang", "spawn_and_hang", {"marker": {"type": "string"}}, timeout_s=30.0)])
    monkeypatch.setattr(sandbox, "SUPERVISOR_GRACE_S", -28.5)  # the caller gives up first, after 1.5 s
    import glob
    import tempfile

    pattern = os.path.join(tempfile.gettempdir(), "trajflow-tool-*")
    before = set(glob.glob(pattern))
    r = sb.call(ToolCall("hang", {"marker": marker}, ""))
    assert r.error == "crashed: the sandbox's supervisor did not answer in time", r.error
    assert _gone(marker) == []  # the supervisor's death reached the tool (parent-death signal, PID 1)
    assert set(glob.glob(pattern)) - before == set()  # its temp directory was removed by the caller


def test_answers_are_capped_in_characters_whatever_their_bytes():
    sb = _strict([_tool("echo", "echo", {})], max_response_chars=50)
    text = "\U0001F600\x00" * 100  # 12 bytes per character as JSON escapes, 4-6 as UTF-8
    r = sb.call(ToolCall("echo", {"text": text}, ""))
    assert r.error is None and r.result == text[:50] + "... [truncated 150 characters]"


def test_memory_limit_holds_for_all_of_a_calls_processes():
    sb = _strict([_tool("kids", "children_allocate", {"children": {"type": "integer"},
                                                      "megabytes": {"type": "integer"}},
                        memory_mb=128, timeout_s=20.0)])
    if "memory: cgroup" not in sb.isolation:
        pytest.skip(f"no memory cgroup here: {sb.isolation}")
    r = sb.call(ToolCall("kids", {"children": 3, "megabytes": 90}, ""))  # 270 MiB under 128 MiB
    assert r.error is not None and r.error.startswith("memory:"), r


def test_file_size_and_process_count_limits():
    sb = _strict([_tool("write", "write_file", {"megabytes": {"type": "integer"}}, file_size_mb=1),
                  _tool("fork", "fork_many", {"count": {"type": "integer"}}, max_processes=4, timeout_s=10.0)])
    assert sb.call(ToolCall("write", {"megabytes": 1}, "")).result == "wrote 1 MiB"
    r = sb.call(ToolCall("write", {"megabytes": 3}, ""))
    assert r.error.startswith("exception: OSError") and "File too large" in r.error, r.error
    r = sb.call(ToolCall("fork", {"count": 20}, ""))
    assert r.error is not None and "BlockingIOError" in r.error, r  # EAGAIN from fork past RLIMIT_NPROC


def test_environment_is_an_allow_list(monkeypatch):
    monkeypatch.setenv("TRAJFLOW_TEST_SECRET", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter3")
    sb = _strict([_tool("env", "environment", {})], max_response_chars=100_000)
    env = json.loads(sb.call(ToolCall("env", {}, "")).result)
    assert "hunter2" not in json.dumps(env) and "hunter3" not in json.dumps(env)
    assert set(env) <= {"PATH", "PYTHONPATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE", "TZ"}, set(env)


def test_no_access_to_secrets_or_the_runs_files(tmp_path):
    run_file = tmp_path / "run.json"
    run_file.write_text('{"secret": "run data"}')
    run_file.chmod(0o644)
    sb = _strict([_tool("read", "read_file", {"path": {"type": "string"}})])
    for path in ("/etc/shadow", str(run_file), f"/proc/{os.getpid()}/environ"):
        if path == "/etc/shadow" and not os.path.exists(path):
            continue
        r = sb.call(ToolCall("read", {"path": path}, ""))
        assert r.error is not None and r.error.startswith(("exception: PermissionError",
                                                           "exception: FileNotFoundError")), (path, r)


def test_private_temp_directory_is_gone_after_the_call():
    sb = _strict([_tool("mark", "temp_marker", {"name": {"type": "string"}})])
    name = f"trajflow-marker-{uuid.uuid4().hex}"
    first = sb.call(ToolCall("mark", {"name": name}, "")).result
    second = sb.call(ToolCall("mark", {"name": name}, "")).result
    assert name not in first and name not in second, second  # each call starts with an empty one
    import glob
    import tempfile

    assert not glob.glob(os.path.join(tempfile.gettempdir(), "**", name), recursive=True)


def test_weaker_sandbox_is_refused_unless_allowed():
    for allow in (False, True):
        sb = Sandbox([_tool("echo", "echo", {})], allow_weaker=allow)
        sb.isolation, sb.missing = "no namespaces; memory: per process", ["net: unshare(CLONE_NEWNET): refused"]
        if allow:
            assert sb.call(ToolCall("echo", {"text": "hi"}, "")).result == "hi"
        else:
            with pytest.raises(SandboxUnavailable, match="allow_weaker_sandbox=true"):
                sb.call(ToolCall("echo", {"text": "hi"}, ""))


def test_run_metadata_record_and_refusal_as_a_config_error(monkeypatch):
    from types import SimpleNamespace

    import trajflow.envs.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_RECORDS", {})
    probe = Sandbox([])
    probe.probe_isolation()
    record = sandbox.tool_sandbox_record(SimpleNamespace(allow_weaker_sandbox=False))
    assert record == {"isolation": probe.isolation, "missing": probe.missing, "allow_weaker": False}

    def refused(self):  # what probe_isolation records where the kernel refuses a namespace
        self.isolation, self.missing = "user namespaces; memory: per process", ["net: unshare(CLONE_NEWNET): refused"]
        return self.isolation

    monkeypatch.setattr(sandbox, "_RECORDS", {})
    monkeypatch.setattr(Sandbox, "probe_isolation", refused)
    with pytest.raises(ConfigError, match=r"^rollout.multi_turn.enable=true: tool sandbox: .*CLONE_NEWNET.*"
                                          r"allow_weaker_sandbox=true"):
        sandbox.tool_sandbox_record(SimpleNamespace(allow_weaker_sandbox=False))
    record = sandbox.tool_sandbox_record(SimpleNamespace(allow_weaker_sandbox=True))
    assert record["missing"] == ["net: unshare(CLONE_NEWNET): refused"] and record["allow_weaker"] is True


_IN_USERNS = """
import json, os
from trajflow.envs.sandbox import Sandbox, ToolCall
from tests.sandbox_tools import read_file
from trajflow.envs.tools import Tool
sb = Sandbox([Tool(name="read", description="", parameters={"type": "object"},
                   function="tests.sandbox_tools:read_file")], allow_weaker=True)
sb.probe_isolation()
r = sb.call(ToolCall("read", {"path": "/proc/1/cmdline"}, ""))
print(json.dumps({"euid": os.geteuid(), "isolation": sb.isolation, "missing": sb.missing, "error": r.error,
                  "init": r.result}))
"""


@pytest.mark.parametrize("mapping, euid", [("--map-user=1000 --map-group=1000", 1000), ("--map-root-user", 0)])
def test_a_worker_that_is_not_root_or_root_of_a_rootless_container(mapping, euid):
    """A non-root worker gets the same namespaces through its own user namespace; root of a user
    namespace that maps no ``nobody`` (a rootless container) cannot switch user, and says so."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(["unshare", "--user", "true"]).returncode != 0:
        pytest.skip("no unprivileged user namespaces (or no unshare) here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["unshare", "--user", *mapping.split(), sys.executable, "-c", _IN_USERNS],
                         capture_output=True, text=True, cwd=root, timeout=60,
                         env={"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join([root] + sys.path[1:])})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["euid"] == euid
    assert got["isolation"].startswith("user, net, pid, mount namespaces"), got
    # /proc/1 is the tool's own PID 1 (a fork of the supervisor), never the host's init
    assert got["error"] is None and "trajflow.envs.sandbox_worker" in got["init"], got
    if euid == 0:
        assert got["missing"] == [f"user: uid 65534 is not mapped in this user namespace (a rootless container?): "
                                  "the tool runs as the worker's uid 0"]
    else:
        assert got["missing"] == []


def test_seccomp_denies_new_namespaces_but_not_processes():
    sb = _strict([_tool("ns", "new_namespace", {}), _tool("sub", "subprocess_runs", {})])
    if "seccomp: yes" not in sb.isolation:
        pytest.skip(f"no seccomp table for this machine: {sb.isolation}")
    r = sb.call(ToolCall("ns", {}, ""))
    assert r.error == "exception: PermissionError: [Errno 1] Operation not permitted", r  # allowed without it
    assert sb.call(ToolCall("sub", {}, "")).result == "child 7"
