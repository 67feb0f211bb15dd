"""The policy worker (actor + rollout): keeps the model and its optimizer resident across iterations.

A plain class, run as a long-lived Ray actor by :mod:`trajflow.workers.group`. Methods are named
for their role in RL as in verl's workers: ``generate_sequences``, ``compute_log_prob``,
``update_actor``, plus checkpointing. Inputs and outputs are plain Python/numpy (cheap to move
through Ray's object store); tensors only exist inside the worker.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from stages.policy_update import PolicyLossConfig, agg_loss, compute_policy_loss, kl_loss
from stages.rollout import SamplingParams
from stages.rollout_correction import rollout_is_weights
from trajflow.config import ActorConfig
from trajflow.engines.hf import HFRolloutEngine
from trajflow.models import eos_token_ids, load_causal_lm, load_tokenizer
from trajflow.modeling.backends import LocalBackend, adamw
from trajflow.modeling.forward import compute_log_probs
from trajflow.modeling.packing import micro_batch_plan, pack
from trajflow.workers.group import dispatch, free_address


def set_threads(num_threads: int) -> int:
    """Use ``num_threads`` torch threads (0: every CPU of the machine).

    Ray sets ``OMP_NUM_THREADS`` to an actor's ``num_cpus`` (often 1), which would leave a CPU
    worker using one core.
    """
    n = num_threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def build_prompt_ids(tokenizer: Any, messages_list: Sequence[list[dict]], max_prompt_length: int) -> list[list[int]]:
    """Token ids of each chat prompt via the tokenizer's chat template (generation prompt added).

    Raises:
        ValueError: a prompt is longer than ``max_prompt_length`` tokens (names the row).
    """
    out = []
    for i, messages in enumerate(messages_list):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        ids = list(map(int, ids))
        if len(ids) > max_prompt_length:
            raise ValueError(f"prompt row {i} has {len(ids)} tokens, more than data.max_prompt_length="
                             f"{max_prompt_length}")
        out.append(ids)
    return out


class PolicyWorker:
    """Actor and rollout in one process (the ``hf`` engine shares the trained module).

    With ``actor.strategy=deepspeed`` the worker is one rank of a data-parallel group
    (:class:`trajflow.workers.group.WorkerGroup` calls :meth:`init_distributed` on every rank after
    construction); rollout then runs on each rank's share of the prompts. With
    ``rollout.engine=vllm`` a vLLM engine on this rank's GPU generates and gets the new weights
    after every update; with ``rollout.pool`` set, separate rollout workers do
    (:meth:`attach_rollout`).

    Args:
        model_path: a resolved Hugging Face directory.
        actor: the ``actor`` config section as a dict.
        model_cfg: the ``model`` config section as a dict.
        rollout: the ``rollout`` config section as a dict.
        seed: initial torch/numpy/random seed.
        device: ``cpu``, ``cuda`` or ``npu``.
        num_threads: torch threads (0 = all CPUs).
    """

    def __init__(self, model_path: str, actor: dict, model_cfg: dict, rollout: dict, seed: int,
                 device: str = "cpu", num_threads: int = 0) -> None:
        from trajflow.resources import require_device

        require_device(device, "this Ray worker's node")
        self.threads = set_threads(num_threads)
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        self.actor = actor
        self.rollout_cfg = rollout
        self.device = device
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_causal_lm(model_path, model_cfg.get("dtype", "float32"), device,
                                    model_cfg.get("attn_implementation", "sdpa"))
        if model_cfg.get("gradient_checkpointing"):
            self.model.gradient_checkpointing_enable()
        self.model.config.use_cache = True
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.eos_ids = eos_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        self.model_cfg = model_cfg
        self.optimizer = None
        self.backend: Any = None
        if actor.get("strategy", "none") != "deepspeed":
            self.optimizer = adamw(self.model.parameters(), actor["lr"], actor.get("betas", (0.9, 0.999)),
                                   actor.get("weight_decay", 0.0), device)
            self.backend = LocalBackend(self.model, self.optimizer)
        if rollout.get("engine", "hf") == "vllm" and rollout.get("pool") is None:
            from trajflow.engines.vllm import VLLMRolloutEngine

            self.engine = VLLMRolloutEngine(model_path, rollout, model_cfg, self.eos_ids, seed=seed, colocated=True)
        else:
            self.engine = HFRolloutEngine(self.model, self.pad_id, self.eos_ids, rollout.get("micro_batch_size", 32),
                                          device)
        self.policy_version = 0
        self.optimizer_steps = 0

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
        if self.actor.get("strategy") != "deepspeed":
            raise RuntimeError(f"init_distributed needs actor.strategy='deepspeed', got {self.actor.get('strategy')!r}")
        from trajflow.modeling.backends import DeepSpeedBackend, setup_rank_env

        setup_rank_env(master_addr, master_port, rank, world_size, self.device)
        t0 = time.perf_counter()
        self.backend = DeepSpeedBackend(self.model, self.actor, self.model_cfg.get("dtype", "float32"), self.device,
                                        rank, world_size)
        if self.backend.zero_stage == 3 and isinstance(self.engine, HFRolloutEngine):
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
            return  # generation runs on the trained module itself: nothing to send
        if getattr(self.engine, "rank0_push", False):
            # Separate rollout workers: rank 0 sends one full copy (gathered layer by layer under ZeRO-3).
            state = self.backend.full_state_dict()
            if state is not None:
                self.engine.update_weights(state)
            return
        with self.backend.gathered():  # an engine per rank (vLLM on this rank's GPU) needs the full weights
            self.engine.update_weights({k: v.detach() for k, v in self.model.state_dict().items()})

    @dispatch("broadcast")
    def get_weights(self) -> dict[str, np.ndarray] | None:
        """All parameters as float32 numpy arrays (rank 0's copy; collective under ZeRO-3)."""
        state = self.backend.full_state_dict() if self.backend is not None else self.model.state_dict()
        if state is None:
            return None
        return {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()}

    # ------------------------------------------------------------------ info
    @dispatch("rank0")
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    @dispatch("rank0")
    def info(self) -> dict:
        return {"pid": os.getpid(), "threads": self.threads, "policy_version": self.policy_version,
                "eos_ids": self.eos_ids, "pad_id": self.pad_id,
                "num_params": sum(p.numel() for p in self.model.parameters())}

    # ------------------------------------------------------------------ rollout
    @dispatch("rank0")
    def tokenize_prompts(self, messages_list: list[list[dict]], max_prompt_length: int) -> list[list[int]]:
        return build_prompt_ids(self.tokenizer, messages_list, max_prompt_length)

    @dispatch("split", split_args=("prompt_ids",))
    def generate_sequences(self, prompt_ids: list[list[int]], params: SamplingParams,
                           recompute_log_prob: bool = False) -> dict:
        """Sample ``params.n`` responses per prompt with their rollout log-probs.

        The log-probs are read from the generation's own logits under the sampling temperature
        (no second forward pass); ``recompute_log_prob`` recomputes them teacher-forced instead.

        Returns:
            dict with ``response_ids`` (list of int lists, prompt-major), ``response_text``,
            ``finish_reason``, ``old_logprobs`` (list of float lists; absent for greedy decoding),
            ``timing_s/gen`` (seconds) and ``policy_version``.
        """
        t0 = time.perf_counter()
        out = self.engine.generate(prompt_ids, params)
        if getattr(self.engine, "colocated", False):
            self.engine.sleep()  # free the GPU memory vLLM holds for the forward passes and the update
        t1 = time.perf_counter()
        result = {"response_ids": out.response_ids, "finish_reason": out.finish_reason,
                  "response_text": self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True),
                  "policy_version": self.policy_version, "timing_s/gen": t1 - t0}
        if not params.greedy:
            if recompute_log_prob or out.logprobs is None:
                rows = [p for p in prompt_ids for _ in range(params.n)]
                result["old_logprobs"] = [x.tolist() for x in self.compute_log_prob(rows, out.response_ids, params.temperature)]
                result["timing_s/old_log_prob"] = time.perf_counter() - t1
            else:
                result["old_logprobs"] = out.logprobs
        return result

    @dispatch("split", split_args=("prompt_ids", "response_ids"))
    def compute_log_prob(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                         temperature: float) -> list[np.ndarray]:
        """Per-token log-probs under the current policy, packed exactly as :meth:`update_actor` packs."""
        logp, _ = compute_log_probs(self.model, prompt_ids, response_ids, temperature=temperature,
                                    micro_batch_size=self.actor["ppo_micro_batch_size"], pad_id=self.pad_id,
                                    device=self.device, max_tokens=self._max_tokens())
        return logp

    def _max_tokens(self) -> int | None:
        """The micro-batches' token budget (``actor.use_dynamic_bsz``), or None for fixed-size ones."""
        if self.actor.get("use_dynamic_bsz"):
            return int(self.actor.get("ppo_max_token_len_per_gpu", ActorConfig.ppo_max_token_len_per_gpu))
        return None

    def _split_rows(self, batch: dict):
        """Row ids -> micro-batches, as :func:`trajflow.modeling.packing.micro_batch_plan` cuts them."""
        def split(rows: list[int]) -> list[list[int]]:
            plan = micro_batch_plan([batch["prompt_ids"][r] for r in rows], [batch["response_ids"][r] for r in rows],
                                    int(self.actor["ppo_micro_batch_size"]), self._max_tokens())
            return [rows[sl] for sl in plan]
        return split

    # ------------------------------------------------------------------ update
    @dispatch("broadcast")
    def update_actor(self, batch: dict, temperature: float) -> dict:
        """PPO-style policy update over one iteration's batch.

        ``batch`` holds per-row lists: ``prompt_ids``, ``response_ids``, ``old_logprobs`` (the
        rollout engine's), ``advantages`` (ragged, aligned with ``response_ids``), optional
        ``ref_logprobs`` and ``loss_mask`` (ragged 0/1; rows or tokens excluded from the loss).

        The behaviour policy's log-probs in the PPO ratio are the trainer's own: when the whole
        batch is one optimizer step of one epoch (fully on-policy), they are the current forward's
        log-probs detached, so the ratio is exactly 1 and no extra forward pass is spent; otherwise
        they are recomputed before the first step with the same packing as the update. The
        engine's log-probs are compared with them (``actor/rollout_logprob_diff``) and, with
        ``batch["rollout_is"]`` (``"token"``/``"sequence"``, threshold ``batch["rollout_is_threshold"]``),
        weight the policy-gradient loss by min(pi_old / pi_rollout, threshold)
        (:mod:`stages.rollout_correction`; metrics ``rollout_corr/*``). ``shuffle_seed`` sets the
        mini-batch order and ``rng_seed`` (optional) seeds torch's global RNG first. The batch is cut into
        mini-batches of ``ppo_mini_batch_size * n`` rows (one optimizer step each) and those into
        micro-batches of ``ppo_micro_batch_size`` rows, or of at most ``ppo_max_token_len_per_gpu``
        computed tokens with ``use_dynamic_bsz`` (gradient accumulation, exact thanks to the
        mini-batch-wide denominators of :func:`stages.policy_update.agg_loss`), for ``ppo_epochs``
        passes. Under DeepSpeed every rank gets the whole batch, keeps the mini-batch-wide
        denominators and trains on its token-balanced share of each mini-batch
        (:class:`trajflow.modeling.backends.DeepSpeedBackend`); metrics are combined across ranks.

        Returns:
            Metrics averaged over optimizer steps, verl names (``actor/pg_loss``, ``actor/pg_clipfrac``,
            ``actor/ppo_kl``, ``actor/entropy``, ``actor/kl_loss``, ``actor/grad_norm``, ``actor/lr``,
            ``actor/ratio_first_step_max_abs_dev``) plus ``timing_s/update_actor``.
        """
        t0 = time.perf_counter()
        sums: dict[str, list[float]] = {}
        a = self.actor
        n_rows = len(batch["response_ids"])
        mini_rows = int(batch.get("mini_batch_rows") or n_rows)
        loss_cfg = PolicyLossConfig(clip_ratio=a["clip_ratio"], clip_ratio_low=a["clip_ratio_low"],
                                    clip_ratio_high=a["clip_ratio_high"], clip_ratio_c=a["clip_ratio_c"],
                                    loss_agg_mode=a["loss_agg_mode"])
        use_kl = a["kl_loss_coef"] > 0 and batch.get("ref_logprobs") is not None
        rng = np.random.default_rng(int(batch.get("shuffle_seed", 0)))
        if batch.get("rng_seed") is not None:
            # Any draw inside the update (dropout, ...) depends on (seed, iteration) only, not on
            # whatever ran in this process before: a resumed run updates exactly as an uninterrupted one.
            torch.manual_seed(int(batch["rng_seed"]))
        single_step = a["ppo_epochs"] == 1 and mini_rows >= n_rows
        trainer_old = None
        if not single_step:
            t_old = time.perf_counter()
            trainer_old = self.compute_log_prob(batch["prompt_ids"], batch["response_ids"], temperature)
            sums["timing_s/old_log_prob"] = [time.perf_counter() - t_old]
        diffs: list[float] = []
        is_level = batch.get("rollout_is")
        is_threshold = float(batch.get("rollout_is_threshold") or 2.0)
        is_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.model.train()
        first_step_ratio_dev = None

        def ragged(key: str, rows: Sequence[int], width: int, fill: float = 0.0) -> torch.Tensor:
            t = torch.full((len(rows), width), fill, dtype=torch.float32)
            for j, r in enumerate(rows):
                v = np.asarray(batch[key][r], dtype=np.float32)
                t[j, :len(v)] = torch.from_numpy(v[:width])
            return t.to(self.device)

        for epoch in range(a["ppo_epochs"]):
            order = np.arange(n_rows)
            if a.get("shuffle"):
                order = rng.permutation(n_rows)
            for m0 in range(0, n_rows, mini_rows):
                mini = order[m0:m0 + mini_rows]
                masks = []
                for r in mini:
                    lm = batch.get("loss_mask")
                    masks.append(np.asarray(lm[r], dtype=np.float32) if lm is not None
                                 else np.ones(len(batch["response_ids"][r]), np.float32))
                global_tokens = float(sum(m.sum() for m in masks))
                global_seqs = float(sum(1 for m in masks if m.sum() > 0))
                if global_tokens == 0:
                    continue
                self.backend.zero_grad()
                step_metrics: dict[str, float] = {}
                tokens = [len(batch["prompt_ids"][r]) + len(batch["response_ids"][r]) for r in mini]
                for rows, live in self.backend.micro_batches(mini, self._split_rows(batch), tokens):
                    packed = pack([batch["prompt_ids"][r] for r in rows], [batch["response_ids"][r] for r in rows],
                                  self.pad_id, self.device)
                    T = packed.responses.shape[1]
                    mask = packed.response_mask.float() * ragged("loss_mask", rows, T) if batch.get("loss_mask") is not None \
                        else packed.response_mask.float()
                    logp, ent = self.backend.forward(packed, temperature, compute_entropy=True,
                                                     entropy_grad=bool(a["entropy_coeff"]))
                    if trainer_old is None:
                        old = logp.detach()
                    else:
                        old = torch.zeros_like(logp)
                        for j, r in enumerate(rows):
                            old[j, :len(trainer_old[r])] = torch.from_numpy(trainer_old[r])
                    is_w = None
                    if live and batch.get("old_logprobs") is not None:
                        rollout_lp = ragged("old_logprobs", rows, T)
                        m = packed.response_mask
                        if epoch == 0:
                            diffs.append(float(((old - rollout_lp).abs() * m).sum() / m.sum().clamp(min=1)))
                        if is_level:  # truncated IS: min(pi_old / pi_rollout, C), a constant weight
                            is_w, _ = rollout_is_weights(old, rollout_lp, m, is_level, is_threshold)
                            if epoch == 0:
                                for j, r in enumerate(rows):
                                    n = len(batch["response_ids"][r])
                                    is_rows[r] = (old[j, :n].cpu().numpy(), rollout_lp[j, :n].cpu().numpy())
                    adv = ragged("advantages", rows, T)
                    # Dr. GRPO's constant normaliser is the response cap (verl pads responses to it), not
                    # the micro-batch's longest response, so micro-batches add up to the mini-batch loss.
                    agg_kw = dict(global_num_tokens=global_tokens, global_num_seqs=global_seqs,
                                  horizon=int(self.rollout_cfg.get("max_new_tokens") or T))
                    pg_loss, pg_m = compute_policy_loss(a["policy_loss"], old, logp, adv, mask, loss_cfg,
                                                        rollout_is_weights=is_w, **agg_kw)
                    loss = pg_loss
                    ent_loss = agg_loss(ent.detach() if a["entropy_coeff"] == 0 else ent, mask, a["loss_agg_mode"], **agg_kw)
                    if a["entropy_coeff"]:
                        loss = loss - a["entropy_coeff"] * ent_loss
                    if use_kl:
                        ref = ragged("ref_logprobs", rows, T)
                        kl = kl_loss(logp, ref, mask, a["kl_loss_type"], a["loss_agg_mode"], **agg_kw)
                        loss = loss + a["kl_loss_coef"] * kl
                    if not live:  # a padding micro-batch of a data-parallel rank: no gradient, no metrics
                        self.backend.backward(loss * 0.0)
                        continue
                    if use_kl:
                        step_metrics["actor/kl_loss"] = step_metrics.get("actor/kl_loss", 0.0) + kl.item()
                        step_metrics["actor/kl_coef"] = a["kl_loss_coef"]
                    self.backend.backward(loss)
                    if first_step_ratio_dev is None:
                        with torch.no_grad():
                            dev = ((logp - old).exp() - 1).abs() * mask
                            first_step_ratio_dev = float(dev.max())
                    step_metrics["actor/pg_loss"] = step_metrics.get("actor/pg_loss", 0.0) + pg_loss.item()
                    step_metrics["actor/entropy"] = step_metrics.get("actor/entropy", 0.0) + ent_loss.item()
                    frac = float(mask.sum()) / global_tokens
                    for k, v in pg_m.items():
                        step_metrics[k] = step_metrics.get(k, 0.0) + float(v) * frac
                gn, stepped = self.backend.step(a["grad_clip"])
                self.optimizer_steps += int(stepped)
                step_metrics["actor/grad_norm"] = gn
                for k, v in step_metrics.items():
                    sums.setdefault(k, []).append(v)
        self.backend.zero_grad()
        self.policy_version += 1
        # verl's training/rollout_probs_diff (actor/rollout_logprob_diff): how far the engine's
        # log-probs are from the trainer's, averaged over micro-batches (of every rank).
        metrics = self.backend.reduce_metrics(
            {k: float(np.mean(v)) for k, v in sums.items()},
            maxima={"actor/ratio_first_step_max_abs_dev": float(first_step_ratio_dev or 0.0)},
            means={"actor/rollout_logprob_diff": diffs})
        metrics["actor/lr"] = self.backend.lr()
        is_rows = self.backend.gather_rows(is_rows)  # every rank's rows (data parallel)
        if is_rows:
            metrics.update(self._rollout_is_metrics(is_rows, is_level, is_threshold))
        self._push_weights()
        metrics["timing_s/update_actor"] = time.perf_counter() - t0
        metrics["policy_version"] = self.policy_version
        return metrics

    @staticmethod
    def _rollout_is_metrics(rows: dict[int, tuple[np.ndarray, np.ndarray]], level: str, threshold: float) -> dict:
        """``rollout_corr/*`` over the whole batch from each row's (trainer old, engine) log-probs."""
        ordered = [rows[r] for r in sorted(rows)]
        width = max([len(o) for o, _ in ordered] + [1])
        old = torch.zeros((len(ordered), width), dtype=torch.float64)
        eng = torch.zeros_like(old)
        mask = torch.zeros((len(ordered), width), dtype=torch.bool)
        for i, (o, e) in enumerate(ordered):
            old[i, :len(o)] = torch.from_numpy(o.astype(np.float64))
            eng[i, :len(e)] = torch.from_numpy(e.astype(np.float64))
            mask[i, :len(o)] = True
        return rollout_is_weights(old, eng, mask, level, threshold)[1]

    # ------------------------------------------------------------------ checkpoints
    @dispatch("broadcast")
    def save_checkpoint(self, directory: str) -> dict:
        """Write weights (safetensors), optimizer state and the worker's RNG states into ``directory``.

        Under DeepSpeed: sharded model/optimizer states (one file per rank) and per-rank RNG states.
        """
        from safetensors.torch import save_file

        if self.backend.distributed:
            self.backend.save(directory, {"policy_version": self.policy_version,
                                          "optimizer_steps": self.optimizer_steps})
            return {"policy_version": self.policy_version}
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        # Tied embeddings share storage; safetensors refuses shared tensors, so store copies.
        seen: dict[int, str] = {}
        for k, v in list(state.items()):
            ptr = v.data_ptr()
            if ptr in seen:
                state[k] = v.clone()
            seen[ptr] = k
        save_file(state, str(d / "model.safetensors"))
        torch.save({"optimizer": self.optimizer.state_dict(), "policy_version": self.policy_version,
                    "optimizer_steps": self.optimizer_steps,
                    "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                            "python": random.getstate()}}, d / "actor_state.pt")
        return {"policy_version": self.policy_version}

    @dispatch("broadcast")
    def load_checkpoint(self, directory: str) -> dict:
        """Restore weights, optimizer and RNG states saved by :meth:`save_checkpoint`."""
        from safetensors.torch import load_file

        if self.backend.distributed:
            state = self.backend.load(directory)
            self.policy_version = int(state["policy_version"])
            self.optimizer_steps = int(state.get("optimizer_steps", 0))
            self._push_weights()
            return {"policy_version": self.policy_version}
        d = Path(directory)
        state = load_file(str(d / "model.safetensors"), device=str(self.device) if self.device != "cpu" else "cpu")
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise RuntimeError(f"{d}/model.safetensors does not match the model: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")
        extra = torch.load(d / "actor_state.pt", weights_only=False)
        self.optimizer.load_state_dict(extra["optimizer"])
        self.policy_version = int(extra["policy_version"])
        self.optimizer_steps = int(extra.get("optimizer_steps", 0))
        torch.set_rng_state(extra["rng"]["torch"])
        np.random.set_state(extra["rng"]["numpy"])
        random.setstate(extra["rng"]["python"])
        self._push_weights()
        return {"policy_version": self.policy_version}

    @dispatch("broadcast")
    def export_hf(self, directory: str) -> str:
        """Save the current policy as a Hugging Face model directory (``from_pretrained``-loadable).

        Under DeepSpeed rank 0 writes the consolidated weights (ZeRO-3 gathers them layer by layer).
        """
        if self.backend is not None and self.backend.distributed:
            state = self.backend.full_state_dict()
            if state is not None:
                self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
                self.tokenizer.save_pretrained(directory)
            import torch.distributed as dist

            dist.barrier()
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
