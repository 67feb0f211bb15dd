"""Which models trajflow's fast paths compute exactly, and the model features they must honour.

The fast paths (the tree-packed and cached-prompt forwards of :mod:`trajflow.modeling.forward`, the
HF engine's decode loop) call the model's decoder and its output embedding directly. They keep every
attention feature the model's own code applies inside the decoder (each layer's mask type from
``config.layer_types`` or ``config.sliding_window``, query scaling, attention soft-capping: the tree
forward asks the model's own mask builders and kernels), and apply what the causal-LM head adds on
top of the output embedding (Gemma's final-logit soft-capping, :func:`final_logits`).

An architecture is taken on the fast paths only once a parity test has compared it with
transformers' own forward and ``generate`` (``tests/test_any_model.py``): a model type outside
:data:`VERIFIED_MODEL_TYPES` could add something the fast paths do not know of (a logit scale, a
different mask), so it runs through transformers' own forward and ``generate`` instead, with one
log line saying so.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("trajflow.modeling")

#: ``config.model_type`` values whose fast paths the parity matrix verifies.
VERIFIED_MODEL_TYPES = frozenset({
    "llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2",
    "gpt_neox",
})

#: Attention kernels the tree-packed forward runs piece by piece (others: the cached-prompt forward).
TREE_KERNELS = ("sdpa", "eager")

_logged: set[tuple[str, str]] = set()


def fast_path_unsupported(model: torch.nn.Module) -> str | None:
    """Why trajflow's fast paths may not compute ``model`` exactly, or ``None`` if they do."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in VERIFIED_MODEL_TYPES:
        return f"model_type {model_type!r} is not among the parity-tested {', '.join(sorted(VERIFIED_MODEL_TYPES))}"
    if getattr(model.config, "attention_chunk_size", None):
        return "chunked attention"
    return None


def note_fallback(model: torch.nn.Module, what: str, reason: str) -> None:
    """One log line per model class and path that falls back to transformers' own code."""
    key = (type(model).__name__, what)
    if key not in _logged:
        _logged.add(key)
        log.warning("%s: %s runs through transformers' own %s (%s)", type(model).__name__, what,
                    "generate" if what == "decoding" else "forward", reason)


def sliding_window(config) -> int | None:
    """The shortest attention window any layer of ``config`` has (keys at position distance
    ``< window`` are visible), or ``None`` if every layer attends to the whole row.

    Per-layer types (``config.layer_types``, e.g. Gemma's and Qwen's ``"sliding_attention"`` /
    ``"full_attention"``) decide where declared; else ``config.sliding_window`` applies to every layer
    (Mistral, Phi-3, Qwen3-MoE).
    """
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def final_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What the causal-LM head does after the output embedding: ``logits`` ``(..., V)`` soft-capped as
    ``cap * tanh(logits / cap)`` where ``config.final_logit_softcapping`` is set (Gemma 2 and 3),
    unchanged (the same tensor) otherwise."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
