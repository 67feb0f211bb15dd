"""LLM-as-judge reward (``reward.judge``): a generative model behind an OpenAI-compatible endpoint
rates each response, and its rating becomes (part of) the response's score.

As in the generative-reward-model / LLM-as-judge setups of verl, OpenRLHF and TRL (Zheng et al.
2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena"), the judge is asked, per response,
with a prompt template filled from the row (:func:`judge_prompt`); its reply is parsed for a score
in ``[score_min, score_max]`` (:func:`parse_verdict`) and mapped to ``[0, 1]``. The combined score is

    score = rule_weight * rule + weight * judge

(``rule_weight = 0``: the judge alone, and the rule scorers do not run).

Calls go through the real ``openai`` client: each request has ``timeout_s``; the client retries
timeouts, connection errors and HTTP 408/409/429/5xx ``max_retries`` times with its exponential
backoff, and at ``temperature > 0`` an unparseable reply is asked again as often. A judgement that
still fails is never a silent zero: the row gets ``error_score``, its ``reward_error`` names why
(``judge: ...``), so the gate counts it (``scorer_error_rate``) and quarantines it, and
``reward/judge_error_frac`` is logged. At ``temperature = 0`` with a ``seed`` the judgements are as
deterministic as the judge's server makes greedy decoding (trajflow's own endpoint: exactly).

The API key is read from the environment variable ``api_key_env`` names when scoring; it is never
written anywhere.
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

#: ``Score: 7``, ``rating = 7.5``, ``**Score:** 8/10``, ``Grade: 3 out of 5``: a keyword, then a number,
#: optionally ``/ max`` or ``out of max``.
_KEYWORD = re.compile(r"(?:score|rating|grade|verdict)[^\w-]{0,4}(-?\d+(?:\.\d+)?)(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?",
                      re.IGNORECASE)
#: A reply that is only a number (``7``, ``7/10``, ``**7**``, ``7.``).
_BARE = re.compile(r"^\W*(-?\d+(?:\.\d+)?)(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?\W*$", re.IGNORECASE)
#: Longest part of a judge reply kept in ``reward_extra`` (for audit).
REPLY_CHARS = 300


class VerdictError(ValueError):
    """The judge's reply has no score in range."""


def parse_verdict(text: str, score_min: float = 0.0, score_max: float = 10.0) -> float:
    """The judge's score in a reply, mapped to ``[0, 1]``: ``(x - score_min) / (score_max - score_min)``.

    The score is the number after the *last* ``score``/``rating``/``grade``/``verdict`` keyword
    (case-insensitive, up to four non-word characters other than ``-`` between, e.g. ``**Score:** 8``), or the whole
    reply when it is a single number. ``x / m`` or ``x out of m`` is read as the fraction ``x / m``.

    Args:
        text: the judge's reply.
        score_min, score_max: the range the prompt asked for.

    Returns:
        float in ``[0, 1]``.

    Raises:
        VerdictError: no score found, or outside ``[score_min, score_max]`` (or ``x / m`` outside ``[0, 1]``).
    """
    text = str(text or "")
    found = list(_KEYWORD.finditer(text))
    m = found[-1] if found else _BARE.match(text.strip())
    if m is None:
        raise VerdictError(f"no score in the judge's reply {_snippet(text)!r}")
    x = float(m.group(1))
    if m.group(2) is not None:
        denom = float(m.group(2))
        if denom <= 0 or not 0.0 <= x <= denom:
            raise VerdictError(f"score {m.group(0)!r} is not a fraction in [0, 1]")
        return x / denom
    if not score_min <= x <= score_max:
        raise VerdictError(f"score {x:g} is outside [{score_min:g}, {score_max:g}] in {_snippet(text)!r}")
    return (x - score_min) / (score_max - score_min)


def _snippet(text: str, n: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _message_text(m: Any) -> str:
    content = m.get("content") if isinstance(m, Mapping) else m
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def judge_prompt(template: str, messages: Sequence[Mapping] | str, response: str, ground_truth: Any) -> str:
    """``template`` filled for one row.

    Args:
        template: ``reward.judge.prompt_template`` (``str.format`` placeholders).
        messages: the row's prompt (chat messages, or a plain text prompt).
        response: the response text (or the agent's answer).
        ground_truth: the row's reference answer.

    Returns:
        The judge's user message: ``{question}`` is the prompt's last user message, ``{prompt}`` the
        whole prompt as ``role: content`` lines, ``{response}``, ``{ground_truth}`` (empty when None).
    """
    if isinstance(messages, str):
        question = prompt = messages
    else:
        msgs = list(messages or [])
        users = [_message_text(m) for m in msgs if isinstance(m, Mapping) and m.get("role") == "user"]
        question = users[-1] if users else (_message_text(msgs[-1]) if msgs else "")
        prompt = "\n".join(f"{m.get('role', '')}: {_message_text(m)}" for m in msgs if isinstance(m, Mapping))
    return template.format(question=question, prompt=prompt, response=str(response or ""),
                           ground_truth="" if ground_truth is None else str(ground_truth))


@dataclass
class JudgeResult:
    """The judge's verdicts on a batch.

    Attributes:
        scores: ``(rows,)`` float32 judge scores in ``[0, 1]``; ``error_score`` where the judgement failed.
        errors: per row, why the judgement failed (``judge: ...``), or None.
        replies: per row, the judge's last reply (up to :data:`REPLY_CHARS` characters), or None.
    """

    scores: np.ndarray
    errors: list[str | None]
    replies: list[str | None]


def judge_api_key(cfg: Mapping) -> str:
    """The judge's API key: the environment variable ``cfg["api_key_env"]`` names ("EMPTY" when none is named).

    Raises:
        ValueError: the variable is named but not set (one line naming it).
    """
    name = cfg.get("api_key_env")
    if not name:
        return "EMPTY"  # the openai client needs some key; a server without auth ignores it
    value = os.environ.get(str(name))
    if not value:
        raise ValueError(f"reward.judge.api_key_env={name!r}: the environment variable {name} is not set")
    return value


def judge_client(cfg: Mapping, base_url: str | None = None, api_key: str | None = None) -> Any:
    """An ``openai.OpenAI`` client for the judge, with ``timeout_s`` and ``max_retries``.

    Args:
        cfg: the ``reward.judge`` section as a dict.
        base_url: the endpoint (default ``cfg["base_url"]``; the judge worker's for ``model_path``).
        api_key: the bearer token (default: :func:`judge_api_key`; the run's token for ``model_path``).

    Raises:
        ValueError: no ``api_key`` given and the key's environment variable is named but not set.
    """
    import openai

    return openai.OpenAI(base_url=str(base_url or cfg["base_url"]), api_key=api_key or judge_api_key(cfg),
                         timeout=float(cfg.get("timeout_s", 60.0)), max_retries=int(cfg.get("max_retries", 2)))


def judge_scores(cfg: Mapping, prompts: Sequence[Any], responses: Sequence[str], ground_truths: Sequence[Any],
                 client: Any = None) -> JudgeResult:
    """Ask the judge about every response (``cfg["concurrency"]`` requests at once).

    Args:
        cfg: the ``reward.judge`` section as a dict.
        prompts: per row, the prompt's chat messages (or text).
        responses: per row, the text judged.
        ground_truths: per row, the reference answer (or None).
        client: an ``openai.OpenAI`` client to use (default: :func:`judge_client`, for ``cfg["base_url"]``).

    Returns:
        :class:`JudgeResult`; never raises for a failed judgement (it is that row's error).

    Raises:
        ValueError: the API key's environment variable is named but not set.
    """
    import openai

    if client is None:
        client = judge_client(cfg)
    temperature = float(cfg.get("temperature", 0.0))
    # At temperature 0 the same request gives the same reply: asking again would not help.
    tries = 1 + (int(cfg.get("max_retries", 2)) if temperature > 0 else 0)
    lo, hi = float(cfg.get("score_min", 0.0)), float(cfg.get("score_max", 10.0))
    extra = {} if cfg.get("seed") is None else {"seed": int(cfg["seed"])}
    system = cfg.get("system_prompt")

    def one(i: int) -> tuple[float | None, str | None, str | None]:
        try:
            text = judge_prompt(str(cfg["prompt_template"]), prompts[i], responses[i], ground_truths[i])
        except (KeyError, IndexError, ValueError) as e:
            return None, f"judge: the prompt template could not be filled ({type(e).__name__}: {e})", None
        messages = ([{"role": "system", "content": str(system)}] if system else []) + [{"role": "user", "content": text}]
        reply, err = None, None
        for _ in range(tries):
            try:
                r = client.chat.completions.create(model=str(cfg.get("model", "judge")), messages=messages,
                                                   temperature=temperature, max_tokens=int(cfg.get("max_tokens", 64)),
                                                   **extra)
            except openai.APIError as e:  # the client's own retries are spent
                return None, f"judge: {type(e).__name__}: {_snippet(str(e), 200)}", reply
            choice = r.choices[0] if r.choices else None
            reply = (choice.message.content or "") if choice is not None else ""
            try:
                return parse_verdict(reply, lo, hi), None, reply[:REPLY_CHARS]
            except VerdictError as e:
                err = f"judge: {e}"
        return None, err, (reply or "")[:REPLY_CHARS]

    rows = len(responses)
    with ThreadPoolExecutor(max_workers=max(1, min(int(cfg.get("concurrency", 8)), rows or 1)),
                            thread_name_prefix="trajflow-judge") as pool:
        got = list(pool.map(one, range(rows)))
    error_score = float(cfg.get("error_score", 0.0))
    scores = np.array([error_score if s is None or not math.isfinite(s) else s for s, _, _ in got], np.float32)
    return JudgeResult(scores, [e for _, e, _ in got], [r for _, _, r in got])


def combine(rule: np.ndarray, extras: list[dict], result: JudgeResult, cfg: Mapping) -> tuple[np.ndarray, list[dict]]:
    """``rule_weight * rule + weight * judge`` per row, and each row's extras with ``judge_score``,
    ``judge_reply`` and, for a failed judgement, ``judge_error`` and ``error`` (what makes the row's
    ``reward_error``, unless its scorer had already failed).

    Args:
        rule: ``(rows,)`` rule scores (zeros when ``rule_weight`` is 0 and the scorers did not run).
        extras: per-row scorer extras.
        result: :func:`judge_scores`' result for the same rows.
        cfg: the ``reward.judge`` section as a dict.

    Returns:
        ``(scores (rows,) float32, extras)``.
    """
    w_rule, w = float(cfg.get("rule_weight", 0.0)), float(cfg.get("weight", 1.0))
    score = w_rule * np.asarray(rule, np.float64) + w * result.scores.astype(np.float64)
    out = []
    for e, s, err, reply in zip(extras, result.scores, result.errors, result.replies):
        e = dict(e) if isinstance(e, dict) else {}
        e["judge_score"] = None if err is not None else round(float(s), 6)
        e["judge_reply"] = reply
        if err is not None:
            e["judge_error"] = err
            e.setdefault("error", err)
        out.append(e)
    return score.astype(np.float32), out


def judge_metrics(extras: Sequence[Any]) -> dict[str, float]:
    """``reward/judge_error_frac`` and ``reward/judge_score/mean`` from stored extras (rows scored by
    :func:`combine`); {} when no row was judged."""
    judged = [e for e in extras if isinstance(e, dict) and "judge_score" in e]
    if not judged:
        return {}
    failed = sum(1 for e in judged if e.get("judge_error") is not None)
    ok = [float(e["judge_score"]) for e in judged if e.get("judge_error") is None and e.get("judge_score") is not None]
    out = {"reward/judge_error_frac": failed / len(judged)}
    if ok:
        out["reward/judge_score/mean"] = float(np.mean(ok))
    return out
