"""The multi-turn episode loop, over any :class:`~trajflow.engines.base.RolloutEngine` (HF, vLLM,
remote rollout workers): prompts go in as token ids and come out as token ids, so the same loop
serves every engine.

Each round generates one assistant turn for every live episode (one ``engine.generate`` call per
distinct token budget, ``n=1`` per episode), asks the episodes' environments for their answers
concurrently (their tool calls run in the sandbox's processes at the same time), and appends the
observation tokens rendered by the chat template (:class:`trajflow.envs.render.ChatRenderer`). The
model's tokens are kept exactly as sampled.

Budgets: ``total_tokens`` caps ``len(response_ids)`` (``rollout.max_new_tokens``); a turn generates
at most ``turn_tokens`` (0 = what is left). A turn cut by a budget (no EOS), or observation tokens
that would not fit, end the episode with ``length``; an episode whose environment is not done after
``max_assistant_turns`` turns, or that would need more than ``max_user_turns`` observation turns,
ends with ``max_turns``; one whose environment says done ends with ``stop``.

Every ended episode has an outcome for the ``env`` scorer where one exists: the last reward a step
gave (``env_reward_source`` ``step``); else the environment's terminal call
(:meth:`~trajflow.envs.registry.Environment.final_reward`, source ``final``), made once per episode
that no step rewarded, also one whose first turn was cut before any step; else
``rollout.multi_turn.default_env_reward`` (source ``default``); else none (``null``, which the
``env`` scorer refuses, naming the row).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from trajflow.stages.multi_turn import Episode, tool_calls_json
from trajflow.stages.rollout import SamplingParams
from trajflow.envs.registry import Environment, StepResult
from trajflow.envs.render import ChatRenderer
from trajflow.envs.tool_format import parse_tool_calls


@dataclass(frozen=True)
class EpisodeLimits:
    """Budgets of an episode (``rollout.max_new_tokens`` and ``rollout.multi_turn.*``).

    Attributes:
        total_tokens: most tokens after the prompt (generated and observation), >= 1.
        turn_tokens: most tokens one assistant turn generates (0 = what is left of ``total_tokens``).
        max_assistant_turns: most assistant turns, >= 1.
        max_user_turns: most observation turns.
    """

    total_tokens: int
    turn_tokens: int = 0
    max_assistant_turns: int = 4
    max_user_turns: int = 4


def turn_seed(seed: int, turn: int, budget: int) -> int:
    """The sampling seed of one ``generate`` call of an episode round (distinct per turn and budget)."""
    return (int(seed) * 1_000_003 + turn * 7_919 + budget) % (2 ** 62)


def run_episodes(engine: Any, renderer: ChatRenderer, envs: Sequence[Environment], rows: Sequence[dict],
                 params: SamplingParams, limits: EpisodeLimits, eos_ids: Sequence[int], fmt: str = "hermes",
                 decode: Any = None, step_workers: int = 8, max_prompt_length: int = 0,
                 default_reward: float | None = None) -> list[Episode]:
    """Run one episode per ``(env, row)`` pair to its end.

    Args:
        engine: ``generate(prompt_ids, params) -> GenerationOutput`` (n=1 per prompt).
        renderer: the chat template renderer (with the environment's tool schemas).
        envs: one fresh environment per episode.
        rows: the prompt row of each episode (``messages``, ``ground_truth``, ``data_source``, ``extra_info``).
        params: sampling parameters; ``n`` and ``max_new_tokens`` are replaced per call.
        limits: the budgets.
        eos_ids: ids that end an assistant turn.
        fmt: ``rollout.multi_turn.format`` (to record the parsed calls on the assistant message).
        decode: ``ids -> text`` for the assistant messages (the tokenizer's decode without special tokens).
        step_workers: environments stepped at once.
        max_prompt_length: ``data.max_prompt_length`` (0 = unchecked): the environment's ``reset`` may
            rewrite the dataset prompt, so its rendering is checked again here, as single-turn prompts are.
        default_reward: ``env_reward`` of an episode that neither a step nor ``final_reward`` rewarded.

    Returns:
        The episodes, in ``envs`` order, each with a ``finish_reason``.

    Raises:
        TemplatePrefixError: the chat template cannot be extended turn by turn.
        ValueError: a prompt from ``reset`` is longer than ``max_prompt_length`` tokens (names the row,
            its prompt id, its length and the key).
    """
    if decode is None:
        decode = lambda ids: renderer.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    eos = set(int(e) for e in eos_ids)
    episodes, convs = [], []
    for env, row in zip(envs, rows):
        initial = env.reset(row)
        conv = renderer.with_tools(initial)
        prompt_ids = renderer.prompt_ids(initial)
        if max_prompt_length and len(prompt_ids) > max_prompt_length:
            raise ValueError(f"prompt row {len(episodes)} (prompt_id {row.get('prompt_id')!r}): the environment's "
                             f"reset gave a prompt of {len(prompt_ids)} tokens, more than "
                             f"data.max_prompt_length={max_prompt_length}; shorten what reset returns or raise "
                             f"data.max_prompt_length")
        episodes.append(Episode(prompt_ids=prompt_ids, prompt_messages=initial))
        convs.append(conv)
    for turn in range(limits.max_assistant_turns):
        live = [i for i, e in enumerate(episodes) if not e.done]
        if not live:
            break
        budgets: dict[int, list[int]] = {}
        for i in live:
            left = limits.total_tokens - len(episodes[i].response_ids)
            budgets.setdefault(min(left, limits.turn_tokens) if limits.turn_tokens else left, []).append(i)
        stepping, ended = [], {}
        for budget, idx in sorted(budgets.items()):
            call = dataclasses.replace(params, n=1, max_new_tokens=budget, seed=turn_seed(params.seed, turn, budget))
            out = engine.generate([episodes[i].prompt_ids + episodes[i].response_ids for i in idx], call)
            for j, i in enumerate(idx):
                ids = list(out.response_ids[j])
                e = episodes[i]
                e.add_generated(ids, out.rollout_logprobs[j] if out.rollout_logprobs is not None else None)
                text = decode(ids)
                calls = parse_tool_calls(text, fmt)
                e.messages.append({"role": "assistant", "content": text, "tool_calls": tool_calls_json(calls)})
                if out.finish_reason[j] != "stop" or not ids:
                    e.finish_reason = "length"  # cut by the turn or total budget: not a finished message
                else:
                    stepping.append(i)
                    ended[i] = ids[-1] if ids[-1] in eos else None  # the end token the model wrote, if any
        with ThreadPoolExecutor(max_workers=max(1, min(step_workers, len(stepping) or 1))) as pool:
            results: list[StepResult] = list(pool.map(
                lambda i: envs[i].step({"role": "assistant", "content": episodes[i].messages[-1]["content"]}),
                stepping))
        for i, res in zip(stepping, results):
            e = episodes[i]
            e.tool_calls.extend({"turn": turn, "name": r.name, "arguments": r.arguments, "result": r.result,
                                 "error": r.error, "duration_s": float(r.duration_s)} for r in res.tool_calls)
            if res.reward is not None:
                e.env_reward, e.env_reward_source = float(res.reward), "step"
            if res.done:
                e.finish_reason = "stop"
                continue
            if turn + 1 >= limits.max_assistant_turns or e.user_turns >= limits.max_user_turns:
                e.messages.extend({"role": m["role"], "content": m["content"], "tool_calls": None}
                                  for m in res.observations)
                e.finish_reason = "max_turns"
                continue
            before = convs[i]
            obs_ids = renderer.observation_ids(before, res.observations, ended_with=ended[i])
            convs[i] = before + [{"role": "assistant", "content": e.messages[-1]["content"]}] + \
                [dict(m) for m in res.observations]
            e.messages.extend({"role": m["role"], "content": m["content"], "tool_calls": None}
                              for m in res.observations)
            if len(e.response_ids) + len(obs_ids) >= limits.total_tokens:
                e.finish_reason = "length"  # no room for the observation and a reply to it
                continue
            e.add_observation(obs_ids)
            e.user_turns += 1
    for i, e in enumerate(episodes):
        if e.finish_reason is None:
            e.finish_reason = "max_turns"
        if e.env_reward is None:
            final = envs[i].final_reward([dict(m) for m in e.messages], e.finish_reason)
            if final is not None:
                e.env_reward, e.env_reward_source = float(final), "final"
            elif default_reward is not None:
                e.env_reward, e.env_reward_source = float(default_reward), "default"
    return episodes


class EpisodeRunner:
    """Everything one process needs to run episodes from the ``rollout.multi_turn`` config: the tools,
    the sandbox (its processes start on first use), the renderer and the environment factory.

    Args:
        multi_turn: the ``rollout.multi_turn`` section.
        tokenizer: the policy's tokenizer (with a chat template).
        eos_ids: ids that end an assistant turn.
        total_tokens: ``rollout.max_new_tokens``, the cap on everything after the prompt.

    Raises:
        ConfigError: the tool config is wrong (names the file, the tool and the field).
        ValueError: unknown environment, or a tokenizer without a chat template.
    """

    def __init__(self, multi_turn: Any, tokenizer: Any, eos_ids: Sequence[int], total_tokens: int) -> None:
        import logging

        from trajflow.envs.registry import EnvContext, environment_tools
        from trajflow.envs.sandbox import Sandbox
        from trajflow.envs.tools import load_tool_config

        self.cfg = multi_turn
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        configured = load_tool_config(multi_turn.tool_config_path) if multi_turn.tool_config_path else []
        tools = environment_tools(multi_turn.environment, EnvContext(configured, None, multi_turn.format))
        self.sandbox = Sandbox(tools, max_response_chars=multi_turn.max_tool_response_length,
                               workers=multi_turn.tool_workers,
                               allow_weaker=bool(getattr(multi_turn, "allow_weaker_sandbox", False)))
        self.context = EnvContext(configured, self.sandbox, multi_turn.format)
        self.renderer = ChatRenderer(tokenizer, [t.schema() for t in tools], self.eos_ids)
        self.limits = EpisodeLimits(total_tokens=int(total_tokens), turn_tokens=int(multi_turn.max_tokens_per_turn),
                                    max_assistant_turns=int(multi_turn.max_assistant_turns),
                                    max_user_turns=int(multi_turn.max_user_turns))
        if tools:  # refuses a weaker sandbox than allowed before any episode starts
            self.sandbox.check_isolation()
            logging.getLogger(__name__).info("tool sandbox isolation: %s", self.sandbox.isolation)

    def run(self, engine: Any, rows: Sequence[dict], params: SamplingParams,
            max_prompt_length: int = 0) -> list[Episode]:
        """One episode per row (fresh environments) with ``engine``; ``max_prompt_length`` as in :func:`run_episodes`."""
        from trajflow.envs.registry import make_environment

        envs = [make_environment(self.cfg.environment, self.context) for _ in rows]
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return run_episodes(engine, self.renderer, envs, rows, params, self.limits, self.eos_ids,
                            fmt=self.cfg.format, decode=decode, step_workers=max(1, int(self.cfg.tool_workers)),
                            default_reward=getattr(self.cfg, "default_env_reward", None),
                            max_prompt_length=int(max_prompt_length))
