"""Multi-turn episodes as rollout rows: the episode record, the rollout table and the rollout metrics.

One row per sampled episode (see ``docs/multi-turn.md`` for the schema). ``response_ids`` holds every
token after the prompt: the model's tokens of each assistant turn exactly as sampled, interleaved
with the chat template's tokens of the observations; ``loss_mask`` marks the former with 1.
Plain data functions: no Ray, no Prefect, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from trajflow.batch import PROMPT_TYPE, list_column, nested_column

#: ``messages``: the conversation after the prompt messages (``tool_calls`` is JSON text or null).
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string())]))
#: ``tool_calls``: every call of the episode (``error`` null when it succeeded).
TOOL_CALLS_TYPE = pa.list_(pa.struct([("turn", pa.int32()), ("name", pa.string()), ("arguments", pa.string()),
                                      ("result", pa.string()), ("error", pa.string()),
                                      ("duration_s", pa.float32())]))
#: ``finish_reason`` of an episode.
FINISH_REASONS = ("stop", "length", "max_turns")


@dataclass
class Episode:
    """One sampled episode.

    Attributes:
        prompt_ids: tokens of the initial messages with the generation prompt.
        prompt_messages: the initial messages (``Environment.reset``; the ``prompt`` column).
        response_ids: every token after the prompt.
        loss_mask: 1 at generated tokens, 0 at observation and template tokens; ``len(response_ids)``.
        rollout_logprobs: the sampler's (behaviour policy's) log-prob at generated tokens, 0.0 elsewhere; ``len(response_ids)``.
        turn_spans: ``[start0, end0, start1, end1, ...]`` of each assistant turn in ``response_ids``.
        messages: the conversation after the prompt messages.
        tool_calls: ``{turn, name, arguments, result, error, duration_s}`` per call.
        finish_reason: ``stop``, ``length`` or ``max_turns``; ``None`` while running.
        env_reward: the environment's outcome reward, or ``None``.
        env_reward_source: where ``env_reward`` came from: ``step`` (the last reward a step gave),
            ``final`` (the environment's terminal ``final_reward`` call), ``default``
            (``rollout.multi_turn.default_env_reward``), or ``None`` (no reward).
        user_turns: observation turns appended so far.
        agent_error: ``rollout.agent`` episodes: why the agent failed (``timeout: ...``, the exception), or None.
        agent_answer: ``rollout.agent`` episodes: the final answer the agent returned (scored in place of
            the response text), or None.
        tito_drift_tokens: ``rollout.agent`` episodes: tokens where the agent's re-rendered history
            differed from the recorded tokens used instead (:func:`trajflow.serve.sessions.drift_tokens`).
        agent_calls: ``rollout.agent`` episodes: calls the agent made (those outside the stored chain included).
    """

    prompt_ids: list[int]
    prompt_messages: list[dict]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    turn_spans: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    env_reward: float | None = None
    env_reward_source: str | None = None
    user_turns: int = 0
    agent_error: str | None = None
    agent_answer: str | None = None
    tito_drift_tokens: int = 0
    agent_calls: int = 0

    @property
    def num_turns(self) -> int:
        """Assistant turns so far."""
        return len(self.turn_spans) // 2

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Append an assistant turn's sampled tokens (mask 1) and their sampler log-probs."""
        start = len(self.response_ids)
        self.response_ids.extend(int(t) for t in ids)
        self.loss_mask.extend([1] * len(ids))
        self.rollout_logprobs.extend([float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids))
        self.turn_spans.extend([start, len(self.response_ids)])

    def add_observation(self, ids: Sequence[int]) -> None:
        """Append observation/template tokens (mask 0, log-prob 0.0)."""
        self.response_ids.extend(int(t) for t in ids)
        self.loss_mask.extend([0] * len(ids))
        self.rollout_logprobs.extend([0.0] * len(ids))


def multi_turn_table(iteration: int, prompts: Sequence[Any], episodes: Sequence[Episode], response_text: Sequence[str],
                     n: int, policy_version: int, offset: int = 0,
                     extra_info_type: pa.DataType | None = None, agent: bool = False) -> pa.Table:
    """The rollout stage's output for multi-turn episodes (``len(prompts) * n`` rows, prompt-major).

    Args:
        iteration: iteration number.
        prompts: ``PromptRecord`` per prompt (``prompt_id``, ``data_source``, ``ground_truth``, ``extra_info``).
        episodes: ``n`` episodes per prompt, prompt-major.
        response_text: each episode's ``response_ids`` decoded (special tokens skipped).
        n: episodes per prompt.
        policy_version: the weights' version that generated.
        offset: number of the first prompt (:func:`trajflow.stages.rollout.sample_ids`).
        extra_info_type: the dataset's ``extra_info`` struct type (None infers it).
        agent: the episodes are ``rollout.agent``'s: add ``agent_error``, ``agent_answer`` (string or
            null), ``tito_drift_tokens`` and ``agent_calls`` (int32).

    Raises:
        ValueError: the episodes do not follow the row contract (lengths, finish reasons).
    """
    from trajflow.stages.rollout import sample_ids

    if len(episodes) != len(prompts) * n:
        raise ValueError(f"multi_turn_table: {len(episodes)} episodes for {len(prompts)} prompts x n={n}")
    for i, e in enumerate(episodes):
        if not len(e.loss_mask) == len(e.rollout_logprobs) == len(e.response_ids):
            raise ValueError(f"episode {i}: loss_mask/rollout_logprobs/response_ids lengths differ")
        if e.finish_reason not in FINISH_REASONS:
            raise ValueError(f"episode {i}: finish_reason {e.finish_reason!r} is not one of {FINISH_REASONS}")
    sids, gids = sample_ids(iteration, len(prompts), n, offset)
    rep = [p for p in prompts for _ in range(n)]
    cols = {
        "sample_id": pa.array(sids, pa.string()),
        "prompt_id": pa.array([str(p.prompt_id) for p in rep], pa.string()),
        "group_id": pa.array(gids, pa.string()),
        "iteration": pa.array([iteration] * len(sids), pa.int64()),
        "policy_version": pa.array([int(policy_version)] * len(sids), pa.int64()),
        "prompt": pa.array([[{"role": m["role"], "content": m["content"]} for m in e.prompt_messages]
                            for e in episodes], PROMPT_TYPE),
        "prompt_ids": list_column([e.prompt_ids for e in episodes], pa.int32()),
        "response_ids": list_column([e.response_ids for e in episodes], pa.int32()),
        "response_text": pa.array(list(response_text), pa.string()),
        "rollout_logprobs": list_column([e.rollout_logprobs for e in episodes], pa.float32()),
        "finish_reason": pa.array([e.finish_reason for e in episodes], pa.string()),
        "ground_truth": pa.array([str(p.ground_truth) for p in rep], pa.string()),
        "data_source": pa.array([p.data_source for p in rep], pa.string()),
        "extra_info": nested_column([p.extra_info for p in rep], extra_info_type),
        "loss_mask": list_column([e.loss_mask for e in episodes], pa.int8()),
        "turn_spans": list_column([e.turn_spans for e in episodes], pa.int32()),
        "num_turns": pa.array([e.num_turns for e in episodes], pa.int32()),
        "messages": pa.array([[{"role": m["role"], "content": m.get("content"), "tool_calls": m.get("tool_calls")}
                               for m in e.messages] for e in episodes], MESSAGES_TYPE),
        "tool_calls": pa.array([e.tool_calls for e in episodes], TOOL_CALLS_TYPE),
        "env_reward": pa.array([e.env_reward for e in episodes], pa.float32()),
        "env_reward_source": pa.array([e.env_reward_source for e in episodes], pa.string()),
    }
    if agent:
        cols["agent_error"] = pa.array([e.agent_error for e in episodes], pa.string())
        cols["agent_answer"] = pa.array([e.agent_answer for e in episodes], pa.string())
        cols["tito_drift_tokens"] = pa.array([e.tito_drift_tokens for e in episodes], pa.int32())
        cols["agent_calls"] = pa.array([e.agent_calls for e in episodes], pa.int32())
    return pa.table(cols)


def tool_calls_json(calls: Sequence[Any]) -> str | None:
    """An assistant message's ``tool_calls`` field: the parsed calls as JSON text, or ``None``."""
    if not calls:
        return None
    return json.dumps([{"name": c.name, "arguments": c.arguments if c.arguments is not None else c.raw}
                       for c in calls], ensure_ascii=False)


def multi_turn_metrics(table: pa.Table) -> dict[str, float]:
    """``tool/calls``, ``tool/errors``, ``tool/timeouts`` (counts over the batch), ``num_turns/mean|max``,
    ``tool/calls_per_episode`` and ``tool/well_formed_frac``; empty for a single-turn table.

    ``tool/errors`` counts every failed call (timeouts included); a timeout is an error whose text
    starts with ``timeout:`` (:mod:`trajflow.envs.sandbox`). ``tool/well_formed_frac`` is the share of
    episodes with at least one call that parsed, named a known tool and passed its arguments' schema
    (whatever the tool then did): what a model has to learn first.
    """
    if "num_turns" not in table.column_names:
        return {}
    turns = np.asarray(table.column("num_turns").to_numpy(zero_copy_only=False), np.float64)
    calls = [c for row in table.column("tool_calls").to_pylist() for c in (row or [])]
    errors = [c["error"] for c in calls if c["error"] is not None]
    rows = max(1, table.num_rows)
    format_errors = ("malformed:", "unknown tool:", "arguments:")
    well_formed = sum(any(c["error"] is None or not c["error"].startswith(format_errors) for c in (row or []))
                      for row in table.column("tool_calls").to_pylist())
    return {"tool/calls": float(len(calls)), "tool/errors": float(len(errors)),
            "tool/well_formed_frac": well_formed / rows,
            "tool/timeouts": float(sum(e.startswith("timeout:") for e in errors)),
            "tool/calls_per_episode": len(calls) / rows,
            "num_turns/mean": float(turns.mean()) if turns.size else 0.0,
            "num_turns/max": float(turns.max()) if turns.size else 0.0, **agent_metrics(table)}


def agent_metrics(table: pa.Table) -> dict[str, float]:
    """``rollout.agent`` rows: ``rollout/tito_drift_tokens`` (sum over the batch: tokens where an agent's
    re-rendered history differed from the recorded ones the rows use), ``rollout/agent_error_frac``
    (rows whose agent raised or timed out), ``rollout/agent_timeout_frac`` and ``rollout/agent_calls``
    (mean calls per episode); empty for other rows."""
    if "agent_error" not in table.column_names:
        return {}
    errors = table.column("agent_error").to_pylist()
    rows = max(1, table.num_rows)
    return {"rollout/tito_drift_tokens": float(sum(table.column("tito_drift_tokens").to_pylist())),
            "rollout/agent_error_frac": sum(e is not None for e in errors) / rows,
            "rollout/agent_timeout_frac": sum(e is not None and e.startswith("timeout:") for e in errors) / rows,
            "rollout/agent_calls": sum(table.column("agent_calls").to_pylist()) / rows}


@dataclass(frozen=True)
class EpisodeGeneration:
    """What a multi-turn rollout returns: ``len(rows)`` episodes (the caller repeats each prompt row ``n``
    times, prompt-major).

    Attributes:
        episodes: the episodes.
        response_ids: each episode's ``response_ids`` (for length metrics and scoring).
        response_text: each episode's ``response_ids`` decoded without special tokens.
        policy_version: the version of the weights that generated.
        timing: ``timing_s/gen`` (seconds, tool calls included).
    """

    episodes: list[Episode]
    response_ids: list[list[int]]
    response_text: list[str]
    policy_version: int
    timing: dict[str, float] = field(default_factory=dict)
