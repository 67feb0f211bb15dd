"""One decode step of a Llama-family decoder without transformers' per-call machinery.

A decode step feeds one token per row. On a CPU at the rollout's few dozen rows, the decoder's
linear layers are bound by reading the weights (~30 ms of a 62 ms step of SmolLM2-135M in bf16 at
16 rows on an AMX Xeon, one thread); much of the rest is the model's generic forward around them:
the 4-D mask built per call, keyword plumbing, decorators and hooks of each module call.
:func:`decode_step` runs the same layers on the same KV cache with the single-query case written out:

- one boolean mask ``(rows, 1, 1, W)`` per step, shared by all layers;
- attention per key-value head, the ``G`` query heads of a group as ``G`` queries against their
  shared keys (no ``repeat_kv`` copy; transformers' ``sdpa`` path does the same for one query);
- rotary embedding, RMSNorms and MLPs through the model's own modules and function, so their
  arithmetic is the model's.

The arithmetic is that of transformers' ``sdpa`` path for a single query; only the attention
mask's form differs (one boolean mask per step instead of one built per call). The
step is used only where :func:`supports_decode_step` verifies the structure it assumes: a decoder
of :data:`MODEL_TYPES` with full (not sliding-window) attention, no q/k norms, mergeable cache
layers; anything else runs the model's own forward.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

#: transformers ``model_type`` values whose decoder layer is exactly: input RMSNorm, q/k/v
#: projections (bias allowed), rotary on q and k, causal attention over the cache, o projection,
#: residual, post-attention RMSNorm, gated MLP, residual.
MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


def supports_decode_step(model: torch.nn.Module) -> str | None:
    """``None`` if :func:`decode_step` computes what ``model``'s decoder computes for one new token
    per row, else a short reason why not.

    Args:
        model: a transformers causal LM (``get_decoder()``).
    """
    from trajflow.modeling.lean_norm import RMS_NORM_CLASSES

    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {sorted(MODEL_TYPES)}"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "layer types other than full attention"
    decoder = model.get_decoder()
    for layer in getattr(decoder, "layers", None) or [None]:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or any(not hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                             "scaling", "head_dim")):
            return "a decoder layer without the q/k/v/o projections"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "q/k norms"
        if any(not hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "an MLP that is not gated"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm).__name__ not in RMS_NORM_CLASSES:
                return f"norm {type(norm).__name__}"
    if type(decoder.norm).__name__ not in RMS_NORM_CLASSES or not hasattr(decoder, "rotary_emb"):
        return "final norm or rotary embedding of another kind"
    return None


def _rotary(layer: torch.nn.Module):
    """The ``apply_rotary_pos_emb`` of the module that defines ``layer``'s attention class."""
    return sys.modules[type(layer.self_attn).__module__].apply_rotary_pos_emb


@torch.no_grad()
def decode_step(decoder: torch.nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, cache) -> torch.Tensor:
    """Run one new token per row through ``decoder``, appending its keys and values to ``cache``.

    Computes, per layer (Touvron et al. 2023, "LLaMA", Sec. 2.2; attention as Vaswani et al. 2017,
    eq. 1, with grouped key-value heads, Ainslie et al. 2023)::

        h = x + o_proj(softmax(q K^T * scaling + mask) V)      q, K from rope(q_proj(norm1(x))), cache
        out = h + down_proj(act(gate_proj(norm2(h))) * up_proj(norm2(h)))

    then the final norm.

    Args:
        decoder: a decoder :func:`supports_decode_step` accepted (``model.get_decoder()``).
        tokens: ``(rows, 1)`` int64 token ids.
        attention_mask: ``(rows, W)`` 0/1 over the cached positions and the new one (the last column).
        position_ids: ``(rows, 1)`` int64 position of each new token.
        cache: a transformers ``DynamicCache`` holding ``W - 1`` positions per layer (updated in place
            through ``cache.update``).

    Returns:
        ``(rows, hidden)`` last hidden state after the final norm, in the decoder's dtype.
    """
    x = decoder.embed_tokens(tokens)                                   # (R, 1, d)
    rows = x.shape[0]
    cos, sin = decoder.rotary_emb(x, position_ids=position_ids)
    # Key columns each row attends to, one boolean mask per step broadcast over heads and layers.
    mask = attention_mask.bool()[:, None, None, :]                     # (R, 1, 1, W)
    rotary = None
    for i, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        rotary = rotary or _rotary(layer)
        hd = attn.head_dim
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(rows, 1, -1, hd).transpose(1, 2)       # (R, H, 1, hd)
        k = attn.k_proj(h).view(rows, 1, -1, hd).transpose(1, 2)       # (R, KVH, 1, hd)
        v = attn.v_proj(h).view(rows, 1, -1, hd).transpose(1, 2)
        q, k = rotary(q, k, cos, sin)
        keys, values = cache.update(k, v, i)                           # (R, KVH, W, hd)
        # A key-value head's G query heads as G queries against its keys (no repeat_kv copy):
        # (R, KVH, G, hd), what transformers' sdpa path does for a single query.
        o = F.scaled_dot_product_attention(q.reshape(rows, keys.shape[1], -1, hd), keys, values, attn_mask=mask,
                                           scale=attn.scaling)
        o = o.reshape(rows, 1, -1)                                     # (R, 1, H * hd), head h = kv * G + g
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return decoder.norm(x)[:, -1]
