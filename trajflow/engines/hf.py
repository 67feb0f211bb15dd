"""Rollout with Hugging Face ``generate`` on the policy's own module (CPU or GPU)."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from trajflow.stages.rollout import SamplingParams, logprobs_from_logits, response_lengths_and_finish
from trajflow.engines.base import GenerationOutput, LogprobKind, RolloutEngine, WeightSync
from trajflow.engines.batching import decode_continuous
from trajflow.modeling.forward import PromptLayout, encode_prompts, layout_prompts, prefix_fits_window
from trajflow.modeling.support import fast_path_unsupported, note_fallback


class HFRolloutEngine(RolloutEngine):
    """Samples from a transformers causal LM that is also the one being trained.

    Sharing the module means weight sync is free and the rollout always uses the newest policy.
    Prompts are sorted by length (so padding wastes little compute) and generated
    ``micro_batch_size // n`` prompts (all ``n`` samples of each) per ``generate`` call. The call's
    prompts are prefilled around their common prefix (:class:`trajflow.modeling.forward.PromptLayout`:
    the prefix once, each prompt's remainder once) and the KV cache is copied to each prompt's ``n``
    rows, so no prompt token is computed twice. Responses are returned in prompt-major order.

    Decoding is trajflow's own loop (:func:`trajflow.engines.batching.decode_continuous`), not
    ``generate``: a row that emits EOS leaves the batch at once (its KV cache rows are dropped), and
    with ``continuous_batching`` the freed slots are refilled with the next rows, one slot at a time
    (a prompt is prefilled once and its cache kept for its later rows), their cache joined to the
    running batch, so every step runs ``micro_batch_size`` rows until the last prompts drain; each
    step appends its keys and values in place (:mod:`trajflow.engines.kv_cache`), and a bf16 copy's
    linear weights are packed for oneDNN (:mod:`trajflow.modeling.packed_linear`, bit-identical), and a
    Llama-family model's decode forwards run through :func:`trajflow.engines.decode_step.decode_step`
    (its own layers without the model forward's per-call machinery; ``lean_step``); tokens are drawn by :func:`trajflow.stages.rollout.sample_tokens` with one pre-drawn
    uniform per row and token from a generator seeded per group of ``micro_batch_size // n``
    prompts (the same samples whatever the schedule), and their log-probs come from the same logits. Under ZeRO-3 (``synced_gpus``) every rank must run
    the same number of forwards, so ``generate(synced_gpus=True)`` is used instead; a model the fast
    paths are not verified for (:func:`trajflow.modeling.support.fast_path_unsupported`) decodes with
    plain ``generate`` on left-padded prompts, with one log line saying so.

    With a sliding window shorter than prompt + response the prompts are not laid out around a
    common prefix (:func:`trajflow.modeling.forward.prefix_fits_window`): every prompt is left-padded
    whole, so the window counts real tokens, as it does for ``generate``.

    Rollout precision (``rollout.dtype``): with a ``dtype`` other than the trained module's, the
    engine samples from its own copy of the module in that dtype (a bf16 copy halves the bytes each
    decode step reads, and runs bf16 matmuls), refreshed from the trained module by :meth:`sync`
    after every update. Its log-probs then differ slightly from the trainer's; the update logs the
    difference (``rollout_corr/*``) and ``algorithm.rollout_is`` corrects for it. The policy worker
    frees the copy's weights (:meth:`release`) while it updates, the phase that also holds the
    gradients, the activations and autocast's bf16 casts of the weights; the cast :meth:`sync` does
    after every update allocates them anew.

    Args:
        model: the policy module.
        pad_id: pad token id (left padding of prompts).
        eos_ids: ids that end a response.
        micro_batch_size: decode slots: most rows per decoding step (``rollout.micro_batch_size``).
        device: torch device of the model.
        dtype: ``rollout.dtype`` (``None`` or the module's own dtype: share the module).
        continuous_batching: refill finished rows' slots with the next prompts
            (``rollout.continuous_batching``); off, each group of ``micro_batch_size // n`` prompts
            decodes alone until its longest response ends.

    Contract (:class:`trajflow.engines.base.RolloutEngine`): weights SHARED with the trained module
    (:meth:`refresh` re-casts the copy), or FULL when the module is a rollout worker's own copy;
    RAW log-probs (unfiltered, tempered); :meth:`sleep` frees the cast copy, :meth:`wake_up` re-casts it.
    """

    weight_sync = (WeightSync.SHARED, WeightSync.FULL)
    logprob_kind = LogprobKind.RAW

    def __init__(self, model: torch.nn.Module, pad_id: int, eos_ids: Sequence[int], micro_batch_size: int = 32,
                 device: str = "cpu", dtype: str | None = None, continuous_batching: bool = True) -> None:
        from trajflow.modeling.precision import DTYPES

        self.source = model
        self.model = model
        self.pad_id = pad_id
        self.eos_ids = list(eos_ids)
        self.micro_batch_size = micro_batch_size
        self.continuous_batching = continuous_batching
        self.device = device
        # A bf16 copy's linear weights packed for oneDNN once per sync (trajflow.modeling.packed_linear):
        # a decode step's small-M matmuls then skip the per-call weight reorder. Bit-identical output.
        self.pack_weights = True
        # Each decode step appends its keys and values in place (trajflow.engines.kv_cache).
        self.in_place_cache = True
        # Free slots take the next rows at once, a prompt's rows possibly starting at different steps.
        self.split_groups = True
        # Decode forwards of Llama-family models through trajflow.engines.decode_step (same layers,
        # without the model forward's per-call machinery); other models run their own forward.
        self.lean_step = True
        # Rows that end while others wait leave their places in the KV cache to the next rows
        # (trajflow.engines.batching.decode_continuous, reuse_slots) instead of two whole-cache copies.
        self.reuse_slots = True
        self._packed = self._pack_checked = False
        target = DTYPES[dtype] if dtype is not None else None
        self._released = False
        if target is not None and any(p.is_floating_point() and p.dtype != target for p in model.parameters()):
            self.model = _empty_copy(model, target)
            self._dtype = target
            self._released = True
            self.sync()
        # Data-parallel ranks with sharded parameters (ZeRO-3) must run every decoding step together.
        self.synced_gpus = False

    @property
    def own_copy(self) -> bool:
        """Whether the engine samples from its own copy of the weights (another dtype than training)."""
        return self.model is not self.source

    @torch.no_grad()
    def sync(self, buckets: Iterable[Mapping[str, torch.Tensor]] | None = None) -> None:
        """Copy the trained module's current weights into the engine's copy, cast to its dtype
        (a no-op when the engine shares the module). Parameters and buffers are matched by name;
        a released copy (:meth:`release`) gets new storage.

        Args:
            buckets: the whole weights one part at a time (``{name: tensor}``, e.g. one transformer
                block of FSDP2-sharded parameters gathered at a time), read in place of the module's
                parameters; each is cast into the copy before the next is taken. Buffers (never
                sharded) still come from the module.
        """
        if not self.own_copy:
            return
        self._unpack(restore=False)  # the packed weights are stale; the emptied ones are cast below
        mine = dict(_tensors(self.model))
        packable = self._packable()
        src: dict[str, torch.Tensor] = dict(self.source.named_buffers())
        if buckets is None:
            src.update(dict(self.source.named_parameters()))
        else:
            for bucket in buckets:
                for name in [n for n in bucket if n in mine]:
                    self._cast_into(mine.pop(name), bucket[name])
                    self._pack_one(packable.get(name))
                del bucket  # before the next one is gathered
        missing = [name for name in mine if name not in src and isinstance(mine[name], torch.nn.Parameter)]
        if buckets is not None and missing:
            raise RuntimeError(f"sync: the weight buckets lack {missing[:3]} of the engine's copy")
        for name, t in mine.items():
            if name in src:
                self._cast_into(t, src[name])
                self._pack_one(packable.get(name))
        self._released = False
        self._pack()

    def _packable(self) -> dict:
        """``{weight name: (module, free its plain weight)}`` of the layers :meth:`_pack` packs
        (none when packing is off or unavailable)."""
        from trajflow.modeling.packed_linear import packing_available, shared_weights

        if not (self.pack_weights and self.own_copy and packing_available(self._dtype, self.device)):
            return {}
        shared = shared_weights(self.model)
        return {f"{prefix}.weight": (m, id(m.weight) not in shared) for prefix, m in self.model.named_modules()
                if type(m) is torch.nn.Linear}

    def _pack_one(self, entry) -> None:
        """Pack one layer right after its weight was cast (so a sync holds one layer's plain weight
        beyond the copy at a time, not all of them)."""
        from trajflow.modeling.packed_linear import pack_linear

        if entry is not None:
            pack_linear(entry[0], self.micro_batch_size, check=not self._pack_checked, free_weight=entry[1])
            self._packed = True

    def _pack(self) -> None:
        """Pack every bf16 linear of the copy not packed yet (trajflow.modeling.packed_linear)."""
        from trajflow.modeling.packed_linear import pack_linears, packing_available

        if self.pack_weights and self.own_copy and packing_available(self._dtype, self.device):
            pack_linears(self.model, self.micro_batch_size, check=not self._pack_checked)
            self._packed = self._pack_checked = True

    def _unpack(self, restore: bool) -> None:
        from trajflow.modeling.packed_linear import unpack_linears

        if self._packed:
            unpack_linears(self.model, restore=restore)
            self._packed = False

    def _cast_into(self, t: torch.Tensor, value: torch.Tensor) -> None:
        # An emptied tensor (released, or a weight emptied while packed) gets new storage.
        if (self._released or t.shape != value.shape) and t.is_floating_point():
            t.data = value.detach().to(self._dtype, copy=True)
        else:
            t.copy_(value)

    def release(self) -> None:
        """Free the storage of the engine's own copy of the weights (a no-op when it shares the
        module) until the next :meth:`sync`, which casts them from the trained module again (as does
        :meth:`generate` if no sync came: the trained module then still holds the weights the
        copy had, as long as every change to it is followed by a sync, as the policy worker does)."""
        if not self.own_copy or self._released:
            return
        self._unpack(restore=False)
        for _, t in _tensors(self.model):
            if t.is_floating_point():
                t.data = t.data.new_empty(0)
        self._released = True

    # ------------------------------------------------------------ contract
    def refresh(self, gathered=contextlib.nullcontext, buckets=None) -> None:
        """WeightSync.SHARED: the trained module changed; re-cast the copy (:meth:`sync`, inside
        ``gathered()``, or from ``buckets()`` when given); nothing when the module is shared."""
        if self.own_copy:
            self._sync_from(gathered, buckets)

    def _sync_from(self, gathered, buckets) -> None:
        if buckets is not None:
            self.sync(buckets())
        else:
            with gathered():
                self.sync()

    def sleep(self) -> None:
        """Free the cast copy's storage (:meth:`release`); nothing when the module is shared."""
        self.release()

    def wake_up(self, gathered=contextlib.nullcontext, buckets=None) -> None:
        """Re-cast a released copy from the trained module (inside ``gathered()``: whole parameters;
        or from ``buckets()``, as in :meth:`refresh`)."""
        if self._released:
            self._sync_from(gathered, buckets)

    def on_sharded_module(self, world_size: int) -> None:
        """Sharded parameters (ZeRO-3) read in place: every decoding step gathers them, so the ranks
        step together (``generate(synced_gpus=True)``). A copy in another dtype is whole on every rank."""
        if not self.own_copy:
            self.synced_gpus = world_size > 1

    def update_weights(self, named_tensors, version: int | None = None) -> None:
        """WeightSync.FULL: load new weights ``{name: tensor}`` into the module (a separate rollout
        worker's copy); ``version`` is not kept (the rollout worker records it).

        Raises:
            RuntimeError: a name the module does not have.
        """
        state = dict(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        was_packed = self._packed
        self._unpack(restore=True)  # load_state_dict copies into whole weights
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if was_packed:
            self._pack()
        if unexpected:
            raise RuntimeError(f"update_weights: unknown weights {unexpected[:3]}")

    def _prefill(self, layout: PromptLayout, n: int):
        """KV cache of all but the last column of ``layout``, computed once per prompt (the common
        prefix once per call) and repeated ``n`` times; ``None`` if there is nothing to cache.

        ``generate`` then only runs the last prompt token and the new ones; the layout's position ids
        follow ``generate``'s own rule (count of real tokens so far), so the cache is what it would
        have computed itself.
        """
        _, cache = encode_prompts(self.model.get_decoder(), layout, layout.input_ids.shape[1] - 1)
        if cache is not None and n > 1:
            cache.batch_repeat_interleave(n)
        return cache

    @torch.no_grad()
    def _generate_synced(self, layout: PromptLayout, n: int, params: SamplingParams,
                         seed: int, synced: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode loop's result (:func:`trajflow.engines.batching.decode_continuous`) from ``generate(synced_gpus=True)``, for ZeRO-3 ranks in lockstep;
        ``synced=False``: plain ``generate`` with no cache handed in (``layout`` left-padded, no
        common prefix), for models the fast paths are not verified for."""
        width = layout.input_ids.shape[1]
        cache = self._prefill(layout, n) if synced else None
        ids = layout.input_ids.repeat_interleave(n, dim=0)
        attn = layout.attention_mask.repeat_interleave(n, dim=0)
        torch.manual_seed(seed)
        # output_logits: the raw per-step logits, from which the sampled tokens' log-probs under the
        # sampling temperature are read without a second forward pass.
        kwargs = dict(max_new_tokens=params.max_new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                      return_dict_in_generate=True, output_logits=not params.greedy, synced_gpus=synced)
        if cache is not None:
            kwargs["cache"] = cache
        if params.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            # top_k=0 disables the warper; None would fall back to generation_config's 50.
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        out = self.model.generate(input_ids=ids, attention_mask=attn, **kwargs)
        resp = out.sequences[:, width:].cpu()
        if resp.shape[1] == 0:
            resp = torch.full((ids.shape[0], 1), self.pad_id, dtype=torch.long)
        step_lp = None
        if out.logits:
            step_lp = torch.stack([logprobs_from_logits(lg, resp[:, t].to(lg.device), params.temperature)
                                   for t, lg in enumerate(out.logits)], dim=1).cpu()
        return resp, step_lp

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Sample ``params.n`` responses for each prompt; see :class:`GenerationOutput` for the order.

        Raises:
            ValueError: ``params.max_new_tokens < 1``.
        """
        if int(params.max_new_tokens) < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if self._released:  # an update released the copy and stopped before its sync
            self.sync()
        n = int(params.n)
        prompts = [list(p) for p in prompt_ids]
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        per_call = max(1, self.micro_batch_size // n)
        total = len(prompts) * n
        responses: list[list[int] | None] = [None] * total
        finish: list[str | None] = [None] * total
        logprobs: list[list[float] | None] = [None] * total
        gen = torch.Generator(device="cpu").manual_seed(int(params.seed))
        unsupported = fast_path_unsupported(self.model)
        if unsupported is not None and not self.synced_gpus:
            note_fallback(self.model, "decoding", unsupported)
        longest = max((len(p) for p in prompts), default=0) + int(params.max_new_tokens)
        share_prefix = unsupported is None and prefix_fits_window(self.model.config, longest)
        groups = [order[start:start + per_call] for start in range(0, len(order), per_call)]
        # One RNG stream per group of prompts, seeded in a fixed order: same seed, same samples.
        seeds = [int(torch.randint(0, 2**62, (1,), generator=gen)) for _ in groups]
        steps: list[int] = []
        was_training = self.model.training
        self.model.eval()
        try:
            if self.synced_gpus or unsupported is not None:
                for pidx, seed in zip(groups, seeds):
                    idx = [i * n + s for i in pidx for s in range(n)]  # output rows, prompt-major
                    layout = layout_prompts([prompts[i] for i in pidx], self.pad_id, self.device, share_prefix)
                    resp, step_lp = self._generate_synced(layout, n, params, seed, synced=self.synced_gpus)
                    self._collect(resp, step_lp, idx, responses, finish, logprobs)
            else:
                resp, step_lp = decode_continuous(self.model, prompts, groups, seeds, params, self.micro_batch_size,
                                                  self.pad_id, self.eos_ids, self.device, share_prefix,
                                                  join=self.continuous_batching, on_step=steps.append,
                                                  in_place_cache=self.in_place_cache, split_groups=self.split_groups,
                                                  lean_step=self.lean_step, reuse_slots=self.reuse_slots)
                self._collect(resp, step_lp, range(total), responses, finish, logprobs)
        finally:
            self.model.train(was_training)
        stats = {"decode_steps": len(steps), "decode_rows_mean": float(np.mean(steps)) if steps else 0.0}
        return GenerationOutput(response_ids=responses, finish_reason=finish,  # type: ignore[arg-type]
                                rollout_logprobs=None if params.greedy else logprobs, stats=stats)  # type: ignore[arg-type]

    def _collect(self, resp: torch.Tensor, step_lp: torch.Tensor | None, idx, responses: list, finish: list,
                 logprobs: list) -> None:
        """Cut each row of ``resp`` ``(rows, T)`` after its first EOS into the output lists at ``idx``."""
        lengths, reasons = response_lengths_and_finish(resp, self.eos_ids)
        for j, i in enumerate(idx):
            length = int(lengths[j])
            responses[i] = resp[j, :length].tolist()
            finish[i] = reasons[j]
            if step_lp is not None:
                logprobs[i] = step_lp[j, :length].tolist()


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter and buffer, each shared tensor once (tied embeddings)."""
    return list(model.named_parameters()) + list(model.named_buffers())


def _empty_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen, eval-mode copy of ``model`` whose floating-point parameters and buffers are empty
    tensors of ``dtype`` (shared ones stay shared), for :meth:`HFRolloutEngine.sync` to fill.

    ``copy.deepcopy(model).to(dtype)`` would first copy every weight in the module's own dtype: a
    second full-precision model, held until the cast.
    """
    memo: dict[int, torch.Tensor] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point() and id(t) not in memo:
            empty = t.detach().new_empty(0, dtype=dtype)
            memo[id(t)] = torch.nn.Parameter(empty, requires_grad=False) if isinstance(t, torch.nn.Parameter) \
                else empty
    out = copy.deepcopy(model, memo)
    return out.eval()


def generated_token_count(out: GenerationOutput) -> int:
    """Total response tokens in a generation output."""
    return int(np.sum([len(r) for r in out.response_ids]))
