"""Teacher-forced forward passes over (prompt, response) pairs, shared by every model worker.

The policy's old log-probs, the reference's log-probs and the log-probs inside the PPO update all
come from :func:`forward_micro_batch` over micro-batches made by :func:`micro_batch_slices`. Using
one packing for all three is what makes the importance ratio of the first PPO step exactly 1 on
on-policy data: same rows, same padding, same kernels, bit-identical log-probs.

Packing of a micro-batch of ``b`` rows (verl's layout)::

    [pad ... pad | prompt tokens | response tokens | pad ... pad]
     <- left-padded to P (longest prompt) -><- right-padded to T (longest response) ->

so every row's response starts at column ``P`` and the logits that predict response token ``t`` sit
at column ``P - 1 + t``. Only those ``T`` positions go through the LM head, which avoids the
``(b, P + T, vocab)`` logits tensor (49k vocab: 400 MB for 8 x 256 tokens).

Shared prompts. A group's ``n`` samples share one prompt, and micro-batches hold whole groups (rows
are prompt-major), so :func:`forward_micro_batch` runs each distinct prompt through the decoder once,
copies its key/value cache to the rows that share it and runs only the responses against that cache.
For prompts much longer than responses (the default recipe: ~90 prompt tokens, ~20 response tokens,
n = 4) this removes most of the forward and backward compute. Gradients flow through the copied
cache into the prompt's forward (the copy's backward sums the rows' contributions), so the result is
the full forward's up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from stages.rollout import entropy_from_logits_t, logprobs_from_logits


def micro_batch_slices(num_rows: int, micro_batch_size: int) -> list[slice]:
    """Consecutive row slices of at most ``micro_batch_size`` rows (the last may be shorter)."""
    return [slice(i, min(i + micro_batch_size, num_rows)) for i in range(0, num_rows, micro_batch_size)]


@dataclass
class PackedBatch:
    """One micro-batch packed for a forward pass.

    Attributes:
        input_ids: ``(b, P + T)`` int64.
        attention_mask: ``(b, P + T)`` int64, 1 on prompt and response tokens.
        position_ids: ``(b, P + T)`` int64, counting real tokens only.
        responses: ``(b, T)`` int64 response tokens (pad 0).
        response_mask: ``(b, T)`` bool, True on real response tokens.
        prompt_width: ``P``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int


def pack(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int,
         device: str | torch.device = "cpu") -> PackedBatch:
    """Pack prompts (left-padded) and responses (right-padded) into one batch; see module doc."""
    b = len(prompt_ids)
    p_len = np.array([len(p) for p in prompt_ids])
    r_len = np.array([len(r) for r in response_ids])
    P, T = int(p_len.max()), max(int(r_len.max()), 1)
    ids = np.full((b, P + T), pad_id, dtype=np.int64)
    attn = np.zeros((b, P + T), dtype=np.int64)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[i, P - len(p):P] = p
        ids[i, P:P + len(r)] = r
        attn[i, P - len(p):P + len(r)] = 1
    attention_mask = torch.from_numpy(attn)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    input_ids = torch.from_numpy(ids)
    responses = input_ids[:, P:].clone()
    rmask = attention_mask[:, P:].bool()
    responses[~rmask] = 0
    return PackedBatch(input_ids.to(device), attention_mask.to(device), position_ids.to(device),
                       responses.to(device), rmask.to(device), P)


def shared_prompt_rows(packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows with identical (padded) prompts: ``(first_row, inverse)`` or ``None`` if all differ.

    Returns:
        ``first_row`` ``(k,)`` int64, one row index per distinct prompt, and ``inverse`` ``(b,)`` int64,
        the distinct prompt of each row (``first_row[inverse[i]]`` has row ``i``'s prompt).
    """
    P = packed.prompt_width
    # ids and mask together: a prompt that starts with the pad id is not the shorter prompt's padding.
    key = packed.input_ids[:, :P] * 2 + packed.attention_mask[:, :P]
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    if uniq.shape[0] == key.shape[0]:
        return None
    first = torch.full((uniq.shape[0],), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, torch.arange(key.shape[0], device=key.device), reduce="amin")
    return first, inverse


def response_hidden_states(model: torch.nn.Module, packed: PackedBatch, share_prompts: bool = True) -> torch.Tensor:
    """Final hidden states that predict the response tokens: ``(b, T, hidden)``, model dtype.

    With ``share_prompts`` (and rows that share a prompt, and no gradient checkpointing, which turns
    the KV cache off) each distinct prompt is run once and its cache copied to its rows; see the
    module doc. Otherwise one forward over the whole packed batch.
    """
    decoder = model.get_decoder()
    P = packed.prompt_width
    T = packed.responses.shape[1]
    shared = None
    if share_prompts and not (model.training and getattr(model, "is_activation_checkpointing", False)):
        shared = shared_prompt_rows(packed)
    if shared is None:
        hidden = decoder(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                         position_ids=packed.position_ids, use_cache=False).last_hidden_state
        return hidden[:, P - 1:P - 1 + T]
    first, inverse = shared
    prompt_out = decoder(input_ids=packed.input_ids[first, :P], attention_mask=packed.attention_mask[first, :P],
                         position_ids=packed.position_ids[first, :P], use_cache=True)
    h_first = prompt_out.last_hidden_state[inverse, P - 1:P]  # predicts response token 0
    if T == 1:
        return h_first
    cache = prompt_out.cache
    cache.batch_select_indices(inverse)  # differentiable gather: the backward sums over the group
    resp_out = decoder(input_ids=packed.input_ids[:, P:P + T - 1], attention_mask=packed.attention_mask[:, :P + T - 1],
                       position_ids=packed.position_ids[:, P:P + T - 1], cache=cache, use_cache=True)
    return torch.cat([h_first, resp_out.last_hidden_state], dim=1)


def forward_micro_batch(model: torch.nn.Module, packed: PackedBatch, temperature: float,
                        compute_entropy: bool = False, logits_chunk: int = 1024,
                        share_prompts: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropy) of the response tokens under ``model``.

    Args:
        model: a transformers causal LM (``get_decoder()`` and ``get_output_embeddings()``).
        packed: from :func:`pack`.
        temperature: sampling temperature of the rollout (> 0).
        compute_entropy: also return the per-token entropy of ``softmax(logits / temperature)``.
        logits_chunk: response positions sent through the LM head at a time.
        share_prompts: run each distinct prompt once (see the module doc); same values up to rounding.

    Returns:
        ``log_probs`` ``(b, T)`` float32 and ``entropy`` ``(b, T)`` float32 or ``None``; values at
        masked positions are meaningless (callers apply ``packed.response_mask``).
    """
    head = model.get_output_embeddings()
    h = response_hidden_states(model, packed, share_prompts)
    b, T = h.shape[0], h.shape[1]
    flat_h = h.reshape(b * T, -1)
    flat_y = packed.responses.reshape(b * T)
    logps, ents = [], []
    for i in range(0, b * T, logits_chunk):
        logits = head(flat_h[i:i + logits_chunk])
        logps.append(logprobs_from_logits(logits, flat_y[i:i + logits_chunk], temperature))
        if compute_entropy:
            ents.append(entropy_from_logits_t(logits, temperature))
    logp = torch.cat(logps).reshape(b, T)
    ent = torch.cat(ents).reshape(b, T) if compute_entropy else None
    return logp, ent


@torch.no_grad()
def compute_log_probs(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                      response_ids: Sequence[Sequence[int]], *, temperature: float, micro_batch_size: int,
                      pad_id: int, device: str = "cpu", compute_entropy: bool = False) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Per-token log-probs of every response, as ragged float32 arrays (one per row).

    Micro-batches follow :func:`micro_batch_slices`, the same packing the PPO update uses.
    """
    was_training = model.training
    model.eval()
    out: list[np.ndarray] = []
    ent_out: list[np.ndarray] | None = [] if compute_entropy else None
    try:
        for sl in micro_batch_slices(len(prompt_ids), micro_batch_size):
            packed = pack(prompt_ids[sl], response_ids[sl], pad_id, device)
            logp, ent = forward_micro_batch(model, packed, temperature, compute_entropy)
            for j, r in enumerate(response_ids[sl]):
                out.append(logp[j, :len(r)].float().cpu().numpy())
                if ent_out is not None:
                    ent_out.append(ent[j, :len(r)].float().cpu().numpy())
    finally:
        model.train(was_training)
    return out, ent_out
