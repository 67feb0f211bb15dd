"""The config keys the docs name exist: every trajflow key in README.md, benchmarks/README.md and
docs/*.md is in the schema, and every verl key of docs/config.md's "Mapping to verl and TRL" is
accepted as typed (rewritten to a trajflow key that exists, dropped as verl-only machinery, or refused
with a line saying what to set instead), as that page promises. A renamed or removed key fails here
instead of in a user's first command. Reads text and the schema only: well under a second."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from trajflow.config.schema import TrajflowConfig, _field_for
from trajflow.config.verl_keys import translate_verl_keys
from trajflow.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = [f.name for f in dataclasses.fields(TrajflowConfig)]
MAPPING = "## Mapping to verl and TRL"

#: Backticked names that start like a key but are not config keys.
NOT_KEYS = {
    "model.generate", "model.load_weights",  # methods of a model object
    "model.safetensors",                      # a file name
    "rollout.max_head_offpolicyness",         # AReaL's key, named for comparison
}

FILE = re.compile(r"\.(py|parquet|json|yaml|md|png|lance|db)$")  # rollout.parquet, reward.py, ...
KEY = re.compile(r"`((?:%s)(?:\.\w+)+)(?:=[^`]*)?`" % "|".join(SECTIONS))


@pytest.fixture(autouse=True)
def _own_said_lines(monkeypatch):
    """translate_verl_keys says each rewrite once per process: keep these lookups from using that up."""
    from trajflow.config import verl_keys

    monkeypatch.setattr(verl_keys, "_SAID", set())


def _is_key(key: str) -> bool:
    if _field_for(key) is not None:
        return True
    parts = key.split(".")  # an entry of a dict-valued key, e.g. gates.policies.<expectation>
    for i in range(len(parts) - 1, 0, -1):
        f = _field_for(".".join(parts[:i]))
        if f is not None:
            return "dict" in str(f.type)
    return False


def _mapping_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "config.md").read_text().split(MAPPING, 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split(" | ")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| trajflow |")]


def _verl_key_known(key: str) -> bool:
    """``key`` is one of verl's that trajflow rewrites, drops or refuses by name."""
    try:
        return translate_verl_keys([f"{key}=1"]) != [f"{key}=1"]
    except ConfigError as e:
        return "unknown" not in str(e)


def test_every_key_the_docs_name_exists():
    """A trajflow key of the schema, or (in the verl mapping's prose) a verl key trajflow knows."""
    unknown = [f"{p.relative_to(ROOT)}: {k}" for p in DOCS for k in sorted(set(KEY.findall(p.read_text())))
               if k not in NOT_KEYS and not FILE.search(k) and not _is_key(k) and not _verl_key_known(k)]
    assert not unknown, "keys named in the docs but not in trajflow/config/schema.py:\n" + "\n".join(unknown)


def _verl_keys() -> list[str]:
    """The verl column's keys, ``arr.`` expanded; ``a.b.c` / `d``` (or ``(and `d`)``) is ``a.b.c`` and ``a.b.d``."""
    top = {*SECTIONS, "actor_rollout_ref", "reward_model", "custom_reward_function", "async_training"}
    keys = []
    for row in _mapping_rows():
        prev = None
        for m in re.finditer(r"(/ |\(and )?`([^`]+)`", row[1]):
            name = m.group(2).split("=", 1)[0].replace("arr.", "actor_rollout_ref.")
            if not re.fullmatch(r"\w+(\.\w+)*", name):
                continue  # a value, a path, or an abbreviation such as critic.model.fsdp_config...
            if m.group(1) and prev is not None and name.split(".")[0] not in top:
                # shorthand: the last components of the key before it
                n = name.count(".") + 1
                name = ".".join(prev.split(".")[:-n] + [name])
            elif "." not in name:
                continue  # a value such as `low_var_kl`
            prev = name
            keys.append(name)
    return keys


def test_the_mapping_table_is_parsed():
    keys = _verl_keys()
    # spot checks of the parser on rows of each kind
    assert {"actor_rollout_ref.rollout.top_k", "actor_rollout_ref.rollout.val_kwargs.temperature",
            "algorithm.rollout_correction.rollout_rs_threshold_lower", "trainer.max_critic_ckpt_to_keep",
            "actor_rollout_ref.actor.optim.min_lr_ratio"} <= set(keys)
    assert len(keys) > 80


@pytest.mark.parametrize("verl_key", sorted(set(_verl_keys())))
def test_every_verl_key_of_the_mapping_is_accepted_as_typed(verl_key):
    try:
        out = translate_verl_keys([f"{verl_key}=1"])
    except ConfigError as e:
        # refused on purpose, saying what to set instead (never "unknown")
        assert "unknown" not in str(e) and verl_key.split(".")[0] in str(e), str(e)
        return
    for o in out:
        key = o.split("=", 1)[0]
        assert _is_key(key), f"{verl_key} becomes {key}, which is not a trajflow key"
