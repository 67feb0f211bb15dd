"""Tree packing: a micro-batch's prompts and responses as one sequence, one decoder call.

A micro-batch holds whole groups (a prompt's ``n`` samples) and prompts from one template share a
long prefix. :func:`tree_pack` lays the micro-batch out as a prompt tree plus responses::

    [common prefix | prompt 1's rest | ... | prompt k's rest | row 1's response | ... | row b's response]

with per-path position ids and a tree attention mask, so each distinct prompt token is computed
once and every linear layer runs one matmul over all of the micro-batch's tokens (its weight
gradient formed once, not once per decoder call as with a KV cache and response buckets).

The tree's attention runs as one SDPA call with the dense ``(N, N)`` mask: SDPA also computes the
masked-out scores, ``N^2`` in all where the real attention is ``N`` times the context. For the
default recipe (32 rows, N ~ 770) that is ~0.6 s of a 3.4 s update; computing it block by block
(prefix; each prompt with its responses) in one padded SDPA call cut the attention to 0.34 s but
added as much in gathers and their backward, so it is not done. The hidden states equal the
plain padded forward's up to float summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from trajflow.workers.forward import PackedBatch

# Longest packed sequence run as one decoder call. The dense tree attention grows as N^2 while the
# real attention grows as N times the context; past this length (long prompts or responses, large
# micro-batches) the cached-prompt path of trajflow.workers.forward, whose attention is exact per
# row, is used.
TREE_MAX_TOKENS = 2048


@dataclass
class TreePacking:
    """A micro-batch packed as a prompt tree plus responses; see the module doc.

    A response contributes its first ``l - 1`` tokens (the inputs that predict tokens ``1 .. l - 1``;
    token 0 is predicted by its prompt's last token). Each token sees, causally, its own segment and
    its ancestors: a prompt's rest sees the prefix; a response sees the prefix and its own prompt's
    rest. Position ids restart per path, so every token sits at the position it has in its own row
    ``prompt + response``.

    Attributes:
        input_ids: ``(1, N)`` int64.
        position_ids: ``(1, N)`` int64.
        attention_mask: ``(1, 1, N, N)`` bool, True where a query (row) may attend to a key (column).
        source: ``(R,)`` int64: for each real response token of the micro-batch, in row-major order
            (the order of ``packed.response_mask.nonzero()``), the packed position whose hidden
            state predicts it.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    source: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def common_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Longest prefix shared by all ``prompts`` (at least two), stopping one token short of the
    shortest so that every prompt keeps a token of its own; 0 for fewer than two prompts."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(p) for p in prompts)
    first = prompts[0]
    c = 0
    while c < shortest - 1 and all(p[c] == first[c] for p in prompts):
        c += 1
    return c


def _row_prompts(packed: "PackedBatch") -> list[tuple[int, ...]]:
    P = packed.prompt_width
    lens = packed.attention_mask[:, :P].sum(-1).tolist()
    rows = packed.input_ids.tolist()
    return [tuple(rows[i][P - n:P]) for i, n in enumerate(lens)]


def tree_packed_tokens(packed: "PackedBatch") -> int:
    """Length ``N`` of :func:`tree_pack`'s sequence for ``packed``, without building it."""
    distinct = list(dict.fromkeys(_row_prompts(packed)))
    c = common_prefix_length(distinct)
    resp = int((packed.response_mask.sum(-1) - 1).clamp(min=0).sum())
    return c + sum(len(p) - c for p in distinct) + resp


def tree_pack(packed: "PackedBatch") -> TreePacking:
    """Pack ``packed`` (from :func:`trajflow.workers.forward.pack`) as a prompt tree plus responses."""
    b = packed.input_ids.shape[0]
    row_prompts = _row_prompts(packed)
    index: dict[tuple, int] = {}
    inverse = [index.setdefault(p, len(index)) for p in row_prompts]
    distinct = list(index)
    k = len(distinct)
    c = common_prefix_length(distinct)
    resp_lens = packed.response_mask.sum(-1).tolist()
    resp_rows = packed.responses.tolist()
    ids: list[int] = list(distinct[0][:c])
    pos: list[int] = list(range(c))
    seg: list[int] = [0] * c  # segment 0: the prefix; 1..k: prompts' rests; k+1..k+b: responses
    last = []
    for j, p in enumerate(distinct):
        ids.extend(p[c:])
        pos.extend(range(c, len(p)))
        seg.extend([1 + j] * (len(p) - c))
        last.append(len(ids) - 1)
    source: list[int] = []
    for i in range(b):
        n_in = max(int(resp_lens[i]) - 1, 0)
        start = len(ids)
        ids.extend(resp_rows[i][:n_in])
        pos.extend(range(len(row_prompts[i]), len(row_prompts[i]) + n_in))
        seg.extend([1 + k + i] * n_in)
        if resp_lens[i] > 0:
            source.append(last[inverse[i]])
            source.extend(range(start, start + n_in))
    S = 1 + k + b
    sees = torch.eye(S, dtype=torch.bool)  # sees[s, t]: segment s may attend to segment t
    if c > 0:
        sees[:, 0] = True
    inv = torch.tensor(inverse, dtype=torch.long)
    sees[torch.arange(1 + k, S), 1 + inv] = True
    seg_t = torch.tensor(seg, dtype=torch.long)
    N = len(ids)
    mask = sees[seg_t][:, seg_t] & torch.ones(N, N, dtype=torch.bool).tril()
    device = packed.input_ids.device
    return TreePacking(torch.tensor([ids], dtype=torch.long, device=device),
                       torch.tensor([pos], dtype=torch.long, device=device),
                       mask[None, None].to(device), torch.tensor(source, dtype=torch.long, device=device))


def tree_hidden_states(model: torch.nn.Module, packed: "PackedBatch") -> torch.Tensor:
    """Final hidden states that predict ``packed``'s real response tokens, from one decoder call
    over :func:`tree_pack`'s sequence: ``(R, hidden)``, model dtype, rows in the row-major order of
    ``packed.response_mask.nonzero()``.
    """
    tree = tree_pack(packed)
    out = model.get_decoder()(input_ids=tree.input_ids, attention_mask=tree.attention_mask,
                              position_ids=tree.position_ids, use_cache=False)
    return out.last_hidden_state[0].index_select(0, tree.source)
