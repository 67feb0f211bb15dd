"""The reference-policy worker: a frozen copy of the initial policy that serves log-probs for KL.

Only created when a KL term is on (``actor.kl_loss_coef > 0`` or ``algorithm.use_kl_in_reward``),
so runs without KL never load a second model.
"""

from __future__ import annotations

import numpy as np

from trajflow.config import MixedPrecisionConfig, ModelConfig, RolloutConfig
from trajflow.modeling.forward import compute_log_probs
from trajflow.modeling.precision import cast_buffers
from trajflow.models import load_causal_lm, load_tokenizer
from trajflow.workers.base import Worker
from trajflow.workers.group import dispatch


class ReferenceWorker(Worker):
    """Frozen reference policy (a Ray actor in the pipeline).

    Args:
        model_path: resolved Hugging Face directory of the reference model.
        model_cfg: the ``model`` config section.
        rollout: the ``rollout`` config section: ``temperature`` (the sampling temperature, which
            the KL terms' log-probs use too) and ``log_prob_micro_batch_size`` (rows per forward).
        device: torch device.
        num_threads: torch threads (0 = all CPUs).
        mixed_precision: the ``reference.mixed_precision`` section (compute dtype; default float32).
    """

    def __init__(self, model_path: str, model_cfg: ModelConfig, rollout: RolloutConfig, device: str = "cpu",
                 num_threads: int = 0, mixed_precision: MixedPrecisionConfig | None = None) -> None:
        self._start(device, num_threads)
        mp = mixed_precision or MixedPrecisionConfig()
        # fp32 weights and the same autocast as the actor: the reference's log-probs at step 0
        # equal the actor's bit for bit (bf16-stored weights would round the norms differently).
        self.param_dtype = str(mp.param_dtype)
        self.model = load_causal_lm(model_path, model_cfg.dtype, device, model_cfg.attn_implementation)
        cast_buffers(self.model, str(mp.buffer_dtype))
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.pad_id = int(load_tokenizer(model_path).pad_token_id)
        self.rollout = rollout

    @dispatch("split", split_args=("prompt_ids", "response_ids"))
    def compute_ref_log_prob(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                             temperature: float | None = None) -> list[np.ndarray]:
        """Per-token log-probs of each response under the reference policy at ``temperature`` (the
        rows' sampling temperature, stored with the rollout; None: ``rollout.temperature``), float32 ragged."""
        temperature = self.rollout.temperature if temperature is None else temperature
        logp, _ = compute_log_probs(self.model, prompt_ids, response_ids, temperature=temperature,
                                    micro_batch_size=int(self.rollout.log_prob_micro_batch_size), pad_id=self.pad_id,
                                    device=self.device, param_dtype=self.param_dtype)
        return logp
