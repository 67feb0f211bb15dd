"""Multi-turn rollout rows written by hand: a scripted conversation turned into the rollout row contract
(``prompt_ids``, ``response_ids`` with observation tokens interleaved, int8 ``loss_mask``, ``turn_spans``,
``num_turns``, ``messages``, ``tool_calls``) with a real tokenizer and its chat template."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from trajflow.models import chat_prompt_ids

MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string())]))
TOOL_CALL_TYPE = pa.list_(pa.struct([("turn", pa.int32()), ("name", pa.string()), ("arguments", pa.string()),
                                     ("result", pa.string()), ("error", pa.string()),
                                     ("duration_s", pa.float32())]))


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def episode(tokenizer: Any, prompt: list[dict], turns: list[tuple[str, str | None]]) -> dict:
    """One episode's contract fields from a script.

    Args:
        tokenizer: a tokenizer with a ChatML chat template (``<|im_end|>`` ends a turn).
        prompt: the initial messages.
        turns: ``(assistant text, tool result or None)`` per assistant turn; a tool result becomes a
            ``tool`` message rendered by the chat template (plus the next generation prompt).

    Returns:
        ``prompt_ids``, ``response_ids``, ``loss_mask``, ``turn_spans``, ``num_turns``, ``messages``,
        ``tool_calls``, ``response_text``.
    """
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt_ids = chat_prompt_ids(tokenizer, prompt)
    response: list[int] = []
    mask: list[int] = []
    spans: list[int] = []
    history = list(prompt)
    messages, calls = [], []
    for t, (text, result) in enumerate(turns):
        generated = tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
        spans += [len(response), len(response) + len(generated)]
        response += generated
        mask += [1] * len(generated)
        history.append({"role": "assistant", "content": text})
        messages.append({"role": "assistant", "content": text, "tool_calls": None})
        if result is None:
            continue
        before = _render(tokenizer, history, False)
        history.append({"role": "tool", "content": result})
        after = _render(tokenizer, history, True)
        assert before.endswith("<|im_end|>\n") and after.startswith(before)
        # The model stopped at <|im_end|>; the template's newline after it and the tool message
        # (with the next generation prompt) are the observation.
        observation = tokenizer("\n" + after[len(before):], add_special_tokens=False)["input_ids"]
        response += observation
        mask += [0] * len(observation)
        messages.append({"role": "tool", "content": result, "tool_calls": None})
        calls.append({"turn": t, "name": "calculator", "arguments": json.dumps({"expression": text}),
                      "result": result, "error": None, "duration_s": 0.001})
    return {"prompt_ids": prompt_ids, "response_ids": response, "loss_mask": mask, "turn_spans": spans,
            "num_turns": len(turns), "messages": messages, "tool_calls": calls,
            "response_text": tokenizer.decode(response, skip_special_tokens=False)}


def multi_turn_columns(episodes: list[dict], rollout_logprobs: list[list[float]]) -> dict[str, pa.Array]:
    """The contract's typed Arrow columns for ``episodes`` (old log-probs 0.0 where ``loss_mask`` is 0)."""
    for e, lp in zip(episodes, rollout_logprobs):
        assert len(lp) == len(e["response_ids"])
    return {
        "prompt_ids": pa.array([e["prompt_ids"] for e in episodes], pa.list_(pa.int32())),
        "response_ids": pa.array([e["response_ids"] for e in episodes], pa.list_(pa.int32())),
        "response_text": pa.array([e["response_text"] for e in episodes], pa.string()),
        "rollout_logprobs": pa.array([[v if m else 0.0 for v, m in zip(lp, e["loss_mask"])]
                                  for e, lp in zip(episodes, rollout_logprobs)], pa.list_(pa.float32())),
        "loss_mask": pa.array([e["loss_mask"] for e in episodes], pa.list_(pa.int8())),
        "turn_spans": pa.array([e["turn_spans"] for e in episodes], pa.list_(pa.int32())),
        "num_turns": pa.array([e["num_turns"] for e in episodes], pa.int32()),
        "messages": pa.array([e["messages"] for e in episodes], MESSAGE_TYPE),
        "tool_calls": pa.array([e["tool_calls"] for e in episodes], TOOL_CALL_TYPE),
    }
