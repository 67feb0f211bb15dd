"""OpenAI chat messages <-> the chat template's text, and sampled tokens -> OpenAI choices.

What the endpoint shows the agent is text; what it records is tokens (:mod:`trajflow.serve.sessions`).
This module is the text side:

- :func:`template_messages`: an OpenAI ``messages`` list as the chat template takes it. Content given
  as parts is joined; an assistant message's structured ``tool_calls`` are written back into its
  content in the template's tool format (Hermes/Qwen ``<tool_call>{json}</tool_call>``, the format
  :mod:`trajflow.envs.tool_format` parses), since that is how the model wrote them.
- :func:`assistant_message`: the model's text as an OpenAI assistant message: tool calls parsed out
  of the content into ``tool_calls`` (with ids) and ``finish_reason`` ``tool_calls``.
- :func:`cut_at_stop`: the first stop string in the sampled tokens (OpenAI's ``stop``): the tokens up
  to the one that completes it are kept, the text before it is returned.
- :func:`message_key`: the normalised form two messages are compared in (the agent sends back the
  assistant message it was given, possibly re-serialised).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Sequence

from trajflow.envs.tool_format import parse_tool_calls


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP 400); the message names the field."""


def content_text(content: Any) -> str:
    """An OpenAI message ``content``: a string, ``None``, or a list of parts (their ``text`` joined).

    Raises:
        RequestError: a part that is not text (images, audio).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"messages: content part of type {kind!r} is not supported (text only)")
            out.append(str(part.get("text", "")))
        return "".join(out)
    raise RequestError(f"messages: content must be a string or a list of text parts, got {type(content).__name__}")


def tool_call_text(name: str, arguments: Any) -> str:
    """One call in the Hermes format the model writes: ``<tool_call>{"name": .., "arguments": ..}</tool_call>``."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "</tool_call>"


def _call_arguments(fn: dict) -> Any:
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args  # kept as written: the template shows what the agent sent
    return args


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """``messages`` as ``{role, content}`` dicts for the chat template (tool calls written into the
    assistant content, Hermes format).

    Raises:
        RequestError: a message without a role, or with content that is not text.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}]: expected an object with a 'role'")
        role = "system" if m["role"] == "developer" else m["role"]
        text = content_text(m.get("content"))
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            written = "\n".join(tool_call_text(c.get("function", {}).get("name", ""), _call_arguments(c.get("function", {})))
                                for c in calls)
            text = f"{text}\n{written}" if text.strip() else written
        out.append({"role": role, "content": text})
    return out


def message_key(m: dict) -> tuple:
    """What identifies a message when the agent sends it back: role, content text (stripped) and
    the tool calls (name, parsed arguments); ids, names and extra fields are ignored."""
    calls = tuple((c.get("function", {}).get("name", ""),
                   json.dumps(_call_arguments(c.get("function", {})), sort_keys=True, ensure_ascii=False))
                  for c in (m.get("tool_calls") or []))
    return (m.get("role"), content_text(m.get("content")).strip(), calls)


def assistant_message(text: str, fmt: str = "hermes") -> tuple[dict, bool]:
    """The model's text as an OpenAI assistant message.

    Well-formed tool calls (parsed by :func:`trajflow.envs.tool_format.parse_tool_calls`) move to
    ``tool_calls`` with fresh ids and JSON-text arguments, and their text leaves the content; a
    malformed call stays in the content, as written, so the agent sees what the model wrote.

    Returns:
        ``(message, has_calls)``.
    """
    calls = [c for c in parse_tool_calls(text, fmt) if c.error is None]
    content = text
    for c in calls:
        content = content.replace(c.raw, "", 1)
    if calls:
        content = content.replace("<tool_call>", "").replace("</tool_call>", "").strip()
    msg: dict = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        msg["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                             for c in calls]
    return msg, bool(calls)


def cut_at_stop(ids: Sequence[int], stop: Sequence[str], decode: Callable[[Sequence[int]], str]
                ) -> tuple[list[int], str | None]:
    """Cut sampled tokens at the first stop string (OpenAI ``stop``).

    The kept tokens run through the one whose text completes the stop string (what was sampled
    before the stop was seen; nothing after it conditions them), the returned text ends before it.

    Args:
        ids: the sampled tokens.
        stop: the stop strings (empty: no cut).
        decode: ``ids -> text`` (special tokens skipped).

    Returns:
        ``(kept_ids, text_before_stop)``, or ``(ids, None)`` when no stop string occurs.
    """
    if not stop:
        return list(ids), None
    full = decode(ids)
    if not any(s in full for s in stop):
        return list(ids), None
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        hits = [text.index(s) for s in stop if s in text]
        if hits:
            return list(ids[:k]), text[:min(hits)]
    return list(ids), None  # pragma: no cover - the full text had a stop string
