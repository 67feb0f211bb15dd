"""Rollout workers on their own resource pool (``rollout.pool``), and the policy's handle to them.

With ``rollout.pool`` set, a group of :class:`RolloutWorker` actors (one per slot of that pool)
holds the engines instead of the policy workers: each policy rank sends its prompts to its own
engines through :class:`RemoteRolloutEngine`, and rank 0 pushes the new weights to every engine
after each update. Old log-probs are still computed by the policy itself, so the importance ratio
of the first PPO step stays exactly 1.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from stages.rollout import Generation, SamplingParams
from trajflow.config import ModelConfig, RolloutConfig
from trajflow.engines.base import GenerationOutput
from trajflow.workers.base import Worker
from trajflow.workers.group import dispatch


class RolloutWorker(Worker):
    """A rollout engine in its own Ray actor: the ``hf`` engine on a copy of the policy, or vLLM.

    Args:
        model_path: resolved Hugging Face directory of the initial policy.
        rollout: the ``rollout`` config section (``engine``, ``micro_batch_size``, ...).
        model_cfg: the ``model`` config section.
        seed: torch/numpy/random seed (and the vLLM engine's).
        device: torch device (``trainer.device``).
        num_threads: torch threads (0 = all CPUs).
    """

    def __init__(self, model_path: str, rollout: RolloutConfig, model_cfg: ModelConfig, seed: int,
                 device: str = "cpu", num_threads: int = 0) -> None:
        from trajflow.models import eos_token_ids, load_causal_lm, load_tokenizer

        self._start(device, num_threads, seed)
        self.tokenizer = load_tokenizer(model_path)
        self.prompt_format = model_cfg.prompt_format
        self.version = 0
        if rollout.engine == "vllm":
            from transformers import GenerationConfig

            from trajflow.engines.vllm import VLLMRolloutEngine

            try:
                gen_cfg = GenerationConfig.from_pretrained(model_path)
            except Exception:  # no generation_config.json
                gen_cfg = None
            eos = eos_token_ids(self.tokenizer, gen_cfg, model_cfg.prompt_format)
            self.engine: Any = VLLMRolloutEngine(model_path, rollout, model_cfg, eos, seed=seed, colocated=False)
            self.model = None
        else:
            from trajflow.engines.hf import HFRolloutEngine

            # The sampler's own copy in rollout.dtype; update_weights casts the policy's weights into it.
            self.model = load_causal_lm(model_path, str(getattr(rollout, "dtype", model_cfg.dtype)), device,
                                        model_cfg.attn_implementation)
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
            eos = eos_token_ids(self.tokenizer, getattr(self.model, "generation_config", None),
                                model_cfg.prompt_format)
            self.engine = HFRolloutEngine(self.model, int(self.tokenizer.pad_token_id), eos, rollout.micro_batch_size,
                                          device, continuous_batching=bool(getattr(rollout, "continuous_batching", True)))

    @dispatch("split", split_args=("prompt_ids",))
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generation:
        """Sample ``params.n`` responses per prompt (prompt-major).

        Returns:
            :class:`~stages.rollout.Generation` with the engine's log-probs as ``rollout_logprobs``
            (``None`` for greedy decoding), this engine's weight version as ``policy_version`` and
            ``timing_s/gen``.
        """
        t0 = time.perf_counter()
        out = self.engine.generate(prompt_ids, params)
        timing = {"timing_s/gen": time.perf_counter() - t0}
        return Generation(response_ids=out.response_ids,
                          response_text=self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True),
                          finish_reason=out.finish_reason, rollout_logprobs=None if params.greedy else out.logprobs,
                          policy_version=self.version, timing=timing)

    @dispatch("rank0")
    def tokenize_prompts(self, messages_list: list[list[dict]], max_prompt_length: int) -> list[list[int]]:
        """Prompt token ids as the policy renders them (:func:`trajflow.workers.policy.build_prompt_ids`):
        an overlapped rollout tokenizes here, not on the policy workers, which are training."""
        from trajflow.workers.policy import build_prompt_ids

        return build_prompt_ids(self.tokenizer, messages_list, max_prompt_length, self.prompt_format)

    @dispatch("broadcast")
    def update_weights(self, state: dict, version: int | None = None) -> int:
        """Load the policy's new weights ``{name: tensor}``; returns this engine's weight version.

        Args:
            state: the weights.
            version: the policy version they are (recorded as ``policy_version`` by what this engine
                generates); None counts the pushes instead.
        """
        self.engine.update_weights(state)
        self.version = self.version + 1 if version is None else int(version)
        return self.version

    @dispatch("broadcast")
    def weights_digest(self) -> str:
        """sha256 over the ``hf`` engine's parameters (tests)."""
        from trajflow.checkpoint import state_digest

        return state_digest(self.model.state_dict())


class RemoteRolloutEngine:
    """The :class:`~trajflow.engines.base.RolloutEngine` of a policy rank whose engines are rollout workers.

    Args:
        handles: the rollout workers this rank generates on (its prompts are cut evenly across them).
        push_to: the rollout workers this rank sends weights to (all of them on rank 0, none elsewhere).
    """

    rank0_push = True
    colocated = False

    def __init__(self, handles: Sequence[Any], push_to: Sequence[Any] = ()) -> None:
        self.handles = list(handles)
        self.push_to = list(push_to)

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
                                finish_reason=[f for o in outs for f in o.finish_reason], logprobs=logprobs,
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
