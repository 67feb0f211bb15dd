"""The ``reward.judge`` section: an LLM-as-judge reward scored through an OpenAI-compatible endpoint
(:mod:`trajflow.stages.judge`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trajflow.config.fields import _f

#: The default judging prompt: the placeholders are filled per row (``{question}`` the prompt's last
#: user message, ``{prompt}`` the whole prompt conversation, ``{response}`` the response or the agent's
#: answer, ``{ground_truth}`` the row's reference answer).
DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer: {ground_truth}\n\n"
    "Answer to grade:\n{response}\n\n"
    "Is the answer correct and does it agree with the reference? Rate it from 0 (wrong) to 10 (correct). "
    "Reply with one line: Score: <number from 0 to 10>")


@dataclass
class JudgeConfig:
    """An LLM-as-judge reward: a generative model behind an OpenAI-compatible endpoint rates each response."""

    enable: bool = _f(False, "score responses with the judge too: score = rule_weight * rule + weight * judge")
    base_url: Optional[str] = _f(None, "the judge's OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1); one "
                                 "a run folder stores is used on resume/replay only when named again")
    model_path: Optional[str] = _f(None, "instead of base_url: the judge model (a Hugging Face directory or a built-in "
                                   "name) that trajflow serves itself for the whole run, as a Ray actor behind the "
                                   "same OpenAI-compatible endpoint on 127.0.0.1 with a per-run token; one a run "
                                   "folder stores is used on resume/replay only when named again")
    num_cpus: float = _f(0.0, "CPUs Ray reserves for the judge worker of model_path (0 = none reserved, as the "
                         "reward model's worker; it then shares the CPUs with the other roles)", ge=0.0)
    num_threads: int = _f(0, "torch threads of the judge worker of model_path (0 = trainer.num_threads)", ge=0)
    model: str = _f("judge", "model name sent to the judge endpoint")
    api_key_env: Optional[str] = _f(None, "name of the environment variable holding the judge's API key (read when "
                                    "scoring, never stored; null = no key); named again on resume/replay")
    prompt_template: str = _f(DEFAULT_JUDGE_TEMPLATE, "the judge's user message; placeholders {question}, {prompt}, "
                              "{response}, {ground_truth} (write {{ and }} for literal braces)")
    system_prompt: Optional[str] = _f(None, "a system message before the prompt (null = none)")
    score_min: float = _f(0.0, "the lowest score the judge is asked for (maps to judge score 0)")
    score_max: float = _f(10.0, "the highest score the judge is asked for (maps to judge score 1)")
    weight: float = _f(1.0, "weight of the judge's score (in [0, 1]) in the combined score")
    rule_weight: float = _f(0.0, "weight of the rule scorers' score in the combined score (0 = the judge alone: "
                            "the rule scorers do not run)")
    error_score: float = _f(0.0, "judge score of a response whose judgement failed (no parseable score after the "
                            "retries); the row's reward_error says why and the gate counts it")
    max_tokens: int = _f(64, "most tokens of a judge reply", ge=1)
    temperature: float = _f(0.0, "the judge's sampling temperature (0 = greedy: deterministic where the judge is)",
                            ge=0.0)
    seed: Optional[int] = _f(0, "seed sent with every judge request (null = none)")
    timeout_s: float = _f(60.0, "seconds one judge request may take before it is retried", gt=0.0)
    max_retries: int = _f(2, "retries of a judge request after a timeout, a connection error, HTTP 408/409/429/5xx "
                          "(the openai client's backoff) or, at temperature > 0, an unparseable reply", ge=0)
    concurrency: int = _f(8, "judge requests in flight at once", ge=1)


#: The placeholders ``reward.judge.prompt_template`` may use.
JUDGE_PLACEHOLDERS = ("question", "prompt", "response", "ground_truth")


def check_judge(judge, source: str = "config") -> None:
    """The cross-field rules of ``reward.judge`` (:func:`trajflow.config.rules.validate` calls it).

    Raises:
        ConfigError: enabled without exactly one of an http(s) ``base_url`` and a ``model_path``;
            ``api_key_env`` with ``model_path`` (the served judge has its own per-run token);
            ``score_max <= score_min``; a prompt
            template with a placeholder other than :data:`JUDGE_PLACEHOLDERS` or unbalanced braces.
    """
    import string

    from trajflow.errors import ConfigError

    if not judge.enable:
        return
    model_path = judge.model_path
    if model_path and judge.base_url:
        raise ConfigError(f"{source}: reward.judge.base_url={judge.base_url!r} and reward.judge.model_path="
                          f"{model_path!r}: name one (a judge endpoint you run, or a judge model trajflow serves)")
    if model_path:
        if judge.api_key_env:
            raise ConfigError(f"{source}: reward.judge.api_key_env={judge.api_key_env!r} with "
                              "reward.judge.model_path: the judge trajflow serves uses its own per-run token "
                              "(set api_key_env=null)")
    elif not str(judge.base_url or "").startswith(("http://", "https://")):
        raise ConfigError(f"{source}: reward.judge.enable=true needs reward.judge.base_url, the judge's "
                          f"OpenAI-compatible base URL (http://... or https://...; got {judge.base_url!r}), "
                          "or reward.judge.model_path, a judge model trajflow serves")
    if judge.score_max <= judge.score_min:
        raise ConfigError(f"{source}: reward.judge.score_max={judge.score_max} must be > "
                          f"reward.judge.score_min={judge.score_min}")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(str(judge.prompt_template)) if f is not None}
    except ValueError as e:
        raise ConfigError(f"{source}: reward.judge.prompt_template: {e} (write {{{{ and }}}} for literal braces)") \
            from None
    bad = sorted(n for n in names if n not in JUDGE_PLACEHOLDERS)
    if bad:
        raise ConfigError(f"{source}: reward.judge.prompt_template uses {{{bad[0]}}}: the placeholders are "
                          f"{', '.join('{' + p + '}' for p in JUDGE_PLACEHOLDERS)} (write {{{{ and }}}} for literal "
                          "braces)")
