"""The driver's live run, cut by the run's phases; this package's face is what the flows call.

The flows read ``from trajflow import run`` and then ``run.open_run(...)``, ``run.begin_iteration(...)``,
``run.record(...)``: every verb below is one step of a run, defined in the module of its phase.

- :mod:`~trajflow.run.preflight`: bad data, model, store or reward input, before anything starts;
- :mod:`~trajflow.run.session`: the run id, opening a run (new or resumed), finishing, closing;
- :mod:`~trajflow.run.resume`: the stored config, what changed, where a run continues, checkpoint restore;
- :mod:`~trajflow.run.iteration`: each iteration's books (begin, record, due checks, publish, save);
- :mod:`~trajflow.run.roles`: the driver's calls into the role workers (generate, score, weight sync);
- :mod:`~trajflow.run.replay`: planning and opening a replay; :mod:`~trajflow.run.gate`: the reward
  gate of an iteration.

The rest is the machinery the verbs share: :mod:`~trajflow.run.context` (``RunContext`` and the typed
state), :mod:`~trajflow.run.workers` (start and stop), :mod:`~trajflow.run.recovery` (stage attempts
that survive dead workers), :mod:`~trajflow.run.validation`, :mod:`~trajflow.run.cache_keys`,
:mod:`~trajflow.run.progress`.
"""

import importlib

#: Each verb and the module of its phase. Imported on first use (PEP 562): a config or data error is
#: reported by the light modules (preflight, resume) before torch, Ray or Prefect are imported.
_VERBS = {
    "iteration": ("begin_iteration", "checkpoint_due", "iterations", "log_iteration", "log_validation", "record",
                  "rollout_checkpoint_id", "save", "validation_before_training_due", "validation_due", "was_gated"),
    "preflight": ("check_batch_size", "check_custom_function", "check_model_weights", "check_prompt_lengths",
                  "check_reward_and_gates", "check_scorers", "check_store_root", "custom_function_record",
                  "preflight"),
    "resume": ("check_resumable", "config_changes", "finished_summary", "restore_checkpoint", "resume_config",
               "store_root_from"),
    "roles": ("snapshot_rollout_weights", "sync_rollout_weights"),
    "session": ("build_context", "choose_run_id", "close_run", "create_run_folder", "finish_run", "new_run_id",
                "open_evaluation", "open_run", "preload_audit", "start_workers"),
}
_MODULE_OF = {verb: module for module, verbs in _VERBS.items() for verb in verbs}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "begin_iteration", "build_context", "check_batch_size", "check_custom_function",
    "check_model_weights", "check_prompt_lengths", "check_resumable", "check_reward_and_gates", "check_scorers",
    "check_store_root", "checkpoint_due", "choose_run_id", "close_run", "config_changes", "create_run_folder",
    "custom_function_record", "finish_run", "finished_summary", "iterations", "log_iteration", "log_validation",
    "new_run_id", "open_evaluation", "open_run", "preflight", "preload_audit", "record", "restore_checkpoint",
    "resume_config", "rollout_checkpoint_id", "save", "snapshot_rollout_weights", "start_workers",
    "store_root_from", "sync_rollout_weights", "validation_before_training_due", "validation_due", "was_gated",
]
