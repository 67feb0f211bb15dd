"""``stream: true``: a finished response as the server-sent events OpenAI's API sends.

The engine samples a call's tokens in one batch, so the events are written once the call's
generation has ended; their shape is OpenAI's, which its clients parse: ``data: {chunk}`` lines, a
blank line after each, and ``data: [DONE]`` last.

Chat (``chat.completion.chunk``), per choice: a first chunk with ``delta: {role: assistant, content: ""}``;
one chunk per sampled token with the text it adds (``delta.content``; the pieces join to the
message's content exactly) and, with ``logprobs``, that token's entry; for a reply with tool calls, its
content in one chunk and one chunk per call (``delta.tool_calls`` with index, id, name and
arguments); then ``delta: {}`` with the ``finish_reason``. Text completions (``text_completion``):
one chunk per token (``text``; ``logprobs`` with ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``),
then the ``finish_reason``. With ``stream_options: {include_usage: true}`` every chunk has ``usage: null``
and a last chunk with ``choices: []`` carries the usage.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator, Sequence


def token_pieces(ids: Sequence[int], text: str, decode: Callable[[Sequence[int]], str]) -> list[str]:
    """The text each sampled token adds to ``text``, one piece per id, joining to ``text`` exactly.

    A token's piece is what the decoding of the ids up to it adds to the longest prefix of ``text``
    decoded so far (a token that ends inside a multi-byte character adds nothing until the one that
    completes it); text past the last token's decoding (none, normally) goes to the last piece and
    tokens past the end of ``text`` (a stop string's) add nothing.
    """
    pieces, done = [], 0
    for k in range(1, len(ids) + 1):
        decoded = decode(ids[:k])
        common = 0
        limit = min(len(decoded), len(text))
        while common < limit and decoded[common] == text[common]:
            common += 1
        upto = max(done, common)
        pieces.append(text[done:upto])
        done = upto
    if pieces:
        pieces[-1] += text[done:]
    elif text:
        pieces.append(text)
    return pieces


def _envelope(response: dict, kind: str, choices: list[dict], usage: bool) -> dict:
    out = {"id": response["id"], "object": kind, "created": response["created"], "model": response["model"],
           "system_fingerprint": None, "choices": choices}
    if usage:
        out["usage"] = None
    return out


def chat_chunks(response: dict, pieces: Sequence[Sequence[str]], usage: bool) -> Iterator[dict]:
    """The ``chat.completion.chunk`` objects of a chat ``response`` (its choices in order).

    Args:
        response: the ``chat.completion`` object (:meth:`trajflow.serve.app.AgentServer.chat`).
        pieces: per choice, :func:`token_pieces` of its sampled ids and message content.
        usage: ``stream_options.include_usage``: a last chunk with the usage.
    """
    kind = "chat.completion.chunk"
    for choice, parts in zip(response["choices"], pieces):
        i, message = choice["index"], choice["message"]
        entries = list((choice.get("logprobs") or {}).get("content") or [])
        lp = (lambda e: {"content": e, "refusal": None}) if choice.get("logprobs") is not None else (lambda e: None)
        yield _envelope(response, kind, [{"index": i, "delta": {"role": "assistant", "content": "", "refusal": None},
                                          "logprobs": None, "finish_reason": None}], usage)
        calls = message.get("tool_calls") or []
        if calls:  # the content left beside the calls, then each call whole
            first = True
            if message.get("content"):
                yield _envelope(response, kind, [{"index": i, "delta": {"content": message["content"]},
                                                  "logprobs": lp(entries), "finish_reason": None}], usage)
                first = False
            for j, c in enumerate(calls):
                delta = {"tool_calls": [{"index": j, "id": c["id"], "type": "function",
                                         "function": {"name": c["function"]["name"],
                                                      "arguments": c["function"]["arguments"]}}]}
                yield _envelope(response, kind, [{"index": i, "delta": delta, "logprobs": lp(entries) if first else None,
                                                  "finish_reason": None}], usage)
                first = False
        else:
            for k, piece in enumerate(parts):
                yield _envelope(response, kind, [{"index": i, "delta": {"content": piece},
                                                  "logprobs": lp(entries[k:k + 1]), "finish_reason": None}], usage)
        yield _envelope(response, kind, [{"index": i, "delta": {}, "logprobs": None,
                                          "finish_reason": choice["finish_reason"]}], usage)
    if usage:
        yield _envelope(response, kind, [], False) | {"usage": response["usage"]}


def completion_chunks(response: dict, pieces: Sequence[Sequence[str]], usage: bool) -> Iterator[dict]:
    """The ``text_completion`` chunks of a text-completion ``response``; ``pieces`` and ``usage`` as in
    :func:`chat_chunks`."""
    kind = "text_completion"
    for choice, parts in zip(response["choices"], pieces):
        i, lps = choice["index"], choice.get("logprobs")
        for k, piece in enumerate(parts):
            logprobs = None
            if lps is not None:
                logprobs = {"tokens": lps["tokens"][k:k + 1], "token_logprobs": lps["token_logprobs"][k:k + 1],
                            "top_logprobs": (lps["top_logprobs"] or [])[k:k + 1] or None,
                            "text_offset": lps["text_offset"][k:k + 1]}
            yield _envelope(response, kind, [{"index": i, "text": piece, "logprobs": logprobs, "finish_reason": None}],
                            usage)
        yield _envelope(response, kind, [{"index": i, "text": "", "logprobs": None,
                                          "finish_reason": choice["finish_reason"]}], usage)
    if usage:
        yield _envelope(response, kind, [], False) | {"usage": response["usage"]}


def sse(chunks: Iterator[dict]) -> Iterator[bytes]:
    """Server-sent events: ``data: <json>\\n\\n`` per chunk, then ``data: [DONE]\\n\\n``."""
    for c in chunks:
        yield b"data: " + json.dumps(c, ensure_ascii=False).encode("utf-8") + b"\n\n"
    yield b"data: [DONE]\n\n"


def include_usage(body: dict) -> bool:
    """``stream_options.include_usage`` of a request (False when absent)."""
    opts: Any = body.get("stream_options") or {}
    return bool(opts.get("include_usage")) if isinstance(opts, dict) else False
