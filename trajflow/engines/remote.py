"""The engine of a policy rank whose rollouts run on separate rollout workers (``rollout.pool``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from trajflow.stages.rollout import Generation, SamplingParams
from trajflow.engines.base import GenerationOutput, LogprobKind, RolloutEngine, WeightSync


class RemoteRolloutEngine(RolloutEngine):
    """The :class:`~trajflow.engines.base.RolloutEngine` of a policy rank whose engines are rollout workers
    (:class:`trajflow.workers.rollout.RolloutWorker` Ray actors, ``rollout.pool``).

    Contract: FULL weights, sent once by policy rank 0 to every rollout worker (``weights_from_rank0``);
    the log-probs are the remote engines' kind; nothing to sleep (the engines live elsewhere).

    Args:
        handles: the rollout workers this rank generates on (its prompts are cut evenly across them).
        push_to: the rollout workers this rank sends weights to (all of them on rank 0, none elsewhere).
    """

    weight_sync = (WeightSync.FULL,)
    weights_from_rank0 = True

    def __init__(self, handles: Sequence[Any], push_to: Sequence[Any] = (),
                 logprob_kind: LogprobKind = LogprobKind.RAW) -> None:
        self.handles = list(handles)
        self.push_to = list(push_to)
        self.logprob_kind = logprob_kind  # the remote engines' kind

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Prompts cut into contiguous chunks, one per engine; results concatenated (prompt-major)."""
        import ray

        bounds = np.linspace(0, len(prompt_ids), len(self.handles) + 1).astype(int)
        refs = [h.generate.remote([list(p) for p in prompt_ids[a:b]], params)
                for h, a, b in zip(self.handles, bounds[:-1], bounds[1:]) if b > a]
        outs: list[Generation] = ray.get(refs)
        logprobs = None
        if outs and all(o.rollout_logprobs is not None for o in outs):
            logprobs = [lp for o in outs for lp in o.rollout_logprobs]
        return GenerationOutput(response_ids=[r for o in outs for r in o.response_ids],
                                finish_reason=[f for o in outs for f in o.finish_reason], rollout_logprobs=logprobs,
                                stats={"engine_versions": [o.policy_version for o in outs]})

    def update_weights(self, named_tensors: dict, version: int | None = None) -> None:
        """Send ``{name: tensor}`` (moved to CPU) once through the object store to every engine of
        ``push_to``, tagged with its policy ``version``."""
        if not self.push_to:
            return
        import ray

        state = {k: v.detach().cpu() for k, v in named_tensors.items()}
        ref = ray.put(state)
        ray.get([h.update_weights.remote(ref, version) for h in self.push_to])
