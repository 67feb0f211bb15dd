"""The policy worker (actor + rollout): keeps the model and its optimizer resident across iterations.

A plain class, run as a long-lived Ray actor by :mod:`trajflow.workers.group`. Methods are named
for their role in RL as in verl's workers: ``generate_sequences``, ``compute_log_prob``,
``update_actor``, plus checkpointing. Inputs and outputs are plain Python/numpy or the typed
batches of :mod:`stages` (cheap to move through Ray's object store); tensors only exist inside.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trajflow.stages.multi_turn import EpisodeGeneration
from trajflow.stages.policy_update import UpdateBatch
from trajflow.stages.rollout import Generation, SamplingParams
from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
from trajflow.engines.base import RolloutEngine, WeightSync, choose_weight_sync
from trajflow.engines.registry import EngineContext, make_engine
from trajflow.engines.remote import RemoteRolloutEngine
from trajflow.infra.allocator import release_free_memory
from trajflow.modeling import lora
from trajflow.modeling.backends import LocalBackend, adamw
from trajflow.modeling.forward import compute_log_probs
from trajflow.modeling.precision import cast_buffers, section_dtype
from trajflow.models import build_prompt_ids, disable_dropout, eos_token_ids, load_causal_lm, load_tokenizer
from trajflow.state_files import load_state, rng_state, save_state, set_rng_state
from trajflow.workers.actor_update import PPOActor, StepCounters, max_tokens
from trajflow.workers.base import Worker
from trajflow.workers.group import dispatch, free_address


#: A LoRA checkpoint's weights: the adapter's tensors only.
ADAPTER_FILE = "adapter.safetensors"


class PolicyWorker(Worker):
    """Actor and rollout in one process (the ``hf`` engine shares the trained module).

    The worker hosts the engine (:mod:`trajflow.engines`, built by name from ``rollout.engine``) and
    the PPO update loop (:class:`trajflow.workers.actor_update.PPOActor`); it owns the model, the
    optimizer, the weight sync between them (one :class:`~trajflow.engines.base.WeightSync`, chosen
    when the engine is built or attached) and the checkpoints.

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

    #: The PPO update loop this worker hosts; a subclass may name another (e.g. one that injects faults).
    actor_cls: type[PPOActor] = PPOActor

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
        if actor.strategy not in ("deepspeed", "fsdp2"):
            # Under LoRA only the adapters require grad: the optimizer state is megabytes, not 2x the model.
            self.optimizer = adamw(lora.trainable_parameters(self.model), actor.lr, actor.betas, actor.weight_decay, device)
            self.backend = LocalBackend(self.model, self.optimizer, self.param_dtype)
        # With rollout.pool the engines are rollout workers (attach_rollout); until then, and for
        # whatever this process generates itself, the hf engine on this module.
        name = rollout.engine if rollout.pool is None else "hf"
        self._set_engine(make_engine(name, EngineContext(
            model_path, self.model, self.pad_id, self.eos_ids, rollout, model_cfg, device, seed,
            dtype=str(getattr(rollout, "dtype", "float32")), colocated=True, lora_rank=int(model_cfg.lora_rank))))
        self.policy_version = 0
        self.steps = StepCounters()  # optimizer steps, and skipped ones in a row, across updates
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
        """Join the data-parallel group and wrap the model in DeepSpeed or FSDP2 (every rank at once).

        Raises:
            RuntimeError: ``actor.strategy`` is neither ``deepspeed`` nor ``fsdp2``.
        """
        if self.actor.strategy not in ("deepspeed", "fsdp2"):
            raise RuntimeError(f"init_distributed needs actor.strategy='deepspeed' or 'fsdp2', got "
                               f"{self.actor.strategy!r}")
        from trajflow.modeling.backends import DeepSpeedBackend, setup_rank_env

        setup_rank_env(master_addr, master_port, rank, world_size, self.device)
        t0 = time.perf_counter()
        if self.actor.strategy == "fsdp2":
            from trajflow.modeling.fsdp import FSDP2Backend

            self.backend = FSDP2Backend(self.model, self.actor, self.device, rank, world_size)
            self.optimizer = self.backend.optimizer
        else:
            self.backend = DeepSpeedBackend(self.model, self.actor, self.device, rank, world_size)
        if self.actor.strategy == "fsdp2" or self.backend.zero_stage == 3:
            self.engine.on_sharded_module(world_size)
        return {"rank": rank, "world_size": world_size, "init_s": time.perf_counter() - t0}

    def attach_rollout(self, handles: list) -> None:
        """Generate on separate rollout workers (``rollout.pool``) instead of this process.

        This rank uses the rollout workers ``r, r + world_size, ...`` and pushes new weights to
        them after every update.
        """
        rank = getattr(self.backend, "rank", 0)
        world = getattr(self.backend, "world_size", 1)
        mine = [h for i, h in enumerate(handles) if i % world == rank]
        self._set_engine(RemoteRolloutEngine(mine or [handles[rank % len(handles)]],
                                             push_to=handles if rank == 0 else []))
        self._push_weights()

    def _set_engine(self, engine: RolloutEngine) -> None:
        """Use ``engine`` from now on, with the one weight sync it and this policy agree on."""
        self.engine = engine
        self.weight_sync = choose_weight_sync(engine, self.lora)

    def _wake_engine(self) -> None:
        """Before generating: restore what the engine released (a cast copy is cast again from the
        module, whose parameters the backend gathers under ZeRO-3, or block by block under FSDP2)."""
        self.engine.wake_up(self.backend.gathered, **self._cast_buckets())

    def _cast_buckets(self) -> dict:
        """FSDP2: ``{"buckets": ...}``, the full weights one block at a time on this rank's device, every
        rank getting them (:meth:`~trajflow.modeling.fsdp.FSDP2Backend.state_buckets`), from which an
        engine casts its copy without the whole model ever being gathered; ``{}`` for the other
        backends (``gathered`` serves them, and engines written before ``buckets`` keep working)."""
        buckets = getattr(self.backend, "state_buckets", None)
        return {} if buckets is None else {"buckets": lambda: buckets(all_ranks=True, cpu=False)}

    def _push_weights(self) -> None:
        """Bring the engine to the current weights, the way chosen for it (:attr:`weight_sync`)."""
        mode = self.weight_sync
        if mode is WeightSync.SHARED:  # the trained module itself; a copy in rollout.dtype is cast again
            self.engine.refresh(self.backend.gathered, **self._cast_buckets())
        elif mode is WeightSync.ADAPTER:  # vLLM serves the frozen base plus the adapter: only it travels
            self.engine.update_adapter(lora.adapter_state(self.model), self.model.peft_config[lora.ADAPTER],
                                       self.policy_version)
        elif mode is WeightSync.PATH:
            with tempfile.TemporaryDirectory(prefix="trajflow-weights-") as d:
                self.export_hf(d)  # merged under LoRA; under DeepSpeed rank 0 writes, all ranks gather
                self.engine.load_weights_from_path(d, self.policy_version)
        elif getattr(self.backend, "state_buckets", None) is not None:
            # FSDP2: the weights leave one block at a time, gathered from the shards (merged under
            # LoRA); rank 0 sends to separate rollout workers, an engine per rank loads on every rank.
            to_all = not self.engine.weights_from_rank0
            # An engine per rank (vLLM on this rank's GPU) takes the buckets where they were gathered.
            buckets = self.backend.merged_buckets(all_ranks=to_all) if self.lora else \
                self.backend.state_buckets(all_ranks=to_all, cpu=not to_all)
            for bucket in buckets:
                if bucket is not None:  # None: this rank only takes part in the gathering
                    self.engine.update_weights(bucket, version=self.policy_version)
                del bucket  # before the next block is gathered
        elif self.engine.weights_from_rank0:
            # Separate rollout workers: rank 0 sends one full copy (merged under LoRA), tagged with its
            # policy version (recorded by every row the engines generate).
            state = self._rollout_state()
            if state is not None:
                self.engine.update_weights(state, version=self.policy_version)
        elif self.lora:  # an engine per rank loads plain Hugging Face weights: the merged ones
            self.engine.update_weights(lora.merged_state_dict(self.model), version=self.policy_version)
        else:
            with self.backend.gathered():  # an engine per rank (vLLM on this rank's GPU) needs the full weights
                self.engine.update_weights({k: v.detach() for k, v in self.model.state_dict().items()},
                                           version=self.policy_version)

    def _rollout_state(self) -> dict | None:
        """The weights separate rollout workers load: the merged ones with LoRA (base + B A scale),
        else the full state (gathered layer by layer under ZeRO-3); None on ranks other than 0."""
        if self.lora:
            state = lora.merged_state_dict(self.model, keep=getattr(self.backend, "rank", 0) == 0)
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
            :class:`~trajflow.stages.rollout.Generation`, rows prompt-major; ``rollout_logprobs`` is ``None`` for
            greedy decoding; ``timing`` has ``timing_s/gen`` and, when recomputed,
            ``timing_s/old_log_prob`` (seconds).
        """
        t0 = time.perf_counter()
        self._wake_engine()
        with self._inference():
            out = self.engine.generate(prompt_ids, params)
        self.engine.sleep()  # free what the engine holds (vLLM's GPU memory, a cast copy) for what comes next
        t1 = time.perf_counter()
        text = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        timing = {"timing_s/gen": t1 - t0}
        rollout_logprobs = None
        if not params.greedy:
            if recompute_log_prob or out.rollout_logprobs is None:
                rows = [p for p in prompt_ids for _ in range(params.n)]
                rollout_logprobs = [x.tolist() for x in self.compute_log_prob(rows, out.response_ids, params.temperature)]
                timing["timing_s/old_log_prob"] = time.perf_counter() - t1
            else:
                rollout_logprobs = out.rollout_logprobs
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
            :class:`~trajflow.stages.multi_turn.EpisodeGeneration` with the episodes in row order; the engine's
            log-probs are the episodes' ``rollout_logprobs`` (0.0 everywhere for greedy decoding).
        """
        from trajflow.engines.episodes import EpisodeRunner

        if getattr(self, "_episodes", None) is None:
            self._episodes = EpisodeRunner(self.rollout.multi_turn, self.tokenizer, self.eos_ids,
                                           self.rollout.max_new_tokens)
        t0 = time.perf_counter()
        self._wake_engine()
        with self._inference():
            episodes = self._episodes.run(self.engine, rows, params, max_prompt_length)
        self.engine.sleep()
        ids = [e.response_ids for e in episodes]
        self._release()
        return EpisodeGeneration(episodes=episodes, response_ids=ids,
                                 response_text=self.tokenizer.batch_decode(ids, skip_special_tokens=True),
                                 policy_version=self.policy_version, timing={"timing_s/gen": time.perf_counter() - t0})

    @dispatch("split", split_args=("rows",))
    def generate_agent_episodes(self, rows: list[dict], params: SamplingParams,
                                max_prompt_length: int = 0) -> EpisodeGeneration:
        """Run one episode of ``rollout.agent`` per row against this worker's engine, served on 127.0.0.1
        (:mod:`trajflow.serve`; the endpoint starts on first use and lives as long as the worker).

        Each call is sampled at ``params``' temperature/top-p/top-k; the caller repeats each prompt row
        ``n`` times (``params.n`` is ignored). Agents run in threads of this process; the engine runs in
        this method's thread.

        Returns:
            :class:`~trajflow.stages.multi_turn.EpisodeGeneration`; each episode carries ``agent_error``,
            ``agent_answer``, ``tito_drift_tokens`` and ``agent_calls``.
        """
        from trajflow.serve.agents import AgentLimits, load_agent, run_agent_episodes
        from trajflow.serve.app import AgentServer

        if getattr(self, "_agent_server", None) is None:
            self._agent_server = AgentServer(self.tokenizer, self.eos_ids, self.rollout.multi_turn.format).start()
        agent = load_agent(str(self.rollout.agent))
        limits = AgentLimits(budget=int(self.rollout.max_new_tokens),
                             turn_tokens=int(self.rollout.multi_turn.max_tokens_per_turn),
                             timeout_s=float(self.rollout.agent_timeout_s),
                             concurrency=int(self.rollout.agent_concurrency),
                             error_reward=float(self.rollout.agent_error_reward), max_prompt_length=int(max_prompt_length))
        t0 = time.perf_counter()
        self._wake_engine()
        with self._inference():
            done = run_agent_episodes(agent, self._agent_server, self.engine.generate, rows,
                                      (float(params.temperature), float(params.top_p), int(params.top_k)), limits,
                                      seed=int(params.seed), top_logprobs=self._top_logprobs())
        self.engine.sleep()
        episodes = [d.episode for d in done]
        ids = [e.response_ids for e in episodes]
        self._release()
        return EpisodeGeneration(episodes=episodes, response_ids=ids,
                                 response_text=self.tokenizer.batch_decode(ids, skip_special_tokens=True),
                                 policy_version=self.policy_version, timing={"timing_s/gen": time.perf_counter() - t0})

    def _top_logprobs(self):
        """The endpoint's ``top_logprobs``, teacher-forced through the module the engine samples from
        (the HF engine's); None for an engine that holds its model elsewhere (vLLM, rollout workers)."""
        model = getattr(self.engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            return None
        from functools import partial

        from trajflow.serve.top_logprobs import teacher_forced_top_logprobs

        return partial(teacher_forced_top_logprobs, model)

    @dispatch("split", split_args=("prompt_ids", "response_ids"))
    def compute_log_prob(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                         temperature: float) -> list[np.ndarray]:
        """Per-token log-probs under the current policy, packed exactly as :meth:`update_actor` packs."""
        budget = max_tokens(self.actor)
        # Token-budget micro-batches come out in different numbers on different ranks' rows; the
        # forwards of a sharded model are collectives, so every rank runs the largest count.
        sharded = budget and self.backend is not None and self.backend.distributed
        with self._inference():
            logp, _ = compute_log_probs(self.model, prompt_ids, response_ids, temperature=temperature,
                                        micro_batch_size=self.actor.ppo_micro_batch_size, pad_id=self.pad_id,
                                        device=self.device, max_tokens=budget, param_dtype=self.param_dtype,
                                        forwards=self.backend.max_over_ranks if sharded else None)
        return logp

    def _inference(self):
        """The backend's context for forwards outside the training step (FSDP2 gathers its root unit)."""
        import contextlib

        return self.backend.inference() if self.backend is not None else contextlib.nullcontext()

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
        with lora.reference_mode(self.model), self._inference():
            logp, _ = compute_log_probs(self.model, prompt_ids, response_ids,
                                        temperature=self.rollout.temperature if temperature is None else temperature,
                                        micro_batch_size=int(self.rollout.log_prob_micro_batch_size),
                                        pad_id=self.pad_id, device=self.device, param_dtype=self.param_dtype)
        return logp

    # ------------------------------------------------------------------ update
    @dispatch("broadcast")
    def update_actor(self, batch: UpdateBatch) -> dict:
        """PPO-style policy update over one iteration's batch (:func:`trajflow.stages.policy_update.update_batch`):
        :meth:`trajflow.workers.actor_update.PPOActor.update` at the rows' sampling temperature
        (``settings.temperature``; ``rollout.temperature`` when the batch does not say), then the
        engine gets the new weights (unless ``settings.defer_weight_sync``: the driver pushes them).

        Returns:
            :meth:`~trajflow.workers.actor_update.PPOActor.update`'s metrics (verl names) plus
            ``timing_s/update_actor`` (seconds) and ``policy_version``.
        """
        t0 = time.perf_counter()
        settings = batch.settings
        if not settings.defer_weight_sync:
            # Nothing the engine holds (a cast copy, vLLM's memory) stays next to the gradients and
            # activations; _push_weights brings it back with the new weights.
            self.engine.sleep()
        temperature = self.rollout.temperature if settings.temperature is None else settings.temperature
        actor = self.actor_cls(self.model, self.backend, self.actor, self.pad_id, self.device,
                               self.rollout.max_new_tokens, self.compute_log_prob, self.steps)
        metrics = actor.update(batch, temperature)
        self.policy_version += 1
        if not settings.defer_weight_sync:
            self._push_weights()
        self._release()  # activations and gradients are freed: keep neither resident until the next update
        metrics["timing_s/update_actor"] = time.perf_counter() - t0
        metrics["policy_version"] = self.policy_version
        return metrics

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
                                          "optimizer_steps": self.steps.optimizer_steps, **record})
            return {"policy_version": self.policy_version}
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        extra = {"optimizer": self.optimizer.state_dict(), "policy_version": self.policy_version,
                 "optimizer_steps": self.steps.optimizer_steps, "rng": rng_state()}
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
            self.steps.optimizer_steps = int(state.get("optimizer_steps", 0))
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
        self.steps.optimizer_steps = int(extra.get("optimizer_steps", 0))
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
