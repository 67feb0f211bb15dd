"""The ``tool_calculator`` environment: arithmetic beyond mental math, with a ``calculator`` tool.

Prompts come from a prompt dataset such as ``datasets/basic_arithmetic_tool.yaml`` (reasoning-gym
``basic_arithmetic`` with four 3-4 digit terms); the reward is the reward stage's usual
``reasoning_gym`` score of the final ``Answer:`` line, so the environment itself returns none.
"""

from __future__ import annotations

from trajflow.envs.base import ENVIRONMENTS, EnvContext, ToolEnvironment
from trajflow.envs.tools import BUILTIN_TOOLS

#: Added to the prompt's system message: how to call the tool, with one worked call (a worked
#: example is what makes a small instruct model try the format at all).
INSTRUCTIONS = (
    "You have a calculator tool. To use it, write exactly\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>\n'
    "and stop; the result comes back in the next message. When you know the result, end your reply "
    "with a line \"Answer: <number>\"."
)


#: One worked episode placed before the question, as earlier turns of the conversation: a call, the
#: tool's answer (in the tool role, rendered as every observation is), the final line. Measured on
#: SmolLM2-135M-Instruct (3 problems x 8 samples at temperature 1): well-formed calculator calls in
#: 0 of 24 replies with the instructions alone, 12 of 24 with this example as well.
WORKED_EPISODE = (
    {"role": "user", "content": "Calculate 4021 - 387 + 1290 - 56."},
    {"role": "assistant",
     "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "4021 - 387 + 1290 - 56"}}</tool_call>'},
    {"role": "tool", "content": "4868"},
    {"role": "assistant", "content": "Answer: 4868"},
)


class ToolCalculatorEnv(ToolEnvironment):
    """Arithmetic with a calculator: the system message gets :data:`INSTRUCTIONS`, and
    :data:`WORKED_EPISODE` comes before the problem."""

    def __init__(self, ctx: EnvContext) -> None:
        super().__init__(ctx, default_tools=[BUILTIN_TOOLS["calculator"]])

    def reset(self, row: dict) -> list[dict]:
        messages = [dict(m) for m in row["messages"]]
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{INSTRUCTIONS}"
        else:
            messages.insert(0, {"role": "system", "content": INSTRUCTIONS})
        return messages[:1] + [dict(m) for m in WORKED_EPISODE] + messages[1:]


@ENVIRONMENTS.register("tool_calculator")
def tool_calculator(ctx: EnvContext) -> ToolCalculatorEnv:
    """Factory of :class:`ToolCalculatorEnv`."""
    return ToolCalculatorEnv(ctx)
