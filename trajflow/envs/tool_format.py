"""How tool calls are written and read: Hermes/Qwen style ``<tool_call>{json}</tool_call>``.

The model writes one JSON object per call, ``{"name": "<tool>", "arguments": {...}}``, between the
tags; several calls in one message are allowed. Where the chat template does not take ``tools=``,
:func:`plain_tools_block` is the text put in the system message instead (the same block Hermes and
Qwen templates render).
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from trajflow.envs.sandbox import ToolCall

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

#: ``rollout.multi_turn.format`` values.
FORMATS = ("hermes",)


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """Tool calls in an assistant message, in order; a call that does not parse is returned with
    ``error`` set (``"malformed: ..."``) so that the model is told, not ignored.

    Raises:
        ValueError: ``fmt`` is not one of :data:`FORMATS`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"rollout.multi_turn.format={fmt!r}: choose one of {', '.join(FORMATS)}")
    calls, end = [], 0
    for m in _CALL.finditer(text):
        calls.append(_parse_one(m.group(1).strip()))
        end = m.end()
    tail = text[end:]  # an opening tag after the last complete call was never closed
    if "<tool_call>" in tail:
        raw = tail[tail.index("<tool_call>"):]
        calls.append(ToolCall("", None, raw, "malformed: <tool_call> is not closed by </tool_call>"))
    return calls


def _parse_one(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall("", None, raw, f"malformed: the call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", None, raw, 'malformed: expected {"name": "<tool>", "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], None, raw, "malformed: 'arguments' is a string that is not JSON")
    return ToolCall(obj["name"], args, raw)


def plain_tools_block(schemas: Sequence[dict]) -> str:
    """The tool descriptions and calling convention as plain text (for templates without ``tools=``)."""
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
