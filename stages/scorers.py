"""Reward scorers: rule-based functions that score one sampled response against its ground truth.

A *scorer* has verl's custom-reward signature::

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) -> float | dict

and returns either a float score or a dict with a ``"score"`` key plus JSON-serialisable extras.
Built-in scorers live in the :data:`SCORERS` registry under their config names:

``reasoning_gym``
    the dataset's own ``score_answer`` on the extracted answer, plus a format bonus for an ``Answer:`` line.
``math_verify``
    math-verify's symbolic equivalence (``\\frac{1}{2}`` equals ``0.5``), 1.0 or 0.0; strict by default:
    only a stated final answer (``Answer:``, GSM8K's ``####``, ``\\boxed{}``) is scored.
``exact_match``
    normalised string equality, 1.0 or 0.0.
``env``
    a multi-turn episode's own reward (the rollout's ``env_reward``: what the environment's ``step``
    returned), not the text at all.

:func:`select_scorer` maps a row's ``data_source`` to a scorer name; :func:`load_custom_function`
loads a user scorer from ``path/to/file.py:name``. Plain functions over strings (no Ray, no Prefect).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trajflow.stages.registry import Registry

#: Reward scorers by config name (``reward.scorer``, ``reward.default_scorer``); values have verl's custom-reward signature.
SCORERS = Registry("reward scorer")

#: Data sources (compared case-insensitively) scored with ``math_verify``: those verl's default
#: reward (``verl.utils.reward_score.default_compute_score``) scores with its GSM8K, MATH, DAPO-math,
#: PRIME-math and geometry3k functions, all final-answer checks that math-verify's equivalence covers.
MATH_DATA_SOURCES = frozenset(
    s.lower()
    for s in (
        "math",
        "gsm8k",
        "openai/gsm8k",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "math500",
        "math_dapo",
        "math_dapo_reasoning",
        "aime",
        "aime24",
        "aime25",
        "amc",
        "hiyouga/geometry3k",
    )
)
#: Data-source prefixes (case-insensitive) scored with ``math_verify`` (verl: ``aime*``, ``numina_*``).
MATH_DATA_SOURCE_PREFIXES = ("numina", "ai-mo/numinamath", "lighteval/math", "aime", "open-r1/openr1-math")

#: Answers longer than this many characters are cut (from the left) before math-verify parses them:
#: math-verify's own timeout relies on ``signal.alarm`` (main thread only), so it is disabled here
#: and input size is what bounds parsing time.
MATH_VERIFY_MAX_CHARS = 1000

_ANSWER_RE = re.compile(r"answer\s*:", re.IGNORECASE)
#: GSM8K's answer marker: a run of four or more ``#`` (models also write ``#####``; the whole run is
#: the marker, so no ``#`` is left in the answer).
_GSM8K_RE = re.compile(r"#{4,}")
#: Characters that stand for a minus sign or a hyphen and are not ``-`` after NFKC: U+2010-U+2015
#: (hyphens, figure dash, en/em dash, horizontal bar), U+2212 (minus sign), U+2796 (heavy minus),
#: U+FE58 (small em dash). Models write ``\boxed{−5}``; math-verify and string equality read ``-5`` only.
_DASHES = dict.fromkeys(map(ord, "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\u2796\ufe58"), "-")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


# --------------------------------------------------------------------------------------------- extraction


def normalize_text(text: str) -> str:
    """Unicode NFKC (full-width digits and signs, ligatures, non-breaking spaces -> ASCII forms), then
    every minus/dash variant of :data:`_DASHES` as ``-``; non-strings are returned unchanged."""
    if not isinstance(text, str):
        return text
    return unicodedata.normalize("NFKC", text).translate(_DASHES)


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; None if none is closed."""
    for m in reversed(list(_BOXED_RE.finditer(text))):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def _clean(ans: str) -> str:
    ans = ans.strip()
    boxed = _last_boxed(ans)
    if boxed is not None:
        ans = boxed
    ans = ans.strip().strip("*`").strip()
    if ans.endswith(".") and len(ans) > 1:
        ans = ans[:-1].rstrip()
    return ans


def _answer_line(text: str) -> str | None:
    matches = list(_ANSWER_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    line = _clean(rest.split("\n", 1)[0])
    return line or None


def _gsm8k_answer(text: str) -> str | None:
    """The text after the **last** run of four or more ``#`` (GSM8K's ``####`` answer format), first
    line only, cleaned as an ``Answer:`` line; None when there is no such run or nothing follows it.
    ``#### 13``, ``##### 13`` and ``####13`` all give ``13``. (verl's GSM8K ``method="strict"`` takes
    the number after the last ``#### `` in the response's last 300 characters, so it reads
    ``##### 13`` as 13 too but needs the space; here the marker is the whole run of ``#`` and the
    answer need not be a plain number, math-verify judges it.) Searched over the whole text, however
    long (the math-verify length cap applies to what is parsed, not to where the answer is)."""
    matches = list(_GSM8K_RE.finditer(text))
    if not matches:
        return None
    line = _clean(text[matches[-1].end():].split("\n", 1)[0])
    return line or None


def has_answer_line(text: str) -> bool:
    """Whether ``text`` has an ``Answer: <something>`` line (the last ``Answer:`` is followed by text on its line)."""
    return isinstance(text, str) and _answer_line(text) is not None


def extract_answer(text: str) -> str | None:
    """The final answer stated in a model response.

    Rules, in order:

    1. the text after the **last** ``Answer:`` (case-insensitive, so ``Final answer:`` counts), first line
       only, stripped; a ``\\boxed{...}`` in it is unwrapped, then surrounding ``*``/`````
       (markdown) and one trailing ``.`` are removed. An empty remainder counts as not found.
    2. otherwise the text after the **last** run of four or more ``#`` (GSM8K's ``####``; ``##### 13``
       and ``####13`` give ``13``), first line, cleaned as in 1.
    3. otherwise the content of the last ``\\boxed{...}`` (balanced braces, so ``\\boxed{\\frac{1}{2}}``
       gives ``\\frac{1}{2}``).

    The text is first :func:`normalize_text`-ed (``\\boxed{−5}`` with U+2212 gives ``-5``).

    Args:
        text: the response (decoded, without special tokens).

    Returns:
        The answer string, or ``None`` when neither rule finds one (also for non-string input).

    Example:
        >>> extract_answer("7 + 5 = 12\\n\\nThis is the sum.\\nAnswer: 12")
        '12'
    """
    if not isinstance(text, str):
        return None
    text = normalize_text(text)
    line = _answer_line(text)
    if line is not None:
        return line
    line = _gsm8k_answer(text)
    if line is not None:
        return line
    boxed = _last_boxed(text)
    if boxed is not None:
        boxed = _clean(boxed)
        return boxed or None
    return None


# --------------------------------------------------------------------------------------------- scorers


@functools.lru_cache(maxsize=64)
def _rg_score_fn(name: str, config_json: str) -> Callable[[str | None, dict], float]:
    """reasoning-gym's ``score_answer`` for dataset ``name``, built with the generator config when known."""
    import reasoning_gym  # lazy: the import takes seconds
    from reasoning_gym.factory import DATASETS as RG_DATASETS

    if name not in RG_DATASETS:
        import difflib

        close = difflib.get_close_matches(name, sorted(RG_DATASETS), n=3)
        raise ValueError(
            f"reasoning_gym scorer: unknown reasoning-gym dataset {name!r}"
            + (f" (close: {close})" if close else "")
            + "; data_source must be 'reasoning_gym/<dataset name>'"
        )
    config = json.loads(config_json)
    if config:
        return reasoning_gym.create_dataset(name, seed=0, size=1, **config).score_answer
    return reasoning_gym.get_score_answer_fn(name)


@SCORERS.register("reasoning_gym")
def reasoning_gym_scorer(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    format_bonus: float = 0.1,
) -> dict:
    """Score with the reasoning-gym dataset's own ``score_answer``, plus a format bonus.

    The entry passed to ``score_answer`` is rebuilt as ``{"question": extra_info["question"],
    "answer": ground_truth, "metadata": extra_info["metadata"]}``. The scorer instance is built
    with ``extra_info["generator_config"]`` when present (as written by ``trajflow.prompts``), else
    with the dataset's default config.

    Args:
        data_source: ``"reasoning_gym/<dataset name>"`` (e.g. ``"reasoning_gym/basic_arithmetic"``).
        solution_str: the model response.
        ground_truth: the generator's answer.
        extra_info: ``{"question": str, "metadata": dict, "generator_config": dict}`` (all optional).
        format_bonus: added to the score when the response has an ``Answer: ...`` line (>= 0).

    Returns:
        ``{"score": credit + format_bonus * format_ok, "acc": 1.0 | 0.0, "format_ok": bool,
        "extracted": str | None}``, where ``credit`` in [0, 1] is ``score_answer``'s (some datasets
        give partial credit) and ``acc`` is 1.0 only for full credit.

    Raises:
        ValueError: ``data_source`` does not name a registered reasoning-gym dataset.
    """
    if not isinstance(data_source, str) or not data_source.startswith("reasoning_gym/"):
        raise ValueError(f"reasoning_gym scorer: data_source must be 'reasoning_gym/<dataset name>', got {data_source!r}")
    name = data_source.split("/", 1)[1]
    info = extra_info or {}
    config = info.get("generator_config") or {}
    score_fn = _rg_score_fn(name, json.dumps(config, sort_keys=True))
    extracted = extract_answer(solution_str)
    entry = {"question": info.get("question", ""), "answer": ground_truth, "metadata": info.get("metadata") or {}}
    credit = float(score_fn(extracted, entry))
    format_ok = has_answer_line(solution_str)
    return {
        "score": credit + (float(format_bonus) if format_ok else 0.0),
        # Accuracy counts right answers only: the partial credit some datasets give (basic_arithmetic:
        # len(answer) / len(response) when the answer is a substring, "19" for "1" earns 0.5) stays in the score.
        "acc": 1.0 if credit >= 1.0 else 0.0,
        "format_ok": format_ok,
        "extracted": extracted,
    }


@SCORERS.register("math_verify")
def math_verify_scorer(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    strict_format: bool = True,
) -> dict:
    """Symbolic equivalence of the final answer and the ground truth with math-verify (``parse``/``verify``).

    The stated final answer (:func:`extract_answer`: an ``Answer:`` line, GSM8K's last ``####``, or
    the last ``\\boxed{}``) is parsed. Strict (the default, verl's GSM8K ``method="strict"``): a
    response that states no final answer scores 0, however its text ends ("The answer is 42" earns
    nothing). With ``strict_format=False`` math-verify's own extraction then runs on the whole
    response (it takes a boxed or last stated number). Both texts are :func:`normalize_text`-ed first
    (NFKC, Unicode minus signs and dashes as ``-``). math-verify's ``signal.alarm`` timeouts are
    disabled (``parsing_timeout=None``, ``timeout_seconds=None``) so the scorer works in any thread;
    what is parsed is cut to its last :data:`MATH_VERIFY_MAX_CHARS` characters.

    Args:
        data_source: any (unused beyond error messages).
        solution_str: the model response.
        ground_truth: reference answer, plain or LaTeX (``"0.5"``, ``"\\frac{1}{2}"``).
        extra_info: unused.
        strict_format: require a stated final answer (``reward.strict_format``).

    Returns:
        ``{"score": 1.0 | 0.0, "acc": same, "format_ok": bool (an Answer: line exists), "extracted": str | None}``.
    """
    from math_verify import parse, verify  # lazy

    extracted = extract_answer(solution_str)
    if extracted is None and strict_format:
        return {"score": 0.0, "acc": 0.0, "format_ok": has_answer_line(solution_str), "extracted": None}
    target_text = extracted if extracted is not None else normalize_text(solution_str or "")
    gold = parse(normalize_text(str(ground_truth))[-MATH_VERIFY_MAX_CHARS:], parsing_timeout=None)
    pred = parse(target_text[-MATH_VERIFY_MAX_CHARS:], parsing_timeout=None)
    ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
    score = 1.0 if ok else 0.0
    return {"score": score, "acc": score, "format_ok": has_answer_line(solution_str), "extracted": extracted}


def _normalise(s: str) -> str:
    s = " ".join(normalize_text(str(s)).split()).casefold()
    s = s.strip().strip("$").strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    return s


@SCORERS.register("exact_match")
def exact_match_scorer(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
) -> dict:
    """Normalised string equality of the final answer and the ground truth.

    Normalisation: :func:`normalize_text` (NFKC, Unicode minus signs and dashes as ``-``), whitespace
    runs collapsed to one space, case-folded, surrounding ``$`` and one trailing ``.`` removed. The final answer is :func:`extract_answer`'s, or the whole response when
    there is none.

    Returns:
        ``{"score": 1.0 | 0.0, "acc": same, "format_ok": bool, "extracted": str | None}``.
    """
    extracted = extract_answer(solution_str)
    target = extracted if extracted is not None else (solution_str or "")
    score = 1.0 if _normalise(target) == _normalise(ground_truth) else 0.0
    return {"score": score, "acc": score, "format_ok": has_answer_line(solution_str), "extracted": extracted}


@SCORERS.register("env")
def env_scorer(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    env_reward: float | None = None,
) -> float:
    """The environment's outcome reward of a multi-turn episode, as the score (``reward.scorer=env``).

    The reward stage passes each row's ``env_reward`` (the last non-null ``StepResult.reward`` of
    the episode) as the ``env_reward`` keyword; the text, ground truth and data source are not
    read. As in verl's agent loop, where a reward the interaction returns becomes the sample's
    score, the environment decides.

    Args:
        data_source, solution_str, ground_truth, extra_info: unused (verl's scorer signature).
        env_reward: the row's ``env_reward``.

    Returns:
        ``float(env_reward)``.

    Raises:
        ValueError: ``env_reward`` is None (the stage refuses such rows before scoring, naming them;
            this guards direct calls).
    """
    if env_reward is None:
        raise ValueError("env scorer: the row has no env_reward (the environment's step returned no reward)")
    return float(env_reward)


def select_scorer(data_source: str, default: str | None = None, override: str | None = None) -> str:
    """The scorer name for a data source, as verl's default reward picks its function.

    Mapping: ``reasoning_gym/*`` -> ``reasoning_gym``; the math sets (:data:`MATH_DATA_SOURCES`:
    ``openai/gsm8k``, ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
    ``HuggingFaceH4/MATH-500``, ``math_dapo``, ...; or a prefix in :data:`MATH_DATA_SOURCE_PREFIXES`
    such as ``aime*``, ``numina*``) -> ``math_verify``; anything else -> ``default`` (verl's code
    sets among them: trajflow has no code sandbox; its Search-R1 sets have list ground truths).

    Args:
        data_source: the row's ``data_source``.
        default: scorer for unmapped sources (``reward.default_scorer``), or None.
        override: scorer for every source, mapped or not (``reward.scorer``), or None.

    Returns:
        A name registered in :data:`SCORERS`.

    Raises:
        ValueError: ``override`` or ``default`` is not a registered scorer (lists them), or the source
            is unmapped and there is neither (says how to fix it).
    """
    if override is not None:
        SCORERS.get(override)  # raises with the registered names
        return override
    ds = str(data_source)
    low = ds.lower()
    if low.startswith("reasoning_gym/"):
        return "reasoning_gym"
    if low in MATH_DATA_SOURCES or low.startswith(MATH_DATA_SOURCE_PREFIXES):
        return "math_verify"
    if default is not None:
        SCORERS.get(default)  # raises with the registered names
        return default
    raise ValueError(
        f"no reward scorer for data_source {ds!r}: it is not 'reasoning_gym/<name>' or a known math set. "
        f"Set reward.scorer (every row) or reward.default_scorer (unmapped sources) to one of {SCORERS.names()}, "
        f"or reward.custom_function to 'file.py:function'"
    )


def custom_function_file(spec: str) -> Path:
    """The resolved file of a ``"path/to/file.py:function_name"`` spec (which need not exist).

    Raises:
        ValueError: the spec has no ``file:name`` shape.
    """
    if not isinstance(spec, str) or ":" not in spec or not spec.rsplit(":", 1)[0] or not spec.rsplit(":", 1)[1]:
        raise ValueError(f"reward.custom_function must look like 'path/to/file.py:function_name', got {spec!r}")
    return Path(spec.rsplit(":", 1)[0]).expanduser().resolve()


def file_sha256(path: str | Path) -> str | None:
    """sha256 of a file's bytes, or None when it does not exist."""
    p = Path(path)
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None


def load_custom_function(spec: str) -> Callable[..., Any]:
    """Load a user scorer from ``"path/to/file.py:function_name"``.

    The file is imported as a fresh module (relative paths resolve against the working directory).
    The function should have verl's signature ``(data_source, solution_str, ground_truth, extra_info)``.

    Args:
        spec: ``"<file>.py:<name>"``.

    Returns:
        The callable.

    Raises:
        ValueError: no ``:`` separator, the file does not exist (names the resolved path), importing it
            failed (names the file and the exception), or the name is missing or not callable (names the
            function and lists the file's callables).
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"reward.custom_function must look like 'path/to/file.py:function_name', got {spec!r}")
    file_part, name = spec.rsplit(":", 1)
    if not file_part or not name:
        raise ValueError(f"reward.custom_function must look like 'path/to/file.py:function_name', got {spec!r}")
    path = Path(file_part).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward.custom_function: file {file_part!r} not found (resolved to {path})")
    mod_name = f"trajflow_custom_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise ValueError(f"reward.custom_function: cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = module  # lets pickling/dataclasses inside the file find their module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise ValueError(f"reward.custom_function: importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        funcs = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        what = "is not callable" if fn is not None else "not found"
        raise ValueError(f"reward.custom_function: function {name!r} {what} in {path}; callables there: {funcs}")
    return fn
