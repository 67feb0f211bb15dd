"""Resource pools (``resources.pools``) and the placement of roles on them as Ray placement groups.

Each slot of a pool is one Ray bundle and a pool holds one ``STRICT_PACK`` placement group per node;
``colocated`` shares every slot among the roles on the actor's pool, ``split`` gives each role a pool
of its own. With no pools and one actor rank no placement group is made at all. docs/scaling.md
("Resource pools and placement") describes the config and its rules.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from trajflow.errors import ConfigError, DeviceError

#: Roles that can be placed on pools (the config sections carrying a ``pool`` key).
ROLES = ("actor", "reference", "critic", "rollout", "teacher")
#: Keys of one ``resources.pools.<name>`` entry.
POOL_KEYS = ("nodes", "devices_per_node", "device", "num_cpus_per_worker")
DEFAULT_POOL = "default"
_TORCH_DEVICE_RESOURCE = {"cpu": "cpu", "cuda": "gpu", "npu": "NPU"}


@dataclass(frozen=True)
class Pool:
    """One resource pool: ``nodes`` x ``devices_per_node`` worker slots.

    Attributes:
        name: the key under ``resources.pools``.
        nodes: nodes the pool spans (one placement group each).
        devices_per_node: slots (bundles) per node.
        device: ``cpu``, ``gpu`` or a custom Ray resource name (``NPU``, ...).
        num_cpus_per_worker: CPUs reserved per slot.
    """

    name: str
    nodes: int
    devices_per_node: int
    device: str
    num_cpus_per_worker: float

    @property
    def size(self) -> int:
        return self.nodes * self.devices_per_node

    def bundle(self) -> dict[str, float]:
        """The Ray bundle of one slot."""
        b: dict[str, float] = {}
        if self.num_cpus_per_worker > 0:
            b["CPU"] = float(self.num_cpus_per_worker)
        if self.device == "gpu":
            b["GPU"] = 1.0
        elif self.device != "cpu":
            b[self.device] = 1.0
        return b

    def describe(self) -> str:
        dev = "" if self.device == "cpu" else f" x 1 {self.device}"
        return (f"resources.pools.{self.name} ({self.nodes} node(s) x {self.devices_per_node} slot(s), "
                f"{self.num_cpus_per_worker:g} CPU{dev} each)")


def parse_pools(pools: Mapping[str, Any]) -> dict[str, Pool]:
    """Validate ``resources.pools`` and build :class:`Pool` objects.

    Raises:
        ConfigError: unknown key, wrong type or out-of-range value (names ``resources.pools.<name>.<key>``).
    """
    out = {}
    for name, spec in pools.items():
        where = f"resources.pools.{name}"
        if not hasattr(spec, "items"):
            raise ConfigError(f"config: {where} must be a mapping with keys {', '.join(POOL_KEYS)}, got {spec!r}")
        unknown = [k for k in spec.keys() if k not in POOL_KEYS]
        if unknown:
            raise ConfigError(f"config: unknown key '{where}.{unknown[0]}': allowed keys are {', '.join(POOL_KEYS)}")
        nodes = spec.get("nodes", 1)
        per_node = spec.get("devices_per_node", 1)
        device = spec.get("device", "cpu")
        cpus = spec.get("num_cpus_per_worker", 1)
        for key, value in (("nodes", nodes), ("devices_per_node", per_node)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config: {where}.{key}={value!r} must be an integer >= 1")
        if not isinstance(device, str) or not device:
            raise ConfigError(f"config: {where}.device={device!r} must be cpu, gpu or a custom Ray resource name "
                              "(e.g. NPU)")
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus < 0:
            raise ConfigError(f"config: {where}.num_cpus_per_worker={cpus!r} must be a number >= 0")
        if device == "cpu" and cpus <= 0:
            raise ConfigError(f"config: {where}.num_cpus_per_worker={cpus!r} must be > 0 for a cpu pool "
                              "(a slot must reserve something)")
        out[name] = Pool(str(name), int(nodes), int(per_node), device, float(cpus))
    return out


def role_enabled(cfg: Any, role: str) -> bool:
    """Whether a role gets workers of its own in this run."""
    if role == "actor":
        return True
    if role == "reference":
        needed = cfg.actor.kl_loss_coef > 0 or bool(cfg.algorithm.use_kl_in_reward)
        # Under LoRA the actor with its adapters disabled is the reference (verl's ref_in_actor):
        # no worker, no slot, no share of the pool, unless reference.path names another model.
        in_actor = cfg.model.lora_rank > 0 and not cfg.reference.path
        return needed and not in_actor
    if role == "critic":
        # Lazy: trajflow.stages.advantage imports torch, and the config layer stays importable without it.
        from trajflow.stages.advantage import needs_values

        return needs_values(cfg.algorithm.adv_estimator)
    if role == "rollout":
        return cfg.rollout.pool is not None
    if role == "teacher":  # on-policy distillation's teacher
        return cfg.algorithm.adv_estimator == "opd"
    raise KeyError(role)


def implicit_pool(cfg: Any) -> Pool:
    """The pool used when ``resources.pools`` is empty: one node, ``actor.world_size`` slots."""
    return Pool(DEFAULT_POOL, 1, int(cfg.actor.world_size), _TORCH_DEVICE_RESOURCE[cfg.trainer.device],
                float(cfg.resources.actor_num_cpus))


def validate_resources(cfg: Any, source: str = "config") -> None:
    """Cross-field checks of pools, placement, roles, DeepSpeed and devices (called by config validation).

    Raises:
        ConfigError: one line naming the key, the bad value and what is allowed.
    """
    pools = parse_pools(cfg.resources.pools)
    a = cfg.actor
    if a.world_size > 1 and a.strategy not in ("deepspeed", "fsdp2"):
        raise ConfigError(f"{source}: actor.world_size={a.world_size} needs actor.strategy='deepspeed' or 'fsdp2' "
                          f"(got {a.strategy!r}): data-parallel updates run through DeepSpeed or FSDP2")
    fsdp_size = int(a.fsdp.fsdp_size)
    if a.strategy == "fsdp2" and (fsdp_size == 0 or (fsdp_size > 0 and a.world_size % fsdp_size)):
        raise ConfigError(f"{source}: actor.fsdp.fsdp_size={fsdp_size} must be -1 (all ranks) or a divisor of "
                          f"actor.world_size={a.world_size} (the shard group of hybrid sharding)")
    if a.strategy != "deepspeed" and a.zero_stage:
        raise ConfigError(f"{source}: actor.zero_stage={a.zero_stage} needs actor.strategy='deepspeed'")
    mini_rows = a.ppo_mini_batch_size * cfg.rollout.n
    if mini_rows < a.world_size:
        raise ConfigError(f"{source}: actor.ppo_mini_batch_size * rollout.n = {mini_rows} rows per optimizer step "
                          f"is fewer than actor.world_size={a.world_size}: every rank needs at least one row")
    if not pools:
        if cfg.resources.placement == "split":
            raise ConfigError(f"{source}: resources.placement='split' needs resources.pools "
                              "(one pool per role); none are declared")
        for role in ROLES[1:]:
            if cfg[role].pool is not None:
                raise ConfigError(f"{source}: {role}.pool={cfg[role].pool!r} names a pool, but resources.pools "
                                  "is empty")
        if a.pool != DEFAULT_POOL:
            raise ConfigError(f"{source}: actor.pool={a.pool!r} is not declared in resources.pools (none are)")
        return
    names = sorted(pools)
    for role in ROLES:
        name = cfg[role].pool
        if name is not None and name not in pools:
            import difflib

            close = difflib.get_close_matches(str(name), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{source}: {role}.pool={name!r} is not a pool: declared pools are "
                              f"{', '.join(names)}{hint}")
    actor_pool = pools[a.pool]
    if actor_pool.size != a.world_size:
        raise ConfigError(f"{source}: actor.world_size={a.world_size} but {actor_pool.describe()} holds "
                          f"{actor_pool.size} slot(s); set actor.world_size={actor_pool.size} or resize the pool")
    placement = cfg.resources.placement
    used: dict[str, str] = {a.pool: "actor"}
    for role in ROLES[1:]:
        if not role_enabled(cfg, role):
            continue
        name = cfg[role].pool
        if placement == "colocated":
            if name is not None and name != a.pool:
                raise ConfigError(f"{source}: {role}.pool={name!r} differs from actor.pool={a.pool!r}, but "
                                  "resources.placement='colocated' puts every role on the actor's pool; "
                                  "use resources.placement=split")
        else:
            if name is None:
                raise ConfigError(f"{source}: resources.placement='split' needs {role}.pool (the pool the "
                                  f"{role} runs on); declared pools: {', '.join(names)}")
            if name in used:
                raise ConfigError(f"{source}: {role}.pool={name!r} is already used by {used[name]}; "
                                  "resources.placement='split' gives each role its own pool")
            used[name] = role
    device_resource = _TORCH_DEVICE_RESOURCE[cfg.trainer.device]
    for name in {cfg[r].pool or a.pool for r in ROLES if role_enabled(cfg, r)}:
        pool = pools[name]
        if device_resource == "gpu" and pool.device != "gpu":
            raise ConfigError(f"{source}: trainer.device='cuda' needs GPU pools, but "
                              f"resources.pools.{name}.device={pool.device!r}")
        if device_resource == "NPU" and pool.device != "NPU":
            raise ConfigError(f"{source}: trainer.device='npu' needs NPU pools, but "
                              f"resources.pools.{name}.device={pool.device!r}")
        if device_resource == "cpu" and pool.device == "gpu":
            raise ConfigError(f"{source}: resources.pools.{name}.device='gpu' needs trainer.device='cuda' "
                              "(got 'cpu'): the role would hold a GPU and compute on the CPU")


def _share(value: float, k: int) -> float:
    """``value / k`` rounded down to Ray's resource granularity (1e-4)."""
    return math.floor(value / k * 10_000) / 10_000


class Placement:
    """Turns the config's pools and placement into Ray actor options, one per (role, rank).

    Placement groups are created lazily, per pool, on first use, and removed by :meth:`close`.

    Args:
        cfg: the run config.
        placement_timeout_s: how long to wait for a pool's placement groups before failing.
    """

    def __init__(self, cfg: Any, placement_timeout_s: float | None = None) -> None:
        self.cfg = cfg
        self.pools = parse_pools(cfg.resources.pools)
        self.declared = bool(self.pools)
        if not self.declared:
            self.pools = {DEFAULT_POOL: implicit_pool(cfg)}
        self.timeout_s = float(placement_timeout_s if placement_timeout_s is not None
                               else cfg.resources.placement_timeout_s)
        self._pgs: dict[str, list[Any]] = {}

    @property
    def legacy(self) -> bool:
        """No pools declared, one actor rank, no separate rollout: today's single-actor options, no placement groups."""
        return not self.declared and self.cfg.actor.world_size == 1 and self.cfg.rollout.pool is None

    def pool_of(self, role: str) -> Pool:
        if self.cfg.resources.placement == "colocated":
            name = self.cfg.actor.pool
        else:
            name = self.cfg[role].pool or self.cfg.actor.pool
        return self.pools[name]

    def world_size(self, role: str) -> int:
        """Ranks of a role: ``actor.world_size`` for the actor, the pool's slot count for the others."""
        if role == "actor" or self.legacy:
            return int(self.cfg.actor.world_size) if role == "actor" else 1
        return self.pool_of(role).size

    def _sharing(self, pool: Pool) -> int:
        return sum(1 for r in ROLES if role_enabled(self.cfg, r) and self.pool_of(r).name == pool.name)

    def placement_groups(self, pool: Pool) -> list[Any]:
        """The pool's placement groups (created and waited for on first call).

        Raises:
            DeviceError: the cluster lacks the resources (names the pool and what it has), or the
                groups could not be placed within the timeout.
        """
        if pool.name in self._pgs:
            return self._pgs[pool.name]
        import ray
        from ray.util.placement_group import placement_group

        check_capacity(pool, ray.cluster_resources())
        strategy = "STRICT_PACK"
        pgs = [placement_group([pool.bundle() for _ in range(pool.devices_per_node)], strategy=strategy,
                               name=f"trajflow-{pool.name}-{i}") for i in range(pool.nodes)]
        self._pgs[pool.name] = pgs
        deadline = time.monotonic() + self.timeout_s
        for i, pg in enumerate(pgs):
            try:
                ray.get(pg.ready(), timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise DeviceError(
                    f"{pool.describe()}: placement group {i} could not be placed within "
                    f"{self.timeout_s:g} s (resources.placement_timeout_s); free now: "
                    f"{_fmt(ray.available_resources())}") from None
        return pgs

    def actor_options(self, role: str, rank: int) -> dict[str, Any]:
        """Ray ``.options()`` for rank ``rank`` of ``role``."""
        cfg = self.cfg
        if self.legacy:
            # Exactly what a single-machine run always used.
            if role == "actor":
                opts: dict[str, Any] = {"num_cpus": cfg.resources.actor_num_cpus}
                if cfg.trainer.device == "cuda":
                    opts["num_gpus"] = 1
                elif cfg.trainer.device == "npu":
                    opts["resources"] = {"NPU": 1}
                return opts
            return {"num_cpus": 0}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pool = self.pool_of(role)
        k = self._sharing(pool) if cfg.resources.placement == "colocated" else 1
        pgs = self.placement_groups(pool)
        node, slot = divmod(rank % pool.size, pool.devices_per_node)
        opts = {"num_cpus": _share(pool.num_cpus_per_worker, k),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=pgs[node], placement_group_bundle_index=slot,
                    placement_group_capture_child_tasks=False)}
        if pool.device == "gpu":
            opts["num_gpus"] = _share(1.0, k)
        elif pool.device != "cpu":
            opts["resources"] = {pool.device: _share(1.0, k)}
        return opts

    def close(self) -> None:
        """Remove the placement groups this object created."""
        if not self._pgs:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        for pgs in self._pgs.values():
            for pg in pgs:
                try:
                    if ray.is_initialized():
                        remove_placement_group(pg)
                except Exception:  # already gone with the cluster
                    pass
        self._pgs.clear()


def _fmt(resources: Mapping[str, float]) -> str:
    keep = {k: v for k, v in resources.items() if not k.startswith(("node:", "memory", "object_store_memory"))}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"


def check_capacity(pool: Pool, cluster: Mapping[str, float]) -> None:
    """Fail at once (instead of waiting forever) when the whole cluster cannot hold ``pool``.

    Raises:
        DeviceError: names the pool, the resource and how much of it the cluster has.
    """
    for resource, per_slot in sorted(pool.bundle().items(), key=lambda kv: kv[0] == "CPU"):  # devices first
        need = per_slot * pool.size
        have = float(cluster.get(resource, 0.0))
        if have + 1e-9 < need:
            extra = ""
            if resource == "GPU":
                extra = " (is this a GPU cluster? start the nodes with GPUs or use trainer.device=cpu)"
            raise DeviceError(f"{pool.describe()} needs {need:g} {resource} but the Ray cluster has {have:g}"
                              f"{extra}; cluster resources: {_fmt(cluster)}")


def node_ids(handles: Iterable[Any]) -> list[str]:
    """Node ids of actors that have a ``node_id()`` method (tests and diagnostics)."""
    import ray

    return ray.get([h.node_id.remote() for h in handles])
