"""A run's lifecycle around the flow's loop: pick the id, open or resume, begin and record each
iteration, decide validation and checkpoints, save, finish, close.

Every step the ``train`` flow takes is one call here or one stage task (:mod:`flows.tasks`); none
of these functions runs a stage or decides what the next stage is.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import ray
from omegaconf import DictConfig

from trajflow import checkpoint as ckpt
from trajflow.config import to_yaml
from trajflow.errors import NonFiniteError, RunExistsError, StoreError
from trajflow.run.context import IterationState, RunContext, register
from trajflow.run.progress import Progress, print_step
from trajflow.infra import logs
from trajflow.infra.ray_cluster import start_ray
from trajflow.run.workers import close, create_workers, release_workers
from trajflow.store import STAGES, RunStore, follow_umask, run_folders

if TYPE_CHECKING:
    from trajflow.prompts import PromptDatasets

log = logging.getLogger(__name__)


def new_run_id(cfg: DictConfig) -> str:
    """``<recipe>-<UTC time>-<4 hex>``: sortable and unique across parallel launches."""
    return f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def choose_run_id(cfg: DictConfig, run_id: str | None = None) -> tuple[str, bool]:
    """The run id to use and whether it resumes an existing run (``trainer.resume=auto``).

    Raises:
        RunExistsError: the id names an existing run and ``trainer.resume`` is ``disable``.
    """
    run_id = run_id or cfg.trainer.run_id
    if run_id is None:
        return new_run_id(cfg), False
    store = RunStore(cfg.store.root, run_id)
    if store.exists():
        if cfg.trainer.resume == "auto":
            return run_id, True
        raise RunExistsError(f"run {run_id!r} already exists in {store.run_dir}; use trainer.resume=auto "
                             f"or 'trajflow resume {run_id}' to continue it")
    return run_id, False


def preflight(cfg: DictConfig) -> None:
    """Fail on bad data or model input before Prefect, Ray or the run folder are touched.

    Raises:
        trajflow.prompts.DataError: the dataset spec or a row is invalid (names file and row).
        trajflow.models.ModelLoadError: ``model.path`` is not loadable or its weights are corrupt.
        trajflow.errors.DeviceError: ``trainer.device`` or the vLLM engine is not available here.
        trajflow.errors.ConfigError: the custom reward function, the gate suite or policies, the
            gate bounds or ``actor.betas`` (see :func:`check_reward_and_gates`); more prompts per
            iteration than the dataset has (see :func:`check_batch_size`); a tool sandbox weaker than
            ``rollout.multi_turn.allow_weaker_sandbox`` allows.
        StoreError: ``store.root`` is not a writable folder.
    """
    from trajflow.prompts import data_spec, load_prompt_dataset, load_spec
    from trajflow.models import resolve_model_path
    from trajflow.infra.devices import preflight_devices

    preflight_devices(cfg)
    check_store_root(cfg)
    check_reward_and_gates(cfg)
    if cfg.rollout.multi_turn.enable:  # a sandbox weaker than allowed: refused here, before Ray
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
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the {n} training "
                          f"prompts of data.dataset={cfg.data.dataset!r} ({datasets.spec.get('spec_path') or 'data.train_files'}); lower "
                          f"data.train_batch_size to at most {n} or give the dataset more prompts")


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
    from stages.scorers import SCORERS, select_scorer
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


def check_reward_and_gates(cfg: DictConfig) -> None:
    """Import ``reward.custom_function``, parse the gate suite with ``gates.policies``, check the
    gate bounds and ``actor.betas``: each a one-line ConfigError now rather than a failure in the
    first iteration's reward or gate stage.

    Raises:
        trajflow.errors.ConfigError: names the key, the file and what is wrong.
    """
    import math

    from trajflow.errors import ConfigError

    if cfg.reward.custom_function:
        from stages.scorers import load_custom_function

        try:
            load_custom_function(str(cfg.reward.custom_function))
        except Exception as e:  # the user's file: a SyntaxError or any import-time error
            raise ConfigError(str(e) if isinstance(e, ValueError) else
                              f"reward.custom_function={cfg.reward.custom_function!r}: importing it raised "
                              f"{type(e).__name__}: {e}") from None
    betas = list(cfg.actor.betas)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"actor.betas={betas}: AdamW needs two numbers in [0, 1), e.g. [0.9, 0.999]")
    if cfg.gates.enabled:
        g = cfg.gates
        for key in ("score_min", "score_max"):
            if not math.isfinite(float(g[key])):
                raise ConfigError(f"gates.{key}={g[key]}: must be a finite number")
        if g.score_min > g.score_max:
            raise ConfigError(f"gates.score_min={g.score_min} is above gates.score_max={g.score_max}")
        from trajflow.gates.suite import load_suite, suite_policies

        try:
            suite_policies(load_suite(g.suite), dict(g.policies))
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_model_weights(model_dir: Path) -> None:
    """Open each safetensors file's header: a truncated or garbage weights file is named now, and so
    is an architecture without a causal-LM head (:func:`trajflow.models.check_causal_lm`).

    Raises:
        trajflow.errors.ModelLoadError: the file and what the reader said.
    """
    from safetensors import safe_open

    from trajflow.errors import ModelLoadError
    from trajflow.models import check_causal_lm

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError
            raise ModelLoadError(f"model.path: {f} is not a readable safetensors file ({e}); re-download "
                                 f"or re-export the model") from None
    check_causal_lm(model_dir)


def open_run(cfg: DictConfig, run_id: str, resume: bool = False) -> RunContext:
    """Create (or reopen) the run folder, start Ray and the workers, restore a checkpoint on resume.

    On resume: leftovers of killed writers are deleted, the newest complete checkpoint is restored
    (weights, optimizer, RNG, data cursor, KL controller, score history) and training continues at
    the iteration after it; stored stage outputs of the iterations to come are checked now (a file
    that does not verify is named on stderr and recomputed by its task), config changes against the
    stored config are reported and recorded in ``run.json``'s ``sessions``.

    Raises:
        RunExistsError: a new run's folder exists already.
        StoreError: resuming a run that does not exist or is a replay.
        trajflow.prompts.DataError, trajflow.models.ModelLoadError: bad dataset or model.
    """
    from trajflow.tracking import Tracker

    store = RunStore(cfg.store.root, run_id)
    changes: dict = {}
    # Load inputs first: a bad dataset or model must not leave a half-created run behind.
    ctx = build_context(cfg, store)
    if not resume:
        create_run_folder(store, cfg, recipe=str(cfg.recipe), custom_function=custom_function_record(cfg))
    else:
        check_resumable(store)
        logs.attach_run_dir(store.run_dir)
        removed = store.cleanup_temp() + ckpt.cleanup(store)
        for p in removed:
            log.info("removed %s, left behind by a killed writer", p)
        changes = config_changes(store, cfg)
        if changes:
            print(f"run {run_id}: config changed since the last session: "
                  + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()), flush=True)
            store.write_config(to_yaml(cfg))
        store.update_run_meta(status="running")
    print(f"trajflow run {run_id}: {store.run_dir}", flush=True)
    from trajflow.modeling.precision import describe, run_precision

    print(describe(run_precision(cfg)), flush=True)  # decided at config load ('auto'), before any worker starts

    preload_audit()
    try:
        start_workers(ctx)
        start = 1
        previous_mlflow_run = store.read_run_meta().get("mlflow_run_id") if resume else None
        latest = None
        if resume:
            latest, skipped = ckpt.newest_verified_checkpoint(store)
            for it, why in skipped:
                print(f"warning: checkpoint {it:06d} skipped: {why}", file=sys.stderr, flush=True)
        if latest is not None:
            restore_checkpoint(ctx, latest)
            start = latest + 1
        ctx.state.policy_source = ckpt.checkpoint_id(latest)
        ctx.state.start_iteration = start
        ctx.state.last_iteration = int(cfg.trainer.total_iterations)
        if resume:
            _report_resume(ctx, latest, start)
        ctx.tracker = Tracker(cfg, run_id, continue_from=previous_mlflow_run,
                              keep_step=_kept_steps(store, latest))
        _log_datasets(ctx)
        sessions = store.read_run_meta().get("sessions", [])
        sessions.append({"started": time.time(), "resumed_from_checkpoint": latest if resume else None,
                         "first_iteration": start, "config_changes": {k: list(v) for k, v in changes.items()}})
        store.update_run_meta(mlflow_run_id=ctx.tracker.run_id, tracking_uri=ctx.tracker.uri, sessions=sessions)
    except BaseException:
        close(ctx)
        raise
    if start > ctx.state.last_iteration:
        print(f"run {run_id} already finished all {ctx.state.last_iteration} iterations; nothing to do", flush=True)
        ctx.state.nothing_to_do = True
    return ctx


def _kept_steps(store: RunStore, latest: int | None):
    """The MLflow steps a resumed session keeps from the previous one: those up to its checkpoint
    (0 = validation before training included) and iterations a gate stopped (never re-run)."""
    gated = {it for it in store.iterations() if store.read_manifest(it).get("status") == "gated"}
    return lambda step: (latest is not None and step <= latest) or step in gated


def _log_datasets(ctx: RunContext) -> None:
    """The prompt sets as MLflow dataset inputs; a failure only warns (the record, not the run)."""
    spec = ctx.datasets.spec
    source = spec.get("path") or spec.get("spec_path") or spec.get("name") or "prompts"
    if not isinstance(source, str):
        source = ", ".join(str(p) for p in source)  # data.train_files: several files
    try:
        ctx.tracker.log_datasets(ctx.datasets.train, ctx.datasets.validation, str(spec.get("name") or "prompts"),
                                 str(source))
    except Exception as e:
        log.warning("could not log the datasets to MLflow: %s", e)


def custom_function_record(cfg: DictConfig) -> dict | None:
    """What ``run.json`` records of ``reward.custom_function``: its spec, resolved file and sha256."""
    from stages.scorers import custom_function_file, file_sha256

    spec = cfg.reward.custom_function
    if not spec:
        return None
    path = custom_function_file(spec)
    return {"spec": spec, "path": str(path), "sha256": file_sha256(path)}


def check_custom_function(cfg: DictConfig, meta: dict, what: str, same_spec_only: bool = False) -> None:
    """Say which reward code a resume or replay will import, and refuse code the run did not record.

    ``config.yaml`` lives in the run folder, so anyone who can write there could point
    ``reward.custom_function`` at a file of theirs: the code imported must be the file (path and
    sha256) the run recorded when it started, unless ``reward.trust_changed_custom_function=true``.

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
        return
    rec = meta["custom_function"]
    if same_spec_only and (rec or {}).get("spec") != (now or {}).get("spec"):
        return
    if (rec or {}).get("path") != (now or {}).get("path") or (rec or {}).get("sha256") != (now or {}).get("sha256"):
        from trajflow.errors import ConfigError

        def show(r):
            return "none" if not r else f"{r['path']} (sha256 {str(r['sha256'])[:16]})"

        raise ConfigError(f"{what}: reward.custom_function is {show(now)}, but the run recorded {show(rec)}; "
                          f"refusing to import code the run did not start with. Pass "
                          f"reward.trust_changed_custom_function=true if you changed it on purpose")


def create_run_folder(store: RunStore, cfg: DictConfig, **meta) -> None:
    """Create a new run's folder with its resolved ``config.yaml`` and ``run.json`` (``status: running``).

    Args:
        store: the new run's store.
        cfg: its resolved config.
        meta: more ``run.json`` fields (``recipe``, a replay's lineage, ...).

    Raises:
        RunExistsError: the folder holds a run already.
    """
    if store.exists():
        raise RunExistsError(f"run {store.run_id!r} already exists in {store.run_dir}")
    store.run_dir.mkdir(parents=True, exist_ok=True)
    logs.attach_run_dir(store.run_dir)
    store.write_config(to_yaml(cfg))
    from trajflow.modeling.precision import run_precision

    store.update_run_meta(run_id=store.run_id, status="running", created=time.time(), precision=run_precision(cfg),
                          **meta)


def preload_audit() -> None:
    """Import LanceDB in the background: it takes seconds (its generated REST client), and the driver
    is only waiting for Ray and the workers meanwhile; the audit table is written after iteration 1."""
    import threading

    def load() -> None:
        try:
            import lancedb  # noqa: F401
        except Exception:  # reported when the audit table is written
            pass

    threading.Thread(target=load, name="preload-lancedb", daemon=True).start()


def build_context(cfg: DictConfig, store: RunStore) -> RunContext:
    """The run's context without workers: datasets, model path, data cursor, KL controller."""
    from trajflow.prompts import PromptSampler, data_spec, load_prompt_dataset
    from trajflow.models import resolve_model_path

    datasets = load_prompt_dataset(data_spec(cfg.data))
    model_path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    ctx = RunContext(cfg=cfg, store=store, model_path=model_path, datasets=datasets)
    ctx.sampler = PromptSampler(datasets.train, cfg.data.train_batch_size, cfg.trainer.seed)
    if cfg.algorithm.use_kl_in_reward:
        from stages.kl import make_kl_controller

        k = cfg.algorithm.kl_ctrl
        ctx.kl_ctrl = make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
    return ctx


def start_workers(ctx: RunContext) -> None:
    """Start (or join) Ray, register the context for the tasks and start the workers.

    On failure the context is closed (workers, and Ray if this call started it) before re-raising.
    """
    ctx.started_ray = start_ray(ctx.cfg)
    register(ctx)
    try:
        create_workers(ctx)
    except BaseException:
        close(ctx)
        raise


def store_root_from(overrides: Sequence[str]) -> str:
    """The ``store.root=...`` among ``overrides``, else the config default."""
    from trajflow.config import StoreConfig

    for o in overrides:
        if o.startswith("store.root="):
            return o.split("=", 1)[1]
    return StoreConfig().root


def resume_config(run_id: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The stored config of run ``run_id`` (under ``store.root`` from ``overrides``) plus ``overrides``.

    Raises:
        StoreError: no such run, a replay run (see :func:`check_resumable`), or a damaged stored
            config (see :meth:`RunStore.read_config`).
        trajflow.config.ConfigError: a bad override.
    """
    from trajflow.config import load_config

    store = RunStore(store_root_from(overrides), run_id)
    check_resumable(store)
    return load_config(base=store.read_config(), overrides=list(overrides))


def check_resumable(store: RunStore) -> None:
    """Raise :class:`StoreError` unless ``store`` holds a run that ``resume`` can continue.

    Raises:
        StoreError: no such run under the store root (names the root and the runs there), or the
            run is a replay (replays are re-run, not resumed).
    """
    if not store.exists():
        runs = [p.name for p in run_folders(store.root)]
        shown = ", ".join(runs[-10:]) if runs else "none"
        raise StoreError(f"no run {store.run_id!r} in store root {store.root} (runs there: {shown}); "
                         f"pass --store DIR (or store.root=DIR) to look elsewhere")
    meta = store.read_run_meta()
    if meta.get("kind") == "replay":
        raise StoreError(f"run {store.run_id!r} is a replay of run {meta.get('parent_run_id')!r}; replays are "
                         f"not resumed: run 'trajflow replay' again")


def config_changes(store: RunStore, cfg: DictConfig) -> dict[str, tuple]:
    """``{key: (stored, new)}`` for config keys whose value differs from the run's stored config.

    ``trainer.resume``, ``trainer.run_id`` and ``trainer.progress`` are not reported (they say how
    to start, not what to train).
    """
    from trajflow.config import flatten

    old = flatten(store.read_config())
    new = flatten(cfg)
    ignore = {"trainer.resume", "trainer.run_id", "trainer.progress"}
    if old.get("store.root") and new.get("store.root") and \
            Path(old["store.root"]).expanduser().resolve() == Path(new["store.root"]).expanduser().resolve():
        ignore.add("store.root")  # the same folder, spelled differently
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if k not in ignore and old.get(k) != new.get(k)}


def _report_resume(ctx: RunContext, latest: int | None, start: int) -> None:
    """Say where the run continues and name every stored file of the iterations to come that fails to verify."""
    store, total = ctx.store, ctx.cfg.trainer.total_iterations
    where = f"checkpoint {latest:06d}" if latest is not None else "the start (no complete checkpoint)"
    todo = f"iterations {start}..{total}" if start <= total else "no iterations left"
    print(f"resuming run {ctx.run_id} from {where}: {todo}", flush=True)
    for it in (i for i in store.iterations() if i >= start):
        status = store.read_manifest(it).get("status")
        for stage in STAGES:
            path = store.stage_path(it, stage)
            if store.stage_entry(it, stage) is None and path.exists():
                print(f"warning: {path} is not recorded in its manifest (a write was interrupted): "
                      f"it will be recomputed", file=sys.stderr, flush=True)
            elif store.stage_entry(it, stage) is not None and store.verified_stage(it, stage, warn=False) is None:
                print(f"warning: stored {path} is truncated or does not match its manifest's sha256: "
                      f"it will be recomputed", file=sys.stderr, flush=True)
        if status == "gated":
            print(f"iteration {it} was stopped by its gate: it will be skipped", flush=True)


def restore_checkpoint(ctx: RunContext, iteration: int, source: RunStore | None = None) -> None:
    """Load the policy (and critic), optimizers, RNG, data cursor and controller state saved after ``iteration``.

    Args:
        ctx: the run's context (workers started).
        iteration: the checkpoint's iteration.
        source: restore from this run's checkpoint instead of the context's own (a replay starts
            from its parent's); the data cursor is then left alone.

    Raises:
        StoreError: a checkpoint file is missing or does not match the checkpoint's manifest (named).
    """
    store = source or ctx.store
    why = ckpt.verify_checkpoint(store, iteration)
    if why is not None:
        raise StoreError(f"checkpoint {iteration:06d} of run {store.run_id!r} cannot be loaded: {why}")
    d = ckpt.checkpoint_dir(store, iteration)
    state = ckpt.read_trainer_state(store, iteration)
    ray.get(ctx.actor.load_checkpoint.remote(str(d / "actor")))
    if ctx.critic is not None:
        if not (d / "critic").exists():
            raise RuntimeError(f"checkpoint {d} has no critic/ folder, but this run trains a critic "
                               f"(algorithm.adv_estimator={ctx.cfg.algorithm.adv_estimator!r})")
        ray.get(ctx.critic.load_checkpoint.remote(str(d / "critic")))
    if source is None and ctx.sampler is not None and state.get("sampler"):
        ctx.sampler.load_state_dict(state["sampler"])
    if ctx.kl_ctrl is not None and state.get("kl_ctrl"):
        ctx.kl_ctrl.load_state_dict(state["kl_ctrl"])
    ctx.score_history = list(state.get("score_history", []))
    ctx.policy_version = int(state["policy_version"])
    log.info("%s: restored checkpoint %06d of %s", ctx.run_id, iteration, store.run_id)


def iterations(ctx: RunContext) -> range:
    """The iterations this process is to go through: from the resume point to the run's last."""
    return range(ctx.state.start_iteration, ctx.state.last_iteration + 1)


def validation_before_training_due(ctx: RunContext) -> bool:
    """Validate the initial policy: a fresh run with ``trainer.test_freq > 0`` and ``val_before_train``."""
    t = ctx.cfg.trainer
    return ctx.state.start_iteration == 1 and t.test_freq > 0 and bool(t.val_before_train) \
        and not ctx.state.nothing_to_do


def was_gated(ctx: RunContext, iteration: int) -> bool:
    """Whether an earlier session's reward gate stopped ``iteration`` (its manifest says ``gated``):
    such an iteration is not trained again (say so on the console)."""
    if iteration not in ctx.store.iterations() or ctx.store.read_manifest(iteration).get("status") != "gated":
        return False
    print(f"iteration {iteration} of run {ctx.run_id} was stopped by its gate; skipped", flush=True)
    ctx.state.skipped_iterations.append(iteration)
    return True


def begin_iteration(ctx: RunContext, iteration: int, prompts: list,
                    behaviour_version: int | None = None) -> IterationState:
    """Start ``iteration`` with its drawn ``prompts``: its live state (with the data cursor as it is
    now, where every rollout attempt starts), and its manifest back to ``in_progress`` when a crashed
    session left it marked otherwise. ``behaviour_version``: the policy version an overlapped
    rollout is generated by (``trainer.max_staleness`` > 0; see :func:`behaviour_version`)."""
    if ctx.state.progress is None:
        ctx.state.progress = Progress(ctx.state.last_iteration, iteration, ctx.cfg.trainer.progress)
    if iteration in ctx.store.iterations() and ctx.store.read_manifest(iteration).get("status") not in (
            None, "in_progress"):
        ctx.store.mark(iteration, "in_progress")
    state = IterationState(iteration=iteration, prompts=list(prompts), started=time.perf_counter(),
                           sampler_before_rollout=ctx.sampler.state_dict(), behaviour_version=behaviour_version)
    ctx.iterations[iteration] = state
    return state


def behaviour_version(ctx: RunContext, iteration: int, synced: int) -> int:
    """The policy version an overlapped rollout of ``iteration`` is generated by: ``synced``, the
    version the rollout workers hold, unless the iteration's rollout is stored already (a resumed
    run: the rollout that was in flight when the previous session stopped), whose recorded version
    it keeps, so that the stored file is reused rather than regenerated by a newer policy."""
    entry = ctx.store.stage_entry(iteration, "rollout") if iteration in ctx.store.iterations() else None
    recorded = ((entry or {}).get("inputs") or {}).get("policy_version")
    lag = int(ctx.cfg.trainer.max_staleness)
    if recorded is not None and synced - lag <= int(recorded) <= synced:
        return int(recorded)
    return int(synced)


def sync_rollout_weights(ctx: RunContext, iteration: int) -> int:
    """Push the policy's current weights to the rollout workers (``trainer.max_staleness`` > 0; no
    rollout may be in flight on them); the copy's seconds go to ``iteration``'s
    ``timing_s/weight_sync`` when it is live. Returns the version pushed."""
    out = ray.get(ctx.actor.push_weights.remote())
    if iteration in ctx.iterations:
        ctx.iterations[iteration].timing["timing_s/weight_sync"] = float(out["timing_s/weight_sync"])
    return int(out["policy_version"])


def snapshot_rollout_weights(ctx: RunContext, iteration: int) -> tuple[int, Any]:
    """Copy the policy's current weights into the Ray object store for a rollout submitted now but
    started later, once the rollouts ahead of it on the rollout workers are done
    (``trainer.max_staleness`` > 0; :func:`trajflow.run.roles.load_rollout_weights` loads it). The copy's seconds (what
    the trainer waits) go to ``iteration``'s ``timing_s/weight_sync``.

    Returns:
        ``(policy_version, ref)``: the version copied and the ``ObjectRef`` of its weights (None when
        no rank returned any).
    """
    out = ray.get(ctx.actor.snapshot_weights.remote())
    if iteration in ctx.iterations:
        ctx.iterations[iteration].timing["timing_s/weight_sync"] = float(out["timing_s/weight_sync"])
    refs = out["weights"]
    return int(out["policy_version"]), (refs[0] if refs else None)


def _memory_metrics(ctx: RunContext) -> dict[str, float]:
    import psutil

    m = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / 2**30}
    try:
        rss = psutil.Process(ray.get(ctx.actor.info.remote())["pid"]).memory_info().rss
        m["perf/actor_rss_gb"] = rss / 2**30
    except Exception:  # remote node: not visible from here
        pass
    return m


def record(ctx: RunContext, iteration: int, metrics: dict) -> dict:
    """Close the iteration's books: stage timings, ``timing_s/step``, throughput and memory into its
    metrics, the KL controller and the score history updated, its manifest marked ``complete``.

    Returns:
        The iteration's metrics with those added.
    """
    cfg, state = ctx.cfg, ctx.iteration(iteration)
    step_s = time.perf_counter() - state.started
    metrics = dict(metrics)
    metrics.update(state.timing)
    metrics["timing_s/step"] = step_s
    metrics["perf/throughput"] = metrics.get("perf/total_num_tokens", 0.0) / step_s
    metrics.update(_memory_metrics(ctx))
    if ctx.kl_ctrl is not None and "critic/kl" in metrics:
        ctx.kl_ctrl.update(metrics["critic/kl"], cfg.data.train_batch_size * cfg.rollout.n)
    if state.gate_score_mean is not None or "critic/score/mean" in metrics:
        ctx.score_history.append(state.gate_score_mean if state.gate_score_mean is not None
                                 else metrics["critic/score/mean"])
    ctx.store.mark(iteration, "complete", policy_version_after=ctx.policy_version)
    return metrics


def validation_due(ctx: RunContext, iteration: int) -> bool:
    """Validate after ``iteration``: every ``trainer.test_freq`` iterations and after the last."""
    freq = ctx.cfg.trainer.test_freq
    return freq > 0 and (iteration % freq == 0 or iteration == ctx.state.last_iteration)


def checkpoint_due(ctx: RunContext, iteration: int) -> bool:
    """Checkpoint after ``iteration``: every ``trainer.save_freq`` iterations and after the last."""
    freq = ctx.cfg.trainer.save_freq
    return bool(freq and iteration % freq == 0) or iteration == ctx.state.last_iteration


def log_iteration(ctx: RunContext, iteration: int, metrics: dict) -> None:
    """Publish a recorded iteration: metrics and sample responses to MLflow, its trajectories to the
    audit table, the progress bar and the console's ``step:N`` line; its live state is dropped."""
    ctx.tracker.log_metrics(metrics, step=iteration)
    print_step(iteration, metrics)
    _log_samples(ctx, iteration)
    _append_audit(ctx, iteration, optimize=checkpoint_due(ctx, iteration))
    ctx.state.last_metrics = metrics
    ctx.state.trained_iterations.append(iteration)
    if ctx.state.progress is not None:
        ctx.state.progress.done(iteration, metrics)
    ctx.iterations.pop(iteration, None)


def log_validation(ctx: RunContext, step: int, metrics: dict) -> None:
    """Publish a validation outside an iteration (step 0, before training): MLflow and the console's
    ``step:N`` line."""
    ctx.tracker.log_metrics(metrics, step=step)
    print_step(step, metrics)


def rollout_checkpoint_id(ctx: RunContext, iteration: int) -> str:
    """The checkpoint the iteration's rollout policy came from (recorded when the rollout was stored)."""
    entry = ctx.store.stage_entry(iteration, "rollout") or {}
    return entry.get("meta", {}).get("checkpoint_id") or ctx.state.policy_source


def _append_audit(ctx: RunContext, iteration: int, optimize: bool = True) -> None:
    """Add the iteration's trajectories to the run's LanceDB audit table (a failure only warns:
    the table is derived data, ``trajflow audit RUN --rebuild`` recreates it from the Parquet files).
    ``optimize``: see :func:`trajflow.audit.append_iteration`."""
    from trajflow.audit import append_iteration

    try:
        append_iteration(ctx.store, iteration, rollout_checkpoint_id(ctx, iteration), optimize=optimize)
    except Exception as e:
        log.warning("could not append iteration %d to the audit table of %s: %s", iteration, ctx.run_id, e)
        print(f"warning: audit table not updated for iteration {iteration}: {e}", file=sys.stderr, flush=True)


def _log_samples(ctx: RunContext, iteration: int) -> None:
    k = ctx.cfg.trainer.log_samples
    if not k:
        return
    t = ctx.store.read_stage(iteration, "rollout", verify=False).slice(0, k)
    r = ctx.store.read_stage(iteration, "reward", verify=False).slice(0, k)
    from trajflow.tracking import prompt_text

    ctx.tracker.log_table({"sample_id": t.column("sample_id").to_pylist(),
                           "prompt": [prompt_text(p) for p in t.column("prompt").to_pylist()],
                           "response_text": t.column("response_text").to_pylist(),
                           "ground_truth": t.column("ground_truth").to_pylist(),
                           "score": r.column("score").to_pylist()},
                          f"samples/iteration_{iteration:06d}.json")


def save(ctx: RunContext, iteration: int, sampler_state: dict | None = None) -> Path:
    """Checkpoint the state after ``iteration``; ``sampler_state``: the data cursor as it was after
    ``iteration`` drew its prompts, when the next iteration has drawn since (an overlapped rollout)."""
    if sampler_state is None and ctx.sampler is not None:
        sampler_state = ctx.sampler.state_dict()
    state = {"sampler": sampler_state,
             "policy_version": ctx.policy_version,
             "kl_ctrl": ctx.kl_ctrl.state_dict() if ctx.kl_ctrl is not None else None,
             "score_history": ctx.score_history, "mlflow_run_id": ctx.tracker.run_id, "saved_at": time.time()}
    def save_workers(d: Path) -> None:
        futures = [ctx.actor.save_checkpoint.remote(str(d / "actor"))]
        if ctx.critic is not None:
            futures.append(ctx.critic.save_checkpoint.remote(str(d / "critic")))
        ray.get(futures)

    tr = ctx.cfg.trainer
    keep_best = (str(tr.keep_best), str(tr.keep_best_mode)) if tr.get("keep_best") else None
    path = ckpt.save_checkpoint(ctx.store, iteration, state, save_workers, tr.max_checkpoints, keep_best=keep_best)
    if keep_best:  # where to find it: run.json's best_checkpoint
        best = ckpt.best_checkpoint(ctx.store, *keep_best)
        if best is not None:
            ctx.store.update_run_meta(best_checkpoint={"iteration": best, "metric": keep_best[0],
                                                       "value": ckpt.checkpoint_scores(ctx.store, keep_best[0])[best]})
    ctx.state.policy_source = ckpt.checkpoint_id(iteration)
    return path


def finish_run(ctx: RunContext) -> dict:
    """Export the final policy to ``<run>/final`` and return the run summary."""
    store = ctx.store
    if not ctx.state.nothing_to_do or not store.final_dir.exists():
        if not ray.get(ctx.actor.weights_finite.remote()):
            raise NonFiniteError(f"run {ctx.run_id}: the policy's weights are not finite; the final model is not "
                                 f"exported (the checkpoints under {store.checkpoints_dir()} hold earlier states)")
        tmp = store.run_dir / ".final-tmp"
        ray.get(ctx.actor.export_hf.remote(str(tmp)))
        follow_umask(tmp)
        if store.final_dir.exists():
            import shutil

            shutil.rmtree(store.final_dir)
        os.replace(tmp, store.final_dir)
    _log_end_of_run_plots(ctx)
    meta = store.update_run_meta(status="finished", finished=time.time(), policy_version=ctx.policy_version)
    if ctx.state.progress is not None:  # end the bar's line first, or this one is appended to it
        ctx.state.progress.close()
    print(f"trajflow run {ctx.run_id} finished: {store.run_dir}", flush=True)
    return {"run_id": ctx.run_id, "run_dir": str(store.run_dir), "mlflow_run_id": meta.get("mlflow_run_id"),
            "metrics": ctx.state.last_metrics, "policy_version": ctx.policy_version,
            "trained_iterations": list(ctx.state.trained_iterations), "nothing_to_do": ctx.state.nothing_to_do}


def finished_summary(cfg: DictConfig, run_id: str) -> dict | None:
    """The summary of a run with nothing left to do (all iterations checkpointed, final model
    exported), or ``None`` when there is something to train. Starts nothing."""
    store = RunStore(cfg.store.root, run_id)
    latest = ckpt.latest_checkpoint(store)
    if latest is None or latest < cfg.trainer.total_iterations or not store.final_dir.exists():
        return None
    meta = store.read_run_meta()
    return {"run_id": run_id, "run_dir": str(store.run_dir), "mlflow_run_id": meta.get("mlflow_run_id"),
            "metrics": {}, "policy_version": meta.get("policy_version"), "trained_iterations": [],
            "nothing_to_do": True, "last_checkpoint": latest}


def _log_end_of_run_plots(ctx: RunContext) -> None:
    """Reward and response-length PNGs in ``<run>/plots/`` and as MLflow artifacts; a plotting error only warns."""
    if ctx.tracker is None:
        return
    try:
        from trajflow.plots import log_run_plots

        log_run_plots(ctx.tracker, ctx.run_id, ctx.store.run_dir / "plots")
    except Exception as e:  # a missing plot must never fail a finished run
        log.warning("could not log the end-of-run plots: %s", e)


def close_run(ctx: RunContext, status: str) -> None:
    """Close progress, workers and the MLflow run (a finished run's model is logged to it first);
    a failed run says where its files are."""
    if ctx.state.progress is not None:
        ctx.state.progress.close()
    try:
        # The final model is loaded for MLflow once the workers' memory is free; Ray (and with it
        # the watcher that reaps Prefect's temporary server) stops last, after the flow's bookkeeping.
        release_workers(ctx)
        _close_tracker(ctx, status)
        _record_session_end(ctx, status)
    finally:
        close(ctx)


def _close_tracker(ctx: RunContext, status: str) -> None:
    if ctx.tracker is None:
        return
    if status == "FINISHED" and not ctx.state.nothing_to_do and ctx.cfg.tracking.log_model \
            and ctx.store.final_dir.exists():
        _log_final_model(ctx)
    try:
        ctx.tracker.finish(status)
    except Exception as e:  # never hide the original error behind a tracking one
        log.warning("could not close the MLflow run: %s", e)


def _log_final_model(ctx: RunContext) -> None:
    """``final/`` as the MLflow model of the run (``tracking.log_model``), registered under
    ``tracking.register_model``; a failure is one warning line (the model is in ``final/`` anyway)."""
    cfg = ctx.cfg
    try:
        uri = ctx.tracker.log_model(ctx.store.final_dir, registered_name=cfg.tracking.register_model or None,
                                    description=f"trajflow run {ctx.run_id} (recipe {cfg.recipe}), policy version "
                                                f"{ctx.policy_version}, trained from {cfg.model.path}")
        print(f"final model logged to MLflow: {uri}", flush=True)
    except Exception as e:
        log.warning("could not log the final model to MLflow", exc_info=True)
        print(f"warning: the final model was not logged to MLflow ({type(e).__name__}: {str(e).splitlines()[0]}); "
              f"it is in {ctx.store.final_dir}", file=sys.stderr, flush=True)


def _record_session_end(ctx: RunContext, status: str) -> None:
    meta = ctx.store.read_run_meta()
    sessions = meta.get("sessions") or []
    if sessions:
        sessions[-1].update(ended=time.time(), status=status,
                            trained_iterations=list(ctx.state.trained_iterations),
                            skipped_iterations=list(ctx.state.skipped_iterations))
        ctx.store.update_run_meta(sessions=sessions)
    if status == "KILLED":
        ctx.store.update_run_meta(status="interrupted")
        print(f"trajflow run {ctx.run_id} interrupted: {ctx.store.run_dir} (trajflow resume {ctx.run_id} goes on from "
              f"its newest checkpoint)", flush=True)
    elif status != "FINISHED":
        ctx.store.update_run_meta(status="failed")
        print(f"trajflow run {ctx.run_id} stopped ({status.lower()}): {ctx.store.run_dir}", flush=True)
