"""What ``train`` and ``resume`` decide before Prefect, Ray or a model start: the config, the checks
of :mod:`~trajflow.run.preflight`, the run id, and whether a resumed run has anything left to do.

Import-light on purpose (no torch, Ray, Prefect or Great Expectations at module level, nor in
``load_config``): a misspelled key is rejected, and a finished run says "nothing to do", in about a
second. The flows (:mod:`trajflow.flows.train`) call the same functions, so the CLI and the Python
API check the same things in the same order.
"""

from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig


def prepare_train(recipe: str | None = None, overrides: Sequence[str] = (),
                  run_id: str | None = None) -> tuple[DictConfig, str, bool]:
    """The validated config, checked as :func:`~trajflow.run.preflight.preflight` checks it, and the run
    id (``trainer.resume=auto`` with an existing run's id resumes it).

    Returns:
        ``(cfg, run_id, resume)``.

    Raises:
        ConfigError, DataError, ModelLoadError, RunExistsError: bad input, before anything is written.
    """
    from trajflow.config import load_config

    cfg = load_config(recipe, list(overrides))
    from trajflow.run.preflight import check_custom_function, preflight
    from trajflow.run.resume import check_resumable
    from trajflow.run.session import choose_run_id
    from trajflow.store import RunStore

    preflight(cfg)
    run_id, resume = choose_run_id(cfg, run_id)
    if resume:
        store = RunStore(cfg.store.root, run_id)
        check_resumable(store)
        check_custom_function(cfg, store.read_run_meta(), f"run {run_id!r}")
    return cfg, run_id, resume


def prepare_resume(run_id: str, overrides: Sequence[str] = ()) -> tuple[DictConfig, dict | None]:
    """The stored config of run ``run_id`` plus ``overrides``, and whether anything is left to do.

    A run with every iteration checkpointed and its final model exported needs neither its data nor
    its model: its summary (``nothing_to_do=True``) is returned without the preflight checks.

    Returns:
        ``(cfg, summary)``: ``summary`` is None when there is something to train (the preflight
        checks then passed).

    Raises:
        StoreError: no such run, a replay, another driver holds the run.
        ConfigError, DataError, ModelLoadError: a bad override, the run's data or model is gone or bad.
    """
    from trajflow.run.preflight import check_custom_function, preflight
    from trajflow.run.resume import finished_summary, resume_config
    from trajflow.store import RunStore, run_lock

    cfg = resume_config(run_id, overrides)
    store = RunStore(cfg.store.root, run_id)
    check_custom_function(cfg, store.read_run_meta(), f"run {run_id!r}")
    with run_lock(store):  # a driver still training it owns the answer
        done = finished_summary(cfg, run_id)
    if done is None:
        preflight(cfg)
    return cfg, done
