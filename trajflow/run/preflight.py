"""Preflight: fail on bad data, model, store or reward input before Prefect, Ray or the run folder
are touched. Only what needs the data, the model, the file system or the user's code is checked
here; rules over the config alone are :func:`trajflow.config.validate`'s (run at load).

Also the record of ``reward.custom_function`` a run keeps, and the check that a resume or replay
imports the code the run started with.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from trajflow.errors import StoreError

if TYPE_CHECKING:
    from trajflow.prompts import PromptDatasets


def preflight(cfg: DictConfig) -> None:
    """Fail on bad data or model input before Prefect, Ray or the run folder are touched.

    Raises:
        trajflow.prompts.DataError: the dataset spec or a row is invalid (names file and row).
        trajflow.models.ModelLoadError: ``model.path`` is not loadable or its weights are corrupt.
        trajflow.errors.DeviceError: ``trainer.device`` or the vLLM engine is not available here.
        trajflow.errors.ConfigError: the custom reward function, the gate suite or policies (see
            :func:`check_reward_and_gates`); more prompts per
            iteration than the dataset has (see :func:`check_batch_size`); a tool sandbox weaker than
            ``rollout.multi_turn.allow_weaker_sandbox`` allows.
        StoreError: ``store.root`` is not a writable folder.
        trajflow.errors.ConfigError: an http(s) ``tracking.uri`` does not answer within seconds.
    """
    from trajflow.prompts import data_spec, load_prompt_dataset, load_spec
    from trajflow.models import resolve_model_path
    from trajflow.infra.devices import preflight_devices
    from trajflow.tracking import check_tracking_server

    preflight_devices(cfg)
    check_store_root(cfg)
    check_tracking_server(cfg)
    check_reward_and_gates(cfg)
    if cfg.rollout.multi_turn.enable and not cfg.rollout.agent:  # a weaker sandbox than allowed: refused before Ray
        from trajflow.envs.sandbox import tool_sandbox_record

        tool_sandbox_record(cfg.rollout.multi_turn)

    # Generated datasets too: their rows are well-formed by construction, but their count and their
    # length (system prompt, few-shot turns) are the spec's choice.
    data = data_spec(cfg.data)
    datasets = load_prompt_dataset(data)
    check_batch_size(cfg, datasets)
    if load_spec(data).get("source") == "file":  # generated datasets are scored by construction
        check_scorers(cfg, datasets)
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    check_model_weights(model_dir)
    check_prompt_lengths(cfg, datasets, model_dir)


def check_batch_size(cfg: DictConfig, datasets: PromptDatasets) -> None:
    """``data.train_batch_size`` prompts exist: the sampler hands out full batches only, so a larger
    batch would fail in the first iteration, after Ray and Prefect started.

    Raises:
        trajflow.errors.ConfigError: names both numbers, the key and the dataset.
    """
    from trajflow.errors import ConfigError

    n = len(datasets.train)
    if cfg.data.train_batch_size > n:
        # Name the data the prompts came from: verl's data.train_files when given (data.dataset then
        # still holds its unused default), else the spec or file of data.dataset.
        files = cfg.data.get("train_files")
        if files:
            source = f"data.train_files={list(files) if not isinstance(files, str) else files}"
        else:
            spec = datasets.spec.get("spec_path")
            source = f"data.dataset={cfg.data.dataset!r}" + (f" ({spec})" if spec else "")
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the {n} training "
                          f"prompts of {source}; lower data.train_batch_size to at most {n} or give the dataset "
                          f"more prompts")


def _model_context(model_dir: Path) -> tuple[int | None, str]:
    """The longest sequence the model's positions cover, and the config key it came from."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):  # no readable config.json: transformers' loader reports it later
        return None, ""
    for node in (config, config.get("text_config") or {}):  # multimodal configs nest the language model's
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            if isinstance(node.get(key), int) and node[key] > 0:
                return node[key], key
    return None, ""


def check_prompt_lengths(cfg: DictConfig, datasets: PromptDatasets, model_dir: Path) -> None:
    """Every prompt that will be generated from, rendered with the model's chat template as the
    policy worker renders it, fits ``data.max_prompt_length`` and, with ``rollout.max_new_tokens``
    after it, the model's context (``max_position_embeddings`` in its ``config.json``).

    The training prompts and the validation prompts validation uses (``data.val_max_prompts``) are
    checked: either would otherwise fail inside a worker, after Ray and Prefect started, or (past
    the context) run on positions the model never learnt.

    Raises:
        trajflow.prompts.DataError: the first prompt too long, named by its file and line or row
            (generated datasets: the spec and the prompt id), with the keys that would make it fit.
        trajflow.models.ModelLoadError: the model's tokenizer cannot render the prompts.
    """
    from trajflow.errors import DataError, ModelLoadError
    from trajflow.models import load_tokenizer, prompt_lengths

    validation = datasets.validation[:cfg.data.val_max_prompts] if cfg.data.val_max_prompts else datasets.validation
    records = [*datasets.train, *validation]
    if not records:
        return
    context, context_key = _model_context(model_dir)
    try:
        tokenizer = load_tokenizer(model_dir)
        # Rendering all prompts, then one batched encode, gives the ids build_prompt_ids gets one by
        # one (apply_chat_template tokenizes its rendering without special tokens), much faster.
        lengths = prompt_lengths(tokenizer, [r.messages for r in records], str(cfg.model.prompt_format))
    except Exception as e:  # no chat template, a template that rejects the roles, a broken tokenizer
        raise ModelLoadError(f"model.path={cfg.model.path!r}: its tokenizer cannot render the prompts "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                             f"fix the chat_template in its tokenizer_config.json, or remove it to use the plain prompt "
                             f"format (docs/models.md)") from None
    cap, new = int(cfg.data.max_prompt_length), int(cfg.rollout.max_new_tokens)
    for record, length in zip(records, lengths):
        where = record.source or f"prompt {record.prompt_id}"
        if length > cap:
            raise DataError(f"{where}: the prompt is {length} tokens as the policy renders it, more than "
                            f"data.max_prompt_length={cap}; shorten or drop the row, or raise "
                            f"data.max_prompt_length")
        if context is not None and length + new > context:
            raise DataError(f"{where}: the prompt is {length} tokens as the policy renders it; with "
                            f"rollout.max_new_tokens={new} that is {length + new}, more than the model's "
                            f"{context_key}={context} ({Path(model_dir) / 'config.json'}); shorten or drop the "
                            f"row, lower rollout.max_new_tokens, or use a model with a longer context (model.path)")


def check_scorers(cfg: DictConfig, datasets) -> None:
    """Every ``data_source`` of the dataset has a reward scorer (or ``reward.custom_function`` scores
    all rows): an unmapped one would otherwise fail the first reward stage, after generation.

    Args:
        cfg: the run config.
        datasets: the loaded ``trajflow.prompts.PromptDatasets``.

    Raises:
        trajflow.errors.ConfigError: names the data_source, where it occurs and the keys that fix it.
    """
    from trajflow.stages.scorers import SCORERS, select_scorer
    from trajflow.errors import ConfigError

    if cfg.reward.custom_function:
        return
    default = cfg.reward.default_scorer or datasets.spec.get("scorer")
    for source in dict.fromkeys(r.data_source for r in datasets.train + datasets.validation):
        try:
            select_scorer(source, default, cfg.reward.scorer)
        except ValueError:
            where = datasets.origins.get(source, datasets.spec.get("spec_path", "data"))
            raise ConfigError(f"{where}: data_source {source!r} has no reward scorer (mapped: reasoning_gym/*, "
                              f"openai/gsm8k and the MATH sets); set reward.scorer to one of {SCORERS.names()} "
                              f"or reward.custom_function=file.py:function") from None


def check_store_root(cfg: DictConfig) -> None:
    """``store.root`` is (or can be made) a writable folder: found now, not as a traceback after Ray
    and Prefect started.

    Raises:
        StoreError: it is a file, or not writable (names it).
    """
    root = Path(cfg.store.root).expanduser()
    probe = root
    while not probe.exists() and probe != probe.parent:  # the nearest existing ancestor gets created into
        probe = probe.parent
    if not probe.is_dir():
        raise StoreError(f"store.root={cfg.store.root!r}: {probe} is not a folder; point store.root at a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise StoreError(f"store.root={cfg.store.root!r}: {probe} is not writable by this user; point "
                         f"store.root at a writable folder")
    import tempfile

    try:  # access() says yes to root everywhere, /proc and read-only mounts included: try it
        tempfile.TemporaryDirectory(prefix=".trajflow-probe-", dir=probe).cleanup()
    except OSError as e:
        raise StoreError(f"store.root={cfg.store.root!r}: cannot create a folder in {probe} "
                         f"({e.strerror or e}); point store.root at a folder on a writable disk") from None


def check_reward_and_gates(cfg: DictConfig) -> None:
    """Import ``reward.custom_function`` and parse the gate suite with ``gates.policies``: each a
    one-line ConfigError now rather than a failure in the first iteration's reward or gate stage.
    (The gate bounds and ``actor.betas`` are config rules, checked when the config is loaded.)

    Raises:
        trajflow.errors.ConfigError: names the key, the file and what is wrong.
    """
    from trajflow.errors import ConfigError

    if cfg.reward.custom_function:
        from trajflow.stages.scorers import load_custom_function
        from trajflow.trust import check_custom_function_hash

        check_custom_function_hash(cfg)  # reward.custom_function_sha256: hashed before anything is imported
        try:
            load_custom_function(str(cfg.reward.custom_function))
        except Exception as e:  # the user's file: a SyntaxError or any import-time error
            raise ConfigError(str(e) if isinstance(e, ValueError) else
                              f"reward.custom_function={cfg.reward.custom_function!r}: importing it raised "
                              f"{type(e).__name__}: {e}") from None
    if cfg.reward.judge.enable:  # the key's variable named but not set: now, not in the first reward stage
        from trajflow.stages.judge import judge_api_key

        try:
            judge_api_key(cfg.reward.judge)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.gates.enabled:
        from trajflow.gates.suite import check_suite

        check_suite(cfg.gates.suite, cfg.gates.policies)


def check_model_weights(model_dir: Path) -> None:
    """Open each safetensors file's header: a truncated or garbage weights file is named now, and so
    is an architecture without a causal-LM head (:func:`trajflow.models.check_causal_lm`).

    Raises:
        trajflow.errors.ModelLoadError: the file and what the reader said.
    """
    from safetensors import safe_open

    from trajflow.errors import ModelLoadError
    from trajflow.models import check_causal_lm

    weights = sorted(Path(model_dir).glob("*.safetensors"))
    pickles = sorted(p for ext in ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt") for p in Path(model_dir).glob(ext))
    if not weights and pickles:
        raise ModelLoadError(f"model.path: {model_dir} holds only {pickles[0].name} (a pickle), no safetensors "
                             f"weights; trajflow does not load pickles (they can run code): convert it with "
                             f"transformers' save_pretrained(dir, safe_serialization=True)")
    for f in weights:
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError
            raise ModelLoadError(f"model.path: {f} is not a readable safetensors file ({e}); re-download "
                                 f"or re-export the model") from None
    check_causal_lm(model_dir)


def custom_function_record(cfg: DictConfig) -> dict | None:
    """What ``run.json`` records of ``reward.custom_function``: its spec, resolved file and sha256."""
    from trajflow.stages.scorers import custom_function_file, file_sha256

    spec = cfg.reward.custom_function
    if not spec:
        return None
    path = custom_function_file(spec)
    return {"spec": spec, "path": str(path), "sha256": file_sha256(path)}


def check_custom_function(cfg: DictConfig, meta: dict, what: str, same_spec_only: bool = False) -> None:
    """Say which reward code a resume or replay will import, and refuse code the run did not record.

    The stored config's function is used only when the caller named it again (or confirmed its
    sha256), see :mod:`trajflow.trust`; this adds that the file must still be the one (path and
    sha256) the run recorded when it started, unless the caller passes
    ``reward.trust_changed_custom_function=true`` or ``reward.custom_function_sha256=<its sha256>``.
    The record lives in the run folder too, so it can only refuse, never permit.

    Args:
        cfg: the config about to run.
        meta: the run's ``run.json`` (``custom_function``: the record of :func:`custom_function_record`;
            absent for runs from before it was recorded, which are not checked).
        what: how to name the run in messages.
        same_spec_only: check only when the spec equals the recorded one (a replay whose override
            names another function chose it on the command line).

    Raises:
        ConfigError: the function's file differs from the recorded one (names both digests and the override).
    """
    now = custom_function_record(cfg)
    if now is not None:
        print(f"reward.custom_function: importing {now['path']} (sha256 {str(now['sha256'])[:16]})", flush=True)
    if "custom_function" not in meta or cfg.reward.trust_changed_custom_function:
        return  # (a stored consent flag never gets here: trajflow.trust resets it)
    if now is not None and cfg.reward.custom_function_sha256 and cfg.reward.custom_function_sha256 == now["sha256"]:
        return  # the caller confirmed this exact file
    rec = meta["custom_function"]
    if same_spec_only and (rec or {}).get("spec") != (now or {}).get("spec"):
        return
    if (rec or {}).get("path") != (now or {}).get("path") or (rec or {}).get("sha256") != (now or {}).get("sha256"):
        from trajflow.errors import ConfigError

        def show(r):
            return "none" if not r else f"{r['path']} (sha256 {str(r['sha256'])[:16]})"

        raise ConfigError(f"{what}: reward.custom_function is {show(now)}, but the run recorded {show(rec)}; "
                          f"refusing to import code the run did not start with. Pass "
                          f"reward.trust_changed_custom_function=true (or reward.custom_function_sha256="
                          f"{(now or {}).get('sha256')}) if you changed it on purpose")
