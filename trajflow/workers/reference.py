"""The reference-policy worker: a frozen copy of the initial policy that serves log-probs for KL.

Only created when a KL term is on (``actor.kl_loss_coef > 0`` or ``algorithm.use_kl_in_reward``),
so runs without KL never load a second model. With ``reference.strategy=fsdp2`` (verl's ``ref`` role
on FSDP) the workers are ranks of one group, each holding a shard of the frozen model
(:class:`~trajflow.modeling.fsdp.FSDP2Backend` without an optimizer) instead of a whole copy.
"""

from __future__ import annotations

import numpy as np

import contextlib
import time
from types import SimpleNamespace

from trajflow.config import MixedPrecisionConfig, ModelConfig, RolloutConfig
from trajflow.config.schema import FSDPConfig
from trajflow.modeling.forward import compute_log_probs
from trajflow.modeling.precision import cast_buffers
from trajflow.models import load_causal_lm, load_tokenizer
from trajflow.workers.base import Worker
from trajflow.workers.group import dispatch, free_address


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
        strategy: ``none`` (this worker holds the whole model) or ``fsdp2`` (a rank of a sharded group:
            the group calls :meth:`init_distributed` on every rank after construction).
        fsdp: the ``reference.fsdp`` section (``reshard_after_forward``, ``offload_params``, ``fsdp_size``).
    """

    def __init__(self, model_path: str, model_cfg: ModelConfig, rollout: RolloutConfig, device: str = "cpu",
                 num_threads: int = 0, mixed_precision: MixedPrecisionConfig | None = None,
                 strategy: str = "none", fsdp: FSDPConfig | None = None) -> None:
        self._start(device, num_threads)
        mp = mixed_precision or MixedPrecisionConfig()
        self.mixed_precision = mp
        self.strategy = str(strategy)
        self.fsdp = fsdp or FSDPConfig()
        self.backend = None  # FSDP2Backend once init_distributed ran
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

    # ------------------------------------------------------------------ distributed
    @dispatch("rank0")
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node IP and a free port: where the ranks' process group meets."""
        return free_address()

    def init_distributed(self, master_addr: str, master_port: int, rank: int, world_size: int) -> dict:
        """Join the reference's ranks and shard the frozen model with FSDP2 (every rank at once).

        Raises:
            RuntimeError: ``strategy`` is not ``fsdp2``.
        """
        if self.strategy != "fsdp2":
            raise RuntimeError(f"init_distributed needs reference.strategy='fsdp2', got {self.strategy!r}")
        from trajflow.modeling.backends import setup_rank_env
        from trajflow.modeling.fsdp import FSDP2Backend

        setup_rank_env(master_addr, master_port, rank, world_size, self.device)
        t0 = time.perf_counter()
        section = SimpleNamespace(fsdp=self.fsdp, mixed_precision=self.mixed_precision)
        self.backend = FSDP2Backend(self.model, section, self.device, rank, world_size, train=False)
        return {"rank": rank, "world_size": world_size, "init_s": time.perf_counter() - t0}

    @dispatch("gather")
    def held_elements(self) -> int:
        """Parameter elements this rank keeps between forwards: its shards under FSDP2 (about
        1/world_size of the model, or all of it with ``fsdp_size`` 1), the whole model otherwise."""
        from trajflow.modeling.fsdp import _local

        return sum(_local(p).numel() for p in self.model.parameters())

    @dispatch("split", split_args=("prompt_ids", "response_ids"))
    def compute_ref_log_prob(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                             temperature: float | None = None) -> list[np.ndarray]:
        """Per-token log-probs of each response under the reference policy at ``temperature`` (the
        rows' sampling temperature, stored with the rollout; None: ``rollout.temperature``), float32 ragged."""
        temperature = self.rollout.temperature if temperature is None else temperature
        # FSDP2: the root unit (embeddings, norm, head) is gathered for the forwards; every forward is
        # a collective, so the group hands all ranks equally many rows (lockstep).
        with self.backend.inference() if self.backend is not None else contextlib.nullcontext():
            logp, _ = compute_log_probs(self.model, prompt_ids, response_ids, temperature=temperature,
                                        micro_batch_size=int(self.rollout.log_prob_micro_batch_size),
                                        pad_id=self.pad_id, device=self.device, param_dtype=self.param_dtype)
        return logp
