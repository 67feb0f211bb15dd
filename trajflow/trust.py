"""What a run folder may not decide: which code is imported and where the run's data is sent.

A run folder is data. Anyone who can write to it can edit its ``config.yaml`` and ``run.json``, so
a command that reads a stored config (``resume``, ``replay``, ``evaluate``, ``gate``) passes it
through :func:`screen_stored_config` *before* the config is validated (validation imports an
environment factory and the tools of a tool config; start-up checks import the reward function):

- **Code** (:data:`CODE_KEYS`): ``reward.custom_function`` (a Python file), a
  ``rollout.multi_turn.environment`` of the form ``module:factory`` and
  ``rollout.multi_turn.tool_config_path`` (a file naming tool functions) and ``rollout.agent`` (an
  agent function, ``module:function``) are kept only when the
  caller names the key again in their overrides, or, for the reward function, confirms the sha256
  of its file with ``reward.custom_function_sha256=<hex>``. Otherwise a command that needs the
  code stops with one line saying how to consent; one that does not (``gate``) drops it.
- **Consent flags** (:data:`CONSENT_KEYS`) stored in the file are reset to their defaults: only the
  caller's command line grants consent.
- **Judge endpoint**: a stored ``reward.judge.base_url`` (where responses are sent for judging), its
  ``reward.judge.model_path`` (the judge model trajflow serves: weights, no code, but it decides the
  scores) and ``reward.judge.api_key_env`` (the environment variable whose secret is sent with them) are used only
  when the caller names them again; with the judge on, a command that scores stops with one line.
- **Tracking URI**: a stored ``tracking.uri`` different from the caller's (their override, else
  the SQLite store under ``store.root``) is reported in one line and not used, unless the caller
  names it again.
- **Loggers**: a stored ``trainer.logger`` is reused (``tensorboard`` and ``wandb`` are fixed
  libraries: no code is named), but where they write comes from the caller's environment
  (``TENSORBOARD_DIR``, ``WANDB_DIR``, ``WANDB_MODE``), never from the folder: see
  :mod:`trajflow.loggers`.

The record of the reward function in ``run.json`` (path and sha256) lives in the same folder, so it
only ever adds a refusal (the file changed since the run started), never a permission.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from trajflow.errors import ConfigError

#: Config keys whose value names code that trajflow imports.
CODE_KEYS = ("reward.custom_function", "rollout.multi_turn.environment", "rollout.multi_turn.tool_config_path",
             "rollout.agent")
#: Config keys that grant consent; never honoured from a stored file.
CONSENT_KEYS = ("reward.trust_changed_custom_function", "reward.custom_function_sha256")
#: Where a stored config sends the run's data.
URI_KEYS = ("tracking.uri",)
#: The LLM judge's endpoint and the environment variable whose secret is sent to it.
#: ``model_path`` is data (weights, no code) but chooses what judges the responses, so it is treated
#: like the URL.
JUDGE_KEYS = ("reward.judge.base_url", "reward.judge.model_path", "reward.judge.api_key_env")


def override_keys(overrides: Sequence[str]) -> set[str]:
    """The keys the caller's ``key=value`` overrides set (what they named on the command line)."""
    return {o.split("=", 1)[0].strip() for o in overrides if "=" in o}


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The last value ``overrides`` give ``key`` (as typed), or None."""
    value = None
    for o in overrides:
        k, sep, v = o.partition("=")
        if sep and k.strip() == key:
            value = v.strip()
    return value


def _get(cfg: DictConfig, key: str):
    return OmegaConf.select(cfg, key, default=None)


def _set(cfg: DictConfig, key: str, value) -> None:
    OmegaConf.update(cfg, key, value, merge=False, force_add=True)


def _default(key: str):
    from trajflow.config import TrajflowConfig

    return OmegaConf.select(OmegaConf.structured(TrajflowConfig), key)


def names_code(key: str, value) -> bool:
    """Whether ``value`` of code key ``key`` makes trajflow import something not built in."""
    if value in (None, ""):
        return False
    if key == "rollout.multi_turn.environment":
        from trajflow.envs.registry import ENVIRONMENTS, load_builtin_environments

        load_builtin_environments()
        return ":" in str(value) and str(value) not in ENVIRONMENTS
    return True


def _in_use(cfg: DictConfig, key: str, overrides: Sequence[str]) -> bool:
    """Whether the run would import ``key``'s code (the multi-turn keys only with multi-turn on,
    as the overrides leave it)."""
    if key.startswith("rollout.multi_turn."):
        enable = override_value(overrides, "rollout.multi_turn.enable")
        if enable is not None:
            return enable.lower() in ("true", "1", "yes", "on")
        return bool(_get(cfg, "rollout.multi_turn.enable"))
    return True


def file_sha256(path: str | Path) -> str | None:
    """sha256 of a file's bytes, or None when it is not a readable file."""
    import hashlib

    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _confirmed_by_hash(key: str, value, overrides: Sequence[str]) -> bool:
    """The caller confirmed the reward function's file by its sha256 (``reward.custom_function_sha256``)."""
    if key != "reward.custom_function":
        return False
    want = override_value(overrides, "reward.custom_function_sha256")
    if not want:
        return False
    from trajflow.stages.scorers import custom_function_file

    try:
        path = custom_function_file(str(value))
    except ValueError:
        return False
    return file_sha256(path) == want.strip("'\"").lower()


def _consent_hint(key: str, value) -> str:
    hint = f"pass {key}={value} again"
    if key == "reward.custom_function":
        from trajflow.stages.scorers import custom_function_file

        try:
            digest = file_sha256(custom_function_file(str(value)))
        except ValueError:
            digest = None
        if digest:
            hint += f" (or reward.custom_function_sha256={digest}, the sha256 of that file now)"
    return hint


def screen_stored_config(stored: DictConfig, overrides: Sequence[str], source: str | Path, *,
                         needs_code: bool = True, report=None) -> DictConfig:
    """The stored config as a command may use it: code the caller did not name again removed or
    refused, stored consent flags reset, a stored tracking URI other than the caller's dropped.

    Nothing is imported here: the keys are compared as text, and the reward function's file is
    only hashed.

    Args:
        stored: the run's stored config (:meth:`trajflow.store.RunStore.read_config`).
        overrides: the caller's ``key=value`` overrides.
        source: the stored file, for messages.
        needs_code: the command runs the stored code (resume, replay, evaluate): refuse code that
            is not consented to; otherwise (``gate``) drop it silently.
        report: where the one-line note about a dropped tracking URI goes (default: stderr).

    Returns:
        A copy of ``stored`` to use as ``load_config``'s base.

    Raises:
        ConfigError: ``needs_code`` and the stored config names code in use that the caller did
            not name again (names the key, the file and how to consent).
    """
    cfg = OmegaConf.create(OmegaConf.to_container(stored, resolve=False))
    named = override_keys(overrides)
    for key in CONSENT_KEYS:
        if _get(cfg, key) not in (None, _default(key)):
            _set(cfg, key, _default(key))  # consent comes from the command line only
    for key in CODE_KEYS:
        value = _get(cfg, key)
        if key in named or not names_code(key, value) or _confirmed_by_hash(key, value, overrides):
            continue
        if needs_code and _in_use(cfg, key, overrides):
            raise ConfigError(f"{source}: names {key}={value!r}; code named by a run folder is not imported "
                              f"(anyone who can write the folder could have put it there): "
                              f"{_consent_hint(key, value)} to use it")
        _set(cfg, key, _default(key))
    _screen_judge(cfg, overrides, source, needs_code)
    uri = _get(cfg, "tracking.uri")
    if uri and "tracking.uri" not in named:
        _set(cfg, "tracking.uri", None)  # the caller's default: the SQLite store under store.root
        root = override_value(overrides, "store.root") or _get(cfg, "store.root") or "runs"
        from trajflow.tracking import store_tracking_uri

        if str(uri) != store_tracking_uri(root):
            print(f"note: {source} names tracking.uri={uri!r}; not used (a run folder does not choose where "
                  f"data is sent): logging to {store_tracking_uri(root)}; pass tracking.uri={uri} to log there",
                  file=report or sys.stderr, flush=True)
    return cfg


def _screen_judge(cfg: DictConfig, overrides: Sequence[str], source, needs_code: bool) -> None:
    """A stored ``reward.judge.base_url`` (where responses are sent), ``model_path`` (the judge model
    trajflow serves) or ``api_key_env`` (whose secret goes with them) is used only when the caller
    names it again: refused while the judge is on for a command that scores (naming the key and how
    to consent), else dropped (the judge then off, when its endpoint or model was dropped)."""
    named = override_keys(overrides)
    enable = override_value(overrides, "reward.judge.enable")
    on = enable.lower() in ("true", "1", "yes", "on") if enable is not None else bool(_get(cfg, "reward.judge.enable"))
    for key in JUDGE_KEYS:
        value = _get(cfg, key)
        if value in (None, "") or key in named:
            continue
        if needs_code and on:
            raise ConfigError(f"{source}: names {key}={value!r}; a run folder does not choose where responses are "
                              f"sent, which model judges them or which secret goes with them: pass {key}={value} "
                              f"again to use it (or reward.judge.enable=false)")
        _set(cfg, key, None)
        if key in ("reward.judge.base_url", "reward.judge.model_path"):
            _set(cfg, "reward.judge.enable", False)


def check_custom_function_hash(cfg: DictConfig, source: str = "config") -> None:
    """With ``reward.custom_function_sha256`` set, the reward function's file must have that sha256.

    Raises:
        ConfigError: the file is missing or its sha256 differs (names both digests).
    """
    want = _get(cfg, "reward.custom_function_sha256")
    if not want:
        return
    spec = _get(cfg, "reward.custom_function")
    if not spec:
        raise ConfigError(f"{source}: reward.custom_function_sha256 is set but reward.custom_function is not")
    from trajflow.stages.scorers import custom_function_file

    try:
        path = custom_function_file(str(spec))
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    got = file_sha256(path)
    if got != str(want).lower():
        raise ConfigError(f"{source}: reward.custom_function_sha256={want} but {path} "
                          f"{'is missing' if got is None else f'has sha256 {got}'}; refusing to import it")
