"""The rollout engines by name (``rollout.engine``): one builder each, used by the policy worker and
by the separate rollout workers alike.

Adding an engine: subclass :class:`trajflow.engines.base.RolloutEngine` and register a builder here
with :func:`register_engine` (docs/architecture.md, "Adding a rollout engine").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from trajflow.engines.base import RolloutEngine
from trajflow.engines.hf import HFRolloutEngine


@dataclass(frozen=True)
class EngineContext:
    """What a process offers the engine it builds.

    Attributes:
        model_path: the resolved Hugging Face directory of the initial policy.
        model: the module to sample from for engines that share one (``EngineSpec.shares_module``):
            the trained policy in a policy worker, a copy in ``rollout.dtype`` in a rollout worker;
            None for engines that load their own weights.
        pad_id: the tokenizer's pad id.
        eos_ids: ids that end a response.
        rollout: the ``rollout`` config section.
        model_cfg: the ``model`` config section.
        device: ``cpu``, ``cuda`` or ``npu``.
        seed: the process's seed.
        dtype: the sampler's dtype when it may differ from ``model``'s (``rollout.dtype``), else None.
        colocated: the engine shares its device with training (it sleeps between rollouts).
        lora_rank: > 0: the policy trains a LoRA adapter the engine may serve as such.
    """

    model_path: str
    model: Any
    pad_id: int
    eos_ids: Sequence[int]
    rollout: Any
    model_cfg: Any
    device: str = "cpu"
    seed: int = 0
    dtype: str | None = None
    colocated: bool = True
    lora_rank: int = 0


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine.

    Attributes:
        build: ``EngineContext -> RolloutEngine``.
        shares_module: the engine samples from a torch module the process holds (``EngineContext.model``).
    """

    build: Callable[[EngineContext], RolloutEngine]
    shares_module: bool = False


#: ``rollout.engine`` -> its spec.
ENGINES: dict[str, EngineSpec] = {}


def register_engine(name: str, *, shares_module: bool = False) -> Callable:
    """Decorator: register ``build(ctx) -> RolloutEngine`` as the engine ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    def deco(build: Callable[[EngineContext], RolloutEngine]) -> Callable[[EngineContext], RolloutEngine]:
        if name in ENGINES:
            raise ValueError(f"rollout engine {name!r} is already registered")
        ENGINES[name] = EngineSpec(build, shares_module)
        return build
    return deco


def engine_spec(name: str) -> EngineSpec:
    """The registered engine ``name``.

    Raises:
        ValueError: no engine of that name (the message lists the registered ones).
    """
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"rollout.engine={name!r} is not a registered engine; choose one of "
                         f"{', '.join(sorted(ENGINES))}") from None


def make_engine(name: str, ctx: EngineContext) -> RolloutEngine:
    """Build the engine ``name`` (``rollout.engine``) for ``ctx``.

    Raises:
        ValueError: unknown engine; whatever the engine's builder raises (e.g.
            :class:`trajflow.errors.DeviceError` for vLLM without a GPU).
    """
    return engine_spec(name).build(ctx)


@register_engine("hf", shares_module=True)
def _hf(ctx: EngineContext) -> RolloutEngine:
    """Hugging Face sampling on the process's module (:class:`trajflow.engines.hf.HFRolloutEngine`)."""
    return HFRolloutEngine(ctx.model, ctx.pad_id, ctx.eos_ids, int(ctx.rollout.micro_batch_size), ctx.device,
                           dtype=ctx.dtype, continuous_batching=bool(getattr(ctx.rollout, "continuous_batching", True)))


@register_engine("vllm")
def _vllm(ctx: EngineContext) -> RolloutEngine:
    """vLLM on this process's GPU (:class:`trajflow.engines.vllm.VLLMRolloutEngine`); vLLM is imported
    only here, when the engine is built."""
    from trajflow.engines.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(ctx.model_path, ctx.rollout, ctx.model_cfg, ctx.eos_ids, seed=ctx.seed,
                             colocated=ctx.colocated, lora_rank=ctx.lora_rank)
