"""The run's live state, shared by the flow's tasks: config, store, Ray workers, tracker, data cursor.

Prefect tasks receive only a run id and small references; they look the live objects up here
(``get_context(run_id)``) so that no actor handle or tensor is ever hashed, serialised or persisted
by Prefect.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trajflow.store import RunStore

log = logging.getLogger(__name__)

_CONTEXTS: dict[str, "RunContext"] = {}


def start_ray(cfg: DictConfig) -> bool:
    """Connect to ``resources.ray_address`` or start a local Ray; returns True if this call started it."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    if cfg.resources.ray_address:
        ray.init(address=cfg.resources.ray_address, **kwargs)
    else:
        ray.init(num_cpus=cfg.resources.num_cpus or os.cpu_count(), **kwargs)
    return True


@dataclass
class RunContext:
    """Everything a running ``train`` flow needs between tasks."""

    cfg: DictConfig
    store: RunStore
    model_path: str
    actor: Any = None            # Ray handle of PolicyWorker
    reference: Any = None        # Ray handle of ReferenceWorker (None without KL)
    tracker: Any = None          # trajflow.tracking.Tracker
    sampler: Any = None          # trajflow.data.PromptSampler
    datasets: Any = None         # trajflow.data.PromptDatasets
    kl_ctrl: Any = None          # stages.kl controller (KL in reward)
    score_history: list[float] = field(default_factory=list)
    policy_version: int = 0
    started_ray: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.store.run_id

    def plain(self, section: str) -> dict:
        """A config section as a plain dict (what Ray workers receive)."""
        out = OmegaConf.to_container(self.cfg[section], resolve=True)
        if section == "reward" and not out.get("default_scorer") and self.datasets is not None:
            # A dataset spec may name the scorer for its data sources (e.g. a custom file dataset).
            out["default_scorer"] = self.datasets.spec.get("scorer")
        return out  # type: ignore[return-value]

    def needs_reference(self) -> bool:
        return self.cfg.actor.kl_loss_coef > 0 or bool(self.cfg.algorithm.use_kl_in_reward)


def register(ctx: RunContext) -> None:
    _CONTEXTS[ctx.run_id] = ctx


def get_context(run_id: str) -> RunContext:
    try:
        return _CONTEXTS[run_id]
    except KeyError:
        raise RuntimeError(f"no live run context for run {run_id!r} in this process") from None


def unregister(run_id: str) -> None:
    _CONTEXTS.pop(run_id, None)


def create_workers(ctx: RunContext) -> None:
    """Start the policy worker (and the reference worker when a KL term is on) as Ray actors."""
    import ray

    from trajflow.workers.policy import PolicyWorker
    from trajflow.workers.reference import ReferenceWorker

    cfg = ctx.cfg
    device = cfg.trainer.device
    resources: dict[str, Any] = {"num_cpus": cfg.resources.actor_num_cpus}
    if device == "cuda":
        resources["num_gpus"] = 1
    elif device == "npu":
        resources["resources"] = {"NPU": 1}
    policy_cls = ray.remote(max_restarts=0)(PolicyWorker)
    ctx.actor = policy_cls.options(**resources).remote(
        ctx.model_path, ctx.plain("actor"), ctx.plain("model"), ctx.plain("rollout"), int(cfg.trainer.seed),
        device, int(cfg.trainer.num_threads))
    if ctx.needs_reference():
        ref_path = cfg.reference.path
        if ref_path:
            from trajflow.models import resolve_model_path

            ref_path = str(resolve_model_path(ref_path, cfg.model.cache_dir))
        ref_cls = ray.remote(ReferenceWorker)
        ctx.reference = ref_cls.options(num_cpus=0).remote(
            ref_path or ctx.model_path, ctx.plain("model"), int(cfg.rollout.log_prob_micro_batch_size), device,
            int(cfg.trainer.num_threads))
    # Surface load errors (bad model directory, ...) here rather than at the first stage.
    ray.get(ctx.actor.info.remote())
    if ctx.reference is not None:
        ray.get(ctx.reference.pid.remote())


def close(ctx: RunContext) -> None:
    """Stop the run's actors (and Ray, if this run started it)."""
    import ray

    for handle in (ctx.actor, ctx.reference):
        if handle is not None:
            try:
                ray.kill(handle)
            except Exception:  # already dead
                pass
    ctx.actor = ctx.reference = None
    unregister(ctx.run_id)
    if ctx.started_ray:
        ray.shutdown()


def run_dir_for(cfg: DictConfig, run_id: str) -> Path:
    return Path(cfg.store.root).expanduser().resolve() / run_id
