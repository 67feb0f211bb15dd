"""Bring your own agent (``rollout.agent=module:function``): episodes produced by any code that calls
the OpenAI API, recorded token-exact by the endpoint (:mod:`trajflow.serve.app`).

The agent is called once per episode, in its own thread, as ``agent(task_row, base_url, api_key)``:

- ``task_row``: the prompt row, ``{"messages", "ground_truth", "data_source", "extra_info", "prompt_id"}``;
- ``base_url``: the episode's OpenAI base URL (``http://127.0.0.1:<port>/s/<session>/v1``);
- ``api_key``: the run's bearer token.

It returns the episode's outcome: a number (the reward, stored as ``env_reward`` for the ``env``
scorer), a string (the final answer, stored as ``agent_answer`` and scored by the reward stage in
place of the response text), a dict with ``reward`` and/or ``answer``, or None (the reward stage
scores the episode's response text).

Per episode: a timeout (``rollout.agent_timeout_s``; the session then refuses further calls and
the row records ``timeout``); an exception is the row's ``agent_error`` (the run goes on; the row
keeps its sampled tokens and gets ``rollout.agent_error_reward`` as its ``env_reward``). At most
``rollout.agent_concurrency`` episodes run at once.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from trajflow.stages.multi_turn import Episode

if TYPE_CHECKING:  # the endpoint (FastAPI, uvicorn) is imported only where episodes run
    from trajflow.serve.app import AgentServer


def load_agent(spec: str) -> Callable:
    """Import ``module:function`` (the module must be importable: on ``sys.path`` or installed).

    Raises:
        ValueError: malformed spec, missing module or attribute, or not callable (one line).
    """
    module, sep, name = str(spec).partition(":")
    if not sep or not module or not name:
        raise ValueError(f"rollout.agent={spec!r}: expected 'module:function'")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"rollout.agent={spec!r}: cannot import {module!r} ({e})") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"rollout.agent={spec!r}: {module!r} has no function {name!r}")
    return fn


@dataclass(frozen=True)
class AgentLimits:
    """Per-episode limits (``rollout.*``).

    Attributes:
        budget: ``rollout.max_new_tokens``: tokens after the first prompt, sampled and template.
        turn_tokens: most tokens one call samples (0 = what is left of the budget).
        timeout_s: seconds an episode may run.
        concurrency: episodes at once (0 = all).
        error_reward: ``env_reward`` of an episode whose agent raised or timed out.
        max_prompt_length: most tokens of an episode's first prompt (0 = unchecked).
    """

    budget: int
    turn_tokens: int = 0
    timeout_s: float = 300.0
    concurrency: int = 0
    error_reward: float = 0.0
    max_prompt_length: int = 0


@dataclass
class AgentEpisode:
    """One episode's row and what the agent said about it.

    Attributes:
        episode: the token-exact row (:meth:`trajflow.serve.sessions.Session.episode`).
        answer: the agent's final answer, or None.
        error: why the agent failed (``timeout: ...`` or the exception), or None.
        drift: :func:`trajflow.serve.sessions.drift_tokens` summed over the stored calls.
        calls: calls the agent made; ``unchained``: of which not in the stored row.
    """

    episode: Episode
    answer: str | None
    error: str | None
    drift: int
    calls: int
    unchained: int


def _outcome(result: Any) -> tuple[float | None, str | None]:
    """``(reward, answer)`` from what the agent returned.

    Raises:
        TypeError: a type the contract does not allow.
    """
    if result is None:
        return None, None
    if isinstance(result, bool):
        raise TypeError("the agent returned a bool; return a number (reward) or a string (answer)")
    if isinstance(result, (int, float)):
        return float(result), None
    if isinstance(result, str):
        return None, result
    if isinstance(result, dict) and set(result) <= {"reward", "answer"}:
        reward = result.get("reward")
        answer = result.get("answer")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise TypeError(f"the agent's 'reward' is {type(reward).__name__}, not a number")
        return (None if reward is None else float(reward)), (None if answer is None else str(answer))
    raise TypeError(f"the agent returned {type(result).__name__}; return a number, a string, "
                    "{'reward': .., 'answer': ..} or None")


def run_agent_episodes(agent: Callable, server: "AgentServer", generate: Callable, rows: Sequence[dict],
                       sampling: tuple[float, float, int] | None, limits: AgentLimits, seed: int = 0,
                       top_logprobs: Callable | None = None) -> list[AgentEpisode]:
    """Run one episode of ``agent`` per row against ``server``, feeding ``generate`` from this thread.

    Args:
        agent: ``agent(task_row, base_url, api_key)``.
        server: a started :class:`~trajflow.serve.app.AgentServer`.
        generate: the engine's ``generate(prompt_ids, params)``; called only from this thread.
        rows: the episodes' prompt rows.
        sampling: ``(temperature, top_p, top_k)`` every call is sampled with (None: each request's).
        limits: the budgets and limits.
        seed: the base seed of the engine calls.
        top_logprobs: what answers ``top_logprobs`` requests (:class:`~trajflow.serve.batching.GenerationQueue`);
            None: they are refused.

    Returns:
        One :class:`AgentEpisode` per row, in order.

    Raises:
        Exception: what the engine raised (an agent's own failure is its row's ``error``).
    """
    from trajflow.serve.batching import GenerationQueue

    queue = GenerationQueue(generate, seed=seed, top_logprobs=top_logprobs)
    server.attach(queue, sampling)
    sessions = [server.open_session(limits.budget, limits.max_prompt_length, limits.turn_tokens) for _ in rows]
    results: list[Any] = [None] * len(rows)
    errors: list[str | None] = [None] * len(rows)
    started: list[float | None] = [None] * len(rows)
    finished = [False] * len(rows)
    slots = threading.Semaphore(limits.concurrency if limits.concurrency > 0 else max(1, len(rows)))
    released = [False] * len(rows)
    lock = threading.Lock()

    def free(i: int) -> None:  # under lock: give episode i's slot back, once
        if not released[i]:
            released[i] = True
            slots.release()

    def run(i: int) -> None:
        slots.acquire()
        with lock:
            started[i] = time.monotonic()
        try:
            out = agent(dict(rows[i]), server.session_url(sessions[i].sid), server.token)
            with lock:
                if not finished[i]:
                    results[i] = out
        except BaseException as e:  # noqa: BLE001 - any failure of the agent is its row's error
            with lock:
                # A call refused for the episode's token budget ends the episode with ``length``.
                if not finished[i] and not sessions[i].out_of_budget:
                    errors[i] = f"{type(e).__name__}: {e}".strip()
        finally:
            with lock:
                finished[i] = True
                free(i)
            sessions[i].close("the agent returned")

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"trajflow-agent-{i}") for i in range(len(rows))]
    for t in threads:
        t.start()

    def done() -> bool:
        now = time.monotonic()
        with lock:
            for i in range(len(rows)):
                begun = started[i]
                if not finished[i] and begun is not None and now - begun > limits.timeout_s:
                    finished[i] = True
                    errors[i] = f"timeout: the agent ran for more than rollout.agent_timeout_s={limits.timeout_s:g} s"
                    sessions[i].close("the episode timed out")
                    free(i)  # its thread may never return; the next episode takes its slot
            return all(finished)

    def live() -> int:
        with lock:
            return sum(1 for i in range(len(rows)) if started[i] is not None and not finished[i])

    try:
        queue.serve(done, live)
    finally:
        server.detach()
    out = []
    for i, s in enumerate(sessions):
        if s.turns:
            e = s.episode(server.eos_ids[0])
        else:  # no call: the row's prompt is the task's messages as the chat template renders them
            from trajflow.serve.chat import template_messages

            messages = template_messages(rows[i]["messages"])
            with server.tokenizer_lock:
                prompt = server.renderer([])[0].prompt_ids(messages)
            e = s.episode(server.eos_ids[0], prompt, messages)
        answer = None
        error = errors[i]
        if error is None:
            try:
                reward, answer = _outcome(results[i])
            except TypeError as exc:
                error, reward = str(exc), None
            if reward is not None:
                e.env_reward, e.env_reward_source = reward, "agent"
        if error is not None:
            e.env_reward, e.env_reward_source = float(limits.error_reward), "agent_error"
        e.agent_error, e.agent_answer, e.tito_drift_tokens, e.agent_calls = error, answer, s.drift, len(s.turns)
        out.append(AgentEpisode(e, answer, error, s.drift, len(s.turns), s.unchained))
    return out
