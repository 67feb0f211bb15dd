"""Rows into micro-batches: the packing and the micro-batch plans every model forward shares.

The policy's old log-probs, the reference's log-probs and the log-probs inside the PPO update all
use :func:`pack` over the micro-batches of :func:`micro_batch_plan`: the same rows, padding and
kernels give bit-identical log-probs, so the first on-policy PPO ratio is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


def micro_batch_slices(num_rows: int, micro_batch_size: int) -> list[slice]:
    """Consecutive row slices of at most ``micro_batch_size`` rows (the last may be shorter)."""
    return [slice(i, min(i + micro_batch_size, num_rows)) for i in range(0, num_rows, micro_batch_size)]


def token_budget_slices(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                        max_tokens: int) -> list[slice]:
    """Consecutive row slices whose computed tokens stay within ``max_tokens`` (verl's
    ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``).

    A row costs its response, plus its prompt unless a row of the same slice already has that
    prompt (the forward computes each distinct prompt once per micro-batch; a common prefix shared
    by different prompts is not subtracted, so the bound is conservative). A row that alone exceeds
    the budget gets a slice of its own: the budget bounds memory, it never drops a row.

    Raises:
        ValueError: ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"actor.ppo_max_token_len_per_gpu must be >= 1, got {max_tokens}")
    slices, start, used, seen = [], 0, 0, set()
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        key = tuple(p)
        cost = len(r) + (0 if key in seen else len(p))
        if i > start and used + cost > max_tokens:
            slices.append(slice(start, i))
            start, used, seen = i, 0, set()
            cost = len(r) + len(p)
        used += cost
        seen.add(key)
    if len(prompt_ids) > start:
        slices.append(slice(start, len(prompt_ids)))
    return slices


def micro_batch_plan(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                     micro_batch_size: int, max_tokens: int | None = None) -> list[slice]:
    """The micro-batches of consecutive rows every forward of a worker uses: by token budget when
    ``max_tokens`` is set (:func:`token_budget_slices`), else ``micro_batch_size`` rows each."""
    if max_tokens:
        return token_budget_slices(prompt_ids, response_ids, int(max_tokens))
    return micro_batch_slices(len(prompt_ids), micro_batch_size)


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
    """Pack prompts (left-padded) and responses (right-padded) into one batch (verl's layout)::

        [pad ... pad | prompt tokens | response tokens | pad ... pad]
         <- left-padded to P (longest prompt) -><- right-padded to T (longest response) ->

    so every row's response starts at column ``P`` and the logits that predict response token ``t``
    sit at column ``P - 1 + t``.
    """
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


def balanced_partition(weights: Sequence[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """Cut rows into ``k`` parts whose total weights (tokens) are close, keeping each part sorted.

    Greedy longest-processing-time: rows in decreasing weight go to the lightest part that still
    has room. With ``equal_size`` every part holds ``n // k`` or ``n // k + 1`` rows (parts
    ``0 .. n % k - 1`` the larger), which data-parallel ranks need to run the same number of
    micro-batches. Deterministic: ties break by row index, then part index.

    Args:
        weights: one non-negative weight per row (e.g. prompt + response tokens).
        k: number of parts (ranks), >= 1.
        equal_size: bound the part sizes as above (else only the weights are balanced).

    Returns:
        ``k`` lists of row indices, each ascending; together a partition of ``range(n)``.

    Raises:
        ValueError: ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"balanced_partition: k={k} must be >= 1")
    n = len(weights)
    cap = [n // k + (1 if r < n % k else 0) for r in range(k)] if equal_size else [n] * k
    load = [0.0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(n), key=lambda j: (-float(weights[j]), j)):
        r = min((r for r in range(k) if len(parts[r]) < cap[r]), key=lambda r: (load[r], len(parts[r]), r))
        parts[r].append(i)
        load[r] += float(weights[i])
    return [sorted(p) for p in parts]
