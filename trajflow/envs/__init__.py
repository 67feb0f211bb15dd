"""Environments and tools for multi-turn rollouts.

An environment (:mod:`trajflow.envs.registry`) turns a prompt row into initial messages and answers
each assistant message with observation messages; tools (:mod:`trajflow.envs.tools`) are
OpenAI-style function schemas bound to Python callables that run in the sandbox
(:mod:`trajflow.envs.sandbox`), never in the driver or the policy worker.
"""
