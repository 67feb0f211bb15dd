"""Environments by name (``rollout.multi_turn.environment``): build one, find its factory (a
registered name or ``"module:factory"``), load the built-in ones.

The interface (:class:`Environment`, :class:`ToolEnvironment`, :class:`EnvContext`,
:class:`StepResult`) and the registry :data:`ENVIRONMENTS` live in :mod:`trajflow.envs.base`, which
the built-in environments import (so that this module may import them); they are importable from
here too.
"""

from __future__ import annotations

from typing import Sequence

from trajflow.envs.base import ENVIRONMENTS, EnvContext, Environment, StepResult, ToolEnvironment
from trajflow.envs.tools import Tool

__all__ = ["ENVIRONMENTS", "EnvContext", "Environment", "StepResult", "ToolEnvironment", "check_environment",
           "environment_factory", "environment_tools", "load_builtin_environments", "make_environment"]


def make_environment(name: str, ctx: EnvContext) -> Environment:
    """Build the environment registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered (lists the registered names).
    """
    return environment_factory(name)(ctx)


def environment_factory(name: str):
    """The factory of a registered environment, or of ``"module:factory"`` (imported: how a run's
    workers find an environment defined in the user's own package).

    Raises:
        ValueError: not registered, or the module or factory cannot be imported.
    """
    load_builtin_environments()
    if ":" in name and name not in ENVIRONMENTS:
        import inspect

        from trajflow.envs.tools import import_callable

        factory = import_callable(name)
        # An environment factory is Python code of the user's: a class or a function. A builtin such
        # as os:system would be called with the episode's context, never a sensible environment.
        if not (inspect.isclass(factory) or inspect.isfunction(factory) or inspect.ismethod(factory)):
            raise ValueError(f"{name!r} is a {type(factory).__name__}, not a Python function or class that "
                             f"takes an EnvContext and returns an Environment")
        return factory
    return ENVIRONMENTS.get(name)


def check_environment(name: str, tools: Sequence[Tool] = (), fmt: str = "hermes") -> None:
    """Build one environment of ``name`` without a sandbox, as the workers will (their first build
    is :class:`EpisodeRunner`'s, asking for its tools): a factory that raises or returns something
    other than an :class:`Environment` is found before Ray starts.

    Raises:
        ValueError: not registered or not importable, the factory raised (names the exception), or
            it returned another type.
    """
    factory = environment_factory(name)
    try:
        env = factory(EnvContext(list(tools), None, fmt))
    except Exception as e:  # the user's factory: anything
        raise ValueError(f"its factory raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                         f"(called with an EnvContext whose sandbox is None, as when trajflow asks for its "
                         f"tools)") from None
    if not isinstance(env, Environment):
        raise ValueError(f"its factory returned a {type(env).__name__}, not a trajflow.envs.Environment")


def load_builtin_environments() -> None:
    """Import the modules that register the built-in environments."""
    import trajflow.envs.tool_calculator  # noqa: F401


def environment_tools(name: str, ctx: EnvContext) -> list[Tool]:
    """The tools an episode of ``name`` offers (what the sandbox must know)."""
    return list(make_environment(name, ctx).tools)


