"""The environment interface (``rollout.multi_turn.environment``): what a factory gets
(:class:`EnvContext`), what an environment answers (:class:`StepResult`), the base classes, and the
registry environments are registered in (:data:`ENVIRONMENTS`; lookup: :mod:`trajflow.envs.registry`).

An environment is built once per episode by its registered factory, ``factory(ctx: EnvContext) ->
Environment``; :meth:`Environment.reset` gives the episode's first messages from the prompt row and
:meth:`Environment.step` answers each assistant message. :class:`ToolEnvironment` is the usual base:
it runs the message's tool calls in the sandbox and ends the episode at the first message without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from trajflow.stages.registry import Registry
from trajflow.envs.sandbox import Sandbox, ToolResult
from trajflow.envs.tool_format import parse_tool_calls
from trajflow.envs.tools import Tool


#: Environments by config name; a factory takes an :class:`EnvContext` and returns an :class:`Environment`.
ENVIRONMENTS = Registry("environment")


@dataclass(frozen=True)
class EnvContext:
    """What an environment factory gets.

    Attributes:
        tools: the tools of the run (from ``rollout.multi_turn.tool_config_path``, or the
            environment's defaults when that is null: then ``tools`` is empty).
        sandbox: where tool calls run.
        format: ``rollout.multi_turn.format``.
    """

    tools: Sequence[Tool]
    sandbox: Sandbox | None
    format: str = "hermes"


@dataclass
class StepResult:
    """An environment's answer to an assistant message.

    Attributes:
        observations: messages appended to the conversation (``{"role": "tool"|"user", "content": str}``).
        done: the episode is over (``finish_reason`` ``stop``).
        reward: an outcome reward from the environment, or ``None`` (the reward stage's scorer decides).
        tool_calls: the calls this step ran, for the stored record and the ``tool/*`` metrics.
    """

    observations: list[dict] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_calls: list[ToolResult] = field(default_factory=list)


class Environment:
    """One episode's environment. Subclasses override :meth:`reset` and :meth:`step`.

    Attributes:
        tools: the tools whose schemas are shown to the model (the chat template's ``tools=``).
    """

    tools: Sequence[Tool] = ()

    def reset(self, row: dict) -> list[dict]:
        """The episode's first messages (rendered as the prompt), from a prompt row with keys
        ``messages``, ``ground_truth``, ``data_source``, ``extra_info``, ``prompt_id``."""
        return [dict(m) for m in row["messages"]]

    def step(self, message: dict) -> StepResult:
        """Answer an assistant message ``{"role": "assistant", "content": str}``."""
        raise NotImplementedError

    def final_reward(self, messages: list[dict], finish_reason: str) -> float | None:
        """The terminal reward of an episode that ended without any step giving a reward (not
        solved, or cut by a budget before a step was called): called once, after the episode
        ended, with the whole conversation after the prompt (``messages``, the last assistant
        message possibly cut) and the episode's ``finish_reason`` (``stop``, ``length``,
        ``max_turns``). ``None`` (the default): no reward; ``rollout.multi_turn.default_env_reward``
        applies then."""
        return None


class ToolEnvironment(Environment):
    """Runs the tool calls of each assistant message; the first message without a call ends the episode.

    Each call's result becomes one ``{"role": "tool", "content": result}`` message (an
    ``"Error: ..."`` text when it failed).
    """

    def __init__(self, ctx: EnvContext, default_tools: Sequence[Tool] = ()) -> None:
        self.tools = list(ctx.tools) or list(default_tools)
        self.format = ctx.format
        self.sandbox = ctx.sandbox

    def step(self, message: dict) -> StepResult:
        calls = parse_tool_calls(message.get("content") or "", self.format)
        if not calls:
            return StepResult(done=True)
        if self.sandbox is None:
            raise RuntimeError("ToolEnvironment.step needs a sandbox (EnvContext.sandbox is None)")
        results = self.sandbox.run(calls)
        return StepResult(observations=[{"role": "tool", "content": r.result} for r in results], tool_calls=results)
