"""The rollout-engine interface: prompts in, sampled responses out.

Engines are swappable behind :class:`RolloutEngine`: the Hugging Face engine generates with the
policy's own module (CPU or GPU, weights shared in-process, nothing to sync); the vLLM engine runs a
separate vLLM instance on GPUs and receives the policy's weights after every update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from stages.rollout import SamplingParams


@dataclass
class GenerationOutput:
    """Responses for ``len(prompt_ids) * n`` rows, ordered prompt-major (prompt 0's n samples first).

    Attributes:
        response_ids: one list of token ids per row, cut after the first EOS (EOS included).
        finish_reason: ``"stop"`` or ``"length"`` per row.
        logprobs: per-token log-probs reported by the engine (same temperature), or ``None``.
    """

    response_ids: list[list[int]]
    finish_reason: list[str]
    logprobs: list[list[float]] | None = None
    stats: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    """What a rollout engine provides."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Sample ``params.n`` responses per prompt."""
        ...

    def update_weights(self, named_tensors) -> None:
        """Load new policy weights (no-op when the engine shares the policy's module)."""
        ...
