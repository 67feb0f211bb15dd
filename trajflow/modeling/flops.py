"""Model FLOPs of a policy update and the model FLOPs utilisation (MFU) they give, ``perf/mfu/actor``.

MFU (Chowdhery et al. 2022, "PaLM", Appendix B) is the FLOPs the model needs, not what an
implementation happens to compute (recomputation, padding and shared prompts do not count), divided
by the wall time and the devices' peak. Per token of a sequence of length ``T`` a decoder-only
transformer needs ``6 N + 12 L H Q T`` FLOPs to train: ``N`` the parameters of its matrix multiplies
(2 FLOPs per parameter forward, 4 backward), ``L`` layers, ``H`` attention heads of size ``Q`` (the
``Q K^T`` and ``A V`` products, forward and backward). Per sequence that is ``6 N T + 12 L H Q T^2``.

Two refinements, both following the same counting: the input embedding is a lookup, not a matrix
multiply, so it is left out of ``N`` (the output head is counted, tied or not); a frozen matrix
(LoRA's base weights) costs 4 FLOPs per parameter per token, not 6: its activation gradient is
computed, its weight gradient is not. verl reports the same quantity as ``perf/mfu/actor`` (its
``FlopsCounter``, against the device's bf16 dense peak).
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["PEAK_BF16_TFLOPS", "device_peak_tflops", "mfu", "train_flops"]

#: Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets; the first name
#: contained in ``torch.cuda.get_device_name()`` wins, so the specific variants come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("H800", 989.4), ("H20", 148.0),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0),
    ("A10G", 70.0), ("A10", 125.0), ("RTX 4090", 165.2), ("V100", 125.0),
)


def device_peak_tflops(device: str | torch.device) -> float | None:
    """The bf16 dense peak of ``device`` in TFLOP/s from :data:`PEAK_BF16_TFLOPS`, or None when it is
    not a CUDA device or not in the table (a CPU has no such number: set ``trainer.device_peak_tflops``)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(dev)
    for key, peak in PEAK_BF16_TFLOPS:
        if key in name:
            return peak
    return None


def _matmul_params(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, frozen)`` parameters of the model's ``nn.Linear`` weights (embeddings excluded)."""
    trainable = frozen = 0
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            if id(w) in seen:
                continue
            seen.add(id(w))
            n = w.numel() if w.numel() else int(getattr(w, "ds_numel", 0))  # ZeRO-3: a placeholder
            if w.requires_grad:
                trainable += n
            else:
                frozen += n
    return trainable, frozen


def train_flops(model: torch.nn.Module, seq_lens: Iterable[int]) -> float:
    """Model FLOPs of one forward + backward over sequences of ``seq_lens`` tokens (PaLM, App. B).

    ``sum_i (6 N_train + 4 N_frozen) T_i + 12 L H Q T_i^2`` with ``N`` the ``nn.Linear`` weights (the
    output head included, the embedding lookup not) and ``L``, ``H``, ``Q`` from the model's config
    (``num_hidden_layers``, ``num_attention_heads``, ``head_dim`` or ``hidden_size / heads``).

    Args:
        model: the (possibly peft-wrapped) causal LM.
        seq_lens: tokens of each sequence (prompt + response).

    Returns:
        FLOPs as a float.
    """
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    layers, heads = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    trainable, frozen = _matmul_params(model)
    lens = [int(t) for t in seq_lens]
    per_token = 6.0 * trainable + 4.0 * frozen
    return per_token * sum(lens) + 12.0 * layers * heads * head_dim * sum(t * t for t in lens)


def mfu(flops: float, seconds: float, peak_tflops: float, devices: int = 1) -> float:
    """``flops / seconds / (peak_tflops * 1e12 * devices)``: the share of the devices' peak used.

    Raises:
        ValueError: a non-positive ``seconds``, ``peak_tflops`` or ``devices``.
    """
    if not (seconds > 0 and peak_tflops > 0 and devices >= 1):
        raise ValueError(f"mfu needs seconds > 0, peak_tflops > 0 and devices >= 1, got {seconds}, {peak_tflops}, "
                         f"{devices}")
    return float(flops) / float(seconds) / (float(peak_tflops) * 1e12 * int(devices))
