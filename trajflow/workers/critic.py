"""The critic worker: a value model V(s_t) for GAE, trained with the clipped value loss.

A causal LM's transformer body plus a zero-initialised linear value head (:class:`ValueModel`),
with its own AdamW; run as a Ray actor by :func:`trajflow.run.workers.create_workers` only when the
advantage estimator needs values (``algorithm.adv_estimator=gae``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from trajflow.stages.critic_update import CriticBatch, CriticRows
from trajflow.stages.policy_update import explained_variance, value_loss
from trajflow.config import CriticConfig, ModelConfig
from trajflow.modeling.backends import adamw
from trajflow.modeling.packing import PackedBatch, micro_batch_slices, pack
from trajflow.modeling.precision import autocast, cast_buffers, section_dtype
from trajflow.models import disable_dropout, load_causal_lm, load_tokenizer
from trajflow.state_files import load_state, save_state
from trajflow.workers.base import Worker
from trajflow.workers.group import dispatch, free_address


class ValueModel(torch.nn.Module):
    """Transformer body + linear value head.

    The body is a causal LM's ``model.get_decoder()`` (embeddings, blocks, final norm; no LM head),
    as verl's and TRL's critics. It starts from ``critic.path`` when set, else from the policy's
    initial weights. The head starts at zero (V = 0 everywhere), so the first GAE advantages are
    the discounted returns. Values use the packing of :mod:`trajflow.modeling.packing`: the value
    of response token ``t`` is read at the hidden state that predicts it (column ``P - 1 + t``),
    the state *before* the token is generated, which is what GAE's ``V(s_t)`` means (verl reads
    ``values[:, -T-1:-1]`` the same way).

    Args:
        decoder: the body of a causal LM (``model.get_decoder()``), returning ``last_hidden_state``.
        hidden_size: width of the body's output.
    """

    def __init__(self, decoder: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, packed: PackedBatch) -> torch.Tensor:
        """Values of the response positions.

        Args:
            packed: a micro-batch from :func:`trajflow.modeling.packing.pack`.

        Returns:
            ``(b, T)`` float32 values V(s_t) for response tokens ``t = 0..T-1``; entries outside
            ``packed.response_mask`` are meaningless.
        """
        hidden = self.decoder(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                              position_ids=packed.position_ids, use_cache=False).last_hidden_state
        P, T = packed.prompt_width, packed.responses.shape[1]
        h = hidden[:, P - 1:P - 1 + T]
        return self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()


class CriticWorker(Worker):
    """Value model and its optimizer, resident across iterations (a Ray actor in the pipeline).

    With ``critic.strategy=fsdp2`` the worker is one rank of a worker group over the critic's pool
    (:meth:`init_distributed` shards the value model, :class:`trajflow.modeling.fsdp.FSDP2Backend`):
    every rank gets the whole batch, keeps the mini-batch-wide token count and trains on its
    token-balanced share, as the policy's data-parallel ranks do.

    Args:
        model_path: resolved Hugging Face directory of a causal LM whose body becomes the critic
            (``critic.path`` or the policy's ``model.path``).
        critic: the ``critic`` config section (``lr``, ``cliprange_value``, ``ppo_epochs``,
            ``ppo_micro_batch_size``, ``grad_clip``, ``mixed_precision``).
        model_cfg: the ``model`` config section (``dtype``, ``attn_implementation``,
            ``gradient_checkpointing``).
        device: torch device.
        num_threads: torch threads (0 = all CPUs).

    Raises:
        trajflow.models.ModelLoadError: the directory cannot be loaded.
    """

    def __init__(self, model_path: str, critic: CriticConfig, model_cfg: ModelConfig, device: str = "cpu",
                 num_threads: int = 0) -> None:
        self._start(device, num_threads)
        self.cfg = critic
        lm = load_causal_lm(model_path, model_cfg.dtype, device, model_cfg.attn_implementation)
        if model_cfg.gradient_checkpointing:
            lm.gradient_checkpointing_enable()
        hidden = int(lm.config.hidden_size)
        self.model = ValueModel(lm.get_decoder(), hidden).to(device)
        del lm
        disable_dropout(self.model)  # the value loss compares with values computed without dropout
        # fp32 master weights and AdamW state; forwards in critic.mixed_precision.param_dtype.
        self.param_dtype = section_dtype(critic)
        cast_buffers(self.model, str(getattr(getattr(critic, "mixed_precision", None), "buffer_dtype", "float32")))
        self.pad_id = int(load_tokenizer(model_path).pad_token_id)
        # The critic section has no weight decay setting: AdamW's 0.
        self.optimizer = adamw(self.model.parameters(), critic.lr, device=device) \
            if getattr(critic, "strategy", "none") != "fsdp2" else None
        self.backend = None  # FSDP2Backend once init_distributed ran
        self.optimizer_steps = 0

    # ------------------------------------------------------------------ distributed
    @dispatch("rank0")
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node IP and a free port: where the ranks' process group meets."""
        return free_address()

    def init_distributed(self, master_addr: str, master_port: int, rank: int, world_size: int) -> dict:
        """Join the critic's ranks and shard the value model with FSDP2 (every rank at once).

        Raises:
            RuntimeError: ``critic.strategy`` is not ``fsdp2``.
        """
        import time as _time

        if getattr(self.cfg, "strategy", "none") != "fsdp2":
            raise RuntimeError(f"init_distributed needs critic.strategy='fsdp2', got {self.cfg.strategy!r}")
        from trajflow.modeling.backends import setup_rank_env
        from trajflow.modeling.fsdp import FSDP2Backend

        setup_rank_env(master_addr, master_port, rank, world_size, self.device)
        t0 = _time.perf_counter()
        self.backend = FSDP2Backend(self.model, self.cfg, self.device, rank, world_size, policy=False,
                                    state_name="critic_state")
        self.optimizer = self.backend.optimizer
        return {"rank": rank, "world_size": world_size, "init_s": _time.perf_counter() - t0}

    # ------------------------------------------------------------------ values
    @dispatch("split", split_args=("prompt_ids", "response_ids"))
    @torch.no_grad()
    def compute_values(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """V(s_t) for every response token, as ragged float32 arrays aligned with ``response_ids``."""
        was_training = self.model.training
        self.model.eval()
        out: list[np.ndarray] = []
        try:
            for sl in micro_batch_slices(len(prompt_ids), int(self.cfg.ppo_micro_batch_size)):
                packed = pack(prompt_ids[sl], response_ids[sl], self.pad_id, self.device)
                with autocast(self.param_dtype, self.device):
                    v = self.model(packed)
                for j, r in enumerate(response_ids[sl]):
                    out.append(v[j, :len(r)].cpu().numpy().astype(np.float32))
        finally:
            self.model.train(was_training)
        return out

    # ------------------------------------------------------------------ update
    def update_critic(self, batch: CriticBatch) -> dict:
        """Clipped value-loss regression of V onto the returns (:func:`trajflow.stages.critic_update.critic_batch`).

        The loss is :func:`trajflow.stages.policy_update.value_loss` with ``critic.cliprange_value``,
        token-mean over each mini-batch of ``settings.mini_batch_rows`` rows (exact under
        micro-batching), rows in ``settings.shuffle_seed``'s order with ``settings.shuffle``, for
        ``critic.ppo_epochs`` passes.

        Returns:
            Metrics averaged over optimizer steps: ``critic/vf_loss``, ``critic/vf_clipfrac``,
            ``critic/vpred_mean``, ``critic/grad_norm``; plus ``critic/vf_explained_var`` of the
            pre-update values (verl's definition), ``critic/lr`` and ``timing_s/update_critic``.
        """
        t0 = time.perf_counter()
        c = self.cfg
        rows, settings = batch.rows, batch.settings
        n_rows = len(rows.response_ids)
        mini_rows = int(settings.mini_batch_rows or n_rows)
        rng = np.random.default_rng(int(settings.shuffle_seed))
        lm = rows.loss_mask

        def row_mask(r: int) -> np.ndarray:
            return np.asarray(lm[r], np.float32) if lm is not None else np.ones(len(rows.response_ids[r]), np.float32)

        def ragged(values: Sequence[Sequence[float]], ids: Sequence[int], width: int) -> torch.Tensor:
            t = torch.zeros((len(ids), width), dtype=torch.float32)
            for j, r in enumerate(ids):
                v = np.asarray(values[r], dtype=np.float32)[:width]
                t[j, :len(v)] = torch.from_numpy(v)
            return t.to(self.device)

        ev = self._explained_variance(rows, row_mask)
        self.model.train()
        sums: dict[str, list[float]] = {}
        step_tokens: list[float] = []  # each optimizer step's token count
        for _ in range(int(c.ppo_epochs)):
            order = rng.permutation(n_rows) if settings.shuffle else np.arange(n_rows)
            for m0 in range(0, n_rows, mini_rows):
                mini = order[m0:m0 + mini_rows]
                global_tokens = float(sum(row_mask(int(r)).sum() for r in mini))
                if global_tokens == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                step: dict[str, float] = {}
                for ids, live in self._micro_batches(rows, mini):
                    packed = pack([rows.prompt_ids[r] for r in ids], [rows.response_ids[r] for r in ids],
                                  self.pad_id, self.device)
                    T = packed.responses.shape[1]
                    mask = packed.response_mask.float()
                    if lm is not None:
                        mask = mask * ragged(lm, ids, T)
                    if self.backend is not None:
                        vpreds = self.backend.forward(packed)
                    else:
                        with autocast(self.param_dtype, self.device):
                            vpreds = self.model(packed)  # float32 out: the head's output is cast up
                    loss, m = value_loss(vpreds, ragged(rows.values, ids, T), ragged(rows.returns, ids, T), mask,
                                         float(c.cliprange_value), "token-mean", global_num_tokens=global_tokens)
                    if not live:  # a padding micro-batch of a data-parallel rank: zero gradient, no metrics
                        self.backend.backward(loss * 0.0)
                        continue
                    if self.backend is not None:
                        self.backend.backward(loss)
                    else:
                        loss.backward()
                    frac = float(mask.sum()) / global_tokens
                    step["critic/vf_loss"] = step.get("critic/vf_loss", 0.0) + float(loss.item())
                    for k, v in m.items():
                        step[k] = step.get(k, 0.0) + float(v) * frac
                if self.backend is not None:
                    gn, stepped = self.backend.step(float(c.grad_clip))
                    self.optimizer_steps += int(stepped)
                elif c.grad_clip > 0:
                    gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip))
                else:
                    gn = float(torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in self.model.parameters()
                                              if p.grad is not None)))
                if self.backend is None and math.isfinite(gn):
                    self.optimizer.step()
                    self.optimizer_steps += 1
                step["critic/grad_norm"] = gn
                step_tokens.append(global_tokens)
                for k, v in step.items():
                    sums.setdefault(k, []).append(v)
        self.optimizer.zero_grad(set_to_none=True)
        # Token means over the whole update: each step's value is a token mean of its mini-batch, and
        # steps weigh by their tokens; the gradient norm is one value per step (a plain mean).
        metrics = {k: float(np.mean(v)) if k == "critic/grad_norm" else float(np.average(v, weights=step_tokens))
                   for k, v in sums.items()}
        if self.backend is not None:  # each rank's share of a token mean (global denominators) adds up
            metrics = self.backend.reduce_metrics(metrics, maxima={})
        metrics["critic/vf_explained_var"] = ev
        metrics["critic/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["timing_s/update_critic"] = time.perf_counter() - t0
        return metrics

    def _micro_batches(self, rows: CriticRows, mini: np.ndarray) -> list[tuple[list[int], bool]]:
        """``(row ids, live)`` per micro-batch of ``critic.ppo_micro_batch_size`` rows: all of the
        mini-batch in one process, this rank's share (equally many on every rank) under FSDP2."""
        size = int(self.cfg.ppo_micro_batch_size)

        def split(ids: list[int]) -> list[list[int]]:
            return [ids[sl] for sl in micro_batch_slices(len(ids), size)]

        ids = [int(r) for r in mini]
        if self.backend is None:
            return [(part, True) for part in split(ids)]
        tokens = [len(rows.prompt_ids[r]) + len(rows.response_ids[r]) for r in ids]
        return self.backend.micro_batches(ids, split, tokens)

    @staticmethod
    def _explained_variance(rows: CriticRows, row_mask) -> float:
        vals = [np.asarray(v, np.float64) for v in rows.values]
        rets = [np.asarray(r, np.float64) for r in rows.returns]
        width = max([len(v) for v in vals] + [1])
        V = torch.zeros((len(vals), width), dtype=torch.float64)
        R = torch.zeros_like(V)
        M = torch.zeros_like(V)
        for i, (v, r) in enumerate(zip(vals, rets)):
            V[i, :len(v)] = torch.from_numpy(v)
            R[i, :len(r)] = torch.from_numpy(r)
            M[i, :len(v)] = torch.from_numpy(row_mask(i).astype(np.float64)[:len(v)])
        return explained_variance(V, R, M)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str) -> dict:
        """Write the value model (safetensors) and optimizer state into ``directory``."""
        from safetensors.torch import save_file

        if self.backend is not None:  # per-rank shards (trajflow.modeling.fsdp)
            self.backend.save(directory, {"optimizer_steps": self.optimizer_steps})
            return {"optimizer_steps": self.optimizer_steps}
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        seen: set[int] = set()
        for k, v in list(state.items()):  # tied weights share storage; safetensors refuses that
            if v.data_ptr() in seen:
                state[k] = v.clone()
            seen.add(v.data_ptr())
        save_file(state, str(d / "model.safetensors"))
        save_state({"optimizer": self.optimizer.state_dict(), "optimizer_steps": self.optimizer_steps}, d,
                   "critic_state")
        return {"optimizer_steps": self.optimizer_steps}

    def load_checkpoint(self, directory: str) -> dict:
        """Restore what :meth:`save_checkpoint` wrote.

        Raises:
            RuntimeError: the saved tensors do not match this value model.
        """
        from safetensors.torch import load_file

        if self.backend is not None:
            self.optimizer_steps = int(self.backend.load(directory).get("optimizer_steps", 0))
            return {"optimizer_steps": self.optimizer_steps}
        d = Path(directory)
        state = load_file(str(d / "model.safetensors"))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"{d}/model.safetensors does not match the critic: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")
        extra = load_state(d, "critic_state")
        self.optimizer.load_state_dict(extra["optimizer"])
        self.optimizer_steps = int(extra.get("optimizer_steps", 0))
        return {"optimizer_steps": self.optimizer_steps}

    def weights_digest(self) -> str:
        """sha256 over the value model's parameters (tests compare states)."""
        from trajflow.checkpoint import state_digest

        if self.backend is not None:  # gathered block by block; every rank returns rank 0's digest
            return state_digest(self.backend.full_state_dict() or {})
        return state_digest(self.model.state_dict())

    def get_weights(self) -> dict[str, np.ndarray] | None:
        """All parameters as float32 numpy arrays (rank 0's; gathered under FSDP2, a collective)."""
        state = self.backend.full_state_dict() if self.backend is not None else self.model.state_dict()
        if state is None:
            return None
        return {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()}
