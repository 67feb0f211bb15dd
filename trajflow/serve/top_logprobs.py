"""OpenAI's ``top_logprobs``: the most likely tokens at each sampled position, with their log-probs.

The rollout engines report the sampled token's log-prob only, so the endpoint computes the top ones
teacher-forced, after sampling: one forward of the prompt and the sampled ids through the model the
engine sampled from, ``log_softmax(logits / T)`` at each response position (``T`` the sampling
temperature, 1 for greedy decoding: the same kind of log-prob as the sampled token's, the engine's
RAW log-probs of :class:`trajflow.engines.base.LogprobKind`), and its ``k`` largest entries.
"""

from __future__ import annotations

from typing import Sequence

import torch


def teacher_forced_top_logprobs(model: torch.nn.Module, prompt_ids: Sequence[int], rows: Sequence[Sequence[int]],
                                k: int, temperature: float = 1.0) -> list[list[list[tuple[int, float]]]]:
    """The ``k`` most likely tokens at every position of each sampled row.

    Args:
        model: a causal LM (``model(input_ids).logits``: ``(1, L, vocab)``).
        prompt_ids: the prompt the rows were sampled after.
        rows: the sampled ids of each row.
        k: how many tokens per position (>= 1).
        temperature: the sampling temperature (<= 0: 1.0, the model's own distribution for greedy decoding).

    Returns:
        Per row, per sampled token, ``k`` pairs ``(token id, log-prob)`` (float), most likely first:
        ``topk(log_softmax(logits[t] / T))`` at the position that predicted the row's token ``t``.
    """
    t = float(temperature) if temperature and temperature > 0 else 1.0
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for ids in rows:
            if not ids:
                out.append([])
                continue
            x = torch.tensor([list(prompt_ids) + list(ids)], device=device)
            logits = model(input_ids=x).logits[0, len(prompt_ids) - 1:len(prompt_ids) - 1 + len(ids)].float()
            lp = torch.log_softmax(logits / t, dim=-1)
            vals, idx = torch.topk(lp, min(int(k), lp.shape[-1]), dim=-1)
            out.append([[(int(i), float(v)) for i, v in zip(ri.tolist(), rv.tolist())]
                        for ri, rv in zip(idx, vals)])
    return out
