"""FSDP2 data parallel (``torch.distributed.fsdp.fully_shard``), verl's ``strategy: fsdp2``.

Each transformer block (the classes a Hugging Face model lists in ``_no_split_modules``) is one
FSDP unit, and the policy wrapped for packed forwards (:class:`~trajflow.modeling.backends.PackedLogProbs`:
embeddings, final norm and the tied LM head) is the root unit. Every parameter becomes a
``DTensor`` holding a dim-0 shard per rank; a unit's forward all-gathers its parameters and frees
them again after the forward (``reshard_after_forward``) or after the backward, whose
reduce-scatter leaves each rank the gradient of its own shard; AdamW (torch's, as the one-process
backend) then steps the shards only.

Exactness with the one-process update rests on the same three facts as DeepSpeed's
(:class:`~trajflow.modeling.backends.DeepSpeedBackend`): mini-batch-wide loss denominators on every
rank, each rank's loss times ``world_size`` (FSDP averages the reduced gradients over the data-parallel
ranks), and equally many micro-batches on every rank (:meth:`DataParallel.micro_batches`), since
every forward and backward is a collective.

Checkpoints never unpickle: each rank writes its shards of the trained parameters, its AdamW
moments and its RNG states with :func:`trajflow.state_files.save_state` (safetensors + a JSON tree),
rank 0 a JSON record of the mesh and every parameter's global shape; ``torch.distributed.checkpoint``
(whose metadata file is a pickle) is not used.

The critic (``critic.strategy=fsdp2``) uses the same backend with its value model as the root unit;
the reference policy (``reference.strategy=fsdp2``, as verl's ``ref`` role) shards its frozen model
the same way, without an optimizer (``train=False``), and only runs forwards inside :meth:`FSDP2Backend.inference`.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator

import torch

from trajflow.config import ActorConfig
from trajflow.modeling.backends import DataParallel, PackedLogProbs, adamw, join_process_group
from trajflow.modeling.buckets import by_block
from trajflow.modeling.packing import pack
from trajflow.modeling.precision import autocast, section_dtype
from trajflow.state_files import load_state, rng_state, save_state, set_rng_state

FORMAT = "fsdp2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_mesh(device: str, world_size: int, fsdp_size: int = -1):
    """The data-parallel mesh: 1-D ``(world_size,)`` (``fsdp``) when every rank holds a shard, else
    2-D ``(world_size // fsdp_size, fsdp_size)`` (``ddp``, ``fsdp``): hybrid sharding (HSDP), each
    parameter sharded within a group of ``fsdp_size`` ranks (a node) and replicated across groups.

    Raises:
        ValueError: ``fsdp_size`` is neither -1 nor a divisor of ``world_size``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    shard = world_size if fsdp_size in (-1, None) else int(fsdp_size)
    if shard <= 0 or world_size % shard:
        raise ValueError(f"fsdp_size={fsdp_size} must be -1 or a divisor of world_size={world_size}")
    if shard == world_size:
        return init_device_mesh(device, (world_size,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device, (world_size // shard, shard), mesh_dim_names=("ddp", "fsdp"))


def mixed_precision_policy(param_dtype: str, reduce_dtype: str = "float32"):
    """``MixedPrecisionPolicy`` of a ``mixed_precision`` section: parameters all-gathered and used in
    ``param_dtype`` (float32: no cast), gradients reduce-scattered in ``reduce_dtype`` and kept in the
    sharded float32 master parameters' dtype, which AdamW updates (Micikevicius et al. 2018, sec. 3.1)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = None if param_dtype == "float32" else _DTYPES[param_dtype]
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=_DTYPES[reduce_dtype])


def wrap_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that become FSDP units: the transformer blocks (``_no_split_modules`` of the
    Hugging Face model, as verl wraps), in module order; each block's parameters are gathered
    together and freed together."""
    names: set[str] = set()
    for m in model.modules():  # the causal LM, or the decoder inside a value model
        names.update(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class FSDP2Backend(DataParallel):
    """FSDP2 over ``world_size`` ranks (see the module docstring).

    Mixed precision follows trajflow's policy: float32 sharded master weights, gradients and AdamW
    state; with ``mixed_precision.param_dtype`` bfloat16 the units all-gather bfloat16 copies
    (:func:`mixed_precision_policy`) and the forward runs under the same ``torch.autocast`` as the
    one-process backend (log-probs, losses and norms in float32); gradients are reduced in
    ``reduce_dtype``. Activation checkpointing is ``model.gradient_checkpointing`` (set on the
    model before it is wrapped).

    Call from inside an actor after :func:`~trajflow.modeling.backends.setup_rank_env`; all ranks
    construct it together (the process group and the first forward are collectives).

    Args:
        model: the module (on the device); its blocks and a root wrapper are sharded in place.
        actor: the role's section (``lr``, ``betas``, ``weight_decay``, ``mixed_precision``, ``fsdp``;
            the critic's has no betas or weight decay: AdamW's defaults, as its one-process worker).
        device: ``cpu``, ``cuda`` or ``npu``.
        rank: this rank.
        world_size: number of ranks.
        policy: ``model`` is a causal LM trained on packed log-probs (the root unit is
            :class:`~trajflow.modeling.backends.PackedLogProbs` around it); False: ``model`` itself is
            the root and ``forward`` calls it (the critic's value model).
        state_name: stem of rank 0's checkpoint record (``actor_state``, ``critic_state``).
        train: build the optimizer; False for a frozen model (the reference policy: ``actor`` then
            needs only ``fsdp`` and ``mixed_precision``), which has no update, step or checkpoint.
    """

    def __init__(self, model: torch.nn.Module, actor: ActorConfig, device: str, rank: int,
                 world_size: int, policy: bool = True, state_name: str = "actor_state", train: bool = True) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        from trajflow.infra.devices import collective_backend

        join_process_group(collective_backend(device), rank, world_size)
        self.rank, self.world_size, self.device = rank, world_size, device
        cfg = actor.fsdp
        mp = actor.mixed_precision
        self.param_dtype = section_dtype(actor)
        self.mesh = device_mesh(device, world_size, int(cfg.fsdp_size))
        kw: dict[str, Any] = dict(
            mesh=self.mesh, reshard_after_forward=bool(cfg.reshard_after_forward),
            mp_policy=mixed_precision_policy(self.param_dtype, str(mp.reduce_dtype)),
            # Pinned host memory only helps copies to an accelerator.
            offload_policy=CPUOffloadPolicy(pin_memory=device != "cpu") if cfg.offload_params else OffloadPolicy())
        self.units = wrap_units(model)
        for unit in self.units:
            fully_shard(unit, **kw)
        self.root = PackedLogProbs(model) if policy else model
        fully_shard(self.root, **kw)
        self.state_name = state_name
        self.model = model
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        # LoRA: the frozen base is reloaded from model.path; a checkpoint holds the adapters only.
        self.frozen_base = len(self.trainable) < sum(1 for _ in model.parameters())
        self.optimizer = adamw(self.trainable, actor.lr, getattr(actor, "betas", (0.9, 0.999)),
                               float(getattr(actor, "weight_decay", 0.0)), device) if train else None
        self._inference_depth = 0
        # FSDP2 takes the first module to run a forward as its root: run one through the wrapper now,
        # before any generation or log-prob forward calls the blocks directly.
        with torch.no_grad():
            first = pack([[0]], [[0]], 0, device)
            self.root(first, 1.0) if policy else self.root(first)
        self._reshard_all()

    # ---------------------------------------------------------------- update
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward(self, packed, *args, **kwargs):
        """Training forward of one micro-batch through the root unit, in the compute dtype: the
        policy's ``(packed, temperature, compute_entropy, entropy_grad)`` -> float32 ``(b, T)``
        log-probs (and entropy); the critic's ``(packed)`` -> float32 ``(b, T)`` values."""
        with autocast(self.param_dtype, self.device):
            return self.root(packed, *args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        # FSDP averages the reduced gradients over the ranks; the rank losses sum to the full loss.
        (loss * self.world_size).backward()

    def step(self, grad_clip: float) -> tuple[float, bool]:
        """Clip (``clip_grad_norm_`` over the sharded gradients: the norm of the whole gradient,
        Pascanu et al. 2013), then step unless the norm is not finite; ``(grad_norm, stepped)``."""
        params = [p for p in self.trainable if p.grad is not None]
        if grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        gn = float(_full(norm))
        if not math.isfinite(gn):
            return gn, False
        self.optimizer.step()
        return gn, True

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Every parameter group's learning rate (the schedule's value for this update)."""
        for g in self.optimizer.param_groups:
            g["lr"] = float(lr)

    # ---------------------------------------------------------------- forwards outside training
    def _reshard_all(self) -> None:
        for unit in (self.root, *self.units):
            unit.reshard()

    @contextlib.contextmanager
    def inference(self):
        """Context for forwards that call the model's own modules (generation, log-probs): the root
        unit's parameters (embeddings, final norm, LM head) are gathered for its duration, the
        blocks gather their own in their forward hooks. A collective on entry; re-entrant."""
        if self._inference_depth == 0:
            self.root.unshard()
        self._inference_depth += 1
        try:
            yield
        finally:
            self._inference_depth -= 1
            if self._inference_depth == 0:
                self._reshard_all()

    @contextlib.contextmanager
    def gathered(self):
        """Context in which every rank holds all parameters (a rollout copy in another dtype is cast
        from them); the whole model is materialised, so only for that copy."""
        for unit in (*self.units, self.root):
            unit.unshard()
        try:
            yield
        finally:
            self._reshard_all()

    # ---------------------------------------------------------------- weights out
    def state_buckets(self, all_ranks: bool = False, cpu: bool = True) -> Iterator[dict[str, torch.Tensor] | None]:
        """The full weights, one transformer block (bucket) at a time, under the model's own names
        (peft's under LoRA: base weights and adapters apart); a collective (every rank must iterate to
        the end). :func:`trajflow.modeling.buckets.by_block` says why no rank then holds more than one
        block's full weights: each tensor is gathered on its own (``full_tensor()``) when its entry is
        reached.

        Args:
            all_ranks: every rank gets the buckets (an engine per rank); else rank 0 gets them and
                the other ranks ``None`` per bucket.
            cpu: hand the tensors over on the CPU (to send them elsewhere); False keeps them on the
                device (a copy on this rank's device is cast from them).
        """
        keep = all_ranks or self.rank == 0

        def produce(t: torch.Tensor):
            @torch.no_grad()
            def gather():
                full = _full(t.detach())
                return (full.cpu() if cpu else full) if keep else None
            return gather

        yield from by_block(((name, produce(t)) for name, t in self.model.state_dict().items()), keep)

    def merged_buckets(self, all_ranks: bool = False) -> Iterator[dict[str, torch.Tensor] | None]:
        """Under LoRA: the merged weights ``W + s B A`` under the base model's names, one transformer
        block at a time (:func:`trajflow.modeling.lora.merged_buckets`), as CPU tensors on rank 0 (every
        rank with ``all_ranks``), ``None`` per bucket elsewhere; a collective."""
        from trajflow.modeling import lora

        yield from lora.merged_buckets(self.model, keep=all_ranks or self.rank == 0)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on CPU on rank 0 (``None`` elsewhere); a collective, gathered
        one block at a time (:meth:`state_buckets`)."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.state_buckets():
            if bucket:
                out.update(bucket)
        return out if self.rank == 0 else None

    # ---------------------------------------------------------------- checkpoints
    def _saved_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters a checkpoint holds: all of them, or the adapters alone under LoRA."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad or not self.frozen_base]

    def save(self, directory: str | Path, state: dict) -> None:
        """Sharded checkpoint: ``fsdp_rank<r>.{safetensors,json}`` per rank (its parameter shards,
        AdamW state shards, RNG states) and ``actor_state.{safetensors,json}`` from rank 0 (``state``
        plus the mesh and every saved parameter's global shape: the index a loader checks against).
        Every rank must call it; all ranks must see the same filesystem."""
        import torch.distributed as dist

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        params = self._saved_parameters()
        optim = self.optimizer.state_dict()
        optim["state"] = {i: {k: _local(v) for k, v in s.items()} for i, s in optim["state"].items()}
        save_state({"model": {n: _local(p.detach()) for n, p in params}, "optimizer": optim, "rng": rng_state()},
                   d, f"fsdp_rank{self.rank:05d}")
        if self.rank == 0:
            save_state({**state, "format": FORMAT, "world_size": self.world_size, "mesh": list(self.mesh.shape),
                        "lora_only": self.frozen_base,
                        "parameters": {n: list(p.shape) for n, p in params}}, d, self.state_name)
        dist.barrier()

    def load(self, directory: str | Path) -> dict:
        """Restore a checkpoint written by :meth:`save` on the same mesh; returns its ``state``.

        Raises:
            RuntimeError: the checkpoint is not an FSDP2 one, has another mesh, or its parameters
                (names, shapes) are not this model's.
        """
        from torch.distributed.tensor import DTensor

        d = Path(directory)
        state = load_state(d, self.state_name)
        if state.get("format") != FORMAT:
            raise RuntimeError(f"{d} holds a {state.get('format', 'single-process')} checkpoint; "
                               f"strategy=fsdp2 cannot load it (resume with the run's own strategy)")
        if int(state["world_size"]) != self.world_size or list(state["mesh"]) != list(self.mesh.shape):
            raise RuntimeError(f"{d} was saved by FSDP2 ranks on a mesh {state['mesh']}; this run's mesh is "
                               f"{list(self.mesh.shape)} (resume with the same world size and fsdp.fsdp_size)")
        params = self._saved_parameters()
        expected = {n: list(p.shape) for n, p in params}
        if state["parameters"] != expected:
            saved = state["parameters"]
            diff = sorted(k for k in set(expected) | set(saved) if expected.get(k) != saved.get(k))[:3]
            raise RuntimeError(f"{d}: the saved parameters do not match the model (first differences: {diff})")
        mine = load_state(d, f"fsdp_rank{self.rank:05d}")
        with torch.no_grad():
            for n, p in params:
                local, saved = _local(p), mine["model"][n]
                if tuple(saved.shape) != tuple(local.shape):
                    raise RuntimeError(f"{d}: shard of {n} on rank {self.rank} is {tuple(saved.shape)}, "
                                       f"expected {tuple(local.shape)}")
                local.copy_(saved)
        optim = mine["optimizer"]
        ids = [i for g in optim["param_groups"] for i in g["params"]]
        by_id = dict(zip(ids, self.trainable))
        for i, s in optim["state"].items():
            p = by_id[int(i)]
            if isinstance(p, DTensor):
                s.update({k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                stride=p.stride())
                          for k, v in s.items() if v.dim() > 0})
        self.optimizer.load_state_dict(optim)
        set_rng_state(mine["rng"])
        return state
