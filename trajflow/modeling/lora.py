"""LoRA adapters on the actor, through the peft library (LoRA: Hu et al. 2021, arXiv:2106.09685).

Each targeted linear layer ``y = W x`` becomes ``y = W x + s B A x`` with ``A``
``(r, in)`` and ``B`` ``(out, r)`` trainable and ``W`` frozen; ``B`` starts at zero, so the wrapped
model starts as the base model. The scale is ``s = alpha / r`` (Hu et al. 2021, Sec. 4.1) or, with
``model.lora_use_rslora``, ``s = alpha / sqrt(r)`` (rank-stabilised LoRA: Kalajdzievski 2023, "A
Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", arXiv:2312.03732, Theorem 3.2). peft
applies it in the forward and in its merge, writes it into ``adapter_config.json`` (``use_rslora``),
and vLLM reads it from there, so every path that applies the adapter uses the same scale; a
checkpoint records it (:func:`adapter_record`) and a run with another scale refuses to load it
(:func:`check_adapter_record`). peft replaces the layers in place (``get_peft_model``), so every
trajflow forward that calls the model's own modules (the tree-packed and cached-prompt forwards,
the HF decode loop) runs through the adapters without change.

What this module adds on top of peft:

- :func:`apply_lora`: the ``model.lora_*`` config keys (verl's names) as a ``LoraConfig``;
- :func:`adapter_state` / :func:`load_adapter_state`: the trainable tensors only (what a
  checkpoint stores: megabytes instead of the whole model);
- :func:`merged_state_dict` / :func:`merged_buckets`: ``W + s B A`` under the base model's own parameter
  names, without touching the live module (weight sync to engines that load plain Hugging Face
  weights; one transformer block at a time from sharded parameters);
- :func:`save_final`: ``final/`` as a plain merged Hugging Face directory plus ``final/adapter/`` in
  peft's format.

With adapters disabled (peft's ``disable_adapter()`` context) the module computes the frozen base
model, which is the reference policy of the KL terms: no second copy of the weights is needed.

Under DeepSpeed ZeRO-3 every parameter, frozen base and adapter alike, is partitioned across the
ranks (each holds a flat slice; the module's own tensors are empty placeholders). Forwards gather
what they need through ZeRO-3's module hooks; the functions here that read weights directly
(:func:`adapter_state`, :func:`merged_state_dict`, :func:`save_final`) gather them with
``deepspeed.zero.GatheredParameters`` first, a few tensors at a time, and are then collectives:
every rank must call them, in the same order.

Under FSDP2 (``fully_shard``) the parameters are ``DTensor`` s holding one dim-0 shard per rank;
those functions read each tensor with ``full_tensor()`` (an all-gather of that tensor alone), so they
are collectives there too.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path
from typing import Any, Iterator

import torch

from trajflow.modeling.forward import parameters_sharded

#: peft's adapter name: one adapter per model.
ADAPTER = "default"
#: Where ``final/`` keeps the adapter in peft's format.
ADAPTER_DIR = "adapter"


def lora_enabled(model_cfg: Any) -> bool:
    return int(getattr(model_cfg, "lora_rank", 0) or 0) > 0


def is_lora_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft-wrapped model (has adapters)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def apply_lora(model: torch.nn.Module, model_cfg: Any) -> torch.nn.Module:
    """Wrap ``model`` (a transformers causal LM) with LoRA adapters: a ``peft.PeftModelForCausalLM``.

    Only the adapters' ``lora_A`` / ``lora_B`` weights require grad afterwards (fp32 on CPU, the
    model's dtype otherwise). ``model.target_modules='all-linear'`` targets every ``nn.Linear`` but
    the output head, as peft defines it.

    Args:
        model: the loaded causal LM.
        model_cfg: the ``model`` config section (``lora_rank``, ``lora_alpha``, ``lora_use_rslora``,
            ``target_modules``, ``lora_dropout``).
    """
    from peft import LoraConfig, get_peft_model

    targets = model_cfg.target_modules
    targets = targets if isinstance(targets, str) else [str(t) for t in targets]
    config = LoraConfig(r=int(model_cfg.lora_rank), lora_alpha=float(model_cfg.lora_alpha), target_modules=targets,
                        lora_dropout=float(model_cfg.lora_dropout), bias="none", task_type="CAUSAL_LM",
                        use_rslora=bool(getattr(model_cfg, "lora_use_rslora", False)))
    return get_peft_model(model, config)


def adapter_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """The adapter scale ``s``: ``alpha / r`` (Hu et al. 2021) or ``alpha / sqrt(r)`` (rsLoRA,
    Kalajdzievski 2023, Theorem 3.2)."""
    return float(alpha) / (math.sqrt(rank) if use_rslora else float(rank))


def adapter_record(model_cfg: Any) -> dict:
    """What a LoRA checkpoint records about its adapter: ``lora_rank``, ``lora_alpha``,
    ``lora_use_rslora`` and the resulting ``lora_scaling`` (JSON-ready)."""
    rank, alpha = int(model_cfg.lora_rank), float(model_cfg.lora_alpha)
    rs = bool(getattr(model_cfg, "lora_use_rslora", False))
    return {"lora_rank": rank, "lora_alpha": alpha, "lora_use_rslora": rs,
            "lora_scaling": adapter_scaling(rank, alpha, rs)}


def check_adapter_record(recorded: dict, model_cfg: Any, where: str) -> None:
    """Refuse a checkpoint whose adapter was trained with another rank, alpha or scaling rule: its
    tensors would load but compute another model. A checkpoint from before rsLoRA existed records
    only ``lora_rank`` and was plain LoRA.

    Raises:
        RuntimeError: one line naming ``where``, the recorded and the configured values.
    """
    now = adapter_record(model_cfg)
    for key in ("lora_rank", "lora_alpha", "lora_use_rslora"):
        if key not in recorded and key != "lora_use_rslora":
            continue
        was = recorded.get(key, False)
        if (float(was) if key == "lora_alpha" else was) != now[key]:
            raise RuntimeError(f"{where}: the adapter was trained with model.{key}={was!r}, this run has "
                               f"model.{key}={now[key]!r} (resume with the run's own config)")


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer holds: those that require grad (all of them without LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


def _gathered(params: list[torch.nn.Parameter]):
    """Context in which the ZeRO-3 partitioned ``params`` hold their full values on every rank (read
    only: changes are discarded on exit); a no-op for plain parameters. A collective under ZeRO-3."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 ``DTensor`` gathered from every rank (a collective), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' entries of ``model.state_dict()`` (names with the adapter name, ``.lora_A.default.``),
    as detached CPU copies, gathered first under ZeRO-3 or FSDP2 (a collective there)."""
    with _gathered(trainable_parameters(model)):
        return {k: _full(v.detach()).cpu().contiguous().clone() for k, v in model.state_dict().items()
                if ".lora_" in k}


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, peft's names (``...q_proj.lora_A.weight``), detached CPU copies.

    Under ZeRO-3 the adapters are gathered first (megabytes): every rank must call it.
    """
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=_adapter_tensors(model))


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what :func:`adapter_state` returned into ``model`` in place (bit for bit).

    Raises:
        RuntimeError: a key is missing or unexpected (the checkpoint is for another LoRA setup).
    """
    from peft import set_peft_model_state_dict

    current = adapter_state(model)
    if set(current) != set(state) or any(current[k].shape != state[k].shape for k in current):
        missing = sorted(set(current) - set(state))[:3]
        unexpected = sorted(set(state) - set(current))[:3]
        raise RuntimeError(f"the adapter does not match model.lora_rank / model.target_modules: missing {missing}, "
                           f"unexpected {unexpected}")
    result = set_peft_model_state_dict(model, state)
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"the adapter has unexpected keys {result.unexpected_keys[:3]}")


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The merged weights ``W + s B A`` (``s``: :func:`adapter_scaling`) under the base model's parameter names, the live
    module left as it is (adapters unmerged): what ``merge_and_unload().state_dict()`` would give,
    computed with the same addition peft's merge does. Tensors in the model's dtype and device
    (CPU copies when the parameters are sharded). The union of :func:`merged_buckets`, which see.

    Args:
        keep: whether to return the tensors; ranks that only take part in the gathering pass
            False and get ``{}`` (no rank but the writer holds the whole model).
    """
    out: dict[str, torch.Tensor] = {}
    for bucket in merged_buckets(model, keep=keep):
        out.update(bucket or {})
    return out


def merged_buckets(model: torch.nn.Module, keep: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """:func:`merged_state_dict` one transformer block at a time (:func:`trajflow.modeling.buckets.by_block`):
    each weight is merged when it is reached, so with sharded parameters no rank holds more than
    one block's merged weights (and that layer's adapters) at once.

    Under ZeRO-3 (a collective: every rank must iterate to the end) each tensor is gathered on its
    own (``GatheredParameters``), one LoRA layer's adapters at a time, and handed out as a CPU copy.
    Under FSDP2 each tensor is gathered alone (``full_tensor()``) and the delta is peft's formula
    (``get_delta_weight`` of a ``Linear``: ``B @ A * scaling``) on the gathered adapters.

    Args:
        keep: whether to hand out the tensors; a rank that only takes part in the gathering passes
            False and gets None per bucket (as many as the others).

    Yields:
        ``{base-model name: merged tensor}`` per block (None when not ``keep``).
    """
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor import DTensor

    from trajflow.modeling.buckets import by_block

    base = model.get_base_model()
    sharded = parameters_sharded(model)
    modules = dict(base.named_modules())

    def produce(k: str, v: torch.Tensor):
        @torch.no_grad()
        def merged():
            if isinstance(v, DTensor):
                w = v.detach().full_tensor().cpu()  # a new tensor already: no copy needed
            elif sharded:
                with _gathered([v]):
                    w = v.detach().cpu().clone()
            else:
                w = v.detach()
            mod = modules.get(k[:-len(".base_layer.weight")]) if k.endswith(".base_layer.weight") else None
            if isinstance(mod, LoraLayer):
                delta = _delta(mod)
                # In place on a gathered copy (one tensor less at a time); the live weight stays as it is.
                w = w.add_(delta.cpu()) if sharded else w + delta
            return w if keep else None
        return merged

    yield from by_block(((k.replace(".base_layer.", "."), produce(k, v))
                         for k, v in base.state_dict(keep_vars=True).items() if ".lora_" not in k), keep)


def _delta(mod: torch.nn.Module) -> torch.Tensor:
    """``s B A`` of one LoRA layer (transposed for ``fan_in_fan_out``), its adapters gathered first
    when sharded (a collective then)."""
    from torch.distributed.tensor import DTensor

    lora_params = [p for n, p in mod.named_parameters() if ".lora_" in f".{n}"]
    if any(isinstance(p, DTensor) for p in lora_params):
        a, b = _full(mod.lora_A[ADAPTER].weight), _full(mod.lora_B[ADAPTER].weight)
        delta = (b @ a).transpose(0, 1) if mod.fan_in_fan_out else b @ a
        return delta.mul_(mod.scaling[ADAPTER])
    with _gathered(lora_params):
        return mod.get_delta_weight(ADAPTER)  # computed from the gathered adapters: a new tensor


def reference_mode(model: torch.nn.Module):
    """Context in which ``model`` computes its frozen base (peft's ``disable_adapter()``)."""
    return model.disable_adapter()


def save_final(model: torch.nn.Module, tokenizer: Any, directory: str | Path, write: bool = True) -> None:
    """``directory``: the merged model as a plain Hugging Face directory (safetensors, loadable by
    ``AutoModelForCausalLM``), and ``directory/adapter/`` in peft's format (``adapter_config.json``,
    ``adapter_model.safetensors``; ``PeftModel.from_pretrained(base, directory/adapter)``).

    The merge runs on a copy: the live module keeps training with its adapters unmerged. Under
    ZeRO-3 it is a collective (the weights are gathered tensor by tensor, :func:`merged_state_dict`):
    every rank calls it and only the one with ``write`` writes.

    Args:
        write: whether this process writes the files (data-parallel ranks: rank 0 only).
    """
    d = Path(directory)
    if not parameters_sharded(model):
        if not write:
            return
        model.save_pretrained(str(d / ADAPTER_DIR), safe_serialization=True)
        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(str(d), safe_serialization=True)
        tokenizer.save_pretrained(str(d))
        del merged
        return
    # The live module's tensors are empty placeholders: write gathered copies under their names.
    adapter = _adapter_tensors(model)
    merged = merged_state_dict(model, keep=write)
    if write:
        model.save_pretrained(str(d / ADAPTER_DIR), safe_serialization=True, state_dict=adapter)
        model.get_base_model().save_pretrained(str(d), state_dict=merged, safe_serialization=True)
        tokenizer.save_pretrained(str(d))
