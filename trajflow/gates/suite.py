"""Suite files: GX 1.x ``ExpectationSuite`` JSON with trajflow's ``meta`` (name, table, policy, quarantine)."""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trajflow import LAYOUT_ROOT
from trajflow.gates.report import POLICIES
from trajflow.gates.runtime import TABLES, gx_runtime
from trajflow.gates.summary import QUARANTINE_ROWS

#: Folder of the shipped suites: ``<repo>/datasets/expectations`` (``trajflow/datasets/expectations`` installed).
SUITE_DIR = LAYOUT_ROOT / "datasets" / "expectations"
#: The suite used when ``gates.suite`` is None.
DEFAULT_SUITE = SUITE_DIR / "reward_default.json"


@dataclass(frozen=True)
class Entry:
    """One expectation of a suite file, with trajflow's ``meta`` resolved."""

    name: str
    table: str
    type: str
    config: dict  # the expectation's JSON, with meta.name filled in
    default_policy: str
    quarantine: Optional[str]  # QUARANTINE_ROWS name (summary table)
    row_level: bool  # a map expectation: GX lists the offending sample_ids
    column: Optional[str]
    description: str


@dataclass(frozen=True)
class SuiteSpec:
    """A parsed suite file: its expectations split by table, each with name and policy."""

    path: str
    name: str
    entries: tuple[Entry, ...]

    def names(self) -> list[str]:
        """Expectation names in file order."""
        return [e.name for e in self.entries]


_SUITE_CACHE: dict[tuple[str, str], SuiteSpec] = {}


def _resolve_suite_path(suite: str | os.PathLike | None) -> Path:
    if suite is None or str(suite) == "":
        return DEFAULT_SUITE
    p = Path(suite).expanduser()
    # dict.fromkeys: run from the repository root, the first two are one folder
    candidates = [p] if p.is_absolute() else list(dict.fromkeys([Path.cwd() / p, LAYOUT_ROOT / p,
                                                                 SUITE_DIR / p]))
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise ValueError(f"gates.suite={str(suite)!r}: no such file (looked in "
                     f"{', '.join(str(c) for c in candidates)})")


def load_suite(suite: str | os.PathLike | None = None) -> SuiteSpec:
    """Parse and check a suite file (cached by path and content).

    Args:
        suite: path to a GX 1.x ``ExpectationSuite`` JSON file; None = :data:`DEFAULT_SUITE`.
            A relative path is tried against the working directory, the repository root and
            ``datasets/expectations/``.

    Returns:
        The :class:`SuiteSpec`.

    Raises:
        ValueError: the file is missing or not JSON, an expectation is not a valid GX
            expectation (unknown type, bad kwargs), or its ``meta`` has a bad ``table``,
            ``policy`` or ``quarantine`` value, or two expectations share a name. The message
            names the file and the expectation's index and type.
    """
    path = _resolve_suite_path(suite)
    raw = path.read_bytes()
    key = (str(path), hashlib.sha256(raw).hexdigest())
    if key in _SUITE_CACHE:
        return _SUITE_CACHE[key]
    gx_runtime()  # imports GX (expectation classes are checked against it)
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"gate suite {path}: not valid JSON: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("expectations"), list):
        raise ValueError(f"gate suite {path}: expected a GX ExpectationSuite JSON object with an "
                         "'expectations' list")
    seen: set[str] = set()
    entries = [_entry(exp, f"gate suite {path}: expectations[{i}]", seen)
               for i, exp in enumerate(doc["expectations"])]
    spec = SuiteSpec(path=str(path), name=str(doc.get("name") or path.stem), entries=tuple(entries))
    _SUITE_CACHE[key] = spec
    return spec


def _entry(exp: object, where: str, seen: set[str]) -> Entry:
    """One expectation of a suite file, checked; ``where`` starts every error message.

    ``seen`` holds the names of the expectations before it; this one's name is added.
    """
    from great_expectations.expectations.expectation import (
        ColumnMapExpectation, ColumnPairMapExpectation, MulticolumnMapExpectation)
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    if not isinstance(exp, dict) or "type" not in exp:
        raise ValueError(f"{where}: expected an object with 'type' and 'kwargs'")
    where += f" ({exp['type']})"
    cfg = copy.deepcopy({k: v for k, v in exp.items() if k != "id"})
    cfg.setdefault("kwargs", {})
    meta = dict(cfg.get("meta") or {})
    column = cfg["kwargs"].get("column")
    name = meta.get("name") or (exp["type"].removeprefix("expect_")
                                + (f"__{column}" if column else ""))
    if not isinstance(name, str) or "/" in name or not name.strip():
        raise ValueError(f"{where}: meta.name={name!r} must be a non-empty string without '/'")
    if name in seen:
        raise ValueError(f"{where}: meta.name {name!r} is used twice; names must be unique")
    seen.add(name)
    table = meta.get("table", "samples")
    if table not in TABLES:
        raise ValueError(f"{where}: meta.table={table!r}; choose one of {', '.join(TABLES)}")
    policy = meta.get("policy", "fail")
    if policy not in POLICIES:
        raise ValueError(f"{where}: meta.policy={policy!r}; choose one of {', '.join(POLICIES)}")
    quarantine = meta.get("quarantine")
    if quarantine is not None:
        try:
            QUARANTINE_ROWS.get(quarantine)
        except ValueError as e:
            raise ValueError(f"{where}: meta.quarantine: {e}") from e
    meta["name"] = name
    cfg["meta"] = meta
    try:
        obj = ExpectationConfiguration(**cfg).to_domain_obj()
    except Exception as e:  # GX raises pydantic/GX errors of many types
        raise ValueError(f"{where}: not a valid GX expectation: {e}") from e
    row_level = table == "samples" and isinstance(
        obj, (ColumnMapExpectation, ColumnPairMapExpectation, MulticolumnMapExpectation))
    return Entry(name=name, table=table, type=exp["type"], config=cfg, default_policy=policy,
                 quarantine=quarantine, row_level=row_level, column=column,
                 description=str(meta.get("description", "")))


def suite_policies(spec: SuiteSpec, overrides: Mapping[str, str]) -> dict[str, str]:
    """Each expectation's policy: ``overrides`` (``gates.policies``) over the suite's ``meta.policy``.

    Raises:
        ValueError: an override names no expectation of the suite (closest name suggested), or
            asks ``quarantine`` of an expectation that names no offending rows.
    """
    names = spec.names()
    for name, policy in overrides.items():
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"gates.policies.{name}={policy!r}: no expectation named {name!r} in "
                             f"{spec.path}{hint}; names: {', '.join(names)}")
    out = {e.name: overrides.get(e.name, e.default_policy) for e in spec.entries}
    for e in spec.entries:
        if out[e.name] == "quarantine" and not (e.row_level or e.quarantine):
            raise ValueError(
                f"gates.policies.{e.name}=quarantine is not possible: {e.type} on the {e.table} "
                "table names no offending rows (only row-level expectations on the samples "
                "table, or summary expectations with meta.quarantine, can quarantine); use fail "
                "or warn")
    return out


def check_suite(suite: Optional[str], policies: Mapping[str, str]) -> None:
    """Parse the suite file ``suite`` (``gates.suite``; None = the default) with ``policies``
    (``gates.policies``) as a run would: the check the preflight and ``trajflow gate`` make before
    any iteration is validated.

    Raises:
        trajflow.errors.ConfigError: the suite cannot be read or parsed, or a policy does not fit it
            (:func:`suite_policies`); one line naming the file or key.
    """
    from trajflow.errors import ConfigError

    try:
        suite_policies(load_suite(suite), dict(policies))
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
