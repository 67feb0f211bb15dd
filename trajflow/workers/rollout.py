"""Rollout workers on their own resource pool (``rollout.pool``), and the policy's handle to them.

With ``rollout.pool`` set, a group of :class:`RolloutWorker` actors (one per slot of that pool)
holds the engines instead of the policy workers: each policy rank sends its prompts to its own
engines through :class:`trajflow.engines.remote.RemoteRolloutEngine`, and rank 0 pushes the new weights to every engine
after each update. Old log-probs are still computed by the policy itself, so the importance ratio
of the first PPO step stays exactly 1.
"""

from __future__ import annotations

import time

from trajflow.stages.rollout import Generation, SamplingParams
from trajflow.config import ModelConfig, RolloutConfig
from trajflow.engines.base import RolloutEngine
from trajflow.engines.registry import EngineContext, engine_spec, make_engine
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
        spec = engine_spec(rollout.engine)
        self.model = None
        if spec.shares_module:
            # The sampler's own copy in rollout.dtype; update_weights casts the policy's weights into it.
            self.model = load_causal_lm(model_path, str(getattr(rollout, "dtype", model_cfg.dtype)), device,
                                        model_cfg.attn_implementation)
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
            gen_cfg = getattr(self.model, "generation_config", None)
        else:
            from transformers import GenerationConfig

            try:
                gen_cfg = GenerationConfig.from_pretrained(model_path)
            except Exception:  # no generation_config.json
                gen_cfg = None
        eos = eos_token_ids(self.tokenizer, gen_cfg, model_cfg.prompt_format)
        # Not colocated with training, and fed merged full weights by the policy's rank 0 (no adapter).
        self.engine: RolloutEngine = make_engine(rollout.engine, EngineContext(
            model_path, self.model, int(self.tokenizer.pad_token_id), eos, rollout, model_cfg, device, seed,
            colocated=False))

    @dispatch("split", split_args=("prompt_ids",))
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generation:
        """Sample ``params.n`` responses per prompt (prompt-major).

        Returns:
            :class:`~trajflow.stages.rollout.Generation` with the engine's log-probs as ``rollout_logprobs``
            (``None`` for greedy decoding), this engine's weight version as ``policy_version`` and
            ``timing_s/gen``.
        """
        t0 = time.perf_counter()
        out = self.engine.generate(prompt_ids, params)
        timing = {"timing_s/gen": time.perf_counter() - t0}
        return Generation(response_ids=out.response_ids,
                          response_text=self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True),
                          finish_reason=out.finish_reason, rollout_logprobs=None if params.greedy else out.rollout_logprobs,
                          policy_version=self.version, timing=timing)

    @dispatch("rank0")
    def tokenize_prompts(self, messages_list: list[list[dict]], max_prompt_length: int) -> list[list[int]]:
        """Prompt token ids as the policy renders them (:func:`trajflow.models.build_prompt_ids`):
        an overlapped rollout tokenizes here, not on the policy workers, which are training."""
        from trajflow.models import build_prompt_ids

        return build_prompt_ids(self.tokenizer, messages_list, max_prompt_length, self.prompt_format)

    @dispatch("rank0")
    def detokenize(self, response_ids: list[list[int]]) -> list[str]:
        """Responses as text without special tokens (a partial rollout's rows, decoded once they end)."""
        return self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)

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
