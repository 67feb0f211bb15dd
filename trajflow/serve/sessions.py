"""Token-exact sessions: what the endpoint fed the engine and what it sampled, per episode, and the
episode's training row built from those tokens alone (token-in/token-out).

An episode's calls share a session (its own base URL, :mod:`trajflow.serve.app`). Each call is a
:class:`Turn`: the prompt ids the engine was fed and, per choice, the ids it sampled with their
log-probs. When a request continues an earlier turn (its history is that turn's history, then the
assistant message the endpoint returned for one of its choices, then new messages), its prompt is
*not* the re-tokenised history: it is the earlier turn's prompt ids, the sampled ids of that choice
exactly, then the chat template's tokens for what follows (the assistant turn's closing, the new
messages, the next generation prompt; :meth:`trajflow.envs.render.ChatRenderer.observation_ids`).
Where the re-rendered history's tokens differ from these, the difference is counted as drift
(:func:`drift_tokens`; ``rollout/tito_drift_tokens``), never trained on.

The stored row (:meth:`Session.episode`) follows the chain of continued turns that ends at the
episode's last call: ``prompt_ids`` are its first call's prompt, ``response_ids`` every sampled
turn (``loss_mask`` 1, the engine's log-probs) interleaved with the template's observation tokens
(``loss_mask`` 0, log-prob 0.0). Calls outside that chain (a fresh conversation, a rewritten
history, a choice that was not continued) are counted (``rollout/agent_unchained_calls``), not stored.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from trajflow.stages.multi_turn import Episode
from trajflow.serve.chat import RequestError, message_key


@dataclass
class Sample:
    """One choice of a call, as sampled.

    Attributes:
        ids: the sampled token ids (cut at a stop string or ``max_tokens``; EOS included when the
            model stopped).
        logprobs: the engine's log-prob of each of ``ids`` (None for greedy decoding).
        finish_reason: ``stop`` (EOS or a stop string) or ``length``.
        text: the text returned (special tokens skipped; before a stop string).
        message: chat: the assistant message returned; None for completions.
    """

    ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    text: str
    message: dict | None = None

    @property
    def key(self) -> tuple | None:
        return message_key(self.message) if self.message is not None else None


@dataclass
class Turn:
    """One call of a session.

    Attributes:
        kind: ``chat`` or ``completion``.
        prompt_ids: the ids the engine was fed.
        history: chat: the template messages of the request (:func:`trajflow.serve.chat.template_messages`);
            completion: ``[prompt text]`` (or ``[]`` for a token-id prompt).
        keys: chat: :func:`trajflow.serve.chat.message_key` of each request message.
        tools: the request's tools as canonical JSON text ("" without tools).
        parent: ``(turn index, choice index)`` this call continues, or None.
        obs_ids: the template tokens between the parent's sampled ids and this call's generation.
        drift: tokens where the request re-rendered differs from ``prompt_ids`` (:func:`drift_tokens`).
        samples: one per choice.
        raw: chat: the request's messages as sent (their tool calls and ids, for the stored record).
    """

    kind: str
    prompt_ids: list[int]
    history: list[Any]
    keys: list[tuple] = field(default_factory=list)
    tools: str = ""
    parent: tuple[int, int] | None = None
    obs_ids: list[int] = field(default_factory=list)
    drift: int = 0
    samples: list[Sample] = field(default_factory=list)
    raw: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class Prepared:
    """A request's prompt, before sampling: the ids to feed, what they continue and the budget left.

    Attributes:
        prompt_ids: the ids to feed the engine.
        parent: ``(turn, choice)`` continued, or None.
        obs_ids: the template tokens appended after the parent's sampled ids.
        drift: :func:`drift_tokens` between the re-rendered request and ``prompt_ids``.
        budget: tokens this call may still sample (the episode's ``rollout.max_new_tokens`` minus
            everything after its first prompt).
    """

    prompt_ids: list[int]
    parent: tuple[int, int] | None
    obs_ids: list[int]
    drift: int
    budget: int


def drift_tokens(rendered: Sequence[int], recorded: Sequence[int]) -> int:
    """How many tokens two renderings of one context disagree on: the longer one's length minus
    their common prefix and common suffix (0 when equal).

    Example: ``[1, 2, 3, 4]`` vs ``[1, 9, 9, 9, 4]`` -> 5 - 1 - 1 = 3.
    """
    a, b = list(rendered), list(recorded)
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    s = 0
    while s < min(len(a), len(b)) - p and a[-1 - s] == b[-1 - s]:
        s += 1
    return max(len(a), len(b)) - p - s


class BudgetExhausted(RequestError):
    """The episode has no tokens left to sample (``rollout.max_new_tokens``); it ends with ``length``."""


class SessionClosed(RequestError):
    """The session ended (the episode timed out, or the rollout is over)."""


class Session:
    """The calls of one episode.

    Args:
        sid: the session id (part of the episode's base URL).
        budget: ``rollout.max_new_tokens``: most tokens after the first prompt (sampled and template).
        max_prompt_length: most tokens of the first prompt (``data.max_prompt_length``; 0 = unchecked).
        turn_tokens: most tokens one call samples (``rollout.multi_turn.max_tokens_per_turn``; 0 = the budget).
        eos_ids: ids that end an assistant turn.
    """

    def __init__(self, sid: str, budget: int, max_prompt_length: int = 0, turn_tokens: int = 0,
                 eos_ids: Sequence[int] = ()) -> None:
        self.sid = sid
        self.budget = int(budget)
        self.max_prompt_length = int(max_prompt_length)
        self.turn_tokens = int(turn_tokens)
        self.eos_ids = {int(e) for e in eos_ids}
        self.turns: list[Turn] = []
        self.lock = threading.Lock()
        self.closed: str | None = None  # why no call is served any more
        self.out_of_budget = False
        self.in_flight = 0

    # ------------------------------------------------------------------ requests
    def _check_open(self) -> None:
        if self.closed is not None:
            raise SessionClosed(f"session {self.sid} is closed: {self.closed}")

    def _budget(self, prompt_ids: Sequence[int], parent: tuple[int, int] | None) -> int:
        if parent is None:
            if self.max_prompt_length and len(prompt_ids) > self.max_prompt_length:
                raise RequestError(f"the prompt is {len(prompt_ids)} tokens, more than data.max_prompt_length="
                                   f"{self.max_prompt_length}")
            left = self.budget
        else:
            root = self.root_prompt(parent)
            left = self.budget - (len(prompt_ids) - len(root))
        if left <= 0:
            self.out_of_budget = True
            raise BudgetExhausted(f"the episode's token budget (rollout.max_new_tokens={self.budget}) is used up")
        return min(left, self.turn_tokens) if self.turn_tokens else left

    def root_prompt(self, ref: tuple[int, int]) -> list[int]:
        """The first prompt of the chain that ``ref`` (turn, choice) belongs to."""
        t = self.turns[ref[0]]
        while t.parent is not None:
            t = self.turns[t.parent[0]]
        return t.prompt_ids

    def prepare_chat(self, renderer: Any, history: list[dict], keys: list[tuple], tools: str) -> Prepared:
        """The prompt ids of a chat request.

        Args:
            renderer: a :class:`trajflow.envs.render.ChatRenderer` with the request's tools.
            history: the request's template messages.
            keys: :func:`~trajflow.serve.chat.message_key` of each request message.
            tools: the request's tools as canonical JSON text.

        Raises:
            SessionClosed, BudgetExhausted, RequestError: the call cannot be served (HTTP 400).
        """
        from trajflow.envs.render import TemplatePrefixError

        with self.lock:
            self._check_open()
            conv = renderer.with_tools(history)
            fresh = renderer.encode(renderer.text(conv, add_generation_prompt=True))
            parent = self._chat_parent(keys, tools)
            if parent is None:
                return Prepared(fresh, None, [], 0, self._budget(fresh, None))
            t, s = self.turns[parent[0]], self.turns[parent[0]].samples[parent[1]]
            cut = len(t.keys)
            ended = s.ids[-1] if s.finish_reason == "stop" and s.ids and s.ids[-1] in self.eos_ids else None
            try:
                obs = renderer.observation_ids(renderer.with_tools(history[:cut]), history[cut + 1:], ended_with=ended)
            except TemplatePrefixError:
                return Prepared(fresh, None, [], 0, self._budget(fresh, None))
            ids = t.prompt_ids + s.ids + obs
            return Prepared(ids, parent, obs, drift_tokens(fresh, ids), self._budget(ids, parent))

    def _chat_parent(self, keys: list[tuple], tools: str) -> tuple[int, int] | None:
        """The latest (turn, choice) whose history, then the choice's returned message, start ``keys``
        with at least one message after them."""
        for i in range(len(self.turns) - 1, -1, -1):
            t = self.turns[i]
            n = len(t.keys)
            if t.kind != "chat" or t.tools != tools or len(keys) <= n + 1 or keys[:n] != t.keys:
                continue
            for j, s in enumerate(t.samples):
                if s.key == keys[n]:
                    return i, j
        return None

    def prepare_completion(self, encode: Any, prompt: str | None, prompt_ids: list[int] | None) -> Prepared:
        """The prompt ids of a completions request (a text prompt, or token ids).

        A text prompt continues a turn when it starts with that turn's prompt text and a choice's
        returned text; token ids continue one when they start with its prompt ids and sampled ids.
        """
        with self.lock:
            self._check_open()
            fresh = list(prompt_ids) if prompt_ids is not None else encode(prompt)
            for i in range(len(self.turns) - 1, -1, -1):
                t = self.turns[i]
                if t.kind != "completion":
                    continue
                for j, s in enumerate(t.samples):
                    if prompt_ids is not None:
                        head = t.prompt_ids + s.ids
                        if len(prompt_ids) > len(head) and list(prompt_ids[:len(head)]) == head:
                            obs = list(prompt_ids[len(head):])
                            return Prepared(head + obs, (i, j), obs, 0, self._budget(head + obs, (i, j)))
                    elif t.history and prompt.startswith(t.history[0] + s.text) and \
                            len(prompt) > len(t.history[0] + s.text):
                        obs = encode(prompt[len(t.history[0] + s.text):])
                        ids = t.prompt_ids + s.ids + obs
                        return Prepared(ids, (i, j), obs, drift_tokens(fresh, ids), self._budget(ids, (i, j)))
            return Prepared(fresh, None, [], 0, self._budget(fresh, None))

    def record(self, turn: Turn) -> int:
        """Store a served call; returns its index."""
        with self.lock:
            self.turns.append(turn)
            return len(self.turns) - 1

    def close(self, reason: str) -> None:
        """Serve no more calls (they get HTTP 400 naming ``reason``)."""
        with self.lock:
            if self.closed is None:
                self.closed = reason

    # ------------------------------------------------------------------ the row
    def chain(self) -> list[tuple[Turn, Sample]]:
        """The continued calls that end at the last call (its first choice), first call first."""
        if not self.turns:
            return []
        out, ref = [], (len(self.turns) - 1, 0)
        while ref is not None:
            t = self.turns[ref[0]]
            out.append((t, t.samples[ref[1]]))
            ref = t.parent
        return out[::-1]

    def episode(self, eos_id: int, prompt_ids: Sequence[int] = (), prompt_messages: Sequence[dict] = ()) -> Episode:
        """The episode's training row (:class:`trajflow.stages.multi_turn.Episode`) from the recorded tokens.

        A session without any call (the agent failed before its first one) is ``prompt_ids`` (the
        task's messages, ``prompt_messages``, rendered) and one EOS token with ``loss_mask`` 0: a row
        that trains nothing but keeps the group's shape.
        """
        chain = self.chain()
        if not chain:
            e = Episode(prompt_ids=list(prompt_ids), prompt_messages=[dict(m) for m in prompt_messages])
            e.add_observation([eos_id])
            e.finish_reason = "stop"
            return e
        root = chain[0][0]
        prompt_messages = root.history if root.kind == "chat" else [{"role": "user", "content": "".join(root.history)}]
        e = Episode(prompt_ids=list(root.prompt_ids), prompt_messages=[dict(m) for m in prompt_messages])
        for k, (t, s) in enumerate(chain):
            if k:
                e.add_observation(t.obs_ids)
            e.add_generated(s.ids, s.logprobs)
        last_turn, last = chain[-1]
        if last_turn.kind == "chat":
            e.messages, e.tool_calls = _conversation(last_turn, len(root.history), last)
        else:
            e.messages = [{"role": "assistant", "content": s.text, "tool_calls": None} for _, s in chain]
        e.finish_reason = "length" if (self.out_of_budget or last.finish_reason == "length") else "stop"
        return e

    @property
    def drift(self) -> int:
        """Drift tokens of the calls in the stored chain."""
        return sum(t.drift for t, _ in self.chain())

    @property
    def unchained(self) -> int:
        """Calls not in the stored chain."""
        return len(self.turns) - len(self.chain())


def _conversation(last: Turn, start: int, sample: Sample) -> tuple[list[dict], list[dict]]:
    """The ``messages`` after the prompt (the last request's history, then the last reply) and the
    ``tool_calls`` record: each assistant call with the tool message that answered it (by
    ``tool_call_id``, else in order)."""
    msgs = [dict(m) for m in last.history[start:]]
    reply = sample.message or {"role": "assistant", "content": sample.text}
    raw = list(last.raw[start:]) + [reply]
    messages, calls, pending, turn = [], [], [], -1
    for m, tm in zip(raw, msgs + [{"role": "assistant", "content": sample.text}]):
        tcs = m.get("tool_calls") or []
        parsed = [{"name": c.get("function", {}).get("name", ""), "arguments": c.get("function", {}).get("arguments")}
                  for c in tcs]
        messages.append({"role": tm["role"], "content": tm["content"],
                         "tool_calls": json.dumps(parsed, ensure_ascii=False) if parsed else None})
        if m.get("role") == "assistant":
            turn += 1
            for c, p in zip(tcs, parsed):
                args = p["arguments"] if isinstance(p["arguments"], str) else json.dumps(p["arguments"])
                pending.append({"id": c.get("id"), "turn": turn, "name": p["name"], "arguments": args})
        elif m.get("role") == "tool" and pending:
            k = next((i for i, c in enumerate(pending) if c["id"] and c["id"] == m.get("tool_call_id")), 0)
            c = pending.pop(k)
            calls.append({"turn": c["turn"], "name": c["name"], "arguments": c["arguments"],
                          "result": tm["content"], "error": None, "duration_s": 0.0})
    return messages, calls
