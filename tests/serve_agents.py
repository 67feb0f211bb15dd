"""Agents for the server-mode train-flow test: the example calculator agent, and one that crashes on
every fourth episode it is given (a row with an error, never a failed iteration)."""

from __future__ import annotations

import itertools
import threading

from examples.agents.calculator_agent import agent as calculator_agent

_count = itertools.count()
_lock = threading.Lock()


def every_fourth_crashes(task_row: dict, base_url: str, api_key: str):
    with _lock:
        k = next(_count)
    if k % 4 == 0:
        raise RuntimeError("the agent fell over")
    return calculator_agent(task_row, base_url, api_key)
