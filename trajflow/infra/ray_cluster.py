"""Start, watch and stop the Ray cluster a run uses: ``resources.ray_address``, or a local one.

A local Ray started here is handed to :mod:`trajflow.infra.raywatch`, which stops what is left of it
if this process dies without shutting it down.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

_RAY_WATCH: dict[str, Any] = {}  # the watcher of the local Ray this process started (trajflow.infra.raywatch)


def start_ray(cfg: DictConfig) -> bool:
    """Connect to ``resources.ray_address`` or start a local Ray; returns True if this call started it.

    A local Ray started here is watched by :mod:`trajflow.infra.raywatch`: if this process dies without
    shutting it down (SIGKILL, OOM), the watcher stops what is left of that cluster.
    """
    import ray

    if ray.is_initialized():
        return False
    from trajflow.infra.allocator import worker_env_vars

    kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    env_vars = worker_env_vars(str(cfg.resources.get("allocator", "auto")))
    if env_vars:
        kwargs["runtime_env"] = {"env_vars": env_vars}
    if cfg.resources.ray_address:
        ray.init(address=cfg.resources.ray_address, **kwargs)
    else:
        from trajflow.infra import raywatch

        before = raywatch.descendants()
        ray.init(num_cpus=cfg.resources.num_cpus or os.cpu_count(), **kwargs)
        try:
            _RAY_WATCH["known"] = before
            watch_new_ray_processes()
        except Exception as e:  # the watcher is a safety net; never fail a run over it
            log.warning("could not start the Ray watcher: %s", e)
    return True


def watch_new_ray_processes() -> None:
    """Hand Ray processes started since the last call (agents, workers) to the watcher."""
    if "known" not in _RAY_WATCH:
        return
    from trajflow.infra import raywatch

    now = raywatch.descendants()
    new = raywatch.ray_processes(now - _RAY_WATCH["known"])
    _RAY_WATCH["known"] = now
    if "watcher" not in _RAY_WATCH:
        _RAY_WATCH["watcher"] = raywatch.start(new)
    else:
        _RAY_WATCH["watcher"].add(new)


def stop_ray() -> None:
    """Shut down the local Ray this process started and let its watcher reap leftovers."""
    import ray

    ray.shutdown()
    watcher = _RAY_WATCH.pop("watcher", None)
    _RAY_WATCH.pop("known", None)
    if watcher is not None:
        watcher.close()
