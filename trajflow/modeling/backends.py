"""Training backends of a model worker: one process (torch AdamW) or DeepSpeed data parallel.

The policy worker's update loop (:meth:`trajflow.workers.policy.PolicyWorker.update_actor`) is
written once against the small interface of :class:`LocalBackend` (the default single-process path:
``loss.backward()``, ``clip_grad_norm_``, a step skipped on a non-finite norm) and
:class:`DeepSpeedBackend` (ZeRO stage 0-3 over ``world_size`` ranks; its docstring says why the
result equals the single-process update).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from trajflow.config import ActorConfig
from trajflow.modeling.forward import forward_micro_batch
from trajflow.modeling.lean_mlp import lean_mlp
from trajflow.modeling.lean_norm import lean_norm
from trajflow.modeling.packing import PackedBatch, balanced_partition
from trajflow.modeling.precision import autocast
from trajflow.state_files import load_state, rng_state, save_state, set_rng_state

#: Metrics that are not sums over rows (everything else in an update's metrics adds up across ranks).
NON_ADDITIVE = frozenset({"actor/grad_norm", "actor/kl_coef", "critic/grad_norm"})

_DS_ACCELERATOR = {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}
_DTYPE_KEYS = {"bfloat16": "bf16", "float16": "fp16"}
_DS_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def adamw(params, lr: float, betas: Sequence[float] = (0.9, 0.999), weight_decay: float = 0.0,
          device: str = "cpu") -> torch.optim.AdamW:
    """torch's AdamW (Loshchilov & Hutter 2019), with the fused kernel where torch has one.

    The fused kernel (CPU and CUDA) updates each parameter in one pass instead of the multi-tensor
    path's ~10 elementwise passes: for SmolLM2-135M on 2 CPU cores a step takes ~0.08 s instead of
    0.4-1.1 s. Same formula; results differ from the other paths only by float rounding.
    """
    fused = str(device).split(":")[0] in ("cpu", "cuda")
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                             **({"fused": True} if fused else {}))


class LocalBackend:
    """Single-process training (the default).

    Mixed precision (:mod:`trajflow.modeling.precision`): the parameters, their gradients and the
    AdamW state are whatever dtype the module was loaded in (float32: the master weights); with
    ``param_dtype`` bfloat16 each training forward runs under ``torch.autocast``, so the matmuls
    run in bf16 against bf16 casts of the fp32 weights, autograd returns fp32 gradients to the fp32
    parameters, and the log-probs and losses come out float32. ``float32`` runs no autocast at all.

    Args:
        model: the module being trained.
        optimizer: its torch optimizer.
        param_dtype: compute dtype (``actor.mixed_precision.param_dtype``): float32 or bfloat16.
    """

    distributed = False
    rank = 0
    world_size = 1

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 param_dtype: str = "float32") -> None:
        self.model = model
        self.optimizer = optimizer
        self.param_dtype = param_dtype

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward(self, packed: PackedBatch, temperature: float, compute_entropy: bool = False,
                entropy_grad: bool = False):
        """Training forward of one micro-batch (:func:`~trajflow.modeling.forward.forward_micro_batch`)
        in the compute dtype, gated MLPs through :func:`~trajflow.modeling.lean_mlp.lean_mlp` and RMSNorms
        through :func:`~trajflow.modeling.lean_norm.lean_norm`; returns float32 ``(b, T)`` log-probs
        (and entropy)."""
        device = next(self.model.parameters()).device
        # The gated MLPs keep half of what autograd would save for their backward (lean_mlp), the
        # norms their input alone (lean_norm).
        with autocast(self.param_dtype, device), lean_mlp(self.model), lean_norm(self.model):
            return forward_micro_batch(self.model, packed, temperature, compute_entropy, entropy_grad=entropy_grad)

    def micro_batches(self, mini: Sequence[int], split: Callable[[list[int]], list[list[int]]],
                      weights: Sequence[float]) -> list[tuple[list[int], bool]]:
        """``(rows, live)`` per micro-batch: all rows of the mini-batch, in order, cut by ``split``
        (row ids -> micro-batches of consecutive row ids)."""
        return [(rows, True) for rows in split([int(r) for r in mini])]

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, grad_clip: float) -> tuple[float, bool]:
        """Clip, then step unless the gradient norm is not finite; returns ``(grad_norm, stepped)``.

        Clipping is ``clip_grad_norm_``'s (Pascanu et al. 2013): gradients times
        ``min(1, grad_clip / (norm + 1e-6))``. With a fused AdamW the factor is handed to the
        optimizer as the divisor it already applies to every gradient it reads (``grad_scale``, the
        hook ``torch.amp.GradScaler`` uses), which saves a read and a write of all gradients.
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        gn = float(torch.nn.utils.get_total_norm(grads))
        if not math.isfinite(gn):
            return gn, False
        coef = grad_clip / (gn + 1e-6)
        if grad_clip > 0 and coef < 1.0:
            if getattr(self.optimizer, "_step_supports_amp_scaling", False):
                self.optimizer.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32, device=grads[0].device)
            else:
                torch.nn.utils.clip_grads_with_norm_(params, grad_clip, torch.tensor(gn))
        try:
            self.optimizer.step()
        finally:
            self.optimizer.__dict__.pop("grad_scale", None)
        return gn, True

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Every parameter group's learning rate (the schedule's value for this update)."""
        for g in self.optimizer.param_groups:
            g["lr"] = float(lr)

    def reduce_metrics(self, sums: dict[str, float], maxima: dict[str, float],
                       means: dict[str, list[float]] | None = None) -> dict[str, float]:
        """The update's metrics (one process: nothing to combine); ``means`` lists are averaged."""
        out = {**sums, **maxima}
        out.update({k: float(np.mean(v)) for k, v in (means or {}).items() if len(v)})
        return out

    def gathered(self):
        import contextlib

        return contextlib.nullcontext()

    def inference(self):
        """Context for forwards outside the training step (generation, log-probs): nothing to do here."""
        import contextlib

        return contextlib.nullcontext()

    def gather_rows(self, rows: dict) -> dict:
        """Per-row values keyed by row id, from every rank (one process: the same dict)."""
        return rows

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


# --------------------------------------------------------------------------------------------
# DeepSpeed


def setup_rank_env(master_addr: str, master_port: int, rank: int, world_size: int, device: str) -> None:
    """The environment torch.distributed / DeepSpeed read for an env:// rendezvous.

    ``LOCAL_RANK`` is 0: Ray gives each actor its own device (``CUDA_VISIBLE_DEVICES`` /
    ``ASCEND_RT_VISIBLE_DEVICES`` hold one id), so device 0 is this rank's device.
    """
    os.environ.update({"MASTER_ADDR": str(master_addr), "MASTER_PORT": str(master_port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "DS_ACCELERATOR": _DS_ACCELERATOR[device]})


def join_process_group(backend: str, rank: int, world_size: int, timeout_s: float = 1800.0) -> None:
    """Join the ranks' torch.distributed group through a TCPStore that rank 0 serves on ``MASTER_ADDR`` only.

    torch's env:// rendezvous binds its store on every interface (``:::MASTER_PORT``), so a local
    run exposed it to the network though Ray and the driver listen on loopback. Rank 0 binds the
    socket itself and hands it to the store (``master_listen_fd``); the other ranks connect as
    before. ``deepspeed.init_distributed`` then finds the group already initialised and keeps it.
    Reads the variables :func:`setup_rank_env` set.
    """
    import datetime
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(max(128, world_size))
        store = dist.TCPStore(addr, port, world_size, True, timeout, master_listen_fd=sock.detach())
    else:
        store = dist.TCPStore(addr, port, world_size, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def weights_only_checkpoint_engine(engine: Any) -> Any:
    """DeepSpeed's checkpoint engine, reading its ``.pt`` shards with ``torch.load(weights_only=True)``.

    DeepSpeed 0.19's ``TorchCheckpointEngine.load`` unpickles with ``weights_only=False``: a tampered
    shard in a run folder would run code on resume. Only tensors, containers and the few plain
    DeepSpeed classes its checkpoints hold (:data:`DEEPSPEED_SAFE_GLOBALS`) are accepted now; any
    other object fails the load with torch's ``UnpicklingError`` naming it.

    Args:
        engine: the engine ``deepspeed.initialize`` configured (a ``TorchCheckpointEngine``).

    Returns:
        The same engine with its ``load`` replaced, or ``engine`` unchanged when it is another kind
        (e.g. a decoupled or Nebula engine), which trajflow does not configure.
    """
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if type(engine) is not TorchCheckpointEngine:
        return engine

    def load(path: str, map_location=None):
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)

    engine.load = load
    return engine


def deepspeed_safe_globals() -> list:
    """The non-tensor classes DeepSpeed's own checkpoints contain: loss scalers, the ZeRO stage enum,
    and ZeRO-1/2's record of where each parameter sits in the flat optimizer partition."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _skip_cpu_op_builds() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory all-reduce op on CPU (~40 s).

    ``deepspeed.comm`` builds ``deepspeed_shm_comm`` when ``deepspeed.ops.__compatible_ops__``
    says it is buildable (DeepSpeed 0.19: probed lazily and cached in that module attribute,
    which the probe's comment says stays editable). Marking it unavailable makes DeepSpeed use
    plain torch.distributed (gloo) collectives; the op only speeds up inference all-reduce.
    """
    import deepspeed.ops

    ops = deepspeed.ops.__dict__.get("__compatible_ops__")
    if ops is None:
        ops = {}
        deepspeed.ops.__compatible_ops__ = ops  # type: ignore[attr-defined]
    ops["deepspeed_shm_comm"] = False


def deepspeed_config(actor: ActorConfig, world_size: int) -> dict:
    """The DeepSpeed config built from the ``actor`` section.

    The precision policy maps onto DeepSpeed's own mixed precision, which keeps fp32 master weights
    and optimizer state itself: ``actor.mixed_precision.param_dtype`` bfloat16 -> ``bf16.enabled``,
    float16 -> ``fp16.enabled`` with dynamic loss scaling (``loss_scale: 0``; Micikevicius et al.
    2018, sec. 3.2), float32 -> neither; ``reduce_dtype`` -> ``communication_data_type`` (the dtype
    gradients are all-reduced in).

    Args:
        actor: ``actor`` config section (``lr``, ``betas``, ``weight_decay``, ``grad_clip``,
            ``ppo_micro_batch_size``, ``zero_stage``, ``mixed_precision``).
        world_size: data-parallel ranks.

    Returns:
        A dict for ``deepspeed.initialize(config=...)``.
    """
    micro = int(actor.ppo_micro_batch_size)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * world_size,
        # The update loop owns accumulation: backward per micro-batch, step per mini-batch.
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(actor.grad_clip),
        "optimizer": {"type": "AdamW", "params": {
            "lr": float(actor.lr), "betas": [float(b) for b in actor.betas],
            "eps": 1e-8, "weight_decay": float(actor.weight_decay),
            # torch.optim.AdamW: the single-process path's optimizer, and no fused_adam build.
            "torch_adam": True}},
        "zero_optimization": {"stage": int(actor.zero_stage)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if int(actor.zero_stage) == 3:
        cfg["zero_optimization"].update({"stage3_gather_16bit_weights_on_model_save": True})
    mp = getattr(actor, "mixed_precision", None)
    dtype = str(mp.param_dtype) if mp is not None else "float32"
    if dtype in _DTYPE_KEYS:
        cfg[_DTYPE_KEYS[dtype]] = {"enabled": True}
        if dtype == "float16":
            cfg["fp16"].update({"loss_scale": 0, "initial_scale_power": 16})
        cfg["communication_data_type"] = _DS_DTYPE_NAMES[str(mp.reduce_dtype)]
    return cfg


class PackedLogProbs(torch.nn.Module):
    """The policy as DeepSpeed sees it: ``forward(packed, temperature, compute_entropy)`` returns
    :func:`~trajflow.modeling.forward.forward_micro_batch`'s log-probs (and entropy).

    DeepSpeed must run every training forward through its engine (``engine(...)``): that is where
    it resets its per-micro-batch gradient bookkeeping (without it ZeRO-3 overwrites instead of
    accumulating the gradients of earlier micro-batches) and where ZeRO-3 starts its parameter
    fetch trace. Wrapping the model keeps the packed, LM-head-only-on-responses forward.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, packed: PackedBatch, temperature: float, compute_entropy: bool = False,
                entropy_grad: bool = False):
        return forward_micro_batch(self.model, packed, temperature, compute_entropy, entropy_grad=entropy_grad)


class DataParallel:
    """What the data-parallel backends (:class:`DeepSpeedBackend`, :class:`trajflow.modeling.fsdp.FSDP2Backend`)
    share: this rank's micro-batches of a mini-batch and the combination of the ranks' metrics and rows.

    Attributes:
        rank: this rank.
        world_size: number of data-parallel ranks.
    """

    distributed = True
    rank: int = 0
    world_size: int = 1

    def inference(self):
        """Context for forwards outside the training step (generation, log-probs); the parameters'
        own hooks gather what they need, so nothing to do by default."""
        import contextlib

        return contextlib.nullcontext()

    def max_over_ranks(self, n: int) -> int:
        """The largest ``n`` any rank passes (an all-reduce every rank must join): the ranks agree on a
        count of forwards, each one a collective when the model is sharded."""
        t = torch.tensor([int(n)], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def micro_batches(self, mini: Sequence[int], split: Callable[[list[int]], list[list[int]]],
                      weights: Sequence[float]) -> list[tuple[list[int], bool]]:
        """This rank's ``(rows, live)`` micro-batches of a mini-batch; equally many on every rank.

        Args:
            mini: the mini-batch's row ids (all ranks pass the same).
            split: row ids -> micro-batches of consecutive row ids (fixed size or token budget).
            weights: weight (tokens) of each entry of ``mini``.
        """
        parts = balanced_partition(list(weights), self.world_size, equal_size=True)
        # Every rank cuts every rank's share (all see the whole batch), so all agree on the count.
        chunks = [split([int(mini[i]) for i in p]) for p in parts]
        mine = [int(mini[i]) for i in parts[self.rank]]
        count = max(len(c) for c in chunks)
        out = []
        for i in range(count):
            rows = chunks[self.rank][i] if i < len(chunks[self.rank]) else []
            # A rank with fewer rows runs a zero-weighted copy so the collectives line up.
            out.append((rows, True) if rows else ([mine[0] if mine else int(mini[0])], False))
        return out

    def reduce_metrics(self, sums: dict[str, float], maxima: dict[str, float],
                       means: dict[str, list[float]] | None = None) -> dict[str, float]:
        """Combine the ranks' metrics.

        Args:
            sums: per-step sums over this rank's rows (with global denominators they add up across
                ranks), except :data:`NON_ADDITIVE` keys (the same on every rank: rank 0's is kept)
                and ``timing_s/*`` (the slowest rank's).
            maxima: per-rank maxima (the maximum over ranks is kept).
            means: per-rank lists of values; the mean over all ranks' values is kept.
        """
        import torch.distributed as dist

        means = means or {}
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (sums, maxima, means))
        out = dict(sums)
        for key in set().union(*(s for s, _, _ in everyone)):
            values = [s[key] for s, _, _ in everyone if key in s]
            if key.startswith("timing_s/"):
                out[key] = float(max(values))
            elif key not in NON_ADDITIVE:
                out[key] = float(sum(values))
        for key in maxima:
            out[key] = float(max(m[key] for _, m, _ in everyone if key in m))
        for key in means:
            values = [v for _, _, m in everyone for v in m.get(key, [])]
            if values:
                out[key] = float(np.mean(values))
        return out

    def gather_rows(self, rows: dict) -> dict:
        """Per-row values keyed by row id, merged from every rank (a collective)."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, rows)
        merged: dict = {}
        for part in everyone:
            merged.update(part)
        return merged


class DeepSpeedBackend(DataParallel):
    """DeepSpeed ZeRO data parallel over ``world_size`` ranks.

    Exactness with the single-process update rests on three facts:

    1. every rank sees the whole mini-batch and computes the loss denominators over all of it
       (``global_num_tokens`` / ``global_num_seqs`` of :func:`trajflow.stages.policy_update.agg_loss`), then
       takes its own rows (a token-balanced, equal-count cut of the mini-batch); so the ranks'
       losses *sum* to the single-process loss;
    2. DeepSpeed *averages* gradients over ranks, so each rank's loss is multiplied by
       ``world_size``: the reduced gradient equals the single-process gradient (up to float
       summation order);
    3. all ranks run the same number of micro-batches (a rank with fewer rows runs zero-weighted
       copies), because every backward (and, under ZeRO-3, every forward) is a collective.

    Gradient accumulation is caller-owned (``managed_gradient_accumulation: false``): backward per
    micro-batch, one ``engine.step()`` per mini-batch, however many micro-batches it had.

    On CPU the ranks talk over gloo with ``DS_ACCELERATOR=cpu``. DeepSpeed would JIT-compile two
    C++ ops there on first use (~40 s for the shared-memory all-reduce, ~75 s for fused Adam): the
    optimizer is ``torch_adam: true`` (torch's AdamW, the same code the single-process path runs)
    and the shared-memory op is marked unavailable (:func:`_skip_cpu_op_builds`), so gloo carries
    the collectives and nothing compiles at start-up.

    Call from inside an actor after :func:`setup_rank_env`; all ranks construct it together
    (``deepspeed.init_distributed`` and ``deepspeed.initialize`` are collectives).

    Args:
        model: the module (moved to the device already); DeepSpeed wraps it in place.
        actor: the ``actor`` config section.
        device: ``cpu``, ``cuda`` or ``npu``.
        rank: this rank.
        world_size: number of ranks.
    """

    def __init__(self, model: torch.nn.Module, actor: ActorConfig, device: str, rank: int,
                 world_size: int) -> None:
        from trajflow.infra.devices import collective_backend

        if device == "cpu":
            _skip_cpu_op_builds()
        import deepspeed

        join_process_group(collective_backend(device), rank, world_size)
        deepspeed.init_distributed(dist_backend=collective_backend(device), auto_mpi_discovery=False,
                                   rank=rank, world_size=world_size)
        self.rank, self.world_size = rank, world_size
        self.zero_stage = int(actor.zero_stage)
        self.config = deepspeed_config(actor, world_size)
        params = [p for p in model.parameters() if p.requires_grad]
        # LoRA: the frozen base never changes and is reloaded from model.path, so a checkpoint holds
        # the adapters and their optimizer state only.
        self.frozen_base = len(params) < sum(1 for _ in model.parameters())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=PackedLogProbs(model), model_parameters=params,
                                                                 config=self.config)
        self.engine.checkpoint_engine = weights_only_checkpoint_engine(self.engine.checkpoint_engine)
        self.model = model

    # ---------------------------------------------------------------- update
    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def forward(self, packed: PackedBatch, temperature: float, compute_entropy: bool = False,
                entropy_grad: bool = False):
        """Training forward through the DeepSpeed engine (see :class:`PackedLogProbs`)."""
        return self.engine(packed, temperature, compute_entropy, entropy_grad)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages over ranks; the rank losses sum to the full loss, so undo the 1/world.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self, grad_clip: float) -> tuple[float, bool]:
        """Clip and step through the engine; returns ``(grad_norm, stepped)``, the same on every rank.

        DeepSpeed skips a step whose gradient norm is not finite only inside its ZeRO and fp16/bf16
        optimizers. Its plain path (ZeRO-0 in fp32) clips and steps whatever the norm, which wrote NaN
        into every weight, and reports no norm. There the gradients are averaged over the ranks here
        (one flat all-reduce, what ``engine.step`` would do), the norm of the averaged gradient, the
        same on every rank, is taken, and the step is skipped on every rank as the one-process
        backend skips it.
        """
        if not (self.engine.zero_optimization() or self.engine.fp16_enabled() or self.engine.bfloat16_enabled()):
            return self._plain_step()
        skipped = self.engine.skipped_steps
        self.engine.step()
        gn = self.engine.get_global_grad_norm()
        gn = float(gn) if gn is not None else float("nan")
        return gn, self.engine.skipped_steps == skipped

    def _plain_step(self) -> tuple[float, bool]:
        """:meth:`step` on DeepSpeed's plain (ZeRO-0, fp32) path: reduce, check the norm, then step."""
        import torch.distributed as dist

        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        for p in params:  # the same flat layout on every rank, even where a tensor got no gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= self.world_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            del flat
        gn = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if not math.isfinite(gn):
            self.engine.zero_grad()
            return gn, False
        self.engine.enable_backward_allreduce = False  # reduced above: step must not average twice
        try:
            self.engine.step()
        finally:
            self.engine.enable_backward_allreduce = True
        return gn, True

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def set_lr(self, lr: float) -> None:
        """Every parameter group's learning rate (DeepSpeed has no scheduler of its own here)."""
        for g in self.engine.optimizer.param_groups:
            g["lr"] = float(lr)

    # ---------------------------------------------------------------- weights
    def gathered(self):
        """Context in which every rank holds the full parameters (a no-op below ZeRO-3)."""
        import contextlib

        if self.zero_stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on CPU on rank 0 (``None`` on other ranks under ZeRO-3).

        Collective under ZeRO-3 (every rank must call it): DeepSpeed gathers one layer at a time.
        """
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # keys of PackedLogProbs: "model.<name>"
            return None if state is None else {k[len("model."):]: v for k, v in state.items()}
        if self.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory: str | Path, state: dict) -> None:
        """Sharded checkpoint: DeepSpeed's model + optimizer shards, plus this rank's RNG states.

        ``state`` (policy version, step counters) is written by rank 0 to ``actor_state.{json,safetensors}``.
        Every rank must call it, and all ranks must see the same filesystem.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(d / "deepspeed"), tag="latest", save_latest=False,
                                    exclude_frozen_parameters=self.frozen_base)
        save_state(rng_state(), d, f"rng_rank{self.rank:05d}")
        if self.rank == 0:
            save_state({**state, "world_size": self.world_size, "zero_stage": self.zero_stage, "format": "deepspeed"},
                       d, "actor_state")
        import torch.distributed as dist

        dist.barrier()

    def load(self, directory: str | Path) -> dict:
        """Restore a checkpoint written by :meth:`save` with the same ``world_size``; returns its state.

        Raises:
            RuntimeError: the checkpoint is not a DeepSpeed one or has another world size.
        """
        d = Path(directory)
        state = load_state(d, "actor_state")
        if state.get("format") != "deepspeed":
            raise RuntimeError(f"{d} holds a single-process checkpoint; actor.strategy=deepspeed cannot load it")
        if int(state["world_size"]) != self.world_size:
            raise RuntimeError(f"{d} was saved by {state['world_size']} DeepSpeed ranks; actor.world_size is "
                               f"{self.world_size} (resume with the same number of ranks)")
        path, _ = self.engine.load_checkpoint(str(d / "deepspeed"), tag="latest", load_optimizer_states=True,
                                              load_lr_scheduler_states=False,
                                              load_module_strict=not self.frozen_base)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {d / 'deepspeed'}")
        set_rng_state(load_state(d, f"rng_rank{self.rank:05d}"))
        return state
