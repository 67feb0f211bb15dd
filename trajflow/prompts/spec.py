"""Prompt-dataset specs: the YAML files under ``datasets/`` (``source: reasoning_gym`` or ``source: file``,
verl's Parquet/JSONL layout), validated key by key, and the records they load into.

See ``datasets/README.md`` for every key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trajflow import LAYOUT_ROOT
from trajflow.errors import DataError

#: The repository's ``datasets/`` folder (data, not an importable package; ``trajflow/datasets/`` when installed).
DATASETS_DIR = LAYOUT_ROOT / "datasets"

_COMMON_KEYS = {
    "name": "dataset name (defaults to the spec file's stem)",
    "description": "free text",
    "source": "'reasoning_gym' or 'file'",
    "scorer": "reward scorer to use for data sources with no built-in mapping (e.g. 'math_verify')",
    "seed": "integer seed for generation and held-out selection",
    "split": "{validation_size: K}: hold out K distinct problems",
}
_RG_KEYS = {
    "generator": "reasoning-gym dataset name, e.g. 'basic_arithmetic'",
    "size": "number of training rows",
    "config": "generator options passed to reasoning_gym.create_dataset",
    "system_prompt": "system message (omit or null for none)",
    "few_shot": "list of {user, assistant} worked-example turns placed before the question",
    "prompt_template": "user message template with a '{question}' placeholder",
    "problem_key": "what identifies a distinct problem: 'question' or 'metadata.<field>'",
}
_FILE_KEYS = {
    "path": "Parquet (.parquet) or JSONL (.jsonl/.json) file in verl's layout, relative to the spec file, "
            "or a list of them (concatenated)",
    "validation_path": "optional held-out file(s) in the same layout",
    "data_source": "data_source for rows that have none",
}
_SOURCES = {"reasoning_gym": _RG_KEYS, "file": _FILE_KEYS}
_SPLIT_KEYS = {"validation_size"}
MESSAGE_ROLES = {"system", "user", "assistant", "tool"}


@dataclass
class PromptRecord:
    """One prompt with what is needed to score its responses.

    Attributes:
        prompt_id: unique within a loaded dataset, e.g. ``"basic_arithmetic:train:17"``.
        data_source: selects the scorer, e.g. ``"reasoning_gym/basic_arithmetic"`` or ``"openai/gsm8k"``.
        messages: chat messages ``[{"role": ..., "content": ...}, ...]``; the last one is the user turn.
        ground_truth: the reference answer, as a string.
        extra_info: JSON-serialisable dict passed to the scorer (for reasoning-gym rows: ``question``,
            ``metadata``, ``generator``, ``generator_config``, ``split``, ``index``, ``problem_key``).
        source: where the record came from, for error messages: ``"<file>: line 3 (1-based)"``,
            ``"<file>: row index 2 (0-based)"`` or, for generated rows, the spec file and the prompt id.
            Never stored with trajectories (the rollout table takes the fields above by name) and
            not part of equality, so a moved data file changes no stored byte and no comparison.
    """

    prompt_id: str
    data_source: str
    messages: list[dict]
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    source: str = field(default="", compare=False)

    def to_dict(self) -> dict:
        """The record as a plain dict (a deep copy)."""
        return copy.deepcopy(dataclasses.asdict(self))


@dataclass
class PromptDatasets:
    """A loaded dataset: train and held-out prompts plus the resolved spec (with ``name`` and ``spec_path``).

    Attributes:
        origins: for file datasets, where each ``data_source`` first occurs (``"<file>: row index 3
            (0-based)"``), for errors that point at the data.
        extra_info_type: the Arrow type of the rollout table's ``extra_info`` column: the struct
            that holds every record's ``extra_info``, or ``string`` (JSON text) when none does.
    """

    train: list[PromptRecord]
    validation: list[PromptRecord]
    spec: dict
    origins: dict[str, str] = field(default_factory=dict)
    extra_info_type: Any = None


# --------------------------------------------------------------------------------------------- specs


def list_dataset_specs() -> list[str]:
    """Names of the dataset specs shipped in ``datasets/`` (sorted)."""
    return sorted(p.stem for p in DATASETS_DIR.glob("*.yaml"))


def resolve_spec_path(spec_name_or_path: str | Path) -> Path:
    """Find a dataset spec file.

    Args:
        spec_name_or_path: a bare name (``"basic_arithmetic"`` -> ``<repo>/datasets/basic_arithmetic.yaml``)
            or a path to a ``.yaml``/``.yml`` file.

    Returns:
        The resolved absolute path.

    Raises:
        DataError: no such spec; the message lists the shipped spec names and the closest match.
    """
    raw = str(spec_name_or_path)
    candidates = []
    p = Path(raw).expanduser()
    if p.suffix in (".yaml", ".yml") or "/" in raw or "\\" in raw:
        candidates.append(p)
    else:
        candidates += [DATASETS_DIR / f"{raw}.yaml", DATASETS_DIR / f"{raw}.yml", p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    names = list_dataset_specs()
    close = difflib.get_close_matches(p.stem, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise DataError(
        f"dataset spec {raw!r} not found (looked for {', '.join(str(c) for c in candidates)}).{hint} "
        f"Shipped specs in {DATASETS_DIR}: {names}"
    )


def _merge(base: dict, overrides: Mapping[str, Any]) -> dict:
    """Deep-merge ``overrides`` into a copy of ``base``; dotted keys (``"config.max_digits"``) address nested dicts."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        last = parts[-1]
        if isinstance(value, Mapping) and isinstance(node.get(last), dict):
            node[last] = _merge(node[last], value)
        else:
            node[last] = copy.deepcopy(value)
    return out


def _bad_key(where: str, key: str, allowed: Mapping[str, str] | set[str]) -> DataError:
    allowed_names = sorted(allowed)
    close = difflib.get_close_matches(key, allowed_names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return DataError(f"{where}: unknown key {key!r}.{hint} Allowed keys: {allowed_names}")


def _as_paths(value: Any) -> list:
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]


def data_spec(data: Mapping[str, Any]) -> str | dict:
    """What a run's ``data`` section loads: the :func:`load_spec` argument for it.

    ``data.train_files`` / ``data.val_files`` (verl's keys: a path or a list of paths) make an
    inline ``source: file`` spec; without them it is ``data.dataset`` (a spec name, a spec YAML or
    a verl-layout data file).

    Args:
        data: the ``data`` config section (a mapping with ``dataset``, ``train_files``, ``val_files``).

    Returns:
        A spec name or path, or an inline spec dict.

    Raises:
        ConfigError: ``data.val_files`` without training files (``data.dataset`` names a spec).
    """
    from trajflow.errors import ConfigError

    train, val = data.get("train_files"), data.get("val_files")
    if train is None and val is None:
        return str(data["dataset"])
    key = "data.train_files"
    if train is None:
        if file_format(Path(str(data["dataset"]))) is None:
            raise ConfigError(f"data.val_files needs data.train_files (verl's pair) or a data file as data.dataset; "
                              f"data.dataset={data['dataset']!r} is a spec: give it a 'validation_path' instead")
        train, key = data["dataset"], "data.dataset"
    spec: dict[str, Any] = {"source": "file", "path": [str(p) for p in _as_paths(train)], "_key": key}
    if val is not None:
        spec["validation_path"] = [str(p) for p in _as_paths(val)]
    return spec


def load_spec(spec_name_or_path: str | Path | Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> dict:
    """Read, merge and validate a dataset spec (no data is loaded).

    Args:
        spec_name_or_path: see :func:`resolve_spec_path`; or a verl-layout data file (``.parquet``,
            ``.jsonl``, ``.json``), loaded as ``source: file`` with no held-out split; or an inline
            spec from :func:`data_spec` (relative paths resolve against the working directory).
        overrides: keys to replace, merged deeply; dotted keys address nested dicts
            (``{"size": 200, "config.max_digits": 1}``).

    Returns:
        The validated spec dict, with ``name`` (default: file stem), ``seed`` (default 0),
        ``spec_path`` (absolute) and the source's defaults filled in.

    Raises:
        DataError: unreadable YAML, unknown ``source``, an unknown key (named, with the allowed keys), a
            ``scorer`` that is not registered in ``trajflow.stages.scorers.SCORERS``,
            or a value of the wrong type or range (named, with what was expected).
    """
    if not isinstance(spec_name_or_path, Mapping) and file_format(Path(str(spec_name_or_path))) is not None:
        spec_name_or_path = {"source": "file", "path": [str(spec_name_or_path)], "_key": "data.dataset"}
    if isinstance(spec_name_or_path, Mapping):
        raw = dict(spec_name_or_path)
        where = str(raw.pop("_key", "dataset"))
        first = _as_paths(raw.get("path"))[0]
        raw.setdefault("name", Path(str(first)).stem if first else "data")
        base_dir, path = Path.cwd(), None
        labels: dict[str, str] | None = {"path": where, "validation_path": "data.val_files"}
    else:
        path = resolve_spec_path(spec_name_or_path)
        try:
            raw = yaml.safe_load(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            raise DataError(f"{path}: a dataset spec must be YAML text (a data file needs a .parquet, .jsonl or "
                            f".json name)") from None
        except yaml.YAMLError as e:
            raise DataError(f"{path}: invalid YAML: {e}") from e
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise DataError(f"{path}: a dataset spec must be a mapping, got {type(raw).__name__}")
        where, base_dir, labels = str(path), path.parent, None
    spec = _merge(raw, overrides or {})

    source = spec.get("source")
    if source not in _SOURCES:
        raise DataError(f"{where}: 'source' must be one of {sorted(_SOURCES)}, got {source!r}")
    allowed = {**_COMMON_KEYS, **_SOURCES[source]}
    for key in spec:
        if key not in allowed:
            raise _bad_key(f"{where} (source: {source})", key, allowed)

    spec.setdefault("name", path.stem if path is not None else "data")
    spec.setdefault("seed", 0)
    if not isinstance(spec["seed"], int) or isinstance(spec["seed"], bool):
        raise DataError(f"{where}: 'seed' must be an integer, got {spec['seed']!r}")
    if not isinstance(spec["name"], str) or not spec["name"]:
        raise DataError(f"{where}: 'name' must be a non-empty string, got {spec['name']!r}")
    if spec.get("scorer") is not None:
        from trajflow.stages.scorers import SCORERS

        try:
            SCORERS.get(spec["scorer"])
        except ValueError as e:
            raise DataError(f"{where}: 'scorer': {e}") from e

    split = spec.get("split") or {}
    if not isinstance(split, dict):
        raise DataError(f"{where}: 'split' must be a mapping like {{validation_size: 64}}, got {split!r}")
    for key in split:
        if key not in _SPLIT_KEYS:
            raise _bad_key(f"{where}: split", key, _SPLIT_KEYS)
    vs = split.get("validation_size", 0)
    if not isinstance(vs, int) or isinstance(vs, bool) or vs < 0:
        raise DataError(f"{where}: 'split.validation_size' must be an integer >= 0, got {vs!r}")
    spec["split"] = {"validation_size": vs}

    if source == "reasoning_gym":
        _validate_rg_spec(spec, where)
    else:
        _validate_file_spec(spec, where, base_dir, labels)
    spec["spec_path"] = str(path) if path is not None else where
    return spec


def _validate_rg_spec(spec: dict, where: str) -> None:
    gen = spec.get("generator")
    if not isinstance(gen, str) or not gen:
        raise DataError(f"{where}: 'generator' (a reasoning-gym dataset name) is required, got {gen!r}")
    size = spec.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DataError(f"{where}: 'size' must be an integer >= 1 (training rows), got {size!r}")
    spec.setdefault("config", {})
    if spec["config"] is None:
        spec["config"] = {}
    if not isinstance(spec["config"], dict):
        raise DataError(f"{where}: 'config' must be a mapping of generator options, got {spec['config']!r}")
    for reserved in ("seed", "size"):
        if reserved in spec["config"]:
            raise DataError(
                f"{where}: 'config.{reserved}' is set by the spec's top-level '{reserved}'; remove it from 'config'"
            )
    sp = spec.setdefault("system_prompt", None)
    if sp is not None and not isinstance(sp, str):
        raise DataError(f"{where}: 'system_prompt' must be a string or null, got {sp!r}")
    shots = spec.setdefault("few_shot", [])
    if shots is None:
        shots = spec["few_shot"] = []
    if not isinstance(shots, list):
        raise DataError(f"{where}: 'few_shot' must be a list of {{user, assistant}} mappings, got {shots!r}")
    for i, shot in enumerate(shots):
        if not isinstance(shot, dict) or set(shot) != {"user", "assistant"} or not all(
            isinstance(shot[k], str) for k in ("user", "assistant")
        ):
            raise DataError(
                f"{where}: 'few_shot[{i}]' must be a mapping with exactly the string keys 'user' and "
                f"'assistant', got {shot!r}"
            )
    tmpl = spec.setdefault("prompt_template", "{question}")
    if not isinstance(tmpl, str):
        raise DataError(f"{where}: 'prompt_template' must be a string with a '{{question}}' placeholder, got {tmpl!r}")
    try:
        rendered = tmpl.format(question="\x00")
    except (KeyError, IndexError, ValueError) as e:
        raise DataError(
            f"{where}: 'prompt_template' {tmpl!r} is not a valid template: only '{{question}}' may appear in "
            f"braces (write '{{{{' / '}}}}' for literal braces); error: {e!r}"
        ) from e
    if "\x00" not in rendered:
        raise DataError(f"{where}: 'prompt_template' {tmpl!r} must contain the placeholder '{{question}}'")
    key = spec.setdefault("problem_key", "question")
    if not isinstance(key, str) or not (key == "question" or key.startswith("metadata.")):
        raise DataError(f"{where}: 'problem_key' must be 'question' or 'metadata.<field>', got {key!r}")


def _validate_file_spec(spec: dict, where: str, base_dir: Path, labels: Mapping[str, str] | None = None) -> None:
    """``labels``: what the user called ``path`` / ``validation_path`` (``data.train_files``, ...), for
    the messages of an inline spec; a spec file's messages name the file and its key."""
    for key, required in (("path", True), ("validation_path", False)):
        value = spec.get(key)
        if value is None:
            if required:
                raise DataError(f"{where}: 'path' (a .parquet or .jsonl file in verl's layout) is required")
            continue
        values = _as_paths(value)
        if not values:
            raise DataError(f"{where}: '{key}' is an empty list; give at least one file")
        resolved = []
        for i, v in enumerate(values):
            index = f"[{i}]" if len(values) > 1 else ""
            name = f"{labels[key]}{index}" if labels else f"{where}: '{key}{index}'"
            if not isinstance(v, str) or not v:
                raise DataError(f"{name} must be a file path string, got {v!r}")
            p = Path(v).expanduser()
            if not p.is_absolute():
                p = base_dir / p
            if file_format(p) is None:
                raise DataError(f"{name}={v!r}: a data file must end in .parquet, .jsonl or .json")
            if not p.is_file():
                raise DataError(f"{name}={v!r}: file not found (resolved to {p})")
            resolved.append(str(p.resolve()))
        spec[key] = resolved if isinstance(value, Sequence) and not isinstance(value, str) else resolved[0]
    ds = spec.setdefault("data_source", None)
    if ds is not None and not isinstance(ds, str):
        raise DataError(f"{where}: 'data_source' must be a string, got {ds!r}")
    if spec.get("validation_path") and spec["split"]["validation_size"]:
        raise DataError(f"{where}: give either 'validation_path' or 'split.validation_size', not both")


def file_paths(value: str | list[str] | None) -> list[str]:
    """A spec's ``path`` / ``validation_path`` (one file or a list) as a list."""
    return [] if value is None else [str(v) for v in _as_paths(value)]


def file_format(p: Path) -> str | None:
    """``"parquet"`` or ``"jsonl"`` for a data file's suffix, None for anything else."""
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    return None
