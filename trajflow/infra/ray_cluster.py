"""Start, watch and stop the Ray cluster a run uses: ``resources.ray_address``, or a local one.

A local Ray started here listens on loopback only (:func:`loopback_node`); a cluster is the user's
explicit choice of ``resources.ray_address`` and is connected to as it is.

A local Ray started here, and the temporary Prefect server the flow started before it, are handed
to :mod:`trajflow.infra.raywatch`, which stops what is left of them if this process dies without
shutting them down.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

_RAY_WATCH: dict[str, Any] = {}  # the watcher of the local Ray this process started (trajflow.infra.raywatch)


def start_ray(cfg: DictConfig) -> bool:
    """Connect to ``resources.ray_address`` or start a local Ray; returns True if this call started it.

    A local Ray started here is watched by :mod:`trajflow.infra.raywatch`: if this process dies without
    shutting it down (SIGKILL, OOM), the watcher stops what is left of that cluster and the
    temporary Prefect API server this process started (if any).
    """
    import ray

    if ray.is_initialized():
        return False
    from trajflow.infra import logs
    from trajflow.infra.allocator import worker_env_vars

    logs.adopt_library_loggers()  # Ray's own console handler, added at import, would print ray.init's warnings

    # Without -v, worker stdout/stderr stays in the Ray session's logs instead of the console.
    kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING,
                                  log_to_driver=logs.ray_log_to_driver())
    env_vars = worker_env_vars(str(cfg.resources.get("allocator", "auto")))
    if env_vars:
        kwargs["runtime_env"] = {"env_vars": env_vars}
    if cfg.resources.ray_address:
        info = ray.init(address=cfg.resources.ray_address, **kwargs)
    else:
        from trajflow.infra import raywatch

        before = raywatch.descendants()
        with loopback_node():
            info = ray.init(num_cpus=cfg.resources.num_cpus or os.cpu_count(), _system_config=local_system_config(cfg),
                            **kwargs)
        try:
            # The flow started Prefect's temporary server before Ray: not new, but ours to reap.
            _RAY_WATCH["known"] = before - {k for k, cmd in raywatch.command_lines(before).items()
                                            if raywatch.is_prefect_server(cmd)}
            watch_new_ray_processes()
        except Exception as e:  # the watcher is a safety net; never fail a run over it
            log.warning("could not start the Ray watcher: %s", e)
    logs.adopt_library_loggers()
    session = (getattr(info, "address_info", None) or {}).get("session_dir")
    if session:
        log.info("Ray session %s: worker output is in %s", session, os.path.join(session, "logs"))
    return True


def local_system_config(cfg: DictConfig) -> dict[str, Any]:
    """Ray's ``_system_config`` (RayConfig settings) for a local Ray started here: fewer idle worker processes.

    * ``prestart_worker_first_driver: false``: Ray starts ``num_cpus`` workers when the driver connects,
      in case tasks follow. trajflow's tasks never use them: its jobs carry a runtime environment
      (the allocator's ``LD_PRELOAD``), so Ray starts workers of that environment for them anyway,
      and the prestarted ones idle for the whole run (~80 MB each).
    * ``num_workers_soft_limit: reward.num_workers``: how many idle workers Ray keeps for reuse
      (default: one per CPU). The Ray tasks of an iteration (reward scoring in ``reward.num_workers``
      tasks, then the advantage) reuse the same workers every iteration, so keeping that many loses
      no start-up; a worker Ray starts beside them (it may start two for one task) exits after a second
      idle instead of idling through the run.

    ``resources.ray_system_config`` entries override these (e.g. ``{num_workers_soft_limit: -1}`` for
    Ray's default). Ray takes ``_system_config`` only when it starts the cluster; a cluster named by
    ``resources.ray_address`` keeps its own settings. Measured with ``benchmarks/overhead.py`` (docs/scaling.md).
    """
    from omegaconf import OmegaConf

    out: dict[str, Any] = {"prestart_worker_first_driver": False,
                           "num_workers_soft_limit": max(1, int(cfg.reward.get("num_workers", 1)))}
    extra = cfg.resources.get("ray_system_config") or {}
    if OmegaConf.is_config(extra):
        extra = OmegaConf.to_container(extra, resolve=True)
    out.update({str(k): v for k, v in dict(extra).items()})
    return out


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """Make the local Ray that ``ray.init`` starts inside this block take a loopback node IP.

    Every listening socket of a local Ray follows its node IP: the GCS, the raylet and the workers'
    gRPC servers, the runtime-env agent, the dashboard agent's gRPC, HTTP and metrics-export ports
    and the autoscaler monitor's metrics server all bind loopback when that IP is a localhost
    address, and every interface (``0.0.0.0`` / ``::``) otherwise. Passing
    ``_node_ip_address="127.0.0.1"`` is not enough: ``ray.init`` rewrites a localhost address to the
    machine's routable IP (``services.resolve_ip_for_localhost``) unless Ray believes it runs where
    clusters are unsupported (``ray_constants.ENABLE_RAY_CLUSTER``, the switch behind
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``), in which case the node IP is Ray's loopback address.
    That switch is read when the node starts, so it is turned off for this block only: nothing else
    in the process (``ray start`` in a subprocess, a later ``ray.init(address=...)``) sees it.
    """
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # a Ray whose internals moved: say so, go on
        log.warning("this Ray version has no ray_constants.ENABLE_RAY_CLUSTER; the local Ray may listen "
                    "on every interface")
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def watch_new_ray_processes() -> None:
    """Hand the processes started since the last call (Ray's agents and workers, the temporary Prefect
    server) to the watcher; the watcher itself is a descendant too, and is never handed to itself."""
    if "known" not in _RAY_WATCH:
        return
    from trajflow.infra import raywatch

    now = raywatch.descendants()
    fresh = now - _RAY_WATCH["known"]
    commands = raywatch.command_lines(fresh)
    new = sorted(k for k, cmd in commands.items() if raywatch.is_ray(cmd) or raywatch.is_prefect_server(cmd))
    # A process caught inside exec() reads as an empty command line: judged again at the next call.
    _RAY_WATCH["known"] = now - {k for k, cmd in commands.items() if not cmd}
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
