"""Loading a prompt dataset from its spec: reasoning-gym generators or verl-layout files, split into
train and held-out records (distinct problems held out). Deterministic given the spec and its seed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trajflow.errors import DataError

from trajflow.prompts.spec import MESSAGE_ROLES, PromptDatasets, PromptRecord, file_format, file_paths, load_spec

#: The columns of verl's layout a file must have (``data_source`` may come from the spec instead).
REQUIRED_COLUMNS = ("prompt", "reward_model")


def load_prompt_dataset(spec_name_or_path: str | Path | Mapping[str, Any],
                        overrides: Mapping[str, Any] | None = None) -> PromptDatasets:
    """Load a prompt dataset from its spec.

    Args:
        spec_name_or_path: a spec name under ``datasets/`` (``"basic_arithmetic"``), a path to a YAML
            spec, a verl-layout data file (``.parquet``, ``.jsonl``), or an inline spec
            (:func:`trajflow.prompts.spec.data_spec` of a run's ``data`` section).
        overrides: spec keys to replace (deep merge; dotted keys allowed), e.g. ``{"size": 100}``.

    Returns:
        :class:`PromptDatasets` with ``train`` and ``validation`` lists of :class:`PromptRecord`
        (deterministic for a given spec and seed) and the resolved ``spec``.

    Raises:
        DataError: an invalid spec (see :func:`load_spec`); a row without a prompt or a ground truth,
            or with a malformed field (the message names the file and the row: 1-based *line number*
            for JSONL, 0-based *row index* for Parquet); a reasoning-gym generator that is unknown or
            rejects ``config``; a problem space too small for the requested held-out split.
    """
    from trajflow.batch import nested_type

    spec = load_spec(spec_name_or_path, overrides)
    origins: dict[str, str] = {}
    if spec["source"] == "reasoning_gym":
        train, validation = _load_reasoning_gym(spec)
    else:
        train, validation = _load_file_dataset(spec, origins)
    return PromptDatasets(train=train, validation=validation, spec=spec, origins=origins,
                          extra_info_type=nested_type(r.extra_info for r in train + validation))


def _jsonable(obj: Any) -> Any:
    """Convert generator metadata to plain JSON types (tuples -> lists, sets -> sorted lists, other -> str)."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((_jsonable(v) for v in obj), key=repr)
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def _build_messages(spec: dict, question: str) -> list[dict]:
    messages: list[dict] = []
    if spec.get("system_prompt"):
        messages.append({"role": "system", "content": spec["system_prompt"]})
    for shot in spec.get("few_shot") or []:
        messages.append({"role": "user", "content": shot["user"]})
        messages.append({"role": "assistant", "content": shot["assistant"]})
    messages.append({"role": "user", "content": spec["prompt_template"].format(question=question)})
    return messages


def _problem_key(entry: dict, key: str) -> str:
    if key == "question":
        return str(entry["question"])
    value: Any = entry.get("metadata") or {}
    for part in key.split(".")[1:]:
        if not isinstance(value, Mapping) or part not in value:
            raise DataError(f"problem_key {key!r}: the generator's entries have no {key!r} (metadata keys: "
                            f"{sorted((entry.get('metadata') or {}).keys())})")
        value = value[part]
    return json.dumps(_jsonable(value), sort_keys=True)


def _load_reasoning_gym(spec: dict) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Generate rows from one deterministic reasoning-gym stream (item i is drawn with seed + i).

    The first ``validation_size`` distinct problems of the stream are held out (one row each);
    training rows are the following items, skipping every held-out problem, until ``size`` rows.
    """
    import reasoning_gym  # lazy: the import takes seconds
    from reasoning_gym.factory import DATASETS as RG_DATASETS

    where = spec["spec_path"]
    gen, seed, size = spec["generator"], spec["seed"], spec["size"]
    k_val = spec["split"]["validation_size"]
    if gen not in RG_DATASETS:
        names = sorted(RG_DATASETS)
        close = difflib.get_close_matches(gen, names, n=3)
        raise DataError(
            f"{where}: 'generator' {gen!r} is not a reasoning-gym dataset"
            + (f" (close: {close})" if close else "")
            + f". Known generators: {names}"
        )
    config = dict(spec["config"])
    max_items = max(20 * (size + k_val), 10_000)

    def make(n: int):
        try:
            return reasoning_gym.create_dataset(gen, seed=seed, size=n, **config)
        except (TypeError, AssertionError, ValueError) as e:
            raise DataError(f"{where}: reasoning-gym generator {gen!r} rejected 'config' {config!r}: {e}") from e

    ds = make(max_items)
    data_source = f"reasoning_gym/{gen}"
    gen_config = _jsonable(config)

    def record(split: str, n: int, idx: int, entry: dict, key: str) -> PromptRecord:
        question = str(entry["question"])
        answer = entry.get("answer")
        if answer is None:
            raise DataError(f"{where}: generator {gen!r} item {idx} has no answer (ground truth)")
        extra = {
            "question": question,
            "metadata": _jsonable(entry.get("metadata") or {}),
            "generator": gen,
            "generator_config": gen_config,
            "split": split,
            "index": idx,
            "problem_key": key,
        }
        return PromptRecord(
            prompt_id=f"{spec['name']}:{split}:{n}",
            data_source=data_source,
            messages=_build_messages(spec, question),
            ground_truth=str(answer),
            extra_info=extra,
            source=f"{where}: generated prompt {spec['name']}:{split}:{n} (generator item {idx})",
        )

    idx = 0
    held_out: set[str] = set()
    validation: list[PromptRecord] = []
    while len(validation) < k_val:
        if idx >= max_items:
            raise DataError(
                f"{where}: found only {len(validation)} distinct problems in the first {max_items} items of "
                f"{gen!r}; 'split.validation_size' {k_val} is too large for this problem space"
            )
        entry = ds[idx]
        key = _problem_key(entry, spec["problem_key"])
        if key not in held_out:
            held_out.add(key)
            validation.append(record("validation", len(validation), idx, entry, key))
        idx += 1

    train: list[PromptRecord] = []
    while len(train) < size:
        if idx >= max_items:
            raise DataError(
                f"{where}: only {len(train)} training rows outside the {k_val} held-out problems within the "
                f"first {max_items} items of {gen!r}; the held-out split covers (nearly) the whole problem "
                f"space: lower 'split.validation_size' or enlarge the space via 'config'"
            )
        entry = ds[idx]
        key = _problem_key(entry, spec["problem_key"])
        if key not in held_out:
            train.append(record("train", len(train), idx, entry, key))
        idx += 1
    return train, validation


def _read_rows(path: Path) -> tuple[list[tuple[int, Any]], str]:
    """Rows with their position label: (line number 1-based, row) for JSONL; (row index 0-based, row) for Parquet."""
    fmt = file_format(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several error types for corrupt files
            raise DataError(f"{path}: cannot read Parquet file: {str(e).splitlines()[0] if str(e) else e!r}") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise DataError(f"{path}: no {' or '.join(repr(c) for c in missing)} column (columns: {table.column_names}); "
                            f"verl's layout has data_source, prompt (chat messages), reward_model "
                            f"{{style, ground_truth}} and extra_info")
        return list(enumerate(table.to_pylist())), "row index {} (0-based)"
    out = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:  # line by line, so that a bad byte is named by its line
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {lineno} (1-based) is not UTF-8 text (byte {e.start} of the line); "
                                f"re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {lineno} (1-based) is not valid JSON: {e}") from e
    return out, "line {} (1-based)"


def _row_to_record(row: Any, where: str, spec: dict, split: str, n: int) -> PromptRecord:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object (verl layout), got {type(row).__name__}")
    prompt = row.get("prompt")
    if prompt is None or (isinstance(prompt, (str, list)) and len(prompt) == 0):
        raise DataError(f"{where}: missing 'prompt' (a list of chat messages {{role, content}})")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        messages = []
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in MESSAGE_ROLES:
                raise DataError(
                    f"{where}: 'prompt[{j}]' must be a message {{role: one of {sorted(MESSAGE_ROLES)}, "
                    f"content: string}}, got {m!r}"
                )
            messages.append({"role": m["role"], "content": m["content"]})
    else:
        raise DataError(f"{where}: 'prompt' must be a list of chat messages or a string, got {type(prompt).__name__}")
    if not any(m["content"].strip() for m in messages if m["role"] == "user"):
        raise DataError(f"{where}: the prompt has no user message with text (an empty prompt gives the policy "
                        f"nothing to answer); fix or drop the row")

    rm = row.get("reward_model")
    gt = rm.get("ground_truth") if isinstance(rm, dict) else None
    if gt is None or (isinstance(gt, str) and not gt.strip()):
        raise DataError(f"{where}: missing 'reward_model.ground_truth'")
    if isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
        raise DataError(
            f"{where}: 'reward_model.ground_truth' must be a string or number, got {type(gt).__name__}: {gt!r}"
        )
    if isinstance(gt, float) and gt.is_integer():
        gt = int(gt)

    ds = row.get("data_source") or spec.get("data_source")
    if not isinstance(ds, str) or not ds:
        raise DataError(f"{where}: missing 'data_source' (set it in the row or as 'data_source' in the spec)")

    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise DataError(f"{where}: 'extra_info' must be a mapping, got {type(extra).__name__}")
    extra = _jsonable(extra)
    if isinstance(rm, dict) and rm.get("style") is not None:
        extra.setdefault("reward_style", rm["style"])
    extra["split"] = split
    return PromptRecord(
        prompt_id=f"{spec['name']}:{split}:{n}",
        data_source=ds,
        messages=messages,
        ground_truth=str(gt),
        extra_info=extra,
        source=where,
    )


def _load_file(paths: list[str], spec: dict, split: str, origins: dict[str, str]) -> list[PromptRecord]:
    """The rows of ``paths``, concatenated in order (verl's list of ``train_files``)."""
    records = []
    for name in paths:
        path = Path(name)
        rows, label = _read_rows(path)
        if not rows:
            raise DataError(f"{path}: no rows")
        for pos, row in rows:
            where = f"{path}: {label.format(pos)}"
            rec = _row_to_record(row, where, spec, split, len(records))
            origins.setdefault(rec.data_source, where)
            records.append(rec)
    return records


def _prompt_key(rec: PromptRecord) -> str:
    return json.dumps(rec.messages, sort_keys=True)


def _renumber(records: Sequence[PromptRecord], name: str, split: str) -> list[PromptRecord]:
    out = []
    for n, r in enumerate(records):
        extra = dict(r.extra_info, split=split)
        out.append(dataclasses.replace(r, prompt_id=f"{name}:{split}:{n}", extra_info=extra))
    return out


def _load_file_dataset(spec: dict, origins: dict[str, str]) -> tuple[list[PromptRecord], list[PromptRecord]]:
    train = _load_file(file_paths(spec["path"]), spec, "train", origins)
    if spec.get("validation_path"):
        return train, _load_file(file_paths(spec["validation_path"]), spec, "validation", origins)
    k_val = spec["split"]["validation_size"]
    if not k_val:
        return train, []
    # Hold out k distinct prompts, chosen by a seeded permutation; all their rows leave train.
    keys = list(dict.fromkeys(_prompt_key(r) for r in train))
    if k_val >= len(keys):
        raise DataError(
            f"{spec['path']}: 'split.validation_size' {k_val} leaves no training prompts "
            f"({len(keys)} distinct prompts in the file)"
        )
    order = np.random.default_rng(spec["seed"]).permutation(len(keys))
    held = {keys[i] for i in order[:k_val]}
    validation, rest, seen = [], [], set()
    for r in train:
        key = _prompt_key(r)
        if key in held:
            if key not in seen:
                seen.add(key)
                validation.append(r)
        else:
            rest.append(r)
    return _renumber(rest, spec["name"], "train"), _renumber(validation, spec["name"], "validation")
