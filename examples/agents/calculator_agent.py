"""A tool-calling agent written only against the OpenAI SDK, trained by trajflow through its endpoint:

    trajflow train grpo_tool_calculator rollout.agent=examples.agents.calculator_agent:agent

trajflow calls ``agent(task_row, base_url, api_key)`` once per episode; every call it makes is
recorded token-exact and becomes the episode's training row. It returns the final reply, which the
reward stage scores (the text after its last ``Answer:``).
"""

import ast
import json
import operator

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly. Supports + - * / // % ** and "
                                         "parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "the expression, e.g. \"(1234 * 5678) - 90\""}},
        "required": ["expression"], "additionalProperties": False}}}]
SYSTEM = ("You have a calculator tool. To use it, write exactly\n"
          '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>\n'
          "and stop; the result comes back in the next message. When you know the result, end your reply "
          "with a line \"Answer: <number>\".")
# One worked episode before the problem: a small instruct model tries the tool format only after seeing it.
EXAMPLE = [{"role": "user", "content": "Calculate 4021 - 387 + 1290 - 56."},
           {"role": "assistant", "content": "", "tool_calls": [{"id": "ex", "type": "function", "function": {
               "name": "calculator", "arguments": json.dumps({"expression": "4021 - 387 + 1290 - 56"})}}]},
           {"role": "tool", "tool_call_id": "ex", "content": "4868"},
           {"role": "assistant", "content": "Answer: 4868"}]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Numbers and + - * / // % only (no names, no calls): the tool never runs code."""
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported: {type(node).__name__}")
    try:
        value = ev(ast.parse(str(expression)[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as e:
        return f"Error: {e}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def agent(task_row: dict, base_url: str, api_key: str, max_turns: int = 3) -> str:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(task_row["messages"])
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + SYSTEM}
    else:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    messages[1:1] = EXAMPLE
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return reply.content or ""
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(args.get("expression", ""))})
    return reply.content or ""
