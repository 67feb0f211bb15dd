"""Which recipe fits a user's own data: the shape of a verl-layout file (GSM8K's ``#### answer``,
MATH's ``\\boxed{}``), read from its first rows before anything starts.

Without this, ``trajflow train data.train_files=gsm8k.parquet`` trains with the default recipe,
which was sized for two-term arithmetic (64-token responses with an overlong penalty over the last
16): a GSM8K solution does not fit, every response is cut, every score is the penalty's floor and
nothing is learnt. :func:`detect_shape` recognises the two shapes verl's example preprocessors
write (``examples/data_preprocess/gsm8k.py``, ``math_dataset.py``); :data:`SHAPE_RECIPES` names
the recipe for each. Reading is cheap (at most :data:`SAMPLE_ROWS` rows of the first file, through
pyarrow's row-group reader) and never fails: an unreadable file is left to the data checks, which
report it as one line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

#: Rows read from the first data file to decide its shape.
SAMPLE_ROWS = 64

#: The recipe (``flows/configs/<name>.yaml``) for each recognised shape.
SHAPE_RECIPES = {"gsm8k": "grpo_gsm8k", "math": "grpo_math"}

#: Data sources (lower case) that are GSM8K (verl writes ``openai/gsm8k``).
_GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
_BOXED = re.compile(r"\\boxed")
_HASHES = re.compile(r"####")


@dataclass(frozen=True)
class DataShape:
    """A recognised data shape.

    Attributes:
        name: ``"gsm8k"`` or ``"math"``.
        recipe: the recipe made for it (:data:`SHAPE_RECIPES`).
        why: what identified it, for the console (``data_source 'openai/gsm8k'``, ...).
    """

    name: str
    recipe: str
    why: str


def _first_rows(path: Path, limit: int = SAMPLE_ROWS) -> list[dict]:
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=limit):
            return batch.to_pylist()
        return []
    rows = []
    with path.open(encoding="utf-8") as f:
        text = f.read(1 << 20)
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        data = json.loads(text)
        return [r for r in data[:limit] if isinstance(r, dict)]
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
        if len(rows) >= limit:
            break
    return rows


def _prompt_text(row: Mapping[str, Any]) -> str:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, Mapping))
    return ""


def _answer_text(row: Mapping[str, Any]) -> str:
    extra = row.get("extra_info")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            extra = None
    parts = []
    if isinstance(extra, Mapping):
        parts += [str(extra.get(k) or "") for k in ("answer", "solution")]
    rm = row.get("reward_model")
    if isinstance(rm, Mapping):
        parts.append(str(rm.get("ground_truth") or ""))
    return "\n".join(parts)


def shape_of_rows(rows: list[Mapping[str, Any]]) -> DataShape | None:
    """The shape of verl-layout rows, by majority of the rows that show one.

    A row is GSM8K-shaped when its ``data_source`` is ``openai/gsm8k``/``gsm8k`` or its prompt or
    reference solution (``extra_info.answer``) uses ``####``; MATH-shaped when its data source is
    one of the math sets :func:`trajflow.stages.scorers.select_scorer` maps to ``math_verify`` (other than
    GSM8K) or its prompt or solution uses ``\\boxed``.

    Args:
        rows: rows as dicts (``data_source``, ``prompt``, ``reward_model``, ``extra_info``).

    Returns:
        The shape, or None when no row shows either (or as many show each).
    """
    from trajflow.stages.scorers import MATH_DATA_SOURCE_PREFIXES, MATH_DATA_SOURCES

    votes = {"gsm8k": [], "math": []}
    for row in rows:
        ds = str(row.get("data_source") or "").lower()
        prompt, answer = _prompt_text(row), _answer_text(row)
        if ds in _GSM8K_SOURCES:
            votes["gsm8k"].append(f"data_source {row.get('data_source')!r}")
        elif ds in MATH_DATA_SOURCES or ds.startswith(MATH_DATA_SOURCE_PREFIXES):
            votes["math"].append(f"data_source {row.get('data_source')!r}")
        elif _HASHES.search(prompt) or _HASHES.search(answer):
            votes["gsm8k"].append("'####' answers")
        elif _BOXED.search(prompt) or _BOXED.search(answer):
            votes["math"].append("'\\boxed{}' answers")
    g, m = len(votes["gsm8k"]), len(votes["math"])
    if g == m:
        return None
    name = "gsm8k" if g > m else "math"
    reason = max(set(votes[name]), key=votes[name].count)
    return DataShape(name, SHAPE_RECIPES[name], f"{reason} in {votes[name].count(reason)} of the first {len(rows)} rows")


def detect_shape(data: Mapping[str, Any]) -> DataShape | None:
    """The shape of a run's own data (``data.train_files``, or a data file as ``data.dataset``).

    Args:
        data: the ``data`` config section.

    Returns:
        The shape of the first training file, or None: no data file (a spec name), an unrecognised
        shape, or a file that cannot be read (its error comes from the data checks, not from here).
    """
    from trajflow.prompts.spec import file_format, file_paths

    train = data.get("train_files")
    if train is None:
        dataset = data.get("dataset")
        if dataset is None or file_format(Path(str(dataset))) is None:
            return None
        train = dataset
    paths = file_paths(train if isinstance(train, str) else list(train))
    if not paths:
        return None
    path = Path(paths[0]).expanduser()
    try:
        rows = _first_rows(path)
    except Exception:  # missing, unreadable, not verl's layout: preflight names the file and what is wrong
        return None
    return shape_of_rows(rows)


def own_data(data: Mapping[str, Any]) -> str | None:
    """What names the user's own data file(s): ``data.train_files`` or ``data.dataset`` (a file), or None."""
    from trajflow.prompts.spec import file_format

    if data.get("train_files") is not None:
        return "data.train_files"
    dataset = data.get("dataset")
    if dataset is not None and file_format(Path(str(dataset))) is not None:
        return "data.dataset"
    return None


def describe_recipe(cfg: Any) -> str:
    """The console's line at the start of a run: the recipe, its response cap and its reward shaping,
    and, for the user's own data, which shape was recognised (or that none was and the recipe's caps
    apply anyway).

    Args:
        cfg: the run's config (``recipe``, ``data``, ``rollout.max_new_tokens``, ``reward``).

    Returns:
        One line, e.g. ``recipe grpo_gsm8k (data.train_files: GSM8K shape, data_source 'openai/gsm8k' in 8
        of the first 8 rows): responses up to 256 tokens (rollout.max_new_tokens); reward: math_verify ...``.
    """
    reward = cfg.reward
    if reward.get("custom_function"):
        scorer = f"reward.custom_function {reward.custom_function}"
    elif reward.get("scorer"):
        scorer = f"scorer {reward.scorer} for every row"
    else:
        scorer = "scorer by data_source" + (f" (else {reward.default_scorer})" if reward.get("default_scorer") else "")
    ob = reward.overlong_buffer
    cap = int(cfg.rollout.max_new_tokens)
    if ob.enable:
        shaping = (f"plus DAPO's overlong penalty over the last {ob.len} tokens (0 down to -{ob.penalty_factor:g} "
                   f"at the cap; reward.overlong_buffer)")
    else:
        shaping = "no length shaping"
    head = f"recipe {cfg.recipe}"
    key = own_data(cfg.data)
    if key is not None:
        shape = detect_shape(cfg.data)
        if shape is not None:
            head += f" ({key}: {shape.name.upper()} shape, {shape.why})"
        else:
            head += (f" ({key}: no GSM8K '####' or MATH '\\boxed{{}}' shape recognised, so the recipe's cap and "
                     f"shaping apply as they are; check they fit your responses)")
    return f"{head}: responses up to {cap} tokens (rollout.max_new_tokens); reward: {scorer}, {shaping}"
