"""The mixed-precision policy of a model worker: fp32 master weights, low-precision compute.

Every trainable role (actor, critic) keeps its parameters and its AdamW state in float32, the master
weights; forwards (and so the backwards autograd records from them) run under ``torch.autocast`` in
the compute dtype ``mixed_precision.param_dtype`` (verl's FSDP ``mixed_precision`` key of the same
name, which is also a compute dtype over fp32 masters). The numerically fragile tail stays float32:
logits are cast up before log-softmax, entropy, the losses and their reductions
(:func:`trajflow.modeling.forward.forward_micro_batch`). Frozen roles (reference, reward model) use
the same mechanism, so the reference's log-probs at step 0 equal the actor's bit for bit.

Why master weights: bf16 has an 8-bit mantissa, so next to a weight of 1.0 its spacing is 2^-7 =
0.0078; an AdamW step of lr = 1e-5 .. 1e-4 rounds away entirely when the weight itself is bf16
(Micikevicius et al. 2018, "Mixed Precision Training", sec. 3.1). The fp32 master keeps it.

Plain functions over torch; no Ray, no Prefect.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# The bf16 speed probe lives with the device checks (no torch import: the config layer calls it).
from trajflow.infra.devices import FAST_BF16_CPU_FLAGS, bf16_is_fast, cpu_flags  # noqa: F401

#: Config dtype names -> torch dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_type(device: str | torch.device) -> str:
    """``"cpu"``/``"cuda"``/``"npu"`` of a device string such as ``cuda:0``."""
    return str(device).split(":")[0]


def autocast(param_dtype: str, device: str | torch.device):
    """Context that runs a forward in the compute dtype ``param_dtype`` over fp32 parameters.

    ``float32`` is a no-op context (no autocast at all: results are bit-identical to code without it).

    Raises:
        ValueError: an unknown dtype name (``auto`` must be resolved first, see
            :func:`trajflow.config.load_config`).
    """
    if param_dtype not in DTYPES:
        raise ValueError(f"mixed_precision.param_dtype must be one of {sorted(DTYPES)}, got {param_dtype!r}")
    if param_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type(device), dtype=DTYPES[param_dtype])


def fp32_region(device: str | torch.device):
    """Context with autocast off: code in it runs in its inputs' dtypes (log-softmax, losses)."""
    return torch.autocast(device_type=device_type(device), enabled=False)


def cast_buffers(model: torch.nn.Module, buffer_dtype: str) -> None:
    """Cast the floating-point buffers of ``model`` (rotary ``inv_freq``, ...) to ``buffer_dtype``."""
    dtype = DTYPES[buffer_dtype]
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[name] = buf.to(dtype)


def section_dtype(section: Any) -> str:
    """``section.mixed_precision.param_dtype`` (``float32`` where the section has none)."""
    mp = getattr(section, "mixed_precision", None)
    return str(getattr(mp, "param_dtype", "float32")) if mp is not None else "float32"


def run_precision(cfg: Any) -> dict[str, Any]:
    """The run's precision, as ``run.json`` records it and the first lines print it.

    Args:
        cfg: the resolved run config (``auto`` already replaced by :func:`trajflow.config.load_config`).

    Returns:
        ``{"master": model.dtype, "actor": ..., "critic": ..., "reference": ..., "reward_model": ...,
        "rollout": rollout.dtype, "auto": trainer.precision_auto or None}`` (compute dtypes per role).
    """
    return {"master": str(cfg.model.dtype),
            "actor": section_dtype(cfg.actor), "critic": section_dtype(cfg.critic),
            "reference": section_dtype(cfg.reference), "reward_model": section_dtype(cfg.reward.reward_model),
            "rollout": str(cfg.rollout.dtype), "auto": cfg.trainer.precision_auto}


def describe(record: dict[str, Any]) -> str:
    """One console line for :func:`run_precision`'s record."""
    line = (f"precision: {record['master']} master weights, actor compute {record['actor']}, "
            f"rollout {record['rollout']}")
    if record.get("auto"):
        line += f"; {record['auto']}"
    return line
