"""Tools: OpenAI-style function schemas bound to a Python callable, and the tool config YAML.

A tool config (``rollout.multi_turn.tool_config_path``) lists tools by name::

    tools:
      - name: calculator              # a built-in tool (BUILTIN_TOOLS) ...
        options: {max_exponent: 32}   # keyword arguments of its callable the model cannot set
        timeout_s: 2
      - name: lookup                  # ... or your own: the callable and its schema
        function: mypackage.tools:lookup
        description: Look a word up in the glossary.
        parameters: {type: object, properties: {word: {type: string}}, required: [word]}

The callable is named ``module:qualname`` so that the sandbox's worker process can import it; it is
called as ``fn(**arguments, **options)`` and must return a string.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trajflow.errors import ConfigError


@dataclass(frozen=True)
class Tool:
    """A tool the model may call.

    Attributes:
        name: the function name the model writes.
        description: one or two sentences shown to the model.
        parameters: JSON Schema of the arguments object (``type: object``).
        function: ``"module:qualname"`` of the callable, imported in the sandbox process.
        options: keyword arguments fixed by the config (not settable by the model).
        timeout_s: wall-clock seconds one call may take.
        cpu_time_s: CPU seconds one call may use (``RLIMIT_CPU``).
        memory_mb: memory of the call in MiB: all of its processes together where the sandbox has a
            memory cgroup, and each process's address space (``RLIMIT_AS``) in any case.
        max_processes: processes and threads the call may run at once (``RLIMIT_NPROC``, counted in
            the call's own user namespace), its first process included.
        file_size_mb: largest file the call may write, in MiB (``RLIMIT_FSIZE``).
    """

    name: str
    description: str
    parameters: dict
    function: str
    options: dict = field(default_factory=dict)
    timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_mb: int = 1024
    max_processes: int = 16
    file_size_mb: int = 64

    def schema(self) -> dict:
        """The OpenAI function schema: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


#: Built-in tools by name; a tool config entry with only ``name`` (and ``options``) picks one.
BUILTIN_TOOLS: dict[str, Tool] = {
    "calculator": Tool(
        name="calculator",
        description="Evaluate an arithmetic expression exactly. Supports + - * / // % ** and parentheses.",
        parameters={"type": "object", "properties": {"expression": {
            "type": "string", "description": "the expression, e.g. \"(1234 * 5678) - 90\""}},
            "required": ["expression"], "additionalProperties": False},
        function="trajflow.envs.calculator:calculator"),
    "python": Tool(
        name="python",
        description="Run a Python snippet and return what it prints (no network, limited time and memory).",
        parameters={"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                    "required": ["code"], "additionalProperties": False},
        function="trajflow.envs.python_tool:run_python"),
}

_ENTRY_KEYS = {"name", "function", "description", "parameters", "options", "timeout_s", "cpu_time_s", "memory_mb",
               "max_processes", "file_size_mb"}
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list, "null": type(None)}


def import_callable(spec: str):
    """The callable named ``"module:qualname"``.

    Raises:
        ValueError: not of that form, or the module or attribute cannot be found.
    """
    module, _, qual = spec.partition(":")
    if not module or not qual:
        raise ValueError(f"{spec!r} is not 'module:qualname'")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {spec!r}: {e}") from None
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable")
    return obj


def load_tool_config(path: str | Path) -> list[Tool]:
    """Tools declared in a tool config YAML (see the module docstring).

    Raises:
        ConfigError: the file is missing or not YAML, or an entry is wrong; the message names the
            file, the tool (by position and name) and the field.
    """
    p = Path(path).expanduser()
    where = f"rollout.multi_turn.tool_config_path={str(path)!r}"
    if not p.is_file():
        raise ConfigError(f"{where}: file does not exist")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), list) or not doc["tools"]:
        raise ConfigError(f"{where}: expected a mapping with a non-empty list 'tools'")
    tools, seen = [], set()
    for i, entry in enumerate(doc["tools"]):
        tools.append(_tool_from_entry(entry, f"{where}: tools[{i}]"))
        if tools[-1].name in seen:
            raise ConfigError(f"{where}: tools[{i}] ({tools[-1].name}): name is declared twice")
        seen.add(tools[-1].name)
    return tools


def _tool_from_entry(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise ConfigError(f"{where}: field 'name' must be a non-empty string (got {entry!r})")
    name = entry["name"]
    where = f"{where} ({name})"
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(_ENTRY_KEYS))}")
    base = BUILTIN_TOOLS.get(name)
    if base is None and "function" not in entry:
        raise ConfigError(f"{where}: field 'function' is required for a tool that is not built in "
                          f"(built-in tools: {', '.join(sorted(BUILTIN_TOOLS))})")
    fields: dict[str, Any] = dict(base.__dict__) if base is not None else {"name": name}
    fields.update({k: v for k, v in entry.items()})
    fields.setdefault("description", "")
    fields.setdefault("options", {})
    params = fields.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ConfigError(f"{where}: field 'parameters' must be a JSON Schema with type: object (got {params!r})")
    if not isinstance(fields["options"], dict):
        raise ConfigError(f"{where}: field 'options' must be a mapping (got {fields['options']!r})")
    clash = sorted(set(fields["options"]) & set(params.get("properties") or {}))
    if clash:
        raise ConfigError(f"{where}: field 'options' sets {clash[0]!r}, which is one of the model's arguments")
    for key, lo in (("timeout_s", 0.0), ("cpu_time_s", 1), ("memory_mb", 16), ("max_processes", 1),
                    ("file_size_mb", 1)):
        value = fields.get(key, getattr(Tool, key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo or value <= 0:
            raise ConfigError(f"{where}: field {key!r}={value!r} must be a number > {lo}")
    try:
        import_callable(str(fields["function"]))
    except ValueError as e:
        raise ConfigError(f"{where}: field 'function': {e}") from None
    return Tool(**fields)


def check_arguments(tool: Tool, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit ``tool.parameters`` (top-level properties, required keys, JSON
    types, ``additionalProperties: false``), or ``None`` when they do.

    Only the top level is checked: enough to turn a model's wrong call into a readable error, and
    no JSON Schema library is needed.
    """
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props = tool.parameters.get("properties") or {}
    for key in tool.parameters.get("required") or []:
        if key not in arguments:
            return f"missing required argument {key!r}"
    for key, value in arguments.items():
        if key not in props:
            if tool.parameters.get("additionalProperties", True) is False or key in tool.options:
                return f"unknown argument {key!r}; allowed: {', '.join(sorted(props))}"
            continue
        expected = props[key].get("type") if isinstance(props[key], dict) else None
        if isinstance(expected, str) and expected in _JSON_TYPES:
            ok = isinstance(value, _JSON_TYPES[expected]) and not (expected in ("integer", "number")
                                                                    and isinstance(value, bool))
            if not ok:
                return f"argument {key!r} must be a JSON {expected}, got {json.dumps(value)[:40]}"
    return None
