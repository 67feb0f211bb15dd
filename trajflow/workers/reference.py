"""The reference-policy worker: a frozen copy of the initial policy that serves log-probs for KL.

Only created when a KL term is on (``actor.kl_loss_coef > 0`` or ``algorithm.use_kl_in_reward``),
so runs without KL never load a second model.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from trajflow.models import load_causal_lm, load_tokenizer
from trajflow.modeling.forward import compute_log_probs
from trajflow.workers.group import dispatch
from trajflow.workers.policy import set_threads


class ReferenceWorker:
    """Frozen reference policy (a Ray actor in the pipeline).

    Args:
        model_path: resolved Hugging Face directory of the reference model.
        model_cfg: the ``model`` config section as a dict.
        micro_batch_size: rows per forward pass.
        device: torch device.
        num_threads: torch threads (0 = all CPUs).
    """

    def __init__(self, model_path: str, model_cfg: dict, micro_batch_size: int, device: str = "cpu",
                 num_threads: int = 0) -> None:
        from trajflow.resources import require_device

        require_device(device, "this Ray worker's node")
        set_threads(num_threads)
        self.model = load_causal_lm(model_path, model_cfg.get("dtype", "float32"), device,
                                    model_cfg.get("attn_implementation", "sdpa"))
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.pad_id = int(load_tokenizer(model_path).pad_token_id)
        self.micro_batch_size = micro_batch_size
        self.device = device

    @dispatch("rank0")
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    @dispatch("rank0")
    def pid(self) -> int:
        return os.getpid()

    @dispatch("split", split_args=("prompt_ids", "response_ids"))
    def compute_ref_log_prob(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                             temperature: float) -> list[np.ndarray]:
        """Per-token log-probs of each response under the reference policy, float32 ragged."""
        logp, _ = compute_log_probs(self.model, prompt_ids, response_ids, temperature=temperature,
                                    micro_batch_size=self.micro_batch_size, pad_id=self.pad_id,
                                    device=self.device)
        return logp
