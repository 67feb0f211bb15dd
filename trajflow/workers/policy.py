"""The policy worker (actor + rollout): keeps the model and its optimizer resident across iterations.

A plain class, run as a long-lived Ray actor by :mod:`trajflow.workers.group`. Methods are named
for their role in RL as in verl's workers: ``generate_sequences``, ``compute_log_prob``,
``update_actor``, plus checkpointing. Inputs and outputs are plain Python/numpy or the typed
batches of :mod:`stages` (cheap to move through Ray's object store); tensors only exist inside.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from stages.multi_turn import EpisodeGeneration
from stages.policy_update import ACTOR_LOSS_SHARES, ActorLossConfig, UpdateBatch, UpdateRows, UpdateSettings, actor_loss
from stages.rollout import Generation, SamplingParams
from stages.rollout_correction import (rollout_is_kept_metrics, rollout_is_weights, rollout_mismatch_metrics,
                                       rollout_rs_mask)
from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
from trajflow.engines.hf import HFRolloutEngine
from trajflow.infra.allocator import release_free_memory
from trajflow.modeling import lora
from trajflow.modeling.backends import LocalBackend, adamw
from trajflow.modeling.flops import device_peak_tflops, mfu, train_flops
from trajflow.modeling.forward import compute_log_probs
from trajflow.modeling.packing import micro_batch_plan, pack
from trajflow.modeling.precision import cast_buffers, section_dtype
from trajflow.models import chat_prompt_ids, disable_dropout, eos_token_ids, load_causal_lm, load_tokenizer
from trajflow.state_files import load_state, rng_state, save_state, set_rng_state
from trajflow.workers.base import Worker
from trajflow.workers.group import dispatch, free_address


#: A LoRA checkpoint's weights: the adapter's tensors only.
ADAPTER_FILE = "adapter.safetensors"


def build_prompt_ids(tokenizer: Any, messages_list: Sequence[list[dict]], max_prompt_length: int,
                     prompt_format: str = "auto") -> list[list[int]]:
    """Token ids of each chat prompt (:func:`trajflow.models.chat_prompt_ids` in ``prompt_format``:
    the tokenizer's chat template with the generation prompt added, the plain prompt format without
    one, or the few-shot completion format for base models).

    Raises:
        ValueError: a prompt is longer than ``max_prompt_length`` tokens (names the row).
    """
    out = []
    for i, messages in enumerate(messages_list):
        ids = chat_prompt_ids(tokenizer, messages, prompt_format)
        if len(ids) > max_prompt_length:
            raise ValueError(f"prompt row {i} has {len(ids)} tokens, more than data.max_prompt_length="
                             f"{max_prompt_length}")
        out.append(ids)
    return out


@dataclass
class _UpdateState:
    """What one :meth:`PolicyWorker.update_actor` call collects across its micro-batches."""

    old_logprobs: list[np.ndarray] | None  # the proximal policy's: the trainer's before the update (None: fully on-policy)
    temperature: float  # the rows' sampling temperature: every log-prob of the update is computed at it
    diffs: list[float] = field(default_factory=list)  # |old - rollout| log-prob per micro-batch
    is_rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)  # rollout-IS inputs
    first_step_ratio_dev: float | None = None
    nonfinite_steps: int = 0  # optimizer steps skipped because the gradient norm was not finite


class PolicyWorker(Worker):
    """Actor and rollout in one process (the ``hf`` engine shares the trained module).

    With ``actor.strategy=deepspeed`` the worker is one rank of a data-parallel group
    (:class:`trajflow.workers.group.WorkerGroup` calls :meth:`init_distributed` on every rank after
    construction); rollout then runs on each rank's share of the prompts. With
    ``rollout.engine=vllm`` a vLLM engine on this rank's GPU generates and gets the new weights
    after every update; with ``rollout.pool`` set, separate rollout workers do
    (:meth:`attach_rollout`).

    Args:
        model_path: a resolved Hugging Face directory.
        actor: the ``actor`` config section.
        model_cfg: the ``model`` config section.
        rollout: the ``rollout`` config section (``temperature`` is the one the PPO ratio's
            log-probs use: the sampling temperature).
        seed: initial torch/numpy/random seed.
        device: ``cpu``, ``cuda`` or ``npu``.
        num_threads: torch threads (0 = all CPUs).
    """

    def __init__(self, model_path: str, actor: ActorConfig, model_cfg: ModelConfig, rollout: RolloutConfig,
                 seed: int, device: str = "cpu", num_threads: int = 0) -> None:
        self._start(device, num_threads, seed)
        self.actor = actor
        self.rollout = rollout
        self.model_cfg = model_cfg
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_causal_lm(model_path, model_cfg.dtype, device, model_cfg.attn_implementation)
        # Master weights and AdamW state stay model.dtype (float32); forwards run in param_dtype.
        self.param_dtype = section_dtype(actor)
        cast_buffers(self.model, str(getattr(getattr(actor, "mixed_precision", None), "buffer_dtype", "float32")))
        if model_cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.config.use_cache = True
        self.lora = lora.lora_enabled(model_cfg)
        if self.lora:
            self.model = lora.apply_lora(self.model, model_cfg)
        disable_dropout(self.model)  # RL forwards run without dropout (the PPO ratio would compare noise)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.eos_ids = eos_token_ids(self.tokenizer, getattr(self.model, "generation_config", None),
                                     model_cfg.prompt_format)
        self.optimizer = None
        self.backend: Any = None
        if actor.strategy != "deepspeed":
            # Under LoRA only the adapters require grad: the optimizer state is megabytes, not 2x the model.
            self.optimizer = adamw(lora.trainable_parameters(self.model), actor.lr, actor.betas, actor.weight_decay, device)
            self.backend = LocalBackend(self.model, self.optimizer, self.param_dtype)
        if rollout.engine == "vllm" and rollout.pool is None:
            from trajflow.engines.vllm import VLLMRolloutEngine

            self.engine = VLLMRolloutEngine(model_path, rollout, model_cfg, self.eos_ids, seed=seed, colocated=True,
                                            lora_rank=int(model_cfg.lora_rank))
        else:
            self.engine = HFRolloutEngine(self.model, self.pad_id, self.eos_ids, rollout.micro_batch_size, device,
                                          dtype=str(getattr(rollout, "dtype", "float32")),
                                          continuous_batching=bool(getattr(rollout, "continuous_batching", True)))
        self.policy_version = 0
        self.optimizer_steps = 0
        self.nonfinite_in_a_row = 0  # consecutive skipped optimizer steps, across updates
        self.release_memory = True  # resources.release_memory, resolved by the driver (set_release_memory)

    @dispatch("broadcast")
    def set_release_memory(self, on: bool) -> None:
        """Whether to hand freed heap back to the OS after each rollout and update
        (:meth:`trajflow.run.context.RunContext.release_memory` says when it pays)."""
        self.release_memory = bool(on)

    def _release(self) -> None:
        if self.release_memory:
            release_free_memory()

    # ------------------------------------------------------------------ distributed
    @dispatch("rank0")
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node IP and a free port: where the ranks' process group meets."""
        return free_address()

    def init_distributed(self, master_addr: str, master_port: int, rank: int, world_size: int) -> dict:
        """Join the data-parallel group and wrap the model in DeepSpeed (every rank at once).

        Raises:
            RuntimeError: ``actor.strategy`` is not ``deepspeed``.
        """
        if self.actor.strategy != "deepspeed":
            raise RuntimeError(f"init_distributed needs actor.strategy='deepspeed', got {self.actor.strategy!r}")
        from trajflow.modeling.backends import DeepSpeedBackend, setup_rank_env

        setup_rank_env(master_addr, master_port, rank, world_size, self.device)
        t0 = time.perf_counter()
        self.backend = DeepSpeedBackend(self.model, self.actor, self.device, rank, world_size)
        if self.backend.zero_stage == 3 and isinstance(self.engine, HFRolloutEngine) and not self.engine.own_copy:
            # Sharded parameters: every decoding step gathers them, so ranks step together.
            self.engine.synced_gpus = world_size > 1
        return {"rank": rank, "world_size": world_size, "init_s": time.perf_counter() - t0}

    def attach_rollout(self, handles: list) -> None:
        """Generate on separate rollout workers (``rollout.pool``) instead of this process.

        This rank uses the rollout workers ``r, r + world_size, ...`` and pushes new weights to
        them after every update.
        """
        from trajflow.workers.rollout import RemoteRolloutEngine

        rank = getattr(self.backend, "rank", 0)
        world = getattr(self.backend, "world_size", 1)
        mine = [h for i, h in enumerate(handles) if i % world == rank]
        self.engine = RemoteRolloutEngine(mine or [handles[rank % len(handles)]], push_to=handles if rank == 0 else [])
        self._push_weights()

    def _push_weights(self) -> None:
        """Send the current weights to an engine that does not share this module (vLLM, rollout workers)."""
        if isinstance(self.engine, HFRolloutEngine):
            # The trained module itself (nothing to send), or the engine's copy in rollout.dtype.
            if self.engine.own_copy:
                with self.backend.gathered():
                    self.engine.sync()
            return
        if self.lora and hasattr(self.engine, "update_adapter"):
            # vLLM serves the frozen base with the adapter as a LoRARequest: only the adapter travels.
            self.engine.update_adapter(lora.adapter_state(self.model), self.model.peft_config[lora.ADAPTER],
                                       self.policy_version)
            return
        if getattr(self.engine, "rank0_push", False):
            # Separate rollout workers: rank 0 sends one full copy, tagged with its policy version
            # (recorded by every row the engines generate).
            state = self._rollout_state()
            if state is not None:
                self.engine.update_weights(state, version=self.policy_version)
            return
        if self.lora:  # an engine per rank loads plain Hugging Face weights: the merged ones
            self.engine.update_weights(lora.merged_state_dict(self.model))
            return
        with self.backend.gathered():  # an engine per rank (vLLM on this rank's GPU) needs the full weights
            self.engine.update_weights({k: v.detach() for k, v in self.model.state_dict().items()})

    def _rollout_state(self) -> dict | None:
        """The weights separate rollout workers load: the merged ones with LoRA (base + B A scale),
        else the full state (gathered layer by layer under ZeRO-3); None on ranks other than 0."""
        if self.lora:
            state = lora.merged_state_dict(self.model)
            return state if getattr(self.backend, "rank", 0) == 0 else None
        return self.backend.full_state_dict()

    @dispatch("broadcast")
    def snapshot_weights(self) -> dict:
        """Put a copy of the current weights in the Ray object store for the rollout workers to load
        later (``trainer.max_staleness`` >= 2: a rollout still in flight on them must finish on the
        weights it started with, while the trainer moves on).

        Returns:
            ``{"policy_version": int, "weights": [ObjectRef of {name: CPU tensor}] (empty on ranks other
            than 0), "timing_s/weight_sync": seconds the copy took}``. The reference is wrapped in a list
            so that Ray hands it over as a reference, not as the weights themselves.
        """
        import ray

        t0 = time.perf_counter()
        state = self._rollout_state()
        refs = [] if state is None else [ray.put({k: v.detach().cpu() for k, v in state.items()})]
        return {"policy_version": self.policy_version, "weights": refs, "timing_s/weight_sync": time.perf_counter() - t0}

    @dispatch("broadcast")
    def push_weights(self) -> dict:
        """Send the current weights to the separate rollout workers now (``trainer.max_staleness`` > 0:
        the driver calls this after an update, once no rollout is in flight on them).

        Returns:
            ``{"policy_version": int, "timing_s/weight_sync": seconds}``.
        """
        t0 = time.perf_counter()
        self._push_weights()
        return {"policy_version": self.policy_version, "timing_s/weight_sync": time.perf_counter() - t0}

    @dispatch("broadcast")
    def get_weights(self) -> dict[str, np.ndarray] | None:
        """All parameters as float32 numpy arrays (rank 0's copy; collective under ZeRO-3)."""
        state = self.backend.full_state_dict() if self.backend is not None else self.model.state_dict()
        if state is None:
            return None
        return {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()}

    # ------------------------------------------------------------------ info
    @dispatch("rank0")
    def info(self) -> dict:
        return {**super().info(), "policy_version": self.policy_version, "eos_ids": self.eos_ids,
                "pad_id": self.pad_id, "num_params": sum(p.numel() for p in self.model.parameters()),
                "trainable_params": sum(p.numel() for p in lora.trainable_parameters(self.model))}

    # ------------------------------------------------------------------ rollout
    @dispatch("rank0")
    def tokenize_prompts(self, messages_list: list[list[dict]], max_prompt_length: int) -> list[list[int]]:
        return build_prompt_ids(self.tokenizer, messages_list, max_prompt_length, self.model_cfg.prompt_format)

    @dispatch("split", split_args=("prompt_ids",))
    def generate_sequences(self, prompt_ids: list[list[int]], params: SamplingParams,
                           recompute_log_prob: bool = False) -> Generation:
        """Sample ``params.n`` responses per prompt with their rollout log-probs.

        The log-probs are read from the generation's own logits under the sampling temperature
        (no second forward pass); ``recompute_log_prob`` recomputes them teacher-forced instead.

        Returns:
            :class:`~stages.rollout.Generation`, rows prompt-major; ``rollout_logprobs`` is ``None`` for
            greedy decoding; ``timing`` has ``timing_s/gen`` and, when recomputed,
            ``timing_s/old_log_prob`` (seconds).
        """
        t0 = time.perf_counter()
        out = self.engine.generate(prompt_ids, params)
        if getattr(self.engine, "colocated", False):
            self.engine.sleep()  # free the GPU memory vLLM holds for the forward passes and the update
        t1 = time.perf_counter()
        text = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        timing = {"timing_s/gen": t1 - t0}
        rollout_logprobs = None
        if not params.greedy:
            if recompute_log_prob or out.logprobs is None:
                rows = [p for p in prompt_ids for _ in range(params.n)]
                rollout_logprobs = [x.tolist() for x in self.compute_log_prob(rows, out.response_ids, params.temperature)]
                timing["timing_s/old_log_prob"] = time.perf_counter() - t1
            else:
                rollout_logprobs = out.logprobs
        self._release()  # the KV caches and logits of the rollout: the update allocates elsewhere
        return Generation(response_ids=out.response_ids, response_text=text, finish_reason=out.finish_reason,
                          rollout_logprobs=rollout_logprobs, policy_version=self.policy_version, timing=timing)

    @dispatch("split", split_args=("rows",))
    def generate_episodes(self, rows: list[dict], params: SamplingParams,
                          max_prompt_length: int = 0) -> EpisodeGeneration:
        """Run one multi-turn episode per row (``rollout.multi_turn``) on this worker's engine.

        Tools run in the sandbox's own processes, never in this one. The caller repeats each prompt
        row ``n`` times; ``params.n`` is ignored.

        Returns:
            :class:`~stages.multi_turn.EpisodeGeneration` with the episodes in row order; the engine's
            log-probs are the episodes' ``rollout_logprobs`` (0.0 everywhere for greedy decoding).
        """
        from trajflow.engines.episodes import EpisodeRunner

        if getattr(self, "_episodes", None) is None:
            self._episodes = EpisodeRunner(self.rollout.multi_turn, self.tokenizer, self.eos_ids,
                                           self.rollout.max_new_tokens)
        t0 = time.perf_counter()
        episodes = self._episodes.run(self.engine, rows, params, max_prompt_length)
        if getattr(self.engine, "colocated", False):
            self.engine.sleep()
        ids = [e.response_ids for e in episodes]
        self._release()
        return EpisodeGeneration(episodes=episodes, response_ids=ids,
                                 response_text=self.tokenizer.batch_decode(ids, skip_special_tokens=True),
                                 policy_version=self.policy_version, timing={"timing_s/gen": time.perf_counter() - t0})

    @dispatch("split", split_args=("prompt_ids", "response_ids"))
    def compute_log_prob(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                         temperature: float) -> list[np.ndarray]:
        """Per-token log-probs under the current policy, packed exactly as :meth:`update_actor` packs."""
        logp, _ = compute_log_probs(self.model, prompt_ids, response_ids, temperature=temperature,
                                    micro_batch_size=self.actor.ppo_micro_batch_size, pad_id=self.pad_id,
                                    device=self.device, max_tokens=self._max_tokens(), param_dtype=self.param_dtype)
        return logp

    @dispatch("split", split_args=("prompt_ids", "response_ids"))
    def compute_ref_log_prob(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                             temperature: float | None = None) -> list[np.ndarray]:
        """Per-token log-probs under the reference policy at ``temperature`` (the rows' sampling
        temperature; None: ``rollout.temperature``), for KL terms under LoRA (verl's
        ``ref_in_actor``): this module with its adapters disabled is the frozen base model, the
        initial policy, so no reference worker or second copy of the weights exists. Same micro-batches
        as :class:`trajflow.workers.reference.ReferenceWorker` (``rollout.log_prob_micro_batch_size``).

        Returns:
            One float32 array per row, ``(len(response_ids[i]),)``.

        Raises:
            RuntimeError: the model has no adapters (``model.lora_rank=0``).
        """
        if not self.lora:
            raise RuntimeError("compute_ref_log_prob on the policy worker needs model.lora_rank > 0")
        with lora.reference_mode(self.model):
            logp, _ = compute_log_probs(self.model, prompt_ids, response_ids,
                                        temperature=self.rollout.temperature if temperature is None else temperature,
                                        micro_batch_size=int(self.rollout.log_prob_micro_batch_size),
                                        pad_id=self.pad_id, device=self.device, param_dtype=self.param_dtype)
        return logp

    def _max_tokens(self) -> int | None:
        """The micro-batches' token budget (``actor.use_dynamic_bsz``), or None for fixed-size ones."""
        return int(self.actor.ppo_max_token_len_per_gpu) if self.actor.use_dynamic_bsz else None

    def _split_rows(self, rows: UpdateRows):
        """Row ids -> micro-batches, as :func:`trajflow.modeling.packing.micro_batch_plan` cuts them."""
        def split(ids: list[int]) -> list[list[int]]:
            plan = micro_batch_plan([rows.prompt_ids[r] for r in ids], [rows.response_ids[r] for r in ids],
                                    int(self.actor.ppo_micro_batch_size), self._max_tokens())
            return [ids[sl] for sl in plan]
        return split

    def _ragged(self, values: Sequence[Sequence[float]], rows: Sequence[int], width: int) -> torch.Tensor:
        """``(len(rows), width)`` float32 on the device: each row's values, zero-padded (or cut) to ``width``."""
        t = torch.full((len(rows), width), 0.0, dtype=torch.float32)
        for j, r in enumerate(rows):
            v = np.asarray(values[r], dtype=np.float32)
            t[j, :len(v)] = torch.from_numpy(v[:width])
        return t.to(self.device)

    # ------------------------------------------------------------------ update
    @dispatch("broadcast")
    def update_actor(self, batch: UpdateBatch) -> dict:
        """PPO-style policy update over one iteration's batch (:func:`stages.policy_update.update_batch`).

        The loss of each micro-batch is :func:`stages.policy_update.actor_loss` (policy gradient,
        entropy bonus, KL loss), with the log-probs under ``settings.temperature`` (the rows' sampling
        temperature; ``rollout.temperature`` when the batch does not say). The proximal policy's
        log-probs in the PPO ratio (``old_logprobs``) are the trainer's own: when the whole batch is one
        optimizer step of one epoch (fully on-policy), they are the current forward's log-probs
        detached, so the ratio is exactly 1 and no extra forward pass is spent; otherwise they are
        recomputed before the first step with the same packing as the update. The engine's
        log-probs are compared with them (``actor/rollout_logprob_diff``) and, with
        ``settings.rollout_is`` (``"token"``/``"sequence"``, threshold ``settings.rollout_is_threshold``),
        weight the policy-gradient loss by min(pi_old / pi_rollout, threshold)
        (:mod:`stages.rollout_correction`; metrics ``rollout_corr/*``). ``settings.shuffle_seed`` sets
        the mini-batch order and ``settings.rng_seed`` (optional) seeds torch's global RNG first. The
        batch is cut into mini-batches of ``settings.mini_batch_rows`` rows (one optimizer step each)
        and those into micro-batches of ``ppo_micro_batch_size`` rows, or of at most
        ``ppo_max_token_len_per_gpu`` computed tokens with ``use_dynamic_bsz`` (gradient
        accumulation, exact thanks to the mini-batch-wide denominators of
        :func:`stages.policy_update.agg_loss`), for ``ppo_epochs`` passes. Under DeepSpeed every rank
        gets the whole batch, keeps the mini-batch-wide denominators and trains on its
        token-balanced share of each mini-batch (:class:`trajflow.modeling.backends.DeepSpeedBackend`);
        metrics are combined across ranks.

        Returns:
            Metrics averaged over optimizer steps, verl names (``actor/pg_loss``, ``actor/pg_clipfrac``,
            ``actor/ppo_kl``, ``actor/entropy``, ``actor/kl_loss``, ``actor/grad_norm``, ``actor/lr``,
            ``actor/ratio_first_step_max_abs_dev``) plus ``timing_s/update_actor`` and ``policy_version``.
        """
        t0 = time.perf_counter()
        rows, settings = batch.rows, batch.settings
        if isinstance(self.engine, HFRolloutEngine) and not settings.defer_weight_sync:
            # A rollout copy in another dtype is cast again after the update (_push_weights): not
            # held next to the gradients and activations.
            self.engine.release()
        sums: dict[str, list[float]] = {}
        n_rows = len(rows.response_ids)
        mini_rows = int(settings.mini_batch_rows or n_rows)
        loss_cfg = ActorLossConfig.from_actor(self.actor)
        rng = np.random.default_rng(int(settings.shuffle_seed))
        if settings.rng_seed is not None:
            # Any draw inside the update (dropout, ...) depends on (seed, iteration) only, not on
            # whatever ran in this process before: a resumed run updates exactly as an uninterrupted one.
            torch.manual_seed(int(settings.rng_seed))
        temperature = self.rollout.temperature if settings.temperature is None else settings.temperature
        old_logprobs = None  # the proximal policy's (the trainer's before this update)
        if not (self.actor.ppo_epochs == 1 and mini_rows >= n_rows):
            t_old = time.perf_counter()
            old_logprobs = self.compute_log_prob(rows.prompt_ids, rows.response_ids, temperature)
            sums["timing_s/old_log_prob"] = [time.perf_counter() - t_old]
        state = _UpdateState(old_logprobs, temperature)
        self.model.train()
        for epoch in range(self.actor.ppo_epochs):
            order = rng.permutation(n_rows) if self.actor.shuffle else np.arange(n_rows)
            for m0 in range(0, n_rows, mini_rows):
                step = self._mini_batch_step(batch, order[m0:m0 + mini_rows], epoch, loss_cfg, state)
                for k, v in (step or {}).items():
                    sums.setdefault(k, []).append(v)
        train_s = time.perf_counter() - t0 - sum(sums.get("timing_s/old_log_prob", []))
        self.backend.zero_grad()
        self.policy_version += 1
        # verl's training/rollout_probs_diff (actor/rollout_logprob_diff): how far the engine's
        # log-probs are from the trainer's, averaged over micro-batches (of every rank).
        metrics = self.backend.reduce_metrics(
            {k: float(np.mean(v)) for k, v in sums.items()},
            maxima={"actor/ratio_first_step_max_abs_dev": float(state.first_step_ratio_dev or 0.0)},
            means={"actor/rollout_logprob_diff": state.diffs})
        metrics["actor/lr"] = self.backend.lr()
        peak = settings.peak_tflops or device_peak_tflops(self.device)
        if peak and train_s > 0:  # PaLM's model FLOPs utilisation of the update (trajflow.modeling.flops)
            seq = [len(p) + len(r) for p, r in zip(rows.prompt_ids, rows.response_ids)]
            flops = self.actor.ppo_epochs * train_flops(self.model, seq)
            metrics["perf/mfu/actor"] = mfu(flops, train_s, peak, self.backend.world_size)
        metrics["actor/grad_norm_nonfinite"] = float(state.nonfinite_steps)
        metrics["actor/nonfinite_steps_in_a_row"] = float(self.nonfinite_in_a_row)
        is_rows = self.backend.gather_rows(state.is_rows)  # every rank's rows (data parallel)
        if is_rows:
            metrics.update(self._rollout_is_metrics(is_rows, settings))
        if not settings.defer_weight_sync:
            self._push_weights()
        self._release()  # activations and gradients are freed: keep neither resident until the next update
        metrics["timing_s/update_actor"] = time.perf_counter() - t0
        metrics["policy_version"] = self.policy_version
        return metrics

    def _mini_batch_step(self, batch: UpdateBatch, mini: np.ndarray, epoch: int, loss_cfg: ActorLossConfig,
                         state: _UpdateState) -> dict[str, float] | None:
        """One optimizer step over the rows ``mini``: its metrics, or None when no token counts."""
        rows = batch.rows
        masks = [np.asarray(rows.loss_mask[r], dtype=np.float32) if rows.loss_mask is not None
                 else np.ones(len(rows.response_ids[r]), np.float32) for r in mini]
        global_tokens = float(sum(m.sum() for m in masks))
        global_seqs = float(sum(1 for m in masks if m.sum() > 0))
        if global_tokens == 0:
            return None
        self.backend.zero_grad()
        step: dict[str, float] = {}
        tokens = [len(rows.prompt_ids[r]) + len(rows.response_ids[r]) for r in mini]
        for ids, live in self.backend.micro_batches(mini, self._split_rows(rows), tokens):
            self._micro_batch(batch, ids, live, epoch, loss_cfg, state, step, global_tokens, global_seqs)
        gn, stepped = self.backend.step(self.actor.grad_clip)
        self.optimizer_steps += int(stepped)
        if math.isfinite(gn):
            step["actor/grad_norm"] = gn
            self.nonfinite_in_a_row = 0
        else:  # the backend did not step: the weights stay finite; the driver stops a run that keeps doing this
            state.nonfinite_steps += 1
            self.nonfinite_in_a_row += 1
        return step

    def _micro_batch(self, batch: UpdateBatch, ids: list[int], live: bool, epoch: int, loss_cfg: ActorLossConfig,
                     state: _UpdateState, step: dict[str, float], global_tokens: float, global_seqs: float) -> None:
        """Forward and backward of the rows ``ids``; adds their metrics to ``step`` (``live`` only:
        a padding micro-batch of a data-parallel rank backpropagates zero and reports nothing)."""
        rows, settings = batch.rows, batch.settings
        packed = pack([rows.prompt_ids[r] for r in ids], [rows.response_ids[r] for r in ids], self.pad_id, self.device)
        T = packed.responses.shape[1]
        mask = packed.response_mask.float() * self._ragged(rows.loss_mask, ids, T) if rows.loss_mask is not None \
            else packed.response_mask.float()
        # logp: the current policy's; old: the proximal policy's; rollout_lp: the behaviour policy's.
        logp, ent = self.backend.forward(packed, state.temperature, compute_entropy=True,
                                         entropy_grad=bool(loss_cfg.entropy_coeff))
        if state.old_logprobs is None:
            old = logp.detach()
        else:
            old = torch.zeros_like(logp)
            for j, r in enumerate(ids):
                old[j, :len(state.old_logprobs[r])] = torch.from_numpy(state.old_logprobs[r])
        is_w = None
        if live:
            rollout_lp = self._ragged(rows.rollout_logprobs, ids, T)
            # The engine's log-probs exist only where it sampled: a multi-turn row stores 0.0 on its
            # tool/environment tokens, so engine and trainer are compared on the masked tokens only.
            m = packed.response_mask & (mask > 0)
            if epoch == 0:
                state.diffs.append(float(((old - rollout_lp).abs() * m).sum() / m.sum().clamp(min=1)))
            if settings.rollout_is:  # truncated IS: min(pi_old / pi_rollout, C), a constant weight
                is_w, _ = rollout_is_weights(old, rollout_lp, m, settings.rollout_is,
                                             float(settings.rollout_is_threshold))
            if settings.rollout_rs:  # rejection: an outlying token or row weighs 0 (the denominator stays)
                keep, _ = rollout_rs_mask(old, rollout_lp, m, settings.rollout_rs, float(settings.rollout_rs_threshold),
                                          settings.rollout_rs_threshold_lower)
                keep_w = keep.to(torch.float32)
                # Tokens outside m (tool output, padding) keep weight 1: their loss mask already zeroes them.
                keep_w = torch.where(m, keep_w, torch.ones_like(keep_w))
                is_w = keep_w if is_w is None else torch.where(m, is_w * keep_w, is_w)
            if epoch == 0:  # the mismatch metrics are logged every iteration, correction or not
                for j, r in enumerate(ids):
                    n = len(rows.response_ids[r])
                    state.is_rows[r] = (old[j, :n].detach().cpu().numpy(), rollout_lp[j, :n].cpu().numpy(),
                                        m[j, :n].cpu().numpy())
        adv = self._ragged(rows.advantages, ids, T)
        # Dr. GRPO's constant normaliser is the response cap (verl pads responses to it), not the
        # micro-batch's longest response, so micro-batches add up to the mini-batch loss.
        agg_kw = dict(global_num_tokens=global_tokens, global_num_seqs=global_seqs,
                      horizon=int(self.rollout.max_new_tokens or T))
        use_kl = loss_cfg.kl_loss_coef > 0 and rows.ref_logprobs is not None
        ref = self._ragged(rows.ref_logprobs, ids, T) if use_kl else None
        loss, loss_metrics = actor_loss(logp, old, adv, mask, entropy=ent, ref_logp=ref, cfg=loss_cfg, agg_kw=agg_kw,
                                        rollout_is_weights=is_w)
        if not live:
            self.backend.backward(loss * 0.0)
            return
        self.backend.backward(loss)
        if state.first_step_ratio_dev is None:
            with torch.no_grad():
                dev = ((logp - old).exp() - 1).abs() * mask
                state.first_step_ratio_dev = float(dev.max())
        frac = float(mask.sum()) / global_tokens
        for k, v in loss_metrics.items():
            if k == "actor/kl_coef":
                step[k] = v
            elif k in ACTOR_LOSS_SHARES:
                step[k] = step.get(k, 0.0) + v
            else:  # token means of this micro-batch: weighted by its share of the mini-batch's tokens
                step[k] = step.get(k, 0.0) + float(v) * frac

    @staticmethod
    def _rollout_is_metrics(rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], settings: UpdateSettings
                            ) -> dict:
        """``rollout_corr/*`` over the whole batch from each row's (trainer old, engine) log-probs and
        the mask of the tokens that count: the mismatch diagnostics
        (:func:`stages.rollout_correction.rollout_mismatch_metrics`) always, the IS weights'
        statistics when ``settings.rollout_is`` is set, the rejection's when ``settings.rollout_rs`` is."""
        threshold = float(settings.rollout_is_threshold)
        ordered = [rows[r] for r in sorted(rows)]
        width = max([len(o) for o, _, _ in ordered] + [1])
        old = torch.zeros((len(ordered), width), dtype=torch.float64)
        eng = torch.zeros_like(old)
        mask = torch.zeros((len(ordered), width), dtype=torch.bool)
        for i, (o, e, k) in enumerate(ordered):
            old[i, :len(o)] = torch.from_numpy(o.astype(np.float64))
            eng[i, :len(e)] = torch.from_numpy(e.astype(np.float64))
            mask[i, :len(k)] = torch.from_numpy(k.astype(bool))
        out = rollout_mismatch_metrics(old, eng, mask, threshold)
        weights = keep = None
        if settings.rollout_is:
            weights, m = rollout_is_weights(old, eng, mask, settings.rollout_is, threshold)
            out.update(m)
        if settings.rollout_rs:
            keep, m = rollout_rs_mask(old, eng, mask, settings.rollout_rs, float(settings.rollout_rs_threshold),
                                      settings.rollout_rs_threshold_lower)
            out.update(m)
        if weights is not None and keep is not None:
            out.update(rollout_is_kept_metrics(weights, keep, mask))
        return out

    # ------------------------------------------------------------------ checkpoints
    @dispatch("broadcast")
    def save_checkpoint(self, directory: str) -> dict:
        """Write weights (safetensors), optimizer state and the worker's RNG states into ``directory``.

        Under LoRA the weights are the adapter's only (``adapter.safetensors``, peft's tensor names,
        only ``lora_`` keys) and the optimizer state is the adapter's; the frozen base is the model
        at ``model.path``.

        Under DeepSpeed: sharded model/optimizer states (one file per rank) and per-rank RNG states.
        """
        from safetensors.torch import save_file

        record = lora.adapter_record(self.model_cfg) if self.lora else {}
        if self.backend.distributed:
            self.backend.save(directory, {"policy_version": self.policy_version,
                                          "optimizer_steps": self.optimizer_steps, **record})
            return {"policy_version": self.policy_version}
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        extra = {"optimizer": self.optimizer.state_dict(), "policy_version": self.policy_version,
                 "optimizer_steps": self.optimizer_steps, "rng": rng_state()}
        if self.lora:
            # The base weights never change: the adapter and its optimizer state are the whole state.
            save_file(lora.adapter_state(self.model), str(d / ADAPTER_FILE))
            save_state({**extra, **record}, d, "actor_state")
            return {"policy_version": self.policy_version}
        state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        # Tied embeddings share storage; safetensors refuses shared tensors, so store copies.
        seen: dict[int, str] = {}
        for k, v in list(state.items()):
            ptr = v.data_ptr()
            if ptr in seen:
                state[k] = v.clone()
            seen[ptr] = k
        save_file(state, str(d / "model.safetensors"))
        save_state(extra, d, "actor_state")
        return {"policy_version": self.policy_version}

    @dispatch("broadcast")
    def load_checkpoint(self, directory: str) -> dict:
        """Restore weights, optimizer and RNG states saved by :meth:`save_checkpoint`."""
        from safetensors.torch import load_file

        if self.backend.distributed:
            state = self.backend.load(directory)
            if self.lora:
                lora.check_adapter_record(state, self.model_cfg, str(directory))
            self.policy_version = int(state["policy_version"])
            self.optimizer_steps = int(state.get("optimizer_steps", 0))
            self._push_weights()
            return {"policy_version": self.policy_version}
        d = Path(directory)
        device = str(self.device) if self.device != "cpu" else "cpu"
        if self.lora != (d / ADAPTER_FILE).exists():
            raise RuntimeError(f"{d} holds a {'full-weight' if self.lora else 'LoRA adapter'} checkpoint; this run has "
                               f"model.lora_rank={self.model_cfg.lora_rank} (resume with the run's own config)")
        extra = load_state(d, "actor_state")
        if self.lora:
            lora.check_adapter_record(extra, self.model_cfg, str(d))
            try:
                lora.load_adapter_state(self.model, load_file(str(d / ADAPTER_FILE), device=device))
            except RuntimeError as e:
                raise RuntimeError(f"{d / ADAPTER_FILE}: {e}") from None
        else:
            state = load_file(str(d / "model.safetensors"), device=device)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or [m for m in missing if "lm_head" not in m]:
                raise RuntimeError(f"{d}/model.safetensors does not match the model: missing {missing[:3]}, "
                                   f"unexpected {unexpected[:3]}")
        self.optimizer.load_state_dict(extra["optimizer"])
        self.policy_version = int(extra["policy_version"])
        self.optimizer_steps = int(extra.get("optimizer_steps", 0))
        set_rng_state(extra["rng"])
        self._push_weights()
        return {"policy_version": self.policy_version}

    @dispatch("rank0")
    def weights_finite(self) -> bool:
        """Whether every parameter is finite (a non-finite model is never exported)."""
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    @dispatch("broadcast")
    def export_hf(self, directory: str) -> str:
        """Save the current policy as a Hugging Face model directory (``from_pretrained``-loadable).

        Under DeepSpeed rank 0 writes the consolidated weights (ZeRO-3 gathers them layer by layer).
        Under LoRA: the merged model, plus the adapter in peft's format in ``adapter/``
        (:func:`trajflow.modeling.lora.save_final`; rank 0 writes, and under ZeRO-3 every rank
        takes part in gathering the weights).
        """
        if self.backend is not None and self.backend.distributed:
            if self.lora:
                lora.save_final(self.model, self.tokenizer, directory, write=self.backend.rank == 0)
            else:
                state = self.backend.full_state_dict()
                if state is not None:
                    self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
                    self.tokenizer.save_pretrained(directory)
            import torch.distributed as dist

            dist.barrier()
            return directory
        if self.lora:
            lora.save_final(self.model, self.tokenizer, directory)
            return directory
        self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)
        return directory

    @dispatch("broadcast")
    def weights_digest(self) -> str:
        """sha256 over all parameters (tests compare runs bit for bit)."""
        from trajflow.checkpoint import state_digest

        state = self.model.state_dict()
        if self.backend is not None and self.backend.distributed:
            state = self.backend.full_state_dict() or {}
        return state_digest(state)
