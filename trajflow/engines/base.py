"""The rollout-engine contract: token ids in; token ids, per-token log-probs and finish reasons out.

An engine is what samples responses for the policy worker (``rollout.engine``, see
:mod:`trajflow.engines.registry`): the Hugging Face engine generates with the policy's own module,
the vLLM engine runs a vLLM instance on this rank's GPU, the remote engine sends prompts to separate
rollout workers (``rollout.pool``). Everything the policy worker does with an engine is a method of
:class:`RolloutEngine` or one of its declared class attributes; nothing is probed with ``hasattr``.

What an engine declares:

- :attr:`RolloutEngine.weight_sync`: how it receives new policy weights, as :class:`WeightSync`
  capabilities in order of preference. The policy worker picks one, once, when it builds or attaches
  the engine (:func:`choose_weight_sync`), and after every update calls only that one's method.
- :attr:`RolloutEngine.logprob_kind`: what its log-probs are (:class:`LogprobKind`).
- :meth:`RolloutEngine.sleep` / :meth:`RolloutEngine.wake_up`: release and restore what it holds in
  device memory around the phases that need that memory (no-ops for an engine that holds nothing).
"""

from __future__ import annotations

import abc
import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Iterable, Mapping, Sequence

from trajflow.stages.rollout import SamplingParams


class WeightSync(str, enum.Enum):
    """How an engine gets the policy's weights after an update (a declared capability).

    Attributes:
        SHARED: the engine samples from the trained module itself, in this process: nothing travels.
            After an update the worker calls :meth:`RolloutEngine.refresh`, so an engine that keeps
            a cast copy re-casts it.
        FULL: :meth:`RolloutEngine.update_weights` with every tensor, Hugging Face names (the merged
            weights under LoRA).
        ADAPTER: :meth:`RolloutEngine.update_adapter` with the LoRA adapter's tensors only (the
            engine serves the frozen base plus the adapter); chosen only when the policy has LoRA.
        PATH: :meth:`RolloutEngine.load_weights_from_path` with a Hugging Face directory the worker
            has just written (an engine that can only reload from disk).
    """

    SHARED = "shared"
    FULL = "full"
    ADAPTER = "adapter"
    PATH = "path"


class LogprobKind(str, enum.Enum):
    """What the per-token log-probs of :meth:`RolloutEngine.generate` are.

    Attributes:
        RAW: ``log softmax(logits / T)[token]`` of the raw logits at the sampling temperature ``T``,
            before top-k / top-p: exactly what the trainer recomputes teacher-forced, so a fully
            on-policy first PPO step has ratio 1 whatever the filter (the HF engine).
        PROCESSED: the log-prob under the distribution sampling drew from, after top-k / top-p
            renormalisation (as vLLM's ``logprobs_mode="processed_logprobs"``); equal to RAW when
            ``top_k = 0`` and ``top_p = 1``, larger otherwise (the filtered mass is removed). An
            engine that can only report these may instead return ``None`` under a filter (the vLLM
            engine does): the worker then recomputes RAW ones teacher-forced.
    """

    RAW = "raw"
    PROCESSED = "processed"


@dataclass
class GenerationOutput:
    """Responses for ``len(prompt_ids) * n`` rows, ordered prompt-major (prompt 0's n samples first).

    Attributes:
        response_ids: one list of token ids per row, cut after the first EOS (EOS included).
        finish_reason: ``"stop"`` (ended with an EOS) or ``"length"`` (cut at ``max_new_tokens``) per row.
        rollout_logprobs: the behaviour policy's log-prob of each response token (float, one per entry
            of ``response_ids``; see :attr:`RolloutEngine.logprob_kind` for which kind), or ``None`` (greedy
            decoding, or an engine that reports none: the worker then recomputes them teacher-forced).
        stats: engine-specific numbers (decode steps, the versions of remote engines, ...).
    """

    response_ids: list[list[int]]
    finish_reason: list[str]
    rollout_logprobs: list[list[float]] | None = None
    stats: dict = field(default_factory=dict)


class RolloutEngine(abc.ABC):
    """What a rollout engine provides. Subclass it, declare the class attributes, implement
    :meth:`generate` and the method of each :class:`WeightSync` capability you declare, and register
    a builder in :mod:`trajflow.engines.registry`.

    Attributes:
        weight_sync: the capabilities, most preferred first (:func:`choose_weight_sync` picks one).
        logprob_kind: what :meth:`generate`'s log-probs are.
        weights_from_rank0: with data-parallel policy ranks, True: one copy of the weights, sent by
            rank 0 (gathered there layer by layer under ZeRO-3), serves every rank's engine (engines
            on separate rollout workers); False: each rank's engine is fed the full weights by its rank.
    """

    weight_sync: ClassVar[tuple[WeightSync, ...]] = ()
    logprob_kind: ClassVar[LogprobKind] = LogprobKind.RAW
    weights_from_rank0: ClassVar[bool] = False

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Sample ``params.n`` responses per prompt.

        Args:
            prompt_ids: token ids of each prompt (the rendered chat template included).
            params: sampling settings; ``params.greedy`` (temperature 0) means argmax decoding, and
                then no log-probs are expected. The samples must be a function of the prompts, the
                weights and ``params.seed``.

        Returns:
            :class:`GenerationOutput`, ``len(prompt_ids) * params.n`` rows, prompt-major.
        """

    # ------------------------------------------------------------ weight updates (declared above)
    def refresh(self, gathered: Callable[[], ContextManager] = contextlib.nullcontext,
                buckets: Callable[[], Iterable[Mapping[str, Any]]] | None = None) -> None:
        """:attr:`WeightSync.SHARED`: the trained module changed; re-read it (re-cast a copy held in
        another dtype) inside ``gathered()``, in which the module's parameters are whole (ZeRO-3
        shards them; entering it is a collective, so enter it only to read them). Where the trained
        module can hand its whole weights out one block at a time (FSDP2), ``buckets()`` iterates
        them (``{name: tensor}`` each, a collective: iterate to the end) and is read instead, so the
        whole model is never gathered at once. The default does nothing: the engine samples from the
        module itself."""

    def update_weights(self, named_tensors: Mapping[str, Any], version: int | None = None) -> None:
        """:attr:`WeightSync.FULL`: load ``{name: tensor}`` (Hugging Face names, any device).

        Args:
            named_tensors: the full state (under LoRA: the merged weights).
            version: the policy version they are (an engine that records versions keeps it).
        """
        raise NotImplementedError(f"{type(self).__name__} does not declare WeightSync.FULL")

    def update_adapter(self, adapter: Mapping[str, Any], peft_config: Any, version: int) -> None:
        """:attr:`WeightSync.ADAPTER`: serve the LoRA adapter ``adapter`` (peft's tensor names) with
        ``peft_config`` (a ``peft.LoraConfig``) from now on; ``version`` is the policy version."""
        raise NotImplementedError(f"{type(self).__name__} does not declare WeightSync.ADAPTER")

    def load_weights_from_path(self, path: str, version: int | None = None) -> None:
        """:attr:`WeightSync.PATH`: reload the weights from the Hugging Face directory ``path``."""
        raise NotImplementedError(f"{type(self).__name__} does not declare WeightSync.PATH")

    # ------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Release what the engine holds in device memory (weights, KV cache, a cast copy) until
        :meth:`wake_up`; called after every generation call and before every update. Idempotent."""

    def wake_up(self, gathered: Callable[[], ContextManager] = contextlib.nullcontext,
                buckets: Callable[[], Iterable[Mapping[str, Any]]] | None = None) -> None:
        """Restore what :meth:`sleep` released; called before every generation call. Idempotent.
        ``gathered`` and ``buckets`` as in :meth:`refresh` (for an engine that restores from the
        trained module)."""

    def on_sharded_module(self, world_size: int) -> None:
        """The trained module's parameters are sharded across ``world_size`` data-parallel ranks
        (ZeRO-3): an engine that reads them in place must run every forward on every rank together.
        The default does nothing (the engine holds its own weights)."""


class EngineError(RuntimeError):
    """An engine cannot serve this run (no declared weight-sync capability fits)."""


def choose_weight_sync(engine: RolloutEngine, lora: bool) -> WeightSync:
    """The one way the policy worker will send weights to ``engine``, chosen once.

    Under LoRA the adapter alone travels when the engine can serve one; otherwise the engine's
    first declared capability among SHARED, FULL and PATH (FULL and PATH then carry the merged
    weights).

    Raises:
        EngineError: the engine declares no usable capability.
    """
    caps = tuple(engine.weight_sync)
    if lora and WeightSync.ADAPTER in caps:
        return WeightSync.ADAPTER
    for cap in caps:
        if cap is not WeightSync.ADAPTER:
            return cap
    raise EngineError(f"{type(engine).__name__} declares no weight sync this policy can use "
                      f"(declared: {[c.value for c in caps]}, lora={lora})")
