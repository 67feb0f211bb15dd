"""Building a run's config: defaults <- recipe YAML <- ``key=value`` overrides, ``auto`` dtypes
resolved on this machine, then validated (:func:`trajflow.config.rules.validate`) and made read-only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from trajflow import LAYOUT_ROOT
from trajflow.config.rules import validate
from trajflow.config.verl_keys import translate_verl_keys
from trajflow.config.schema import (DEFAULT_RECIPE, PRECISION_SECTIONS, TrajflowConfig, _closest, _expected_type,
                                    _field_for)
from trajflow.errors import ConfigError

#: The shipped recipes (``flows/configs/`` of the repository; ``trajflow/flows/configs/`` when installed).
RECIPES_DIR = LAYOUT_ROOT / "flows" / "configs"


def _explain(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    if isinstance(err, ConfigKeyError) or "not in struct" in str(err) or "Key '" in str(err) and "not" in str(err):
        return ConfigError(f"{source}: unknown config key '{key}'{_closest(key)}")
    if isinstance(err, ValidationError):
        expected = _expected_type(key)
        value = getattr(err, "value", None)
        shown = f"{value!r}" if value is not None else "(value)"
        return ConfigError(f"{source}: {key}={shown} is not a valid {expected}")
    msg = str(err).splitlines()[0]
    return ConfigError(f"{source}: {key or 'config'}: {msg}")



AUTO_PRECISION_ENV = "TRAJFLOW_AUTO_PRECISION"


def _auto_choice(device: str) -> tuple[str, str]:
    import os

    from trajflow.infra.devices import bf16_is_fast

    forced = os.environ.get(AUTO_PRECISION_ENV)
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ConfigError(f"${AUTO_PRECISION_ENV}={forced!r}: expected 'float32' or 'bfloat16' (or unset it to "
                              f"choose by hardware)")
        return forced, f"${AUTO_PRECISION_ENV}={forced}"
    fast, why = bf16_is_fast(device)
    return ("bfloat16" if fast else "float32"), why


def resolve_auto_precision(cfg: DictConfig) -> str | None:
    """Replace every ``auto`` dtype (``<section>.mixed_precision.param_dtype``, ``rollout.dtype``) by
    ``bfloat16`` where bf16 is fast on ``trainer.device`` and ``float32`` elsewhere
    (:func:`trajflow.infra.devices.bf16_is_fast`), decided on this machine, once, at start;
    ``$TRAJFLOW_AUTO_PRECISION`` (``float32``/``bfloat16``) overrides the hardware's answer.

    The stored config then holds the concrete dtypes, so a resumed run keeps them on any machine.

    Returns:
        The decision as one line (also stored in ``trainer.precision_auto``), or ``None`` when no
        key was ``auto``.

    Raises:
        ConfigError: ``$TRAJFLOW_AUTO_PRECISION`` holds something other than the two dtypes.
    """
    keys = [f"{k}.mixed_precision.param_dtype" for k in PRECISION_SECTIONS] + ["rollout.dtype"]
    auto = [k for k in keys if OmegaConf.select(cfg, k) == "auto"]
    if not auto:
        return None
    dtype, why = _auto_choice(str(cfg.trainer.device))
    for k in auto:
        OmegaConf.update(cfg, k, dtype, merge=False)
    note = f"auto -> {dtype} ({why}) for {', '.join(auto)}"
    cfg.trainer.precision_auto = note
    return note



def resolve_recipe(recipe: str | Path | None) -> Path:
    """Map a recipe name (``grpo``) or path to its YAML file.

    Raises:
        ConfigError: the file does not exist (lists the shipped recipes).
    """
    if recipe is None:
        recipe = DEFAULT_RECIPE
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"--config: file {str(p)!r} does not exist")
        return p
    candidate = RECIPES_DIR / f"{recipe}.yaml"
    if candidate.exists():
        return candidate
    shipped = sorted(x.stem for x in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(f"--config: no recipe named {str(recipe)!r}; shipped recipes: {', '.join(shipped)}")


def _recipe_for_own_data(cfg: DictConfig) -> str | None:
    """The recipe made for the shape of the user's own data file (GSM8K, MATH), when no recipe was
    named: the default recipe's 64-token cap and overlong penalty fit two-term arithmetic only
    (:mod:`trajflow.prompts.shape`). None for a dataset spec or an unrecognised shape."""
    from trajflow.prompts.shape import detect_shape, own_data

    if own_data(cfg.data) is None:
        return None
    shape = detect_shape(cfg.data)
    return shape.recipe if shape is not None else None


def load_config(recipe: str | Path | None = None, overrides: Sequence[str] = (),
                base: DictConfig | None = None) -> DictConfig:
    """Build a validated run config.

    Args:
        recipe: recipe name under ``flows/configs/`` or a YAML path (``None``: the default recipe, or,
            for own data in GSM8K's or MATH's shape, ``grpo_gsm8k`` / ``grpo_math``).
        overrides: ``key=value`` strings (OmegaConf dot-list syntax, e.g. ``actor.lr=2e-5``).
        base: start from this resolved config instead of the defaults plus recipe (resume/replay).

    Returns:
        A read-only, struct-mode ``DictConfig`` with the schema of :class:`TrajflowConfig`.

    Raises:
        ConfigError: unknown key, wrong type, value out of range, bad YAML, missing recipe.
    """
    schema = OmegaConf.structured(TrajflowConfig)
    if base is not None:
        layers = [(str("stored config"), base)]
    else:
        path = resolve_recipe(recipe)
        try:
            recipe_cfg = OmegaConf.load(path)
        except Exception as e:
            where = getattr(e, "problem_mark", None)  # yaml's MarkedYAMLError: where the parser stopped
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            raise ConfigError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or str(e).splitlines()[0]}") \
                from None
        if isinstance(recipe_cfg, DictConfig) and len(recipe_cfg) == 0:
            raise ConfigError(f"{path}: the recipe is empty; give at least one section (e.g. 'actor: {{lr: 1e-5}}'), "
                              f"or no --config for the default recipe")
        if not isinstance(recipe_cfg, DictConfig):
            raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(recipe_cfg).__name__}")
        if "recipe" not in recipe_cfg:
            recipe_cfg.recipe = path.stem
        layers = [(str(path), recipe_cfg)]
    overrides = translate_verl_keys(overrides)  # verl's keys as typed (docs/config.md's mapping)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r}: expected key=value (e.g. actor.lr=2e-5)")
    interp = [o for o in overrides if "${" in o.split("=", 1)[1]]
    if interp:
        # The run records literal values (config.yaml is resolved); an interpolation would be
        # resolved against this shell's environment and fail, or differ, elsewhere.
        raise ConfigError(f"override {interp[0]!r}: interpolations (${{...}}) are not accepted in overrides; "
                          f"write the value itself (e.g. let the shell expand $VAR)")
    for o in overrides:
        key = o.split("=", 1)[0].strip()
        f = _field_for(key)
        if f is not None and dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING
                                                      else None):
            some = dataclasses.fields(f.default_factory)[0].name
            raise ConfigError(f"override {o!r}: {key} is a config section, not a value; set one of its keys "
                              f"(e.g. {key}.{some}=...; trajflow config lists them)")
    import yaml

    for o in overrides:  # one at a time: the error names the override whose value YAML cannot read
        try:
            OmegaConf.from_dotlist([o])
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at column {mark.column + 1} of the value" if mark is not None else ""
            raise ConfigError(f"override {o!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e}"
                              f"{at}); write mappings with a space after each colon, e.g. "
                              f"resources.pools='{{a: {{devices_per_node: 1}}}}'") from None
        except OmegaConfBaseException:
            break  # reported below as before
    try:
        layers.append(("override", OmegaConf.from_dotlist(list(overrides))))
    except OmegaConfBaseException as e:
        raise ConfigError(f"override: {str(e).splitlines()[0]}") from None
    cfg = schema
    for source, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as e:
            raise _explain(e, source) from None
    if recipe is None and base is None:
        shaped = _recipe_for_own_data(cfg)
        if shaped is not None:
            return load_config(shaped, overrides)
    fn = cfg.reward.custom_function
    if fn and ":" not in str(fn) and str(fn).endswith(".py"):  # verl's default function name
        cfg.reward.custom_function = f"{fn}:compute_score"
    if cfg.actor.ppo_mini_batch_size is None:  # verl's default: the whole batch in one optimizer step
        cfg.actor.ppo_mini_batch_size = cfg.data.train_batch_size
    resolve_auto_precision(cfg)
    if cfg.algorithm.rollout_is is None and (cfg.trainer.max_staleness or cfg.rollout.dtype != "float32"):
        # Stale rows come from an older policy, a bf16/fp16 sampler from rounded weights: both sample
        # from a distribution other than the trainer's, so correct by default ('disable' is an explicit no).
        cfg.algorithm.rollout_is = "token"
    validate(cfg, "config")
    OmegaConf.set_readonly(cfg, True)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML text (saved with each run)."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def flatten(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    """Flatten to ``{"actor.lr": 1e-05, ...}`` (MLflow params, compare tables)."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, (DictConfig, ListConfig)) else cfg
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
