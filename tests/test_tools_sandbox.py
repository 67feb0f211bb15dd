"""Tools in the sandbox: the calculator's arithmetic, the tool config's errors, and every failure mode
of a call in a real worker process (timeout, exception, memory, CPU, network, bad result)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from trajflow.envs.calculator import evaluate
from trajflow.envs.registry import EnvContext, make_environment
from trajflow.envs.sandbox import Sandbox, ToolCall
from trajflow.envs.tool_format import parse_tool_calls
from trajflow.envs.tools import BUILTIN_TOOLS, Tool, load_tool_config
from trajflow.errors import ConfigError


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
    sb = Sandbox([calc, echo])
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
    sb = Sandbox([_tool("sleepy", "sleepy", {"seconds": {"type": "number"}}, timeout_s=1.0)])
    t0 = time.perf_counter()
    r = sb.call(ToolCall("sleepy", {"seconds": 30}, ""))
    assert time.perf_counter() - t0 < 10  # killed at ~1 s, not after 30
    assert r.error.startswith("timeout:") and r.result.startswith("Error: timeout:")
    assert sb.call(ToolCall("sleepy", {"seconds": 0}, "")).result == "woke up"


def test_exception_unknown_tool_bad_arguments_and_non_string():
    sb = Sandbox([_tool("raises", "raises", {"message": {"type": "string"}}),
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
    sb = Sandbox([_tool("alloc", "allocate", {"megabytes": {"type": "integer"}}, memory_mb=256)])
    assert sb.call(ToolCall("alloc", {"megabytes": 16}, "")).result == "allocated 16 MiB"
    r = sb.call(ToolCall("alloc", {"megabytes": 1024}, ""))
    assert r.error.startswith("memory:")


def test_cpu_time_limit():
    sb = Sandbox([_tool("spin", "spin", {}, cpu_time_s=1, timeout_s=20.0)])
    r = sb.call(ToolCall("spin", {}, ""))
    assert r.error.startswith("cpu:"), r.error


@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace needs root; the sandbox then reports no isolation")
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
    sb = Sandbox([_tool("connect", "connect", {"port": {"type": "integer"}})])
    r = sb.call(ToolCall("connect", {"port": port}, ""))
    assert r.error is not None and r.error.startswith("exception:") and "Error" in r.error
    assert sb.isolation == "netns"
    server.close()


def test_output_truncated_and_calls_run_concurrently():
    sb = Sandbox([_tool("sleepy", "sleepy", {"seconds": {"type": "number"}}), _tool("echo", "echo", {})],
                 max_response_chars=5, workers=4)
    assert sb.call(ToolCall("echo", {"text": "abcdefghij"}, "")).result.startswith("abcde... [truncated 5")
    t0 = time.perf_counter()
    r = sb.run([ToolCall("sleepy", {"seconds": 1.0}, "")] * 4)
    wall = time.perf_counter() - t0
    assert all(x.result == "woke ... [truncated 2 characters]" for x in r)  # "woke up" cut to 5 characters
    assert wall < 3.0, wall  # four 1 s calls, at once: well under 4 s


def test_tool_environment_turns_calls_into_tool_messages():
    env = make_environment("tool_calculator", EnvContext([], Sandbox([BUILTIN_TOOLS["calculator"]])))
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
